"""Code: the response's Python solution is run against test cases in a sandbox.

The solution is the last ```python fenced block of the response (else the last fenced block,
else the whole response). Each test case runs in its own sandboxed process
(:mod:`grpo_envs.sandbox`), so no test can see another's state and no solution can harm the
caller. Two styles of test, given in ``env_info``:

- stdin/stdout: ``{"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``; outputs are
  compared line by line with trailing whitespace and trailing blank lines ignored;
- function call: ``{"tests": [{"fn_name": "add", "args": [1, 2], "kwargs": {}, "expected": 3}]}``
  (``fn_name`` may also sit at the top of env_info); ``fn_name`` may be a function or a method
  of a ``Solution`` class (LeetCode style); return values are compared after a JSON round
  trip, floats with a relative tolerance.

APPS/TACO rows are accepted as they are: ``{"input_output": {"inputs": [...], "outputs": [...],
"fn_name": optional}}`` (a dict or its JSON string); in the function style an expected value
wrapped in a one-element list also matches the bare value.

Reward: the fraction of tests passed, or 1/0 with ``all_or_nothing``. ``response_time_s`` bounds
the wall time of all the tests of one response together: each test gets at most what is left,
and tests past the budget count as timeouts without running.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

from grpo_envs.answers import code_block
from grpo_envs.base import Environment, EnvOutput, preview, response_text, single_turn_output
from grpo_envs.sandbox import Isolation, SandboxLimits, SandboxUnavailable, run_python, sandbox_mode

log = logging.getLogger(__name__)

FLOAT_REL_TOL = 1e-6
FLOAT_ABS_TOL = 1e-9
# Sandbox status → the metric that counts it (per test run).
_STATUS_METRICS = {
    "wrong_answer": "wrong_answers",
    "runtime_error": "runtime_errors",
    "timeout": "timeouts",
    "memory_error": "memory_errors",
    "output_limit": "output_limits",
    "violation": "violations",
    "sandbox_error": "sandbox_errors",
}


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    expected_stdout: str | None = None
    fn_name: str | None = None
    args: tuple = ()
    kwargs: dict | None = None
    expected_value: Any = None

    @property
    def is_call(self) -> bool:
        return self.fn_name is not None


class CodeEnv(Environment):
    """Reward = fraction of test cases the response's Python solution passes.

    Args:
        all_or_nothing: reward 1 only when every test passes, else 0.
        stop_on_first_failure: skip the remaining tests of a response after a failure
            (default: same as all_or_nothing, where the rest cannot change the reward).
        max_parallel: responses run concurrently (each its own sandbox process).
        max_tests: use at most this many test cases per sample (None: all).
        limits: :class:`SandboxLimits` or a dict of its fields (cpu_time_s, memory_mb, ...).
        isolation: :class:`Isolation` or a dict of its fields. The environment refuses to start
            when ``isolation.require`` (default: the jail) cannot be had on this machine.
        response_time_s: wall-clock budget of one response across all its tests (None: only
            each test's own ``limits.wall_time_s``).
    """

    COUNT_METRICS = frozenset({*_STATUS_METRICS.values(), "no_code", "tests_run"})

    def __init__(
        self,
        all_or_nothing: bool = False,
        stop_on_first_failure: bool | None = None,
        max_parallel: int = 1,
        max_tests: int | None = None,
        limits: SandboxLimits | dict | None = None,
        isolation: Isolation | dict | None = None,
        response_time_s: float | None = None,
    ) -> None:
        if max_parallel < 1:
            raise ValueError(f"code env: max_parallel must be >= 1, got {max_parallel}")
        if response_time_s is not None and response_time_s <= 0:
            raise ValueError(f"code env: response_time_s must be > 0, got {response_time_s}")
        self.all_or_nothing = all_or_nothing
        self.stop_on_first_failure = all_or_nothing if stop_on_first_failure is None else stop_on_first_failure
        self.max_parallel = max_parallel
        self.max_tests = max_tests
        self.limits = _as_dataclass(SandboxLimits, limits, "limits")
        self.isolation = _as_dataclass(Isolation, isolation, "isolation")
        self.response_time_s = response_time_s
        try:
            sandbox_mode(self.isolation)  # fail at start-up, not at the first step
        except SandboxUnavailable as exc:
            raise ValueError(f"code env: {exc}") from None

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        cases = [parse_tests(info, i)[: self.max_tests] for i, info in enumerate(env_infos)]
        sources = [code_block(response_text(log) or "") for log in message_logs]
        jobs = list(zip(sources, cases, strict=True))
        if self.max_parallel > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(min(self.max_parallel, len(jobs))) as pool:
                metadata = list(pool.map(lambda job: self._score(*job), jobs))
        else:
            metadata = [self._score(*job) for job in jobs]
        rewards = [m.pop("reward") for m in metadata]
        return single_turn_output(rewards, metadata, self._metrics(metadata))

    def _score(self, source: str, cases: list[CodeTest]) -> dict:
        if not source.strip():
            return {"reward": 0.0, "status": "no_code", "passed": 0, "total": len(cases), "tests": []}
        statuses, first_error, isolation = [], None, {}
        deadline = None if self.response_time_s is None else time.monotonic() + self.response_time_s
        for case in cases:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                status, error = "timeout", f"response_time_s={self.response_time_s} spent before this test"
            else:
                status, error, isolation = self._run_case(source, case, remaining)
            statuses.append(status)
            if status != "passed" and first_error is None:
                first_error = error
            if status != "passed" and self.stop_on_first_failure:
                break
        passed = statuses.count("passed")
        total = len(cases)
        fraction = passed / total if total else 0.0
        reward = float(passed == total and total > 0) if self.all_or_nothing else fraction
        failure = next((s for s in statuses if s != "passed"), None)
        return {
            "reward": reward,
            "status": failure or "passed",
            "passed": passed,
            "total": total,
            "tests": statuses,
            "error": preview(first_error, 500),
            "isolation": isolation,
        }

    def _run_case(self, source: str, case: CodeTest, remaining_s: float | None) -> tuple[str, str | None, dict]:
        wall_s = None if remaining_s is None else min(self.limits.wall_s, remaining_s)
        if case.is_call:
            result = run_python(
                source,
                call=(case.fn_name, list(case.args), dict(case.kwargs or {})),
                limits=self.limits,
                isolation=self.isolation,
                wall_s=wall_s,
            )
        else:
            result = run_python(source, stdin=case.stdin, limits=self.limits, isolation=self.isolation, wall_s=wall_s)
        if result.status == "sandbox_error":
            log.warning("code env: sandbox failure (not the solution's fault): %s", result.error)
        if result.status != "ok":
            return result.status, result.error or result.stderr[-500:], result.isolation
        if case.is_call:
            ok = values_equal(result.value, case.expected_value)
        else:
            ok = _lines(result.stdout) == _lines(case.expected_stdout or "")
        return ("passed", None, result.isolation) if ok else ("wrong_answer", "wrong answer", result.isolation)

    @staticmethod
    def _metrics(metadata: list[dict]) -> dict[str, float]:
        counts = Counter(status for m in metadata for status in m["tests"])
        n = len(metadata)
        metrics = {
            "pass_rate": sum(m["passed"] / m["total"] if m["total"] else 0.0 for m in metadata) / n if n else 0.0,
            "accuracy": sum(m["status"] == "passed" for m in metadata) / n if n else 0.0,
            "tests_run": float(sum(counts.values())),
            "no_code": float(sum(m["status"] == "no_code" for m in metadata)),
        }
        for status, name in _STATUS_METRICS.items():
            metrics[name] = float(counts[status])
        return metrics


def parse_tests(info: dict, index: int = 0) -> list[CodeTest]:
    """The test cases of one sample's env_info (see the module docstring for the formats)."""
    where = f"code env: sample {index}"
    if "tests" in info:
        raw = info["tests"]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}: 'tests' must be a non-empty list, got {raw!r:.200}")
        return [_test_case(t, info.get("fn_name"), f"{where}, test {k}") for k, t in enumerate(raw)]
    if "input_output" in info:
        spec = info["input_output"]
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise ValueError(f"{where}: 'input_output' is not valid JSON: {exc}") from None
        inputs, outputs = spec.get("inputs"), spec.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            raise ValueError(f"{where}: 'input_output' needs equally long, non-empty 'inputs' and 'outputs'")
        fn_name = spec.get("fn_name")
        if fn_name:
            return [
                CodeTest(
                    fn_name=fn_name, args=tuple(a if isinstance(a, list) else [a]), expected_value=_apps_expected(o)
                )
                for a, o in zip(inputs, outputs)
            ]
        return [CodeTest(stdin=_text(i), expected_stdout=_text(o)) for i, o in zip(inputs, outputs)]
    raise ValueError(f"{where}: env_info needs 'tests' or 'input_output', got keys {sorted(info)}")


