"""Reading raw rows from local files (JSONL, JSON, Parquet) and Hugging Face `datasets`.

Every row keeps where it came from (file and 1-based line or row number), so a bad row is
reported as "train.jsonl, line 7, key 'answer'". Reading is eager and checks every row once:
a missing file or an empty source raises a `DataError`; a bad row (a line that is not UTF-8 or
not JSON, nested too deeply to parse, a row without a configured key) goes to the entry's
`BadRows` policy, which refuses it (default) or skips and counts it.

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

from grpo_data.bad_rows import BadRows
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

    def select(self, indices: Sequence[int]) -> Rows:
        return Rows([self.rows[i] for i in indices], self.source, [self.row_numbers[i] for i in indices])

    def repeat(self, times: int) -> Rows:
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


def _refuse(location: str, reason: str) -> None:
    raise DataError(f"{location}: {reason}")


def _bad_row_handler(bad_rows: BadRows | None):
    return bad_rows.reject if bad_rows is not None else _refuse


def read_jsonl(path: Path, bad_rows: BadRows | None = None) -> Iterator[tuple[int, dict]]:
    """Rows of a JSON Lines file; each line is decoded as UTF-8 on its own, so one bad line is
    one bad row (refused or skipped by `bad_rows`), not a traceback for the whole file."""
    reject = _bad_row_handler(bad_rows)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                reject(
                    where(str(path), line_no), f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                reject(where(str(path), line_no), f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            except RecursionError:
                reject(where(str(path), line_no), "JSON nested too deeply to parse")
                continue
            if not isinstance(row, dict):
                reject(where(str(path), line_no), f"expected a JSON object, got {type(row).__name__}")
                continue
            yield line_no, row


def read_json(path: Path, bad_rows: BadRows | None = None) -> Iterator[tuple[int, dict]]:
    """A JSON array of objects (rows numbered from 1), or JSON Lines under a .json name.

    A whole-file JSON document that is not UTF-8 or nests too deeply has no rows to skip: it is
    refused as a file."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # more than one top-level value: JSON Lines
            yield from read_jsonl(path, bad_rows)
            return
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to parse") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if isinstance(data, dict):
        yield 1, data
        return
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(data).__name__}")
    reject = _bad_row_handler(bad_rows)
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            reject(where(str(path), i), f"expected a JSON object, got {type(row).__name__}")
            continue
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


def read_hub(
    name: str, subset: str | None, split: str, columns: Sequence[str], hint: str
) -> Iterator[tuple[int, dict]]:
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
        Path(text).exists() or text.startswith(("/", "./", "../", "~")) or text.endswith(LOCAL_SUFFIXES) or "*" in text
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


def _read_file(path: Path, columns: Sequence[str], bad_rows: BadRows | None = None) -> Iterator[tuple[int, dict]]:
    if path.suffix == ".jsonl":
        return read_jsonl(path, bad_rows)
    if path.suffix == ".json":
        return read_json(path, bad_rows)
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
    bad_rows: BadRows | None = None,
) -> tuple[list[dict], list[int]]:
    """Build canonical rows `{target: value}`; a missing or null value makes the row bad
    (refused naming the row, or skipped by `bad_rows`)."""
    reject = _bad_row_handler(bad_rows)
    fields = {target: _as_field(spec) for target, spec in mapping.items()}
    rows, numbers = [], []
    for number, raw in numbered_rows:
        out = _map_row(raw, fields, source, number, reject)
        if out is not None:
            rows.append(out)
            numbers.append(number)
    return rows, numbers


def _map_row(raw: dict, fields: Mapping[str, Field], source: str, number: int, reject) -> dict | None:
    out = {}
    for target, field in fields.items():
        value = get_field(raw, field.key)
        if value is _MISSING or value is None:
            reject(where(source, number, field.key), f"missing (the row has keys {sorted(raw)})")
            return None
        if field.transform is not None:
            try:
                value = field.transform(value)
            except (ValueError, TypeError) as exc:
                reject(where(source, number, field.key), str(exc))
                return None
        out[target] = value
    return out


def load_rows(
    data_path: str | Path | Sequence[str | Path],
    mapping: Mapping[str, str | Field],
    subset: str | None = None,
    split: str | None = None,
    hint: str = "",
    bad_rows: BadRows | None = None,
) -> Rows:
    """Read and map every row of a local file/folder or a hub dataset; refuse an empty result.
    Bad rows are refused, or skipped and counted when `bad_rows` says so."""
    columns = sorted({top_level_column(_as_field(spec).key) for spec in mapping.values()})
    if isinstance(data_path, (list, tuple)) or is_local(data_path):
        files = local_files(data_path, split)
        rows, numbers, sources = [], [], []
        for f in files:
            skipped_before = bad_rows.count if bad_rows is not None else 0
            r, n = map_rows(_read_file(f, columns, bad_rows), str(f), mapping, bad_rows)
            if not r:
                skipped = (bad_rows.count if bad_rows is not None else 0) - skipped_before
                why = f" ({skipped} bad row(s) skipped)" if skipped else ""
                raise DataError(f"{f}: the file has no rows{why}")
            rows += r
            numbers += n
            sources.append(str(f))
        source = sources[0] if len(sources) == 1 else f"{sources[0]} (+{len(sources) - 1} more files)"
        return Rows(rows, source, numbers)
    name = str(data_path)
    rows, numbers = map_rows(read_hub(name, subset, split or "train", columns, hint), name, mapping, bad_rows)
    if not rows:
        raise DataError(f"{name} (split {split!r}): the dataset has no rows")
    return Rows(rows, name, numbers)
