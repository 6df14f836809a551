"""`ResponseDataset`: prompt/answer pairs from local files or a Hugging Face dataset.

Rows come out canonical, `{"problem": ..., "answer": ...}`, whatever the source's column names
(`input_key` / `output_key`, which may be paths like "reward_model.ground_truth"); the
processors read the canonical keys. NeMo RL users know this class by the same name and keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpo_data.bad_rows import BadRows
from grpo_data.errors import DataError
from grpo_data.sources import Field, Rows, load_rows
from grpo_data.splits import carve_validation

DEFAULT_INPUT_KEY = "input"
DEFAULT_OUTPUT_KEY = "output"
DEFAULT_SEED = 42


def _answer_text(value: Any) -> Any:
    # Numbers become text ("46"); conversations (lists) and text pass through.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


class ResponseDataset:
    """Prompt/answer rows with an optional validation part.

    - `data_path`: a .jsonl / .json / .parquet file, a folder or glob of them, a list of
      those, or a Hugging Face dataset name (loaded with `datasets.load_dataset(data_path,
      subset, split=split)`).
    - `split_validation_size`: a fraction in (0, 1) or a row count carved out of the rows as
      `validation`, deterministically by `seed`; alternatively `val_data_path` names a
      separate validation source.
    - `repeat`: every part repeated this many times (AIME-style evaluation averaging).
    - `answer_transform`: applied to each answer (e.g. GSM8K's text after '####').
    - `bad_rows`: the policy for rows that cannot be read or mapped (refuse by default).

    `train` holds the rows left after carving (all rows if nothing was carved).
    """

    def __init__(
        self,
        data_path: str | Path | Sequence[str | Path],
        input_key: str = DEFAULT_INPUT_KEY,
        output_key: str = DEFAULT_OUTPUT_KEY,
        subset: str | None = None,
        split: str | None = None,
        split_validation_size: float | int | None = 0,
        seed: int = DEFAULT_SEED,
        task_name: str | None = None,
        val_data_path: str | Path | Sequence[str | Path] | None = None,
        val_split: str | None = None,
        repeat: int = 1,
        answer_transform: Callable[[Any], Any] | None = None,
        hint: str = "",
        bad_rows: BadRows | None = None,
    ) -> None:
        if split_validation_size and val_data_path is not None:
            raise DataError("give either split_validation_size or val_data_path, not both")
        transform = answer_transform or _answer_text
        mapping = {"problem": input_key, "answer": Field(output_key, transform)}
        hint = hint or f" with columns {input_key!r} and {output_key!r}"
        rows = load_rows(data_path, mapping, subset=subset, split=split, hint=hint, bad_rows=bad_rows)
        train, validation = carve_validation(rows, split_validation_size, seed)
        if val_data_path is not None:
            validation = load_rows(val_data_path, mapping, subset=subset, split=val_split, hint=hint, bad_rows=bad_rows)
        if repeat != 1:
            train = train.repeat(repeat)
            validation = validation.repeat(repeat) if validation is not None else None
        self.train: Rows = train
        self.validation: Rows | None = validation
        self.source = rows.source
        first = data_path[0] if isinstance(data_path, (list, tuple)) else data_path
        self.task_name = task_name or Path(str(first)).stem or str(first)

    def __len__(self) -> int:
        return len(self.train)

    def __getitem__(self, i: int) -> dict:
        return self.train[i]

    def __repr__(self) -> str:
        n_val = len(self.validation) if self.validation is not None else 0
        return f"ResponseDataset({self.source!r}, train={len(self.train)}, validation={n_val})"
