"""Math: answers checked for mathematical equivalence by math-verify.

The response's answer is the content of its last ``\\boxed{}``, else the rest of its last
``Answer:`` line (DAPO style). The gold answer (``env_info["ground_truth"]``) may be boxed or
bare: a plain number, a fraction, a LaTeX expression, a set or an interval. Every check runs in
a separate math-verify process under a hard deadline (see :mod:`grpo_envs.verifier`), so no
response can hang, crash or exhaust the memory of the caller.
"""

from __future__ import annotations

import logging

from grpo_envs.answers import math_answer
from grpo_envs.base import Environment, EnvOutput, preview, response_text, single_turn_output
from grpo_envs.verifier import MathVerifier

log = logging.getLogger(__name__)


class MathEnv(Environment):
    """Reward 1 for an answer equivalent to the ground truth, else 0.

    Args:
        timeout_s: deadline for parsing and verifying one response.
        max_answer_chars: longer extracted answers count as parse failures without being
            parsed (a 100k-digit "number" is never right and only costs time).
        memory_limit_mb: address-space limit of the math-verify process.
        spare_worker: keep a second, warm math-verify process so a timeout costs no restart.
    """

    COUNT_METRICS = frozenset({"timeouts", "parse_failures", "errors", "gold_parse_failures"})

    def __init__(
        self,
        timeout_s: float = 5.0,
        max_answer_chars: int = 1000,
        memory_limit_mb: int = 4096,
        spare_worker: bool = True,
    ) -> None:
        if timeout_s <= 0 or max_answer_chars <= 0 or memory_limit_mb <= 0:
            raise ValueError(
                "math env: timeout_s, max_answer_chars and memory_limit_mb must be positive, got "
                f"{timeout_s}, {max_answer_chars}, {memory_limit_mb}"
            )
        self.max_answer_chars = max_answer_chars
        self.verifier = MathVerifier(timeout_s, memory_limit_mb, spare_worker)

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        rewards, metadata = [], []
        for i, (log_, info) in enumerate(zip(message_logs, env_infos, strict=True)):
            if "ground_truth" not in info:
                raise KeyError(f"math env: sample {i}: env_info has no 'ground_truth': {info!r}")
            gold = str(info["ground_truth"])
            answer = math_answer(response_text(log_) or "")
            if answer is None or len(answer) > self.max_answer_chars:
                status, parsed = "parse_failure", None
            else:
                verdict = self.verifier.check(gold, answer)
                status, parsed = verdict.status, verdict.parsed
                if status == "gold_parse_failure":
                    log.warning("math env: sample %d: math-verify cannot parse gold %r", i, gold)
                elif status == "error":
                    log.warning("math env: sample %d: %s", i, verdict.error)
            rewards.append(1.0 if status == "correct" else 0.0)
            metadata.append({"answer": preview(answer), "parsed": parsed, "ground_truth": gold, "status": status})
        return single_turn_output(rewards, metadata, self._metrics(rewards, metadata))

    @staticmethod
    def _metrics(rewards: list[float], metadata: list[dict]) -> dict[str, float]:
        def count(status: str) -> float:
            return float(sum(m["status"] == status for m in metadata))

        return {
            "accuracy": sum(rewards) / len(rewards) if rewards else 0.0,
            "timeouts": count("timeout"),
            "parse_failures": count("parse_failure"),
            "errors": count("error"),
            "gold_parse_failures": count("gold_parse_failure"),
        }

    def close(self) -> None:
        self.verifier.close()
