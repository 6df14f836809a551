"""Reading raw rows from local files (JSONL, JSON, Parquet) and Hugging Face `datasets`.

Every row keeps where it came from (file and 1-based line or row number), so a bad row is
reported as "train.jsonl, line 7, key 'answer'". Reading is eager and checks every row once:
a missing file, a line that is not JSON, a row without a configured key or an empty source
raises a `DataError`; no row is dropped.

Keys may be paths into nested rows: "reward_model.ground_truth", "prompt.0.content" or
"prompt[0].content".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_data.errors import DataError, where

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_INDEX = re.compile(r"\[(\d+)\]")
_MISSING = object()


@dataclass
class Rows:
    """A map-style dataset of row dicts, each remembering its source and 1-based row number."""

    rows: list[dict]
    source: str
    row_numbers: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def location(self, i: int) -> str:
        """Where row i came from, for error messages."""
        return where(self.source, self.row_numbers[i])

    def select(self, indices: Sequence[int]) -> "Rows":
        return Rows([self.rows[i] for i in indices], self.source, [self.row_numbers[i] for i in indices])

    def repeat(self, times: int) -> "Rows":
        """The rows `times` times over, one full copy after another."""
        if times < 1:
            raise DataError(f"{self.source}: repeat={times}; expected a positive integer")
        return Rows(self.rows * times, self.source, self.row_numbers * times)


# ---------------------------------------------------------------------------------------------
# Field access


def _split_key(key: str) -> list[str]:
    return _INDEX.sub(r".\1", key).split(".")


def get_field(row: Any, key: str) -> Any:
    """`row[key]`, or the value at a dotted path into nested dicts and lists; `_MISSING` if absent."""
    if isinstance(row, Mapping) and key in row:
        return row[key]
    value = row
    for part in _split_key(key):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def top_level_column(key: str) -> str:
    return _split_key(key)[0]


# ---------------------------------------------------------------------------------------------
# Readers: each yields (row_number, row) with 1-based numbers


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where(str(path), line_no)}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where(str(path), line_no)}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def read_json(path: Path) -> Iterator[tuple[int, dict]]:
    """A JSON array of objects (rows numbered from 1), or JSON Lines under a .json name."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # more than one top-level value: JSON Lines
            yield from read_jsonl(path)
            return
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if isinstance(data, dict):
        yield 1, data
        return
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{where(str(path), i)}: expected a JSON object, got {type(row).__name__}")
        yield i, row


def read_parquet(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq  # arrives with `datasets`

    try:
        schema_names = pq.read_schema(path).names
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = [c for c in columns if c not in schema_names]
    if missing:
        raise DataError(f"{where(str(path), key=missing[0])}: no such column; the file has columns {schema_names}")
    table = pq.read_table(path, columns=list(dict.fromkeys(columns)))
    yield from enumerate(table.to_pylist(), start=1)


def read_hub(name: str, subset: str | None, split: str, columns: Sequence[str], hint: str) -> Iterator[tuple[int, dict]]:
    """Rows of a Hugging Face `datasets` dataset; failures say how to use a local copy instead."""
    import datasets

    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as exc:  # noqa: BLE001 - network, auth, missing split: all become one clear message
        raise DataError(
            f"could not load the dataset {name!r} (subset {subset!r}, split {split!r}) with "
            f"datasets.load_dataset: {type(exc).__name__}: {exc}. If the machine is offline "
            f"(HF_HUB_OFFLINE=1) or the dataset is not cached, download a copy and set "
            f"data_path to the local file or folder{hint}."
        ) from exc
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise DataError(f"{where(name, key=missing[0])}: no such column; the dataset has columns {ds.column_names}")
    table = ds.select_columns(list(dict.fromkeys(columns))).data.table
    yield from enumerate(table.to_pylist(), start=1)


def is_local(data_path: str | Path) -> bool:
    """A local path (existing, absolute/relative-looking or with a data-file suffix) vs a hub name."""
    text = str(data_path)
    return (
        Path(text).exists()
        or text.startswith(("/", "./", "../", "~"))
        or text.endswith(LOCAL_SUFFIXES)
        or "*" in text
    )


def local_files(data_path: str | Path | Sequence[str | Path], split: str | None = None) -> list[Path]:
    """The data files named by a file, a folder, a glob or a list of them, in sorted order.

    In a folder, files whose name contains the split (e.g. "test-00000.parquet" for split
    "test") are used if there are any; otherwise every data file in it.
    """
    if isinstance(data_path, (list, tuple)):
        return [f for p in data_path for f in local_files(p, split)]
    path = Path(data_path).expanduser()
    if "*" in str(path):
        files = sorted(Path(p) for p in path.parent.glob(path.name))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
        if split:
            matching = [p for p in files if split in p.name]
            files = matching or files
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"data file not found: {str(data_path)!r}")
    if not files:
        raise DataError(f"no .jsonl/.json/.parquet files in {str(data_path)!r}")
    for f in files:
        if f.suffix not in LOCAL_SUFFIXES:
            raise DataError(f"{f}: unsupported file type {f.suffix!r}; expected one of {LOCAL_SUFFIXES}")
    return files


