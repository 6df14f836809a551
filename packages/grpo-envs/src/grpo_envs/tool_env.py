"""Tool environments: the model calls declared tools over several turns, then answers.

Each turn, the last assistant message is parsed for tool calls (:mod:`grpo_envs.tool_calls`).
A turn with calls is answered with one ``{"role": "tool", "name": ..., "content": ...}`` message
per call and the conversation goes on; a turn with no call is the final answer, scored by the
subclass's :meth:`ToolEnv.score`. Nothing the model writes can crash a step: invalid JSON, an
unknown tool, bad arguments, a tool that raises or overruns ``tool_timeout_s`` each become an
error observation (``"error: ..."``) and count in the metrics; ``invalid_call_penalty`` is
subtracted from the reward for each call that could not run because the model wrote it wrong.

A subclass declares its tools (:class:`Tool`: an OpenAI-style schema and a function that takes
the call's arguments as keywords and returns text) and scores answers. Tool functions run on a
thread each with a wall-clock limit; a function that ignores the limit keeps its thread, so
tools that can hang hold their own hard limit (the code tool runs in the sandbox, which does).
Boundary: text in, text out; the rollout renders tools and tool messages into tokens.
"""

from __future__ import annotations

import abc
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, ClassVar

from grpo_envs.base import Environment, EnvOutput, count_turns, response_text
from grpo_envs.tool_calls import HERMES_CLOSE, PARSERS, ToolCall, ToolCallError, check_calls, parse_tool_calls

TOOL_ROLE = "tool"
# Stop strings that end a turn right after one call, per format: the tool answers at once.
CALL_STOP_STRINGS = {"hermes": (HERMES_CLOSE,), "llama3": ()}


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``schema`` in the OpenAI / HF ``tools=`` form, ``fn(**arguments) -> str``."""

    schema: dict
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def function_schema(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    """An OpenAI-style function tool schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required or properties)},
        },
    }


