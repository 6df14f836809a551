"""What to do with a bad row: refuse the data (the default) or skip the row and count it.

A row is bad when it cannot become a prompt: a JSONL line that is not UTF-8 or not a JSON
object, a missing or null key, a value of the wrong type, text that is not valid Unicode (a
lone surrogate such as "\\ud800" passes `json.loads` and then breaks the tokenizer), nesting
deeper than `MAX_ROW_DEPTH`, a prompt with no tokens, or a processor that raises on the row.
Every row is checked once, when the dataset is built, so a run never meets a bad row at the
step that draws it.

`refuse` (default): the first bad row stops the build with a `DataError` naming the file and
the row. The project's rule is that nothing is dropped silently, and a bad row is most often a
wrong `input_key` or a broken export that a person wants to hear about at once.
`skip`: bad rows are left out; the count and the first few locations are logged once per
dataset when it is built (`grpo_data.bad_rows` logger) and kept in `BadRows.count`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from grpo_data.errors import DataError

logger = logging.getLogger(__name__)

POLICIES = ("refuse", "skip")
DEFAULT_POLICY = "refuse"
MAX_ROW_DEPTH = 32
"""Deepest nesting of lists/dicts accepted in a row (prompts and answers are a few levels deep)."""
MAX_EXAMPLES = 3
"""Skipped rows named in the summary line; the rest are counted."""


class BadRows:
    """The bad-row policy of one dataset entry, and the rows it skipped."""

    def __init__(self, policy: str = DEFAULT_POLICY, where: str = "data") -> None:
        if policy not in POLICIES:
            raise DataError(f"{where}.bad_rows: {policy!r}; expected one of {POLICIES}")
        self.policy = policy
        self.where = where
        self.count = 0
        self.examples: list[str] = []

    def reject(self, location: str, reason: str) -> None:
        """A bad row at `location` ("file.jsonl, line 7"): raise (refuse) or count it (skip)."""
        if self.policy == "refuse":
            raise DataError(f"{location}: {reason} (data.bad_rows: skip leaves such rows out)")
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{location}: {reason}")

    def summary(self, total: int) -> str:
        """One line: how many of `total` rows were skipped, and the first few reasons."""
        more = f" (+{self.count - len(self.examples)} more)" if self.count > len(self.examples) else ""
        return f"{self.where}: skipped {self.count} bad row(s) of {total}: " + "; ".join(self.examples) + more

    def log_summary(self, total: int) -> None:
        if self.count:
            logger.warning("%s", self.summary(total))


def row_problem(row: Any) -> str | None:
    """Why `row` cannot be used, or None: it must be a mapping whose strings are valid Unicode
    and whose lists/dicts nest at most `MAX_ROW_DEPTH` deep. Iterative, so a deep row cannot
    exhaust the stack."""
    if not isinstance(row, Mapping):
        return f"expected a mapping, got {type(row).__name__}"
    stack: list[tuple[Any, str, int]] = [(row, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            problem = _text_problem(value)
            if problem:
                return f"key {path!r}: {problem}"
        elif isinstance(value, (Mapping, list, tuple)):
            if depth > MAX_ROW_DEPTH:
                return f"key {path!r}: nested deeper than {MAX_ROW_DEPTH} levels"
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for key, child in items:
                if isinstance(key, str) and _text_problem(key):
                    return f"key {path!r}: a key is not valid Unicode"
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))
    return None


def _text_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"text is not valid Unicode (lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start})"
    return None
