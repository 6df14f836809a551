"""The one error type of grpo-data.

A `DataError` is raised for anything wrong with the data or its configuration: a missing file,
a row without the configured key, a line that is not JSON, an empty dataset, a prompt longer
than the limit under strict truncation. Its message names the file, the 1-based row (or line)
number and the key, so a person can open the file and fix the row. Nothing is dropped silently.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or data configuration; the message says where (file, row, key) and what to do."""


def where(source: str | None, row: int | None = None, key: str | None = None) -> str:
    """Format the location part of a `DataError` message: "file.jsonl, line 7, key 'answer'".

    `row` is 1-based. Sources read line by line (JSONL) say "line", others say "row".
    """
    parts = []
    if source:
        parts.append(str(source))
    if row is not None:
        unit = "line" if source and str(source).endswith(".jsonl") else "row"
        parts.append(f"{unit} {row}")
    if key is not None:
        parts.append(f"key {key!r}")
    return ", ".join(parts)