class ToolEnv(Environment):
    """Base of the tool environments (see the module docstring).

    Args:
        call_format: how the model writes calls, a key of ``grpo_envs.tool_calls.PARSERS``.
        max_turns: assistant turns per conversation; a conversation still calling tools at the
            last one ends with reward 0 (``env_info["max_turns"]`` overrides it per sample).
        max_calls_per_turn: calls past this many in one turn are answered with an error.
        tool_timeout_s: wall-clock limit of one call.
        max_result_chars: a tool's text answer is cut to this many characters.
        invalid_call_penalty: subtracted from a turn's reward per call that could not run because
            it was written wrong (invalid JSON, bad shape, unknown tool, bad arguments).
        stop_after_call: end each later turn at the close of a call (``</tool_call>`` in the
            hermes format) by sending that turn's stop strings with the observation.
        max_workers: threads that run tool calls.
    """

    COUNT_METRICS: ClassVar[frozenset[str]] = frozenset(
        {"tool_calls", "tool_errors", "invalid_tool_calls", "tool_timeouts", "tool_time_s", "answered", "out_of_turns"}
    )

    def __init__(
        self,
        call_format: str = "hermes",
        max_turns: int = 4,
        max_calls_per_turn: int = 4,
        tool_timeout_s: float = 10.0,
        max_result_chars: int = 2000,
        invalid_call_penalty: float = 0.0,
        stop_after_call: bool = False,
        max_workers: int = 8,
    ) -> None:
        if call_format not in PARSERS:
            raise ValueError(
                f"{type(self).__name__}: call_format must be one of {sorted(PARSERS)}, got {call_format!r}"
            )
        for key, value in (
            ("max_turns", max_turns),
            ("max_calls_per_turn", max_calls_per_turn),
            ("max_result_chars", max_result_chars),
            ("max_workers", max_workers),
        ):
            if value < 1:
                raise ValueError(f"{type(self).__name__}: {key} must be >= 1, got {value}")
        if tool_timeout_s <= 0 or invalid_call_penalty < 0:
            raise ValueError(f"{type(self).__name__}: tool_timeout_s must be > 0 and invalid_call_penalty >= 0")
        self.call_format = call_format
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_timeout_s = tool_timeout_s
        self.max_result_chars = max_result_chars
        self.invalid_call_penalty = invalid_call_penalty
        self.stop_after_call = stop_after_call
        self._tools = {t.name: t for t in self.make_tools()}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")

    @abc.abstractmethod
    def make_tools(self) -> list[Tool]:
        """The tools this environment offers."""

    @abc.abstractmethod
    def score(self, answer: str, env_info: dict) -> tuple[float, dict]:
        """Reward and metadata of a final answer (the text of a turn without tool calls)."""

    def tools(self) -> list[dict]:
        return [t.schema for t in self._tools.values()]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        outs = [self._step_one(log, info) for log, info in zip(message_logs, env_infos, strict=True)]
        metas = [o[3] for o in outs]
        n = max(len(outs), 1)
        metrics = {key: float(sum(m.get(key, 0) for m in metas)) for key in self.COUNT_METRICS}
        metrics["calls_per_turn"] = metrics["tool_calls"] / n
        stops = CALL_STOP_STRINGS[self.call_format] if self.stop_after_call else None
        return EnvOutput(
            rewards=[o[0] for o in outs],
            observations=[o[1] for o in outs],
            terminateds=[o[2] for o in outs],
            metadata=metas,
            metrics=metrics,
            stop_strings=[None if o[2] else stops for o in outs],
        )

    def _step_one(self, log: list[dict], info: dict) -> tuple[float, list[dict] | None, bool, dict]:
        text = response_text(log) or ""
        turn = count_turns(log)
        calls = check_calls(parse_tool_calls(text, self.call_format), self._tools)
        if not calls:
            reward, meta = self.score(text, info)
            return float(reward), None, True, {**meta, "turn": turn, "answered": 1}
        if turn >= int(info.get("max_turns", self.max_turns)):
            return 0.0, None, True, {"turn": turn, "out_of_turns": 1, "tool_calls": len(calls)}
        messages, meta = self._run_calls(calls)
        meta["turn"] = turn
        return -self.invalid_call_penalty * meta["invalid_tool_calls"], messages, False, meta

    def _run_calls(self, calls: list) -> tuple[list[dict], dict]:
        meta = {
            "tool_calls": len(calls),
            "tool_errors": 0,
            "invalid_tool_calls": 0,
            "tool_timeouts": 0,
            "tool_time_s": 0.0,
            "calls": [],
        }
        calls = [
            c
            if k < self.max_calls_per_turn
            else ToolCallError(
                "too_many_calls",
                f"at most {self.max_calls_per_turn} tool calls per turn",
                name=getattr(c, "name", None),
            )
            for k, c in enumerate(calls)
        ]
        start = time.perf_counter()
        futures = [self._pool.submit(self._call, c) if isinstance(c, ToolCall) else None for c in calls]
        messages = []
        for call, future in zip(calls, futures):
            meta["calls"].append(call.name)
            if future is None:  # a ToolCallError: the model wrote it wrong
                meta["invalid_tool_calls"] += 1
                content = f"error: {getattr(call, 'message', 'invalid tool call')}"
            else:
                remaining = max(0.0, start + self.tool_timeout_s - time.perf_counter())
                try:
                    content, invalid = future.result(timeout=remaining)
                    meta["invalid_tool_calls"] += invalid
                except FutureTimeout:
                    meta["tool_timeouts"] += 1
                    content = f"error: tool {call.name!r} timed out after {self.tool_timeout_s:g} s"
            meta["tool_errors"] += content.startswith("error:")
            messages.append(
                {
                    "role": TOOL_ROLE,
                    "name": getattr(call, "name", None) or "error",
                    "content": truncate(content, self.max_result_chars),
                }
            )
        meta["tool_time_s"] = time.perf_counter() - start
        return messages, meta

    def _call(self, call: ToolCall) -> tuple[str, int]:
        """The tool's answer and 1 when the arguments were wrong (a model error), else 0."""
        fn = self._tools[call.name].fn
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as exc:  # missing or unexpected keyword: the model wrote bad arguments
            return f"error: bad arguments for {call.name!r}: {exc}", 1
        try:
            return str(fn(**call.arguments)), 0
        except Exception as exc:  # a tool raising is answered, never propagated
            return f"error: tool {call.name!r} raised {type(exc).__name__}: {exc}", 0


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut."""
    return text if len(text) <= limit else text[:limit] + f"...[{len(text) - limit} more chars]"
