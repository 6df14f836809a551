"""Processed datasets, and building them from the `data` section of a config.

A `ProcessedDataset` applies a processor lazily, row by row, so a dataloader's worker
processes do the tokenising. `build_dataset` turns one dataset entry of the config (a plain
dict shaped like NeMo RL's data section) into one; `build_data` does the whole section:

    data:
      max_input_seq_length: 256
      default: {processor: math, prompt_file: prompts/cot.txt, env_name: math}
      train:                       # one dataset or a list
        - {dataset_name: OpenMathInstruct-2, split_validation_size: 0.05, seed: 42}
        - {dataset_name: ResponseDataset, data_path: my.jsonl, input_key: q, output_key: a}
      validation:
        - {dataset_name: AIME2024, repeat: 16}

Rows carved off a training set by `split_validation_size` join the validation list.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from grpo_data.arithmetic import DEFAULT_DIGITS, DEFAULT_OPERATIONS, ArithmeticDataset
from grpo_data.builtin_datasets import BUILTIN_DATASETS, find_builtin, load_builtin
from grpo_data.errors import DataError
from grpo_data.processors import check_processor_options, get_processor
from grpo_data.records import DatumSpec, TaskSpec
from grpo_data.response_dataset import DEFAULT_SEED, ResponseDataset
from grpo_data.splits import carve_validation

logger = logging.getLogger(__name__)

ARITHMETIC = "arithmetic"
RESPONSE_DATASET = "ResponseDataset"
DEFAULT_ARITHMETIC_SIZE = 10_000
DEFAULT_ARITHMETIC_SEED = 0
DEFAULT_ARITHMETIC_PROCESSOR = "plain"
DEFAULT_PROCESSOR = "math"

# Keys one dataset entry may have; anything else is a typo and is refused with its key path.
COMMON_KEYS = frozenset(
    {
        "dataset_name", "task_name", "processor", "processor_kwargs", "prompt_file", "system_prompt_file",
        "env_name", "max_input_seq_length", "chat_template_kwargs", "on_overlong", "split_validation_size", "seed",
    }
)  # fmt: skip
ARITHMETIC_KEYS = frozenset({"size", "digits", "operations"})
FILE_KEYS = frozenset(
    {"data_path", "train_data_path", "val_data_path", "input_key", "output_key", "subset", "split", "val_split", "repeat"}
)
PROCESSOR_OPTION_KEYS = ("chat_template_kwargs", "on_overlong")


class ProcessedDataset(Dataset):
    """`processor(rows_dataset[i], task_spec, tokenizer, max_seq_length, i)` for item i, lazily.

    `env_name`, if given, routes every item whose row does not name its own environment.
    Truncated prompts are kept (loss_multiplier 0) and counted in `num_truncated` (in this
    process; in worker processes count `datum.truncated` in the batches instead).
    """

    def __init__(
        self,
        rows_dataset,
        processor,
        task_spec: TaskSpec,
        tokenizer,
        max_seq_length: int | None,
        *,
        env_name: str | None = None,
        processor_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        if len(rows_dataset) == 0:
            raise DataError(f"the dataset is empty: {getattr(rows_dataset, 'source', type(rows_dataset).__name__)}")
        self.rows = rows_dataset
        self.processor_name = processor if isinstance(processor, str) else getattr(processor, "__name__", "processor")
        self.processor = get_processor(processor)
        self.processor_kwargs = dict(processor_kwargs or {})
        check_processor_options(self.processor, self.processor_kwargs, self.processor_name)
        self.task_spec = task_spec
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.env_name = env_name
        self.name = name or task_spec.task_name
        self.source = getattr(rows_dataset, "source", self.name)
        self.num_truncated = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> DatumSpec:
        row = self.rows[i]
        try:
            datum = self.processor(row, self.task_spec, self.tokenizer, self.max_seq_length, i, **self.processor_kwargs)
        except DataError as exc:
            location = self.rows.location(i) if hasattr(self.rows, "location") else f"{self.source}, item {i}"
            raise DataError(f"{location}: {exc}") from None
        if self.env_name and not row.get("env_name"):
            datum.env_name = self.env_name
        datum.dataset_name = self.name
        if datum.truncated:
            self.num_truncated += 1
            if self.num_truncated == 1:
                logger.warning(
                    "%s: prompt %d is longer than max_input_seq_length=%s; it is truncated and masked "
                    "(loss_multiplier 0). Further truncations are counted, not logged.",
                    self.name, i, self.max_seq_length,
                )  # fmt: skip
        return datum

    def __repr__(self) -> str:
        return f"ProcessedDataset({self.name!r}, {len(self)} rows from {self.source!r}, processor={self.processor_name!r})"


@dataclass
class DataSplits:
    """The processed datasets of a config's data section."""

    train: list[ProcessedDataset] = field(default_factory=list)
    validation: list[ProcessedDataset] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# One dataset entry


