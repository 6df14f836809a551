"""The keys of one dataset entry (`data.train`, `data.validation`, `data.default`), typed and torch-free.

Declared here once: grpo-data builds a `DatasetEntry` from each entry it is given (a plain
mapping, as in NeMo RL's data section), and grpo-train's pydantic schema takes its dataset
section's fields from this class, so `grpo config show` and grpo-data read the same keys. Which
keys apply depends on the dataset's kind (`ARITHMETIC_KEYS`, `FILE_KEYS`); the defaults that
depend on the kind (a seed, a size) are named constants in `grpo_data.datasets`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


class DatasetKeyError(ValueError):
    """A refused value of a dataset key; `key` names it (grpo-train reports it at its key path)."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.reason = key, expected
        super().__init__(f"{key}={value!r}: {expected}")


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset entry; None means "not set" (the kind's default applies).

    dataset_name: built-in name (arithmetic, OpenMathInstruct-2, DeepScaler, DAPOMath17K,
        AIME2024, GSM8K, MATH-500) or ResponseDataset; null with a data_path: ResponseDataset.
    task_name: name of the task (prompts, logs); null: the dataset's.
    processor: processor name (plain, math, chat) or `module:function`.
    processor_kwargs: extra keyword arguments of the processor.
    prompt_file / system_prompt_file: prompt template / system prompt files.
    env_name: environment that scores this dataset (a key of `env`).
    max_input_seq_length: prompts longer than this are truncated (or refused, `on_overlong`).
    chat_template_kwargs: extra keyword arguments to apply_chat_template.
    on_overlong: prompts longer than max_input_seq_length: "truncate" with loss_multiplier 0
        (counted), or "error".
    split_validation_size: fraction (< 1) or count of rows carved off as validation, by `seed`.
    seed: seed of the carving (and of the synthetic rows).
    data_path: local JSONL/JSON/Parquet file, folder or glob (overrides the hub location);
        train_data_path is its other name, val_data_path the validation file.
    input_key / output_key: the row keys of the prompt and the answer.
    subset / split / val_split: hub dataset subset and splits.
    repeat: each row this many times (e.g. AIME2024 x16 for validation).
    size / digits / operations: the synthetic arithmetic set: rows, digits per operand, operators.
    """

    dataset_name: str | None = None
    task_name: str | None = None
    processor: str | None = None
    processor_kwargs: dict[str, Any] | None = None
    prompt_file: str | None = None
    system_prompt_file: str | None = None
    env_name: str | None = None
    max_input_seq_length: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    on_overlong: Literal["truncate", "error"] | None = None
    split_validation_size: float | int | None = None
    seed: int | None = None
    data_path: str | None = None
    train_data_path: str | None = None
    val_data_path: str | None = None
    input_key: str | None = None
    output_key: str | None = None
    subset: str | None = None
    split: str | None = None
    val_split: str | None = None
    repeat: int | None = None
    size: int | None = None
    digits: int | None = None
    operations: list[str] | None = None

    def __post_init__(self) -> None:
        for key in POSITIVE_KEYS:
            value = getattr(self, key)
            if value is not None and not value >= 1:
                raise DatasetKeyError(key, value, "Input should be greater than or equal to 1")


DATASET_KEYS = frozenset(f.name for f in dataclasses.fields(DatasetEntry))
POSITIVE_KEYS = ("max_input_seq_length", "repeat", "size", "digits")
# Keys only a synthetic arithmetic entry takes, and keys only a file/hub entry takes; the rest are
# common. Anything else is a typo and is refused with its key path.
ARITHMETIC_KEYS = frozenset({"size", "digits", "operations"})
FILE_KEYS = frozenset(
    {"data_path", "train_data_path", "val_data_path", "input_key", "output_key", "subset", "split", "val_split", "repeat"}
)
COMMON_KEYS = DATASET_KEYS - ARITHMETIC_KEYS - FILE_KEYS
