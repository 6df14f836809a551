"""Tool environments: calls answered by tool messages, bad calls answered by errors, never a crash."""

from __future__ import annotations

import time

import pytest

import grpo_envs
from grpo_envs.base import EnvOutput
from grpo_envs.calculator_env import MAX_DIGITS, CalculatorEnv, calculate
from grpo_envs.tool_env import Tool, ToolEnv, function_schema


def conv(*assistant_turns: str) -> list[dict]:
    log = [{"role": "user", "content": "12345678901234567890+98765432109876543210="}]
    for k, text in enumerate(assistant_turns):
        if k:
            log.append({"role": "tool", "name": "calculator", "content": "..."})
        log.append({"role": "assistant", "content": text})
    return log


GOLD = str(12345678901234567890 + 98765432109876543210)


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr


def test_calculate_is_exact_and_refuses_the_rest():
    assert calculate("12345678901234567890 + 98765432109876543210") == GOLD
    assert calculate("-(7 * 6) // 4 % 5") == str(-(7 * 6) // 4 % 5)
    for bad in ("__import__('os')", "2 ** 10", "1 / 2", "1 +", "x", "1//0", "9" * 1500 + "*" + "9" * 1500):
        with pytest.raises(ValueError):
            calculate(bad)
    assert len(calculate("9" * MAX_DIGITS)) == MAX_DIGITS


def test_calls_then_answer():
    env = grpo_envs.make("calculator", max_turns=3)
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
    out = env.step(
        [
            conv(call("12345678901234567890+98765432109876543210") + call("2*3")),
            conv(f"The sum is {GOLD}."),
            conv(call("1+1"), "It is 7"),
        ],
        [{"ground_truth": GOLD}] * 3,
    )
    assert out.terminateds == [False, True, True] and out.rewards == [0.0, 1.0, 0.0]
    assert out.observations[0] == [
        {"role": "tool", "name": "calculator", "content": GOLD},
        {"role": "tool", "name": "calculator", "content": "6"},
    ]
    assert out.observations[1] is None and out.metadata[1]["correct"] and out.metadata[2]["answer"] == "7"
    assert out.metrics["tool_calls"] == 2 and out.metrics["answered"] == 2 and out.metrics["tool_errors"] == 0
    assert out.metrics["calls_per_turn"] == pytest.approx(2 / 3)
    assert out.stop_strings == [None, None, None]  # stop_after_call off: sampling's own stops


def test_bad_calls_are_error_observations_with_penalty():
    env = CalculatorEnv(invalid_call_penalty=0.5, stop_after_call=True)
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}}</tool_call>'  # tool raises
        '<tool_call>{"name": "calc"}</tool_call>'  # unknown tool
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'  # bad arguments
        '<tool_call>{"name": "calculator", "arguments": {"expression": 1+}}</tool_call>'
    )  # invalid JSON
    out = env.step([conv(text)], [{"ground_truth": "2"}])
    (obs,) = out.observations
    assert [m["content"].split(":")[0] for m in obs] == ["error"] * 4
    assert "raised ValueError" in obs[0]["content"] and "unknown tool 'calc'" in obs[1]["content"]
    assert "bad arguments" in obs[2]["content"] and "not valid JSON" in obs[3]["content"]
    # Three calls were written wrong (the raising tool is not the model's format error).
    assert out.metrics["invalid_tool_calls"] == 3 and out.metrics["tool_errors"] == 4
    assert out.rewards == [-1.5] and out.terminateds == [False] and out.stop_strings == [("</tool_call>",)]


def test_too_many_calls_and_out_of_turns():
    env = CalculatorEnv(max_turns=2, max_calls_per_turn=2)
    out = env.step([conv(call("1+1") * 3), conv(call("1+1"), call("1+1"))], [{"ground_truth": "2"}] * 2)
    assert [m["content"] for m in out.observations[0]] == ["2", "2", "error: at most 2 tool calls per turn"]
    assert out.terminateds == [False, True] and out.observations[1] is None and out.metrics["out_of_turns"] == 1


