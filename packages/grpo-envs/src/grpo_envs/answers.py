"""Pulling the answer out of a model response: integers, ``\\boxed{}``, ``Answer:`` lines, code.

Every function here takes untrusted text of any size and returns None instead of raising;
each runs in time linear in the text (no backtracking regexes over the whole response).
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?\d+")
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)
_CODE_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\r?\n", re.IGNORECASE)
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def canonical_integer(text: str) -> str | None:
    """``"+007"`` → ``"7"``, ``"-0"`` → ``"0"``; None unless ``text`` is exactly an integer.

    Compares as strings, so integers of any length work without int() (which refuses more
    than 4300 digits).
    """
    text = text.strip()
    if not _INTEGER.fullmatch(text):
        return None
    digits = text.lstrip("+-").lstrip("0")
    if not digits:
        return "0"
    return "-" + digits if text[0] == "-" else digits


def first_integer(text: str) -> str | None:
    """The first integer in the stripped text, canonicalised; None when there is none."""
    match = _INTEGER.search(text.strip())
    return canonical_integer(match.group()) if match else None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    One pass over the braces after the first box command, so unclosed boxes in a huge
    response cost linear time.
    """
    openings = {m.end() - 1 for m in _BOXED_OPEN.finditer(text)}
    if not openings:
        return None
    depth = 0
    pending: list[tuple[int, int]] = []  # (depth before the box's "{", index after it)
    last: tuple[int, int] | None = None
    for brace in _BRACE.finditer(text, min(openings)):
        i = brace.start()
        if text[i] == "{":
            if i in openings:
                pending.append((depth, i + 1))
            depth += 1
        else:
            depth -= 1
            if pending and pending[-1][0] == depth:
                start = pending.pop()[1]
                if last is None or start > last[0]:
                    last = (start, i)
    return text[last[0] : last[1]] if last else None


def answer_line(text: str) -> str | None:
    """The rest of the line after the last ``Answer:`` (DAPO style), without math delimiters."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0].strip()
    rest = rest.rstrip(".").strip()
    for left, right in _MATH_DELIMITERS:
        if len(rest) >= len(left) + len(right) and rest.startswith(left) and rest.endswith(right):
            rest = rest[len(left) : len(rest) - len(right)].strip()
            break
    return rest or None


def math_answer(text: str) -> str | None:
    """The answer of a math response: the last ``\\boxed{}``, else the last ``Answer:`` line."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    return answer_line(text)


def code_block(text: str) -> str:
    """The last ```python (or ```py / unlabeled) fenced block; the whole text if there is none."""
    blocks = []
    pos = 0
    while True:
        fence = _CODE_FENCE.search(text, pos)
        if fence is None:
            break
        end = text.find("```", fence.end())
        if end < 0:
            break
        blocks.append((bool(fence.group(1)), text[fence.end() : end]))
        pos = end + 3
    labelled = [body for is_python, body in blocks if is_python]
    if labelled:
        return labelled[-1]
    if blocks:
        return blocks[-1][1]
    return text
