"""Tool-call parsers: hand-written model turns with the calls we expect them to hold."""

from __future__ import annotations

import pytest

from grpo_envs.tool_calls import ToolCall, ToolCallError, check_calls, parse_hermes, parse_llama3, parse_tool_calls


def test_hermes_well_formed_and_several_calls():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": {"code": "print(\'</x>\')"}}</tool_call> done'
    )
    assert parse_hermes(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("python", {"code": "print('</x>')"})]
    assert parse_hermes('no calls here, just prose {"name": "add"}') == []
    # Arguments written as a JSON string are accepted; a call without arguments has none.
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 3}"}</tool_call>') == [
        ToolCall("f", {"x": 3})
    ]
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


def test_hermes_malformed_calls_are_errors_in_order():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
        '<tool_call>["add"]</tool_call><tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    )
    calls = parse_hermes(text)
    assert [type(c).__name__ for c in calls] == ["ToolCallError"] * 4 + ["ToolCall"]
    assert [c.kind for c in calls[:4]] == ["invalid_json", "bad_shape", "bad_shape", "bad_shape"]
    assert calls[0].raw == '{"name": "add", "arguments": {"a": 1,}}'
    assert calls[3].name == "add" and calls[4] == ToolCall("ok", {})
    # Deeply nested junk does not raise (RecursionError is caught).
    (deep,) = parse_hermes("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert isinstance(deep, ToolCallError) and deep.kind == "invalid_json" and len(deep.raw) < 300
    # A number past Python's int digit limit (4300) raises ValueError, not JSONDecodeError, from
    # json.loads: it too is an invalid call, in the call and in a JSON-string argument, in both formats.
    huge = "9" * 5000
    (big,) = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": %s}}</tool_call>' % huge)
    assert isinstance(big, ToolCallError) and big.kind == "invalid_json" and "digits" in big.message
    (big_str,) = parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": %s}"}</tool_call>' % huge)
    assert isinstance(big_str, ToolCallError) and big_str.kind == "bad_shape"
    (big_llama,) = parse_llama3('{"name": "add", "parameters": {"a": %s}}' % huge)
    assert isinstance(big_llama, ToolCallError) and big_llama.kind == "invalid_json"


def test_calls_split_across_stop_strings():
    """Generation stopped on the stop string "</tool_call>" cuts the text before it: each turn's
    text holds one open call, read to the end."""
    turns = [
        'I will add.\n<tool_call>{"name": "add", "arguments": {"a": 5, "b": 7}}',
        '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 1}}\n',
    ]
    assert [parse_hermes(t) for t in turns] == [
        [ToolCall("add", {"a": 5, "b": 7})],
        [ToolCall("add", {"a": 12, "b": 1})],
    ]
    # A call cut mid-JSON (out of tokens) is malformed, not lost.
    (cut,) = parse_hermes('<tool_call>{"name": "add", "argum')
    assert cut.kind == "invalid_json"


def test_llama3_json_calls():
    assert parse_llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}') == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_llama3('<|python_tag|>{"name": "f", "parameters": {"s": "a;b}"}}; {"name": "g", "arguments": {}}') == [
        ToolCall("f", {"s": "a;b}"}),
        ToolCall("g", {}),
    ]
    assert parse_llama3("The answer is 42.") == []
    (bad,) = parse_llama3('{"name": "add", "parameters": {"a": 1}')
    assert bad.kind == "invalid_json"


def test_unknown_tool_and_format():
    calls = check_calls([ToolCall("add", {}), ToolCall("rm", {}), ToolCallError("invalid_json", "x")], ["add"])
    assert calls[0] == ToolCall("add", {}) and calls[2].kind == "invalid_json"
    assert calls[1].kind == "unknown_tool" and calls[1].name == "rm" and "['add']" in calls[1].message
    assert parse_tool_calls('{"name": "a"}', "llama3") == [ToolCall("a", {})]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("", "xml")
