"""Processed datasets, and building them from the `data` section of a config.

A `ProcessedDataset` checks, processes and tokenises every row once when it is built and
keeps the prompts, so a run never meets a bad row at the step that draws it and a long prompt
is not tokenised again at every draw; bad rows are refused or skipped per `data.bad_rows`
(`grpo_data.bad_rows`). `build_dataset` turns one dataset entry of the config
(`grpo_data.config.DatasetEntry`) into one; `build_data` does the whole section
(`grpo_data.config.DataConfig`; `DataConfig.from_mapping` reads one shaped like NeMo RL's):

    data:
      max_input_seq_length: 256
      default: {processor: math, prompt_file: prompts/cot.txt, env_name: math}
      train:                       # one dataset or a list
        - {dataset_name: OpenMathInstruct-2, split_validation_size: 0.05, seed: 42}
        - {dataset_name: ResponseDataset, data_path: my.jsonl, input_key: q, output_key: a}
      validation:
        - {dataset_name: AIME2024, repeat: 16}
      bad_rows: refuse             # or skip (count and leave out rows that cannot be used)

Rows carved off a training set by `split_validation_size` join the validation list.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from grpo_data.arithmetic import DEFAULT_DIGITS, DEFAULT_OPERATIONS, ArithmeticDataset
from grpo_data.bad_rows import DEFAULT_POLICY, BadRows, row_problem
from grpo_data.builtin_datasets import BUILTIN_DATASETS, find_builtin, load_builtin
from grpo_data.config import ARITHMETIC_KEYS, COMMON_KEYS, FILE_KEYS, DataConfig, DatasetEntry
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

DEFAULT_INPUT_KEY, DEFAULT_OUTPUT_KEY, DEFAULT_REPEAT, DEFAULT_SPLIT_VALIDATION_SIZE = "input", "output", 1, 0
# The keys of an entry are declared in grpo_data.config (DatasetEntry); these pass to the processor.
PROCESSOR_OPTION_KEYS = ("chat_template_kwargs", "on_overlong")


class ProcessedDataset(Dataset):
    """`processor(rows_dataset[i], task_spec, tokenizer, max_seq_length, i)` for every row.

    With `preprocess=True` (the default) every row is checked (`bad_rows.row_problem`: valid
    Unicode, bounded nesting), processed and tokenised here, once; a row that fails, or whose
    prompt has no tokens, goes to `bad_rows` (refused by default, or skipped and counted in
    `num_skipped`), and items are copies of the stored prompts. With `preprocess=False` the
    processor runs at each draw instead (rows that grpo's own code generates, see
    `build_dataset_parts`).

    `env_name`, if given, routes every item whose row does not name its own environment.
    Truncated prompts are kept (loss_multiplier 0) and counted in `num_truncated` (with
    `preprocess=False`: in this process; in worker processes count `datum.truncated` instead).
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
        bad_rows: BadRows | None = None,
        preprocess: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if len(rows_dataset) == 0:
            raise DataError(f"the dataset is empty: {getattr(rows_dataset, 'source', type(rows_dataset).__name__)}")
        self.rows = rows_dataset
        self.processor_name = processor if isinstance(processor, str) else getattr(processor, "__name__", "processor")
        self.processor = get_processor(processor)
        self.processor_kwargs = dict(processor_kwargs or {})
        check_processor_options(self.processor, self.processor_kwargs, self.processor_name)
        # Carried on every datum for the renders after the prompt's (tools, tool messages), even
        # where the processor itself renders no template.
        kwargs = (
            chat_template_kwargs
            if chat_template_kwargs is not None
            else self.processor_kwargs.get("chat_template_kwargs")
        )
        self.chat_template_kwargs = dict(kwargs) if kwargs else None
        self.task_spec = task_spec
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.env_name = env_name
        self.name = name or task_spec.task_name
        self.source = getattr(rows_dataset, "source", self.name)
        self.num_truncated = 0
        self.num_skipped = 0
        self._datums: list[DatumSpec] | None = None
        if preprocess:
            self._datums = self._process_all(bad_rows if bad_rows is not None else BadRows(where=self.name))

    def __len__(self) -> int:
        return len(self._datums) if self._datums is not None else len(self.rows)

    def __getitem__(self, i: int) -> DatumSpec:
        if self._datums is not None:
            datum = self._datums[i]  # a copy: callers may extend a prompt's messages or env info
            return dataclasses.replace(
                datum, message_log=[dict(m) for m in datum.message_log], extra_env_info=dict(datum.extra_env_info)
            )
        try:
            return self._process(self.rows[i], i)
        except DataError as exc:
            raise DataError(f"{self._location(i)}: {exc}") from None

    def env_names(self) -> set[str]:
        """The environments this dataset's prompts are routed to (with `preprocess=False`: the
        first row's)."""
        if self._datums is not None:
            return {d.env_name for d in self._datums}
        return {self[0].env_name}

    def _location(self, i: int) -> str:
        return self.rows.location(i) if hasattr(self.rows, "location") else f"{self.source}, item {i}"

    def _process(self, row, i: int) -> DatumSpec:
        datum = self.processor(row, self.task_spec, self.tokenizer, self.max_seq_length, i, **self.processor_kwargs)
        if not isinstance(datum, DatumSpec):
            raise DataError(f"processor {self.processor_name!r} returned {type(datum).__name__}, not a DatumSpec")
        if self.env_name and not row.get("env_name"):
            datum.env_name = self.env_name
        datum.dataset_name = self.name
        if datum.chat_template_kwargs is None and self.chat_template_kwargs:
            datum.chat_template_kwargs = dict(self.chat_template_kwargs)
        if datum.truncated:
            self.num_truncated += 1
            if self.num_truncated == 1:
                logger.warning(
                    "%s: prompt %d is longer than max_input_seq_length=%s; it is truncated and masked "
                    "(loss_multiplier 0). Further truncations are counted, not logged.",
                    self.name, i, self.max_seq_length,
                )  # fmt: skip
        return datum

    def _process_all(self, bad_rows: BadRows) -> list[DatumSpec]:
        datums = []
        skipped_before = bad_rows.count
        for i in range(len(self.rows)):
            row = self.rows[i]
            problem = row_problem(row)
            if problem is None:
                try:
                    datum = self._process(row, i)
                except DataError as exc:
                    problem = str(exc)
                except Exception as exc:  # noqa: BLE001 - a user processor's failure on one row is a bad row
                    problem = f"processor {self.processor_name!r} failed: {type(exc).__name__}: {exc}"
                else:
                    if datum.length < 1 or not any(len(m["token_ids"]) for m in datum.message_log):
                        problem = "the prompt has no tokens"
            if problem is not None:
                bad_rows.reject(self._location(i), problem)
                continue
            datums.append(datum)
        self.num_skipped = bad_rows.count - skipped_before
        if not datums:
            raise DataError(
                f"{self.source}: every row is bad ({self.num_skipped} skipped; first: {bad_rows.examples[0]})"
            )
        return datums

    def __repr__(self) -> str:
        return (
            f"ProcessedDataset({self.name!r}, {len(self)} rows from {self.source!r}, processor={self.processor_name!r})"
        )


