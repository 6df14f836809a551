"""grpo-data: datasets, processors and dataloaders for RL post-training of language models.

Raw rows (JSONL / Parquet / Hugging Face datasets, built-in math sets by name, a synthetic
arithmetic set) become tokenised prompts (`DatumSpec`) through processors, and reach the
trainer through dataloaders that resume exactly. grpo-data speaks tokens and tensors; it
knows nothing about rewards, environments' internals or training.

Submodules are imported on first use, so `import grpo_data` is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataError": "grpo_data.errors",
    "BadRows": "grpo_data.bad_rows",
    "DatumSpec": "grpo_data.records",
    "TaskSpec": "grpo_data.records",
    "ArithmeticDataset": "grpo_data.arithmetic",
    "make_problem": "grpo_data.arithmetic",
    "PROCESSORS": "grpo_data.processors",
    "register_processor": "grpo_data.processors",
    "get_processor": "grpo_data.processors",
    "make_dataloader": "grpo_data.dataloader",
    "InfiniteDataLoader": "grpo_data.dataloader",
    "ProcessedDataset": "grpo_data.datasets",
    "build_dataset": "grpo_data.datasets",
    "build_data": "grpo_data.datasets",
    "DataSplits": "grpo_data.datasets",
    "ResponseDataset": "grpo_data.response_dataset",
    "BUILTIN_DATASETS": "grpo_data.builtin_datasets",
    "load_builtin": "grpo_data.builtin_datasets",
    "MultiDataLoader": "grpo_data.multi_dataloader",
    "SamplingContext": "grpo_data.multi_dataloader",
    "make_train_iterator": "grpo_data.multi_dataloader",
    "PromptBatch": "grpo_data.batching",
    "pad_prompts": "grpo_data.batching",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo_data' has no attribute {name!r}")
