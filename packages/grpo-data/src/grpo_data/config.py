"""The data section (`DataConfig`) and the keys of one dataset entry (`DatasetEntry`), typed and torch-free.

Declared here once: grpo-data's functions take these objects (`build_data`, `make_train_iterator`),
and grpo-train's pydantic schema takes its `data` section's fields from these classes, so
`grpo config show` and grpo-data read the same keys with the same defaults. A plain mapping (as
in NeMo RL's data section) becomes one with `DataConfig.from_mapping`, which refuses unknown keys
at their key path. Which entry keys apply depends on the dataset's kind (`ARITHMETIC_KEYS`,
`FILE_KEYS`); the defaults that depend on the kind (a seed, a size) are named constants in
`grpo_data.datasets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_data.bad_rows import POLICIES as BAD_ROWS_POLICIES
from grpo_data.errors import DataError


class DatasetKeyError(ValueError):
    """A refused value of a data key; `key` names it (grpo-train reports it at its key path)."""

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

    @classmethod
    def from_mapping(cls, entry: Any, where: str) -> DatasetEntry:
        """The entry a mapping of dataset keys gives; an unknown key or a refused value raises a
        DataError naming its key path (`where.key`). Null values mean "not set"."""
        if not isinstance(entry, Mapping):
            raise DataError(f"{where}: expected a mapping of dataset keys, got {type(entry).__name__}")
        for key in entry:
            if key not in DATASET_KEYS:
                raise DataError(f"{where}.{key}: unknown key; the dataset keys are {sorted(DATASET_KEYS)}")
        try:
            return cls(**entry)
        except DatasetKeyError as err:
            raise DataError(f"{where}.{err}") from None  # "data.train.size=0: ..."

    def set_keys(self) -> dict[str, Any]:
        """The keys this entry sets (not None), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


DATASET_KEYS = frozenset(f.name for f in dataclasses.fields(DatasetEntry))
POSITIVE_KEYS = ("max_input_seq_length", "repeat", "size", "digits")
# Keys only a synthetic arithmetic entry takes, and keys only a file/hub entry takes; the rest are
# common. Anything else is a typo and is refused with its key path.
ARITHMETIC_KEYS = frozenset({"size", "digits", "operations"})
FILE_KEYS = frozenset(
    {
        "data_path",
        "train_data_path",
        "val_data_path",
        "input_key",
        "output_key",
        "subset",
        "split",
        "val_split",
        "repeat",
    }
)
COMMON_KEYS = DATASET_KEYS - ARITHMETIC_KEYS - FILE_KEYS


DatasetEntries = DatasetEntry | list[DatasetEntry]


@dataclass(frozen=True)
class DataConfig:
    """The data section: its dataset entries and how the training prompts are drawn.

    max_input_seq_length: longer prompts are truncated and get loss_multiplier 0 (counted); the
        default of every dataset entry that sets none (nor `default` does).
    shuffle: draw the training prompts in a shuffled order (per epoch, by the run's seed).
    num_workers: DataLoader worker processes.
    default: defaults filled into every dataset entry (only the keys that apply to its kind).
    train / validation: one dataset entry or a list of them.
    use_multiple_dataloader: one dataloader per training dataset, mixed by a sampler, instead
        of one over their concatenation.
    num_prompts_per_dataloader: prompts each of those dataloaders gives per draw.
    custom_dataloader: `module:function` sampling function over several dataloaders (default
        round_robin).
    bad_rows: rows of data files that cannot become prompts (wrong types, invalid Unicode or
        UTF-8, deep nesting, a failing processor; checked once when the datasets are built):
        refuse stops with the file and row; skip leaves them out and logs the count
        (grpo_data.bad_rows).
    """

    max_input_seq_length: int = 512
    shuffle: bool = True
    num_workers: int = 0
    default: DatasetEntry = DatasetEntry()
    train: DatasetEntries = DatasetEntry(dataset_name="arithmetic")
    validation: DatasetEntries | None = None
    use_multiple_dataloader: bool = False
    num_prompts_per_dataloader: int | None = None
    custom_dataloader: str | None = None
    bad_rows: Literal["refuse", "skip"] = "refuse"

    def __post_init__(self) -> None:
        if not self.max_input_seq_length >= 1:
            raise DatasetKeyError(
                "max_input_seq_length", self.max_input_seq_length, "Input should be greater than or equal to 1"
            )
        if not self.num_workers >= 0:
            raise DatasetKeyError("num_workers", self.num_workers, "Input should be greater than or equal to 0")
        if self.bad_rows not in BAD_ROWS_POLICIES:
            raise DatasetKeyError("bad_rows", self.bad_rows, f"expected one of {BAD_ROWS_POLICIES}")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any], where: str = "data") -> DataConfig:
        """The section a mapping gives (a plain YAML/JSON data section); an unknown key or a
        refused value raises a DataError naming its key path. Null values mean "not set"."""
        if not isinstance(section, Mapping):
            raise DataError(f"{where}: expected a mapping, got {type(section).__name__}")
        keys = {f.name for f in dataclasses.fields(cls)}
        for key in section:
            if key not in keys:
                raise DataError(f"{where}.{key}: unknown key; the data keys are {sorted(keys)}")
        values = {k: v for k, v in section.items() if v is not None}
        if "default" in values:
            values["default"] = DatasetEntry.from_mapping(values["default"], f"{where}.default")
        for part in ("train", "validation"):
            if part in values:
                values[part] = _entries_from(values[part], f"{where}.{part}")
        try:
            return cls(**values)
        except DatasetKeyError as err:
            raise DataError(f"{where}.{err}") from None

    def entries(self, part: Literal["train", "validation"], where: str = "data") -> list[tuple[str, DatasetEntry]]:
        """The entries of `train` or `validation` with their key paths (`data.train[1]`)."""
        value = getattr(self, part)
        if value is None:
            return []
        if isinstance(value, DatasetEntry):
            return [(f"{where}.{part}", value)]
        return [(f"{where}.{part}[{i}]", entry) for i, entry in enumerate(value)]


def _entries_from(value: Any, where: str) -> DatasetEntries:
    if isinstance(value, Mapping):
        return DatasetEntry.from_mapping(value, where)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [DatasetEntry.from_mapping(entry, f"{where}[{i}]") for i, entry in enumerate(value)]
    raise DataError(f"{where}: expected a dataset mapping or a list of them, got {type(value).__name__}")