@dataclass
class DataSplits:
    """The processed datasets of a config's data section."""

    train: list[ProcessedDataset] = field(default_factory=list)
    validation: list[ProcessedDataset] = field(default_factory=list)
    skipped_rows: dict[str, int] = field(default_factory=dict)
    """Bad rows left out per dataset entry (key path) under `bad_rows: skip`; entries with none are absent."""


# ---------------------------------------------------------------------------------------------
# One dataset entry


def _check_keys(cfg: Mapping[str, Any], kind: str, where: str) -> None:
    allowed = COMMON_KEYS | (ARITHMETIC_KEYS if kind == ARITHMETIC else FILE_KEYS)
    for key in cfg:
        if key not in allowed:
            raise DataError(f"{where}.{key}: unknown key for a {kind!r} dataset; allowed keys are {sorted(allowed)}")


def _kind(entry: DatasetEntry, where: str) -> str:
    name = entry.dataset_name
    if name is None:
        if entry.data_path or entry.train_data_path:
            return RESPONSE_DATASET
        raise DataError(
            f"{where}.dataset_name: missing; give {ARITHMETIC!r}, {RESPONSE_DATASET!r} (with data_path) or one of {sorted(BUILTIN_DATASETS)}"
        )
    if name == ARITHMETIC or name == RESPONSE_DATASET:
        return name
    if find_builtin(name) is None:
        raise DataError(
            f"{where}.dataset_name: unknown dataset {name!r}; give {ARITHMETIC!r}, {RESPONSE_DATASET!r} "
            f"(with data_path) or one of {sorted(BUILTIN_DATASETS)}"
        )
    return "builtin"


def _or(value, default):
    """`value`, or the kind's default when the key is not set (None)."""
    return default if value is None else value


