"""Generation backends: vLLM (production) and plain HF transformers (fallback).

Job: sample responses with their logprobs from the current policy weights, accept weight pushes,
and score fixed token sequences for the refit check. Everything here speaks token ids; rewards
and training live elsewhere. Importing this package is cheap: the backends (torch, vLLM, Ray)
load only when their names are first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from grpo_train.generation.base import GenerationResult, Generator, SamplingSpec

if TYPE_CHECKING:
    from grpo_train.generation.actor import make_generation_actor
    from grpo_train.generation.hf_backend import HFGenerator
    from grpo_train.generation.vllm_backend import VllmGenerator

_LAZY = {
    "VllmGenerator": "grpo_train.generation.vllm_backend",
    "HFGenerator": "grpo_train.generation.hf_backend",
    "make_generation_actor": "grpo_train.generation.actor",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GenerationResult",
    "Generator",
    "HFGenerator",
    "SamplingSpec",
    "VllmGenerator",
    "make_generation_actor",
]
