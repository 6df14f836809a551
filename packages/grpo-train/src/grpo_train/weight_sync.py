"""Trainer side of the weight push into the generation engines, and the refit check.

Job: turn a training model into the tensors a generator's `update_weights` expects
(`state_dict_for_refit`), and compare trainer and generator logprobs on a probe batch after a
push (`check_refit`). How the tensors travel is `grpo_train.weight_transport`; the receiving
side is `grpo_train.generation.vllm_worker_ext`.
Boundary: no Ray, no vLLM import; the loop decides when to push and what probe to score.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch


class RefitMismatchError(RuntimeError):
    """The generator's logprobs disagree with the trainer's after a weight push."""

    def __init__(self, max_abs_diff: float, threshold: float, where: tuple[int, int] | None,
                 trainer_value: float | None, generator_value: float | None) -> None:
        self.max_abs_diff = max_abs_diff
        self.threshold = threshold
        self.where = where
        location = ""
        if where is not None:
            location = (
                f" at sequence {where[0]}, token {where[1]} (trainer {trainer_value:.6f}, "
                f"generator {generator_value:.6f})"
            )
        super().__init__(
            f"refit check failed: max |trainer - generator| logprob difference "
            f"{max_abs_diff:.3g} > threshold {threshold:.3g}{location}. The generator is not "
            f"running the trainer's weights (a missed tensor, a stale tied lm_head or prefix "
            f"cache) or the two disagree on temperature or dtype."
        )


def check_refit(
    trainer_logprobs: list[list[float]], generator_logprobs: list[list[float]], threshold: float
) -> float:
    """Max absolute logprob difference over a probe batch; raises `RefitMismatchError` above
    `threshold`. Both inputs are per-sequence lists of per-token logprobs of the same tokens.
    A NaN anywhere counts as an infinite difference."""
    if len(trainer_logprobs) != len(generator_logprobs):
        raise ValueError(
            f"refit check: {len(trainer_logprobs)} trainer sequences vs "
            f"{len(generator_logprobs)} generator sequences"
        )
    worst, where, values = 0.0, None, (None, None)
    for i, (a_seq, b_seq) in enumerate(zip(trainer_logprobs, generator_logprobs)):
        if len(a_seq) != len(b_seq):
            raise ValueError(
                f"refit check: sequence {i} has {len(a_seq)} trainer logprobs but "
                f"{len(b_seq)} generator logprobs"
            )
        for j, (a, b) in enumerate(zip(a_seq, b_seq)):
            diff = abs(float(a) - float(b))
            if math.isnan(diff):
                diff = math.inf
            if diff > worst or where is None:
                worst, where, values = diff, (i, j), (float(a), float(b))
    if worst > threshold:
        raise RefitMismatchError(worst, threshold, where, *values)
    return worst


def iter_refit_tensors(model: torch.nn.Module, gather: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full detached tensor) of every weight a generator loads, in state-dict
    order, on the model's device and without copies (the transports decide where tensors go).

    Names and layouts are the checkpoint's, as the engine's loader expects them: the model's
    family rule (`grpo_train.model_families`) reverts transformers' load-time conversions (e.g.
    Qwen3-MoE's fused experts become per-expert tensors, views of the fused ones).
    Tied weights are sent once, under the first name (`model.embed_tokens.weight`, not
    `lm_head.weight`): vLLM's loaders skip `lm_head.weight` for tied models and the worker
    extension re-processes the tied lm_head itself. Non-persistent buffers (rotary tables) are
    not part of the state dict and are never sent. DTensor (FSDP2) shards are gathered into
    full tensors, a collective call: every rank of the model must iterate together.
    `gather=False` yields meta tensors with the full weights' shapes and dtypes instead, which is
    enough for metadata and needs no other rank.
    """
    import torch

    from grpo_train.model_families import family_of

    family = family_of(model.config) if hasattr(model, "config") else None
    seen: set[int] = set()
    # keep_vars=True yields the Parameter objects themselves, so tied weights are one object.
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        if not gather:
            tensor = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        elif hasattr(tensor, "full_tensor"):  # DTensor (FSDP2 shard): gather the full weight
            tensor = tensor.full_tensor()
        if family is None:
            yield name, tensor
        else:
            yield from family.checkpoint_tensors(name, tensor)


def state_dict_for_refit(
    model: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights as a generator loads them (see `iter_refit_tensors`): HF parameter
    names, contiguous CPU tensors, optionally cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_refit_tensors(model):
        if dtype is not None:
            tensor = tensor.to(dtype)
        out[name] = tensor.to("cpu").contiguous()
    return out


__all__ = ["RefitMismatchError", "check_refit", "iter_refit_tensors", "state_dict_for_refit"]