def _load_rows(cfg: DatasetEntry, kind: str, where: str, bad_rows: BadRows):
    """(rows, carved validation rows or None, default task name) of one entry."""
    if kind == ARITHMETIC:
        seed = _or(cfg.seed, DEFAULT_ARITHMETIC_SEED)
        rows = ArithmeticDataset(
            size=_or(cfg.size, DEFAULT_ARITHMETIC_SIZE),
            seed=seed,
            digits=_or(cfg.digits, DEFAULT_DIGITS),
            operations=tuple(_or(cfg.operations, DEFAULT_OPERATIONS)),
        )
        train, validation = carve_validation(rows, cfg.split_validation_size, seed)
        return train, validation, ARITHMETIC
    seed = _or(cfg.seed, DEFAULT_SEED)
    if cfg.data_path is not None and cfg.train_data_path is not None:
        raise DataError(f"{where}: give data_path or train_data_path, not both")
    data_path = _or(cfg.data_path, cfg.train_data_path)
    if kind == RESPONSE_DATASET:
        if data_path is None:
            raise DataError(f"{where}.data_path: missing; a ResponseDataset needs a file, folder or hub dataset name")
        ds = ResponseDataset(
            data_path,
            input_key=_or(cfg.input_key, DEFAULT_INPUT_KEY),
            output_key=_or(cfg.output_key, DEFAULT_OUTPUT_KEY),
            subset=cfg.subset,
            split=cfg.split,
            split_validation_size=_or(cfg.split_validation_size, DEFAULT_SPLIT_VALIDATION_SIZE),
            seed=seed,
            val_data_path=cfg.val_data_path,
            val_split=cfg.val_split,
            repeat=_or(cfg.repeat, DEFAULT_REPEAT),
            bad_rows=bad_rows,
        )
    else:
        assert cfg.dataset_name is not None  # a built-in kind has a name (_kind)
        ds = load_builtin(
            cfg.dataset_name,
            data_path=data_path,
            split=cfg.split,
            subset=cfg.subset,
            input_key=cfg.input_key,
            output_key=cfg.output_key,
            repeat=cfg.repeat,
            split_validation_size=cfg.split_validation_size,
            seed=seed,
            val_data_path=cfg.val_data_path,
            bad_rows=bad_rows,
        )
    return ds.train, ds.validation, ds.task_name


