"""Math with a Python tool (ReTool / ToRL style): the model runs code, then answers.

The ``python`` tool runs the model's code as a script in :mod:`grpo_envs.sandbox` (a fresh jailed
process per call, with its CPU, memory, output and wall-clock limits) and answers with its stdout
and stderr, each cut to ``max_output_chars``; a run that ends badly (exception, timeout, memory,
output limit, a forbidden system call) is answered ``error: <status>`` with what it printed, and
counted in ``sandbox_<status>``. The final answer (a turn without a call) is checked against
``env_info["ground_truth"]`` by math-verify (the ``math`` environment's extraction: last
``\\boxed{}``, else an ``Answer:`` line), in its own process under a deadline.
"""

from __future__ import annotations

import threading
from collections import Counter

from grpo_envs.answers import math_answer
from grpo_envs.base import EnvOutput, preview
from grpo_envs.code_env import _as_dataclass
from grpo_envs.sandbox import Isolation, SandboxLimits, SandboxUnavailable, run_python, sandbox_mode
from grpo_envs.sandbox.runner import STATUSES
from grpo_envs.tool_env import Tool, ToolEnv, function_schema, truncate
from grpo_envs.verifier import MathVerifier

# A tool run's wall clock is kept this much inside the tool's own timeout, so the sandbox's
# kill (with what was printed) lands before the environment gives up on the call.
_WALL_MARGIN_S = 0.5


class CodeInterpreterEnv(ToolEnv):
    """Reward 1 for a final answer math-verify finds equal to the ground truth.

    Args (besides :class:`~grpo_envs.tool_env.ToolEnv`'s):
        limits: :class:`SandboxLimits` of one tool run, or a dict of its fields (default: 2 CPU
            seconds, 256 MB, 64 KB of stdout).
        isolation: :class:`Isolation` or a dict of its fields; refuses to start without the jail.
        max_output_chars: stdout and stderr are each cut to this many characters in the answer.
        verify_timeout_s: math-verify's deadline for one answer.
    """

    COUNT_METRICS = ToolEnv.COUNT_METRICS | {f"sandbox_{s}" for s in STATUSES} | {"verify_timeouts"}

    def __init__(
        self,
        limits: SandboxLimits | dict | None = None,
        isolation: Isolation | dict | None = None,
        max_output_chars: int = 1000,
        verify_timeout_s: float = 5.0,
        **tool_env,
    ) -> None:
        self.limits = (
            _as_dataclass(SandboxLimits, limits, "limits")
            if limits is not None
            else SandboxLimits(cpu_time_s=2.0, memory_mb=256, stdout_bytes=64 << 10)
        )
        self.isolation = _as_dataclass(Isolation, isolation, "isolation")
        if max_output_chars < 1:
            raise ValueError(f"code_interpreter env: max_output_chars must be >= 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        try:
            sandbox_mode(self.isolation)  # fail at start-up, not at the first call
        except SandboxUnavailable as exc:
            raise ValueError(f"code_interpreter env: {exc}") from None
        super().__init__(**tool_env)
        self._verify_timeout_s = verify_timeout_s
        self._verifier: MathVerifier | None = None
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._verify_lock = threading.Lock()

    def make_tools(self) -> list[Tool]:
        schema = function_schema(
            "python",
            "Run a Python script; its printed output is returned.",
            {"code": {"type": "string", "description": "the script; print what you need"}},
        )
        return [Tool(schema, self.run_code)]

    def run_code(self, code: str) -> str:
        if not isinstance(code, str):
            raise TypeError("code must be a string")
        wall = max(0.1, min(self.limits.wall_s, self.tool_timeout_s - _WALL_MARGIN_S))
        result = run_python(code, limits=self.limits, isolation=self.isolation, wall_s=wall)
        with self._lock:
            self._counts[f"sandbox_{result.status}"] += 1
        out = truncate(result.stdout, self.max_output_chars)
        err = truncate(result.stderr or result.error or "", self.max_output_chars)
        if result.status == "ok":
            return out if not err else f"{out}\n[stderr]\n{err}"
        return f"error: {result.status}\n[stdout]\n{out}\n[stderr]\n{err}"

    def score(self, answer: str, env_info: dict) -> tuple[float, dict]:
        if "ground_truth" not in env_info:
            raise KeyError(f"code_interpreter env: env_info has no 'ground_truth': {env_info!r}")
        gold = str(env_info["ground_truth"])
        extracted = math_answer(answer)
        if extracted is None:
            return 0.0, {"answer": None, "ground_truth": gold, "status": "parse_failure"}
        with self._verify_lock:  # one math-verify process, one question at a time
            if self._verifier is None:
                self._verifier = MathVerifier(self._verify_timeout_s, 2048, False)
            verdict = self._verifier.check(gold, extracted)
        if verdict.status == "timeout":
            with self._lock:
                self._counts["verify_timeouts"] += 1
        return float(verdict.status == "correct"), {
            "answer": preview(extracted),
            "ground_truth": gold,
            "status": verdict.status,
        }

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        out = super().step(message_logs, env_infos)
        with self._lock:
            counts, self._counts = self._counts, Counter()
        out.metrics.update({f"sandbox_{s}": float(counts[f"sandbox_{s}"]) for s in STATUSES})
        out.metrics["verify_timeouts"] = float(counts["verify_timeouts"])
        return out

    def close(self) -> None:
        super().close()
        if self._verifier is not None:
            self._verifier.close()
