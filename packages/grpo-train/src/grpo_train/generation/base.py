"""What every generation backend promises: sampling settings in, token-level results out.

Job: the shared vocabulary of the generation backends (vLLM, plain HF) — `SamplingSpec`,
`GenerationResult`, the `Generator` protocol — and the small rules both backends apply the same
way (prompt fitting, which temperature a logprob refers to).
Boundary: nothing here imports torch, vLLM or Ray; backends live in their own modules.

Logprob convention (both backends): `response_logprobs[t]` is `log_softmax(logits / T)` of the
sampled token, over the FULL vocabulary — no top-p/top-k renormalisation — because that is what
the trainer recomputes. `T` is the sampling temperature; a greedy request (or temperature 0)
reports logprobs at the generator's `temperature_for_logprobs`, which `score` also uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from grpo_train.model_families import UnsupportedFamilyError, unsupported_names_message

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
# vLLM scores a sequence as a prompt and must still generate one token after it, so a scored
# sequence needs one free position in the context window; both backends keep the same limit.
SCORE_RESERVE = 1


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. Backend-neutral; each backend translates it to its own parameters."""

    temperature: float = 1.0
    """Softmax temperature; 0 (or `greedy`) means argmax decoding."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int | None = -1
    """Keep the k most likely tokens; -1, 0 or None = off."""
    max_new_tokens: int = 16
    """Upper bound on generated tokens per sample."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a sample (the tokenizer's EOS always does); they are kept in
    `response_ids`."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a sample; the tokens that produced them are kept in `response_ids`, the
    `text` is cut before the string."""
    n: int = 1
    """Samples per prompt."""
    greedy: bool = False
    """Argmax decoding (validation); overrides temperature, top-p and top-k."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"SamplingSpec.top_k must be -1/0/None (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n must be >= 1, got {self.n}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def top_k_or_none(self) -> int | None:
        """top_k as a positive int, or None when it is off."""
        return self.top_k if self.top_k is not None and self.top_k > 0 else None


@dataclass
class GenerationResult:
    """One sample. A batch of results is prompt-major: prompt 0 samples 0..n-1, prompt 1, ..."""

    prompt_index: int
    prompt_ids: list[int]
    """The prompt the sample was generated from (after fitting to the context window)."""
    response_ids: list[int]
    response_logprobs: list[float]
    """log_softmax(logits / T)[token] per generated token; len == len(response_ids)."""
    text: str
    finish_reason: str
    """"stop" (EOS, a stop token or a stop string) or "length" (max_new_tokens reached)."""


@runtime_checkable
class Generator(Protocol):
    """A generation backend holding one copy of the policy weights."""

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationResult]: ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        """Load new weights (HF names); returns seconds spent. Clears any prefix cache."""
        ...

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """log_softmax(logits / temperature_for_logprobs) of sequences[i][prompt_lens[i]:]."""
        ...

    def weight_version(self) -> int: ...

    def reseed(self, seed: int) -> None:
        """Restart the sampling random streams (the engine's, never per request)."""
        ...

    def shutdown(self) -> None: ...


def logprob_temperature(sampling: SamplingSpec, temperature_for_logprobs: float) -> float:
    """The temperature the reported logprobs refer to (see the module docstring)."""
    return temperature_for_logprobs if sampling.is_greedy else sampling.temperature


def fit_prompts(prompts: list[list[int]], max_model_len: int, max_new_tokens: int) -> tuple[list[list[int]], int]:
    """Left-truncate prompts so that prompt + max_new_tokens fits the context window with
    `SCORE_RESERVE` positions to spare (so every finished sample can still be scored, see
    `validate_score_inputs`).

    The tail of a prompt (the question's end, the assistant-turn marker) matters most for what
    is generated next, so the head is cut. Returns the fitted prompts and how many were cut, and
    warns with the count; an empty prompt or a window smaller than max_new_tokens is an error.
    """
    budget = max_model_len - max_new_tokens - SCORE_RESERVE
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in "
            f"max_model_len={max_model_len} ({SCORE_RESERVE} position reserved for scoring); "
            f"lower max_new_tokens or raise max_model_len"
        )
    fitted, cut = [], 0
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) > budget:
            cut += 1
            prompt = prompt[-budget:]
        fitted.append(list(prompt))
    if cut:
        logger.warning(
            "%d of %d prompts were longer than max_model_len - max_new_tokens - %d = %d tokens and were left-truncated",
            cut,
            len(prompts),
            SCORE_RESERVE,
            budget,
        )
    return fitted, cut


def check_weight_names(given, expected: set[str] | None, config=None) -> None:
    """Refuse a weight push that would leave part of the model on old weights: every expected
    tensor must come, and nothing else. `expected=None` skips the check (unknown layout).
    `config` (a transformers config, or the model folder to read it from, only on failure)
    names the model type in the error (`model_families.UnsupportedFamilyError`)."""
    if expected is None:
        return
    given = set(given)
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing or extra:
        if isinstance(config, str):
            # transformers: only when a model path is given; `grpo plan` imports this module
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(config)
        raise UnsupportedFamilyError(unsupported_names_message(config, missing, extra, len(expected)))


def validate_score_inputs(sequences: list[list[int]], prompt_lens: list[int], max_model_len: int) -> None:
    """Raise a clear error for score() inputs no backend can handle."""
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"score() got {len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
        if not 1 <= plen <= len(seq):
            raise ValueError(f"sequence {i}: prompt_len={plen} must be in [1, len(sequence)={len(seq)}]")
        if len(seq) > max_model_len - SCORE_RESERVE:
            raise ValueError(
                f"sequence {i} has {len(seq)} tokens; score() takes at most max_model_len - "
                f"{SCORE_RESERVE} = {max_model_len - SCORE_RESERVE}"
            )
