"""Arithmetic with a calculator tool: the model may call ``calculator`` before it answers.

The tool evaluates an integer expression (``+ - * // %``, parentheses, unary minus) by walking
its syntax tree, never ``eval``; operands and results are capped at ``MAX_DIGITS`` digits so a
hostile expression cannot hang the environment. The final answer (a turn without a call) is
scored like the ``arithmetic`` environment: its first integer against ``env_info["ground_truth"]``.
"""

from __future__ import annotations

import ast
import operator

from grpo_envs.answers import canonical_integer, first_integer
from grpo_envs.base import preview
from grpo_envs.tool_env import Tool, ToolEnv, function_schema

MAX_DIGITS = 2000
MAX_EXPRESSION_CHARS = 4000
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """The value of an integer expression as text; raises ValueError on anything else."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    return str(_value(tree.body))


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _capped(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and len(str(abs(left))) + len(str(abs(right))) > MAX_DIGITS + 1:
            raise ValueError(f"result would exceed {MAX_DIGITS} digits")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _capped(_OPS[type(node.op)](left, right))
    raise ValueError(f"unsupported syntax: {type(node).__name__} (integers and + - * // % only)")


def _capped(value: int) -> int:
    if value.bit_length() > MAX_DIGITS * 3.33:  # ~log2(10) bits per digit, checked before str()
        raise ValueError(f"number exceeds {MAX_DIGITS} digits")
    return value


class CalculatorEnv(ToolEnv):
    """Reward 1 when the final answer's first integer equals ``env_info["ground_truth"]``."""

    def make_tools(self) -> list[Tool]:
        schema = function_schema(
            "calculator",
            "Evaluate an integer expression with + - * // % and parentheses.",
            {"expression": {"type": "string", "description": "e.g. 123456789 + 987654321"}},
        )
        return [Tool(schema, calculate)]

    def score(self, answer: str, env_info: dict) -> tuple[float, dict]:
        gold = canonical_integer(str(env_info.get("ground_truth", "")))
        if gold is None:
            raise ValueError(
                f"calculator env: ground_truth must be an integer string, got {env_info.get('ground_truth')!r}"
            )
        got = first_integer(answer)
        return float(got == gold), {"answer": preview(got), "ground_truth": gold, "correct": got == gold}