def _check_keys(cfg: Mapping[str, Any], kind: str, where: str) -> None:
    allowed = COMMON_KEYS | (ARITHMETIC_KEYS if kind == ARITHMETIC else FILE_KEYS)
    for key in cfg:
        if key not in allowed:
            raise DataError(f"{where}.{key}: unknown key for a {kind!r} dataset; allowed keys are {sorted(allowed)}")


def _kind(cfg: Mapping[str, Any], where: str) -> str:
    name = cfg.get("dataset_name")
    if name is None:
        if cfg.get("data_path") or cfg.get("train_data_path"):
            return RESPONSE_DATASET
        raise DataError(f"{where}.dataset_name: missing; give {ARITHMETIC!r}, {RESPONSE_DATASET!r} (with data_path) or one of {sorted(BUILTIN_DATASETS)}")
    if name == ARITHMETIC or name == RESPONSE_DATASET:
        return name
    if find_builtin(name) is None:
        raise DataError(
            f"{where}.dataset_name: unknown dataset {name!r}; give {ARITHMETIC!r}, {RESPONSE_DATASET!r} "
            f"(with data_path) or one of {sorted(BUILTIN_DATASETS)}"
        )
    return "builtin"


def _load_rows(cfg: Mapping[str, Any], kind: str, where: str):
    """(rows, carved validation rows or None, default task name) of one entry."""
    if kind == ARITHMETIC:
        seed = cfg.get("seed", DEFAULT_ARITHMETIC_SEED)
        rows = ArithmeticDataset(
            size=cfg.get("size", DEFAULT_ARITHMETIC_SIZE),
            seed=seed,
            digits=cfg.get("digits", DEFAULT_DIGITS),
            operations=tuple(cfg.get("operations", DEFAULT_OPERATIONS)),
        )
        train, validation = carve_validation(rows, cfg.get("split_validation_size"), seed)
        return train, validation, ARITHMETIC
    seed = cfg.get("seed", DEFAULT_SEED)
    if cfg.get("data_path") is not None and cfg.get("train_data_path") is not None:
        raise DataError(f"{where}: give data_path or train_data_path, not both")
    data_path = cfg.get("data_path", cfg.get("train_data_path"))
    if kind == RESPONSE_DATASET:
        if data_path is None:
            raise DataError(f"{where}.data_path: missing; a ResponseDataset needs a file, folder or hub dataset name")
        ds = ResponseDataset(
            data_path,
            input_key=cfg.get("input_key", "input"),
            output_key=cfg.get("output_key", "output"),
            subset=cfg.get("subset"),
            split=cfg.get("split"),
            split_validation_size=cfg.get("split_validation_size", 0),
            seed=seed,
            val_data_path=cfg.get("val_data_path"),
            val_split=cfg.get("val_split"),
            repeat=cfg.get("repeat", 1),
        )
    else:
        ds = load_builtin(
            cfg["dataset_name"],
            data_path=data_path,
            split=cfg.get("split"),
            subset=cfg.get("subset"),
            input_key=cfg.get("input_key"),
            output_key=cfg.get("output_key"),
            repeat=cfg.get("repeat"),
            split_validation_size=cfg.get("split_validation_size"),
            seed=seed,
            val_data_path=cfg.get("val_data_path"),
        )
    return ds.train, ds.validation, ds.task_name


