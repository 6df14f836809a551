"""Tool-call parsers: the model's text in, the tool calls it asked for (or why they are invalid) out.

Model output is untrusted, so parsing never raises: every call the text attempts comes back
either as a :class:`ToolCall` or as a :class:`ToolCallError` that says what was wrong, in the
order they appear, and a turn may hold several calls. Two formats, chosen by name:

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one JSON object per tag pair. A last ``<tool_call>`` left open is read to the end of the text:
  generation stopped on the stop string ``</tool_call>`` leaves the text cut before it.
- ``llama3`` (Llama 3.x JSON tool calling): the turn is a JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` is accepted too), optionally after the
  ``<|python_tag|>`` marker; several calls are separated by ``;``.

Boundary: text only (no tokens, no torch); checking a call against the declared tools is
:func:`check_calls`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.DOTALL)
_RAW_PREVIEW = 200


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A call the model attempted that cannot be run; ``kind`` is one of ``ERROR_KINDS``."""

    kind: str
    message: str
    raw: str = ""
    name: str | None = None


ERROR_KINDS = ("invalid_json", "bad_shape", "unknown_tool")
Parsed = ToolCall | ToolCallError


def parse_hermes(text: str) -> list[Parsed]:
    """Calls in ``<tool_call>{json}</tool_call>`` blocks, in order."""
    return [_from_json(m.group(1).strip()) for m in _HERMES_BLOCK.finditer(text)]


def parse_llama3(text: str) -> list[Parsed]:
    """Calls of a Llama 3 JSON tool turn; plain prose (no JSON object at the start) is no call."""
    body = text.strip()
    if body.startswith(LLAMA3_PYTHON_TAG):
        body = body[len(LLAMA3_PYTHON_TAG) :].strip()
    elif not body.startswith("{"):
        return []
    return [_from_json(part.strip()) for part in _split_top_level(body, ";") if part.strip()]


PARSERS: dict[str, Callable[[str], list[Parsed]]] = {"hermes": parse_hermes, "llama3": parse_llama3}


def parse_tool_calls(text: str, fmt: str) -> list[Parsed]:
    """The calls in ``text`` in format ``fmt`` (a key of ``PARSERS``)."""
    try:
        parser = PARSERS[fmt]
    except KeyError:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {sorted(PARSERS)}") from None
    return parser(text)


def check_calls(calls: Iterable[Parsed], tool_names: Iterable[str]) -> list[Parsed]:
    """``calls`` with those naming an undeclared tool turned into ``unknown_tool`` errors."""
    known = set(tool_names)
    return [
        ToolCallError("unknown_tool", f"unknown tool {c.name!r}; available: {sorted(known)}", name=c.name)
        if isinstance(c, ToolCall) and c.name not in known
        else c
        for c in calls
    ]


def _from_json(raw: str) -> Parsed:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, or an int past Python's digit limit
        return ToolCallError("invalid_json", f"tool call is not valid JSON: {exc}", _preview(raw))
    if not isinstance(obj, dict):
        return ToolCallError("bad_shape", f"tool call must be a JSON object, got {type(obj).__name__}", _preview(raw))
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("bad_shape", "tool call has no string 'name'", _preview(raw))
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ToolCallError("bad_shape", f"arguments of {name!r} must be a JSON object", _preview(raw), name)
    return ToolCall(name, args)


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _preview(raw: str) -> str:
    return raw if len(raw) <= _RAW_PREVIEW else raw[:_RAW_PREVIEW] + "..."