def build_dataset_parts(
    cfg: DatasetEntry,
    tokenizer,
    *,
    where: str = "data",
    bad_rows: str = DEFAULT_POLICY,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """(main, validation) processed datasets of one entry; validation only if rows were carved
    off (`split_validation_size`) or `val_data_path` was given. `bad_rows` is the policy for rows
    that cannot be used ("refuse" or "skip", see grpo_data.bad_rows); the skipped ones are
    counted in `num_skipped` and logged in one line. `chat_template_kwargs`: the tokenizer's
    (policy.tokenizer.chat_template_kwargs), under the entry's own."""
    if not isinstance(cfg, DatasetEntry):
        raise DataError(f"{where}: expected a DatasetEntry (DatasetEntry.from_mapping), got {type(cfg).__name__}")
    entry = cfg
    kind = _kind(entry, where)
    _check_keys(entry.set_keys(), kind, where)
    bad = BadRows(bad_rows, where)
    main_rows, val_rows, default_task = _load_rows(entry, kind, where, bad)
    source_skips = bad.count
    task_spec = TaskSpec.from_files(entry.task_name or default_task, entry.prompt_file, entry.system_prompt_file)
    processor = entry.processor or (DEFAULT_ARITHMETIC_PROCESSOR if kind == ARITHMETIC else DEFAULT_PROCESSOR)
    options = {k: getattr(entry, k) for k in PROCESSOR_OPTION_KEYS if getattr(entry, k) is not None}
    options.update(entry.processor_kwargs or {})
    # The tokenizer's chat_template_kwargs (policy.tokenizer's), under the entry's own.
    render_kwargs = {**(chat_template_kwargs or {}), **(options.get("chat_template_kwargs") or {})}
    if render_kwargs and _takes_chat_template_kwargs(processor):
        options["chat_template_kwargs"] = render_kwargs

    def processed(rows, suffix: str) -> ProcessedDataset:
        try:
            return ProcessedDataset(
                rows, processor, task_spec, tokenizer, entry.max_input_seq_length,
                env_name=entry.env_name, processor_kwargs=options, name=task_spec.task_name + suffix,
                bad_rows=bad, preprocess=kind != ARITHMETIC, chat_template_kwargs=render_kwargs or None,
            )  # fmt: skip
        except DataError as exc:
            raise DataError(f"{where}: {exc}") from None

    # Synthetic arithmetic rows are generated by grpo's own code in a fixed format (a short
    # "a+b=" and its result), so they cannot be bad; they are processed at each draw, which
    # keeps the demo's 100,000-row set free to build (processing it all took ~19 CPU s).
    main = processed(main_rows, "")
    validation = processed(val_rows, "") if val_rows is not None else None
    main.num_skipped += source_skips  # rows left out while reading count against the training part
    bad.log_summary(len(main) + (len(validation) if validation is not None else 0) + bad.count)
    return main, validation


def build_dataset(
    cfg: DatasetEntry, tokenizer, part: str = "train", *, where: str = "data", bad_rows: str = DEFAULT_POLICY
) -> ProcessedDataset:
    """One `ProcessedDataset` from one dataset entry of the config.

    `part="train"` is the rows left after carving a validation set (all rows if none is
    carved); `part="validation"` is the carved (or `val_data_path`) rows.
    """
    main, validation = build_dataset_parts(cfg, tokenizer, where=where, bad_rows=bad_rows)
    if part == "train":
        return main
    if part == "validation":
        if validation is None:
            raise DataError(f"{where}: no validation part; set split_validation_size or val_data_path")
        return validation
    raise DataError(f"part={part!r}; expected 'train' or 'validation'")


# ---------------------------------------------------------------------------------------------
# The data section


def build_data(
    data_cfg: DataConfig, tokenizer, *, where: str = "data", chat_template_kwargs: Mapping[str, Any] | None = None
) -> DataSplits:
    """All processed datasets of a data section: `train`, `validation`, `default`, the
    section-wide `max_input_seq_length` as a default for every dataset, and `bad_rows`
    ("refuse" or "skip") for every dataset. `chat_template_kwargs` (the tokenizer's) apply to
    every dataset whose processor renders a chat template, under an entry's own."""
    if not isinstance(data_cfg, DataConfig):
        raise DataError(f"{where}: expected a DataConfig (DataConfig.from_mapping), got {type(data_cfg).__name__}")
    policy = data_cfg.bad_rows
    defaults = data_cfg.default.set_keys()
    defaults.setdefault("max_input_seq_length", data_cfg.max_input_seq_length)
    splits = DataSplits()
    train_entries = data_cfg.entries("train", where)
    if not train_entries and data_cfg.validation is None:
        raise DataError(f"{where}.train: no dataset configured")
    for entry_where, entry in train_entries:
        main, validation = build_dataset_parts(
            _with_defaults(defaults, entry, entry_where),
            tokenizer,
            where=entry_where,
            bad_rows=policy,
            chat_template_kwargs=chat_template_kwargs,
        )
        _count_skips(splits, entry_where, main, validation)
        splits.train.append(main)
        if validation is not None:
            splits.validation.append(validation)
    for entry_where, entry in data_cfg.entries("validation", where):
        main, extra = build_dataset_parts(
            _with_defaults(defaults, entry, entry_where),
            tokenizer,
            where=entry_where,
            bad_rows=policy,
            chat_template_kwargs=chat_template_kwargs,
        )
        _count_skips(splits, entry_where, main, extra)
        splits.validation.append(main)
        if extra is not None:
            splits.validation.append(extra)
    _dedupe_names(splits.train)
    _dedupe_names(splits.validation)
    return splits


def _takes_chat_template_kwargs(processor) -> bool:
    """Whether `processor` (a name, import path or callable) takes `chat_template_kwargs`; a name
    that does not resolve is left to ProcessedDataset's own error."""
    try:
        params = inspect.signature(get_processor(processor)).parameters
    except Exception:
        return False
    return "chat_template_kwargs" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _count_skips(splits: DataSplits, where: str, main: ProcessedDataset, extra: ProcessedDataset | None) -> None:
    skipped = main.num_skipped + (extra.num_skipped if extra is not None else 0)
    if skipped:
        splits.skipped_rows[where] = skipped


def _with_defaults(defaults: Mapping[str, Any], entry: DatasetEntry, where: str) -> DatasetEntry:
    """`entry` over `defaults`, taking only the defaults that apply to the entry's kind of
    dataset (a default `input_key` does not reach an arithmetic entry)."""
    own = entry.set_keys()
    kind = _kind(DatasetEntry(**{**defaults, **own}), where)
    allowed = COMMON_KEYS | (ARITHMETIC_KEYS if kind == ARITHMETIC else FILE_KEYS)
    return DatasetEntry(**{**{k: v for k, v in defaults.items() if k in allowed}, **own})


def _dedupe_names(datasets: list[ProcessedDataset]) -> None:
    seen: dict[str, int] = {}
    for ds in datasets:
        count = seen.get(ds.name, 0)
        seen[ds.name] = count + 1
        if count:
            ds.name = f"{ds.name}#{count + 1}"
