"""Fixtures for grpo-data tests: a tiny local tokenizer and writers for small data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_data.testing import make_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_char_tokenizer()


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Rows as JSON Lines; `raw_lines` {1-based line: text} replaces those lines verbatim."""
    lines = [json.dumps(r) for r in rows]
    for line_no, text in (raw_lines or {}).items():
        lines[line_no - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def jsonl():
    return write_jsonl


@pytest.fixture
def parquet():
    return write_parquet
