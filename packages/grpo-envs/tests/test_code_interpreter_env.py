"""Code-interpreter tool env: real sandbox runs, real math-verify; hostile or broken code is an
error observation and a metric, never a crash."""

from __future__ import annotations

import json
import time

import pytest

import grpo_envs


def call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def conv(*turns: str) -> list[dict]:
    log = [{"role": "user", "content": "What is 2**100 mod 97?"}]
    for k, text in enumerate(turns):
        if k:
            log.append({"role": "tool", "name": "python", "content": "..."})
        log.append({"role": "assistant", "content": text})
    return log


@pytest.fixture(scope="module")
def env():
    env = grpo_envs.make(
        "code_interpreter",
        tool_timeout_s=4.0,
        max_output_chars=50,
        limits={"cpu_time_s": 1, "memory_mb": 128, "stdout_bytes": 65536},
    )
    yield env
    env.close()


def test_runs_code_and_checks_the_answer_with_math_verify(env):
    gold = str(2**100 % 97)
    assert [t["function"]["name"] for t in env.tools()] == ["python"]
    out = env.step(
        [
            conv(call("print(pow(2, 100, 97))")),
            conv("x", f"So the answer is \\boxed{{{gold}}}."),
            conv("x", "\\boxed{\\frac{2}{4}}"),
            conv("x", "I don't know"),
        ],
        [{"ground_truth": gold}, {"ground_truth": gold}, {"ground_truth": "0.5"}, {"ground_truth": gold}],
    )
    assert out.observations[0] == [{"role": "tool", "name": "python", "content": f"{gold}\n"}]
    assert out.rewards == [0.0, 1.0, 1.0, 0.0] and out.terminateds == [False, True, True, True]
    assert out.metadata[3]["status"] == "parse_failure"
    assert out.metrics["sandbox_ok"] == 1 and out.metrics["tool_errors"] == 0


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("import os; print(open('/etc/passwd').read())", "runtime_error"),  # no host files in the jail
        ("import socket; socket.create_connection(('1.1.1.1', 80))", "violation"),
        ("while True: pass", "timeout"),
        ("x = 'a' * (1 << 30)", "memory_error"),
        ("raise SystemExit(3)", "runtime_error"),
    ],
)
def test_hostile_or_broken_code_is_an_error_observation(env, code, status):
    start = time.perf_counter()
    out = env.step([conv(call(code))], [{"ground_truth": "1"}])
    assert time.perf_counter() - start < 4.0
    (obs,) = out.observations[0]
    assert obs["content"].startswith(f"error: {status}"), obs
    assert out.metrics[f"sandbox_{status}"] == 1 and out.metrics["tool_errors"] == 1
    assert out.terminateds == [False] and out.rewards == [0.0]


def test_output_is_truncated(env):
    out = env.step([conv(call("print('x' * 5000)"))], [{"ground_truth": "1"}])
    (obs,) = out.observations[0]
    assert obs["content"] == "x" * 50 + "...[4951 more chars]"  # 5000 x and a newline, cut to 50


def test_tool_timeout_beats_a_slow_sandbox():
    env = grpo_envs.make("code_interpreter", tool_timeout_s=1.0, limits={"cpu_time_s": 5, "wall_time_s": 30})
    start = time.perf_counter()
    out = env.step([conv(call("import time; time.sleep(20)"))], [{"ground_truth": "1"}])
    assert time.perf_counter() - start < 3.0
    assert out.observations[0][0]["content"].startswith("error: timeout")
    env.close()