def build_dataset_parts(
    cfg: Mapping[str, Any], tokenizer, *, where: str = "data"
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """(main, validation) processed datasets of one entry; validation only if rows were carved
    off (`split_validation_size`) or `val_data_path` was given."""
    if not isinstance(cfg, Mapping):
        raise DataError(f"{where}: expected a mapping of dataset keys, got {type(cfg).__name__}")
    cfg = {k: v for k, v in cfg.items() if v is not None}  # null means "not set" (typed configs dump it)
    kind = _kind(cfg, where)
    _check_keys(cfg, kind, where)
    main_rows, val_rows, default_task = _load_rows(cfg, kind, where)
    task_spec = TaskSpec.from_files(
        cfg.get("task_name") or default_task, cfg.get("prompt_file"), cfg.get("system_prompt_file")
    )
    processor = cfg.get("processor") or (DEFAULT_ARITHMETIC_PROCESSOR if kind == ARITHMETIC else DEFAULT_PROCESSOR)
    options = {k: cfg[k] for k in PROCESSOR_OPTION_KEYS if cfg.get(k) is not None}
    options.update(cfg.get("processor_kwargs") or {})

    def processed(rows, suffix: str) -> ProcessedDataset:
        try:
            return ProcessedDataset(
                rows, processor, task_spec, tokenizer, cfg.get("max_input_seq_length"),
                env_name=cfg.get("env_name"), processor_kwargs=options, name=task_spec.task_name + suffix,
            )  # fmt: skip
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None

    return processed(main_rows, ""), (processed(val_rows, "") if val_rows is not None else None)


def build_dataset(cfg: Mapping[str, Any], tokenizer, part: str = "train", *, where: str = "data") -> ProcessedDataset:
    """One `ProcessedDataset` from one dataset entry of the config.

    `part="train"` is the rows left after carving a validation set (all rows if none is
    carved); `part="validation"` is the carved (or `val_data_path`) rows.
    """
    main, validation = build_dataset_parts(cfg, tokenizer, where=where)
    if part == "train":
        return main
    if part == "validation":
        if validation is None:
            raise DataError(f"{where}: no validation part; set split_validation_size or val_data_path")
        return validation
    raise DataError(f"part={part!r}; expected 'train' or 'validation'")


# ---------------------------------------------------------------------------------------------
# The data section


def _entries(value: Any, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [(where, value)]
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [(f"{where}[{i}]", entry) for i, entry in enumerate(value)]
    raise DataError(f"{where}: expected a dataset mapping or a list of them, got {type(value).__name__}")


def build_data(data_cfg: Mapping[str, Any], tokenizer, *, where: str = "data") -> DataSplits:
    """All processed datasets of a data section: `train`, `validation`, `default`, and the
    section-wide `max_input_seq_length` as a default for every dataset."""
    defaults = dict(data_cfg.get("default") or {})
    for key in defaults:
        if key not in COMMON_KEYS | ARITHMETIC_KEYS | FILE_KEYS:
            raise DataError(f"{where}.default.{key}: unknown dataset key")
    if data_cfg.get("max_input_seq_length") is not None:
        defaults.setdefault("max_input_seq_length", data_cfg["max_input_seq_length"])
    splits = DataSplits()
    train_entries = _entries(data_cfg.get("train"), f"{where}.train")
    if not train_entries and data_cfg.get("validation") is None:
        raise DataError(f"{where}.train: no dataset configured")
    for entry_where, entry in train_entries:
        main, validation = build_dataset_parts(_with_defaults(defaults, entry, entry_where), tokenizer, where=entry_where)
        splits.train.append(main)
        if validation is not None:
            splits.validation.append(validation)
    for entry_where, entry in _entries(data_cfg.get("validation"), f"{where}.validation"):
        main, extra = build_dataset_parts(_with_defaults(defaults, entry, entry_where), tokenizer, where=entry_where)
        splits.validation.append(main)
        if extra is not None:
            splits.validation.append(extra)
    _dedupe_names(splits.train)
    _dedupe_names(splits.validation)
    return splits


def _with_defaults(defaults: Mapping[str, Any], entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`entry` over `defaults`, taking only the defaults that apply to the entry's kind of
    dataset (a default `input_key` does not reach an arithmetic entry)."""
    if not isinstance(entry, Mapping):
        raise DataError(f"{where}: expected a mapping of dataset keys, got {type(entry).__name__}")
    kind = _kind({**defaults, **entry}, where)
    allowed = COMMON_KEYS | (ARITHMETIC_KEYS if kind == ARITHMETIC else FILE_KEYS)
    return {**{k: v for k, v in defaults.items() if k in allowed}, **entry}


def _dedupe_names(datasets: list[ProcessedDataset]) -> None:
    seen: dict[str, int] = {}
    for ds in datasets:
        count = seen.get(ds.name, 0)
        seen[ds.name] = count + 1
        if count:
            ds.name = f"{ds.name}#{count + 1}"