class SlowEnv(ToolEnv):
    def make_tools(self):
        return [
            Tool(function_schema("sleep", "sleep", {"s": {"type": "number"}}), lambda s: time.sleep(s) or "woke"),
            Tool(function_schema("boom", "raises", {}), lambda: 1 / 0),
        ]

    def score(self, answer, env_info):
        return 1.0, {}


def test_timeout_and_raising_tool_are_answered():
    env = SlowEnv(tool_timeout_s=0.2)
    start = time.perf_counter()
    out = env.step(
        [
            conv(
                '<tool_call>{"name": "sleep", "arguments": {"s": 2}}</tool_call>'
                '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
            )
        ],
        [{}],
    )
    assert time.perf_counter() - start < 1.5
    assert [m["content"] for m in out.observations[0]] == [
        "error: tool 'sleep' timed out after 0.2 s",
        "error: tool 'boom' raised ZeroDivisionError: division by zero",
    ]
    assert (
        out.metrics["tool_timeouts"] == 1 and out.metrics["tool_errors"] == 2 and out.metrics["invalid_tool_calls"] == 0
    )
    env.close()


def test_stop_strings_survive_concat_and_length_check():
    a = EnvOutput([0.0], [None], [True], [{}], stop_strings=[("x",)])
    b = EnvOutput([0.0, 1.0], [None, None], [True, True], [{}, {}])
    assert EnvOutput.concat([a, b], {}).stop_strings == [("x",), None, None]
    assert EnvOutput.concat([b, b], {}).stop_strings is None
    with pytest.raises(ValueError, match="stop_strings has 2 entries"):
        EnvOutput([0.0], [None], [True], [{}], stop_strings=[None, None])


def _without_timings(out: EnvOutput) -> tuple:
    metas = [{k: v for k, v in m.items() if k != "tool_time_s"} for m in out.metadata]
    metrics = {k: v for k, v in out.metrics.items() if k != "tool_time_s"}
    return out.rewards, out.observations, out.terminateds, metas, metrics, out.stop_strings


@pytest.mark.parametrize("name", ["calculator", "number_guess"])
def test_env_actors_carry_no_episode_state(name):
    """Kill-and-resume mid multi-turn (#21): a resumed run scores its conversations with fresh env
    actors, so an env that has stepped earlier episodes (good calls, bad calls, timeouts, wrong
    guesses) must answer a conversation exactly as a fresh one does: the conversation's state is
    its message log, carried by the driver's rollout, never in the env."""
    if name == "calculator":
        logs = [conv(call("2*3")), conv(call("2*3"), f"It is {GOLD}"), conv('<tool_call>{"name": 1}</tool_call>')]
        infos = [{"ground_truth": GOLD}] * 3
        earlier = [conv(call("1+") + call("7*7")), conv(call("9*9"), call("1+1"), "no")]
        kwargs = {"invalid_call_penalty": 0.25, "max_turns": 3}
    else:
        logs = [conv("50"), conv("50", "30"), conv("50", "30", "12")]
        infos = [{"target": 30}] * 3
        earlier = [conv("1", "2", "3"), conv("99")]
        kwargs = {"max_turns": 3}
    fresh = grpo_envs.make(name, **kwargs)
    used = grpo_envs.make(name, **kwargs)
    for _ in range(2):
        used.step(earlier, [infos[0]] * len(earlier))
        used.step(logs[:1], infos[:1])
    expected = _without_timings(fresh.step(logs, infos))
    assert _without_timings(used.step(logs, infos)) == expected
    # The expectation by hand, so the comparison cannot pass on two equally wrong answers.
    if name == "calculator":
        assert expected[0] == [0.0, 1.0, -0.25] and expected[2] == [False, True, False]
    else:
        assert expected[0] == [0.0, 1.0, 0.0] and expected[2] == [False, True, True]
