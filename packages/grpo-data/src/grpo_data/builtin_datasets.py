"""Math datasets known by name, with their real Hugging Face names and column mapping.

| name               | hub dataset                              | prompt column       | answer column               |
|--------------------|------------------------------------------|---------------------|-----------------------------|
| OpenMathInstruct-2 | nvidia/OpenMathInstruct-2 (train_1M)     | problem             | expected_answer             |
| DeepScaler         | agentica-org/DeepScaleR-Preview-Dataset  | problem             | answer                      |
| DAPOMath17K        | BytedTsinghua-SIA/DAPO-Math-17k          | prompt[0].content   | reward_model.ground_truth   |
| AIME2024           | HuggingFaceH4/aime_2024 (repeat 16)      | problem             | answer                      |
| GSM8K              | openai/gsm8k, subset main                | question            | answer, text after '####'   |
| MATH-500           | HuggingFaceH4/MATH-500 (test)            | problem             | answer                      |

`data_path` points any of them at a local copy (.jsonl / .json / .parquet file or folder in
the same schema), which is also how they load on an offline machine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_data.bad_rows import BadRows
from grpo_data.errors import DataError
from grpo_data.response_dataset import DEFAULT_SEED, ResponseDataset


def gsm8k_final_answer(text: Any) -> str:
    """GSM8K's answer column is the worked solution followed by '#### <number>'."""
    if not isinstance(text, str) or "####" not in text:
        raise ValueError("expected a GSM8K solution ending in '#### <answer>'")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass(frozen=True)
class BuiltinDataset:
    name: str
    hub_name: str
    input_key: str
    output_key: str
    split: str = "train"
    subset: str | None = None
    hub_splits: tuple[str, ...] | None = None  # the splits the hub dataset has, where known
    answer_transform: Callable[[Any], Any] | None = None
    repeat: int = 1
    split_validation_size: float = 0.0
    aliases: tuple[str, ...] = ()


BUILTIN_DATASETS: dict[str, BuiltinDataset] = {
    d.name: d
    for d in (
        BuiltinDataset(
            "OpenMathInstruct-2",
            "nvidia/OpenMathInstruct-2",
            input_key="problem",
            output_key="expected_answer",
            split="train_1M",
            hub_splits=("train", "train_1M", "train_2M", "train_5M"),
            split_validation_size=0.05,
            aliases=("openmathinstruct2",),
        ),
        BuiltinDataset(
            "DeepScaler",
            "agentica-org/DeepScaleR-Preview-Dataset",
            input_key="problem",
            output_key="answer",
            aliases=("deepscaler-preview",),
        ),
        BuiltinDataset(
            "DAPOMath17K",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            input_key="prompt[0].content",
            output_key="reward_model.ground_truth",
            aliases=("dapo-math-17k", "dapomath"),
        ),
        BuiltinDataset(
            "AIME2024",
            "HuggingFaceH4/aime_2024",
            input_key="problem",
            output_key="answer",
            repeat=16,
            aliases=("aime_2024", "aime24"),
        ),
        BuiltinDataset(
            "GSM8K",
            "openai/gsm8k",
            input_key="question",
            output_key="answer",
            subset="main",
            hub_splits=("train", "test"),
            answer_transform=gsm8k_final_answer,
        ),
        BuiltinDataset(
            "MATH-500",
            "HuggingFaceH4/MATH-500",
            input_key="problem",
            output_key="answer",
            split="test",
            hub_splits=("test",),
            aliases=("math500",),
        ),
    )
}


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_NORMALISED = {_normalise(alias): d for d in BUILTIN_DATASETS.values() for alias in (d.name, d.hub_name, *d.aliases)}


def find_builtin(name: str) -> BuiltinDataset | None:
    """The built-in dataset called `name` (case, '-' and '_' ignored; hub names work too)."""
    return _BY_NORMALISED.get(_normalise(name))


def load_builtin(
    name: str,
    *,
    data_path=None,
    split: str | None = None,
    subset: str | None = None,
    input_key: str | None = None,
    output_key: str | None = None,
    repeat: int | None = None,
    split_validation_size: float | int | None = None,
    seed: int = DEFAULT_SEED,
    val_data_path=None,
    task_name: str | None = None,
    bad_rows: BadRows | None = None,
) -> ResponseDataset:
    """Load a built-in dataset from the hub or, with `data_path`, from a local copy."""
    spec = find_builtin(name)
    if spec is None:
        raise DataError(f"unknown dataset {name!r}; built-in datasets are {sorted(BUILTIN_DATASETS)}")
    split = split or spec.split
    if data_path is None and spec.hub_splits is not None and split not in spec.hub_splits:
        raise DataError(f"{spec.name}: split {split!r} does not exist; the hub dataset has {list(spec.hub_splits)}")
    if split_validation_size is None:
        split_validation_size = 0 if val_data_path is not None else spec.split_validation_size
    input_key = input_key or spec.input_key
    output_key = output_key or spec.output_key
    hint = f" in the {spec.hub_name} schema (columns {input_key!r} and {output_key!r})"
    return ResponseDataset(
        data_path if data_path is not None else spec.hub_name,
        input_key=input_key,
        output_key=output_key,
        subset=subset if subset is not None else spec.subset,
        split=split,
        split_validation_size=split_validation_size,
        seed=seed,
        task_name=task_name or spec.name,
        val_data_path=val_data_path,
        repeat=spec.repeat if repeat is None else repeat,
        answer_transform=spec.answer_transform,
        hint=hint,
        bad_rows=bad_rows,
    )