def _read_file(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, dict]]:
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".json":
        return read_json(path)
    return read_parquet(path, columns)


# ---------------------------------------------------------------------------------------------
# Column mapping


@dataclass(frozen=True)
class Field:
    """Where a canonical field comes from: a key (path) into the raw row, and an optional
    transform of its value (e.g. GSM8K's "reasoning #### 42" → "42") that raises `ValueError`
    for a value it cannot use."""

    key: str
    transform: Callable[[Any], Any] | None = None


def _as_field(spec: str | Field) -> Field:
    return spec if isinstance(spec, Field) else Field(spec)


def map_rows(
    numbered_rows: Iterator[tuple[int, dict]],
    source: str,
    mapping: Mapping[str, str | Field],
) -> tuple[list[dict], list[int]]:
    """Build canonical rows `{target: value}`; a missing or null value is an error naming the row."""
    fields = {target: _as_field(spec) for target, spec in mapping.items()}
    rows, numbers = [], []
    for number, raw in numbered_rows:
        out = {}
        for target, field in fields.items():
            value = get_field(raw, field.key)
            if value is _MISSING or value is None:
                raise DataError(f"{where(source, number, field.key)}: missing (the row has keys {sorted(raw)})")
            if field.transform is not None:
                try:
                    value = field.transform(value)
                except (ValueError, TypeError) as exc:
                    raise DataError(f"{where(source, number, field.key)}: {exc}") from None
            out[target] = value
        rows.append(out)
        numbers.append(number)
    return rows, numbers


def load_rows(
    data_path: str | Path | Sequence[str | Path],
    mapping: Mapping[str, str | Field],
    subset: str | None = None,
    split: str | None = None,
    hint: str = "",
) -> Rows:
    """Read and map every row of a local file/folder or a hub dataset; refuse an empty result."""
    columns = sorted({top_level_column(_as_field(spec).key) for spec in mapping.values()})
    if isinstance(data_path, (list, tuple)) or is_local(data_path):
        files = local_files(data_path, split)
        rows, numbers, sources = [], [], []
        for f in files:
            r, n = map_rows(_read_file(f, columns), str(f), mapping)
            if not r:
                raise DataError(f"{f}: the file has no rows")
            rows += r
            numbers += n
            sources.append(str(f))
        source = sources[0] if len(sources) == 1 else f"{sources[0]} (+{len(sources) - 1} more files)"
        return Rows(rows, source, numbers)
    name = str(data_path)
    rows, numbers = map_rows(read_hub(name, subset, split or "train", columns, hint), name, mapping)
    if not rows:
        raise DataError(f"{name} (split {split!r}): the dataset has no rows")
    return Rows(rows, name, numbers)