class _Wrapped:
    """An APPS expected value wrapped in a one-element list: matches the list or its element."""

    def __init__(self, value: list) -> None:
        self.value = value


def _apps_expected(output: Any) -> Any:
    return _Wrapped(output) if isinstance(output, list) and len(output) == 1 else output


def _test_case(raw: Any, default_fn: str | None, where: str) -> CodeTest:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a test must be a dict, got {raw!r:.200}")
    fn_name = raw.get("fn_name", default_fn)
    if fn_name is not None:
        if "expected" not in raw:
            raise ValueError(f"{where}: a function-call test needs 'expected'")
        args = raw.get("args", [])
        kwargs = raw.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ValueError(f"{where}: 'args' must be a list and 'kwargs' a dict")
        return CodeTest(fn_name=str(fn_name), args=tuple(args), kwargs=kwargs, expected_value=raw["expected"])
    if "output" not in raw:
        raise ValueError(f"{where}: a stdin/stdout test needs 'output' (or 'fn_name' for a function call)")
    return CodeTest(stdin=_text(raw.get("input", "")), expected_stdout=_text(raw["output"]))


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(map(str, value))
    return str(value)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def values_equal(got: Any, expected: Any) -> bool:
    """Equality after a JSON round trip (tuples are lists), floats within a tolerance."""
    if isinstance(expected, _Wrapped):
        return values_equal(got, expected.value) or values_equal(got, expected.value[0])
    expected = json.loads(json.dumps(expected, default=repr))
    return _equal(got, expected)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _as_dataclass(cls, value, name: str):
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"code env: {name} must be a {cls.__name__} or a dict, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise TypeError(f"code env: unknown {name} keys {unknown}; known: {sorted(known)}")
    value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return cls(**value)
