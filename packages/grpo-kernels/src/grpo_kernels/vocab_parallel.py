"""Token logprobs (and entropies) from vocab-sharded logits: the tensor-parallel lm_head's output.

Each rank of a tensor-parallel group holds the logits of its own slice of the vocabulary,
[T, V / tp], rows replicated across the group. The full softmax never exists: per row the
ranks all-reduce the max (MAX), the sum of exp(z - max) (SUM), the target's logit (SUM: only
the rank that owns the target id contributes it) and, for the entropy, sum p z (SUM). Backward
needs no collective: every rank's gradient rows are [j = target] - p_j over its own columns,
with p_j = exp(z_j - lse) from the saved global lse.

`vocab_parallel_token_logprobs` is the op (a hand-written `torch.autograd.Function`); its
reference twin `reference.vocab_parallel_token_logprobs` composes torch's differentiable
collectives and lets autograd find the gradient. Boundary: torch.distributed process groups
only; it knows nothing about models or meshes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from grpo_kernels.reference import (
    IGNORE_INDEX,
    check_cu_seqlens,
    check_temperature,
    shift_targets_packed,
    work_dtype,
)

__all__ = ["vocab_parallel_token_logprobs", "VocabParallelLogprobsFunction", "check_vocab_parallel_inputs"]


def check_vocab_parallel_inputs(logits, target_ids, group, temperature, ignore_index, cu_seqlens):
    """-> (flat logits [T, V_local], flat targets [T] int64, vocab_start, vocab size, temperature,
    out shape). Every rank holds an equal slice; rank r owns ids [r * V_local, (r + 1) * V_local)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 2:
        raise ValueError("logits: expected this rank's floating-point vocab shard [T, V/tp] or [B, S, V/tp]")
    if not isinstance(target_ids, torch.Tensor) or target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("target_ids: expected a tensor of int64 (or int32) ids")
    if target_ids.device != logits.device:
        raise ValueError(f"target_ids: on {target_ids.device}, but logits are on {logits.device}")
    temperature = check_temperature(temperature)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n_local = logits.shape[-1]
    n_vocab = n_local * size
    if cu_seqlens is not None:
        if logits.dim() != 2 or target_ids.dim() != 1:
            raise ValueError("cu_seqlens: packed input needs flat logits [T, V/tp] and input ids [T]")
        check_cu_seqlens(cu_seqlens, target_ids.numel(), logits.device)
        target_ids = shift_targets_packed(target_ids, cu_seqlens, ignore_index)
    leading = logits.shape[:-1]
    n_rows = leading.numel()
    if target_ids.numel() != n_rows:
        raise ValueError(
            f"target_ids: shape {tuple(target_ids.shape)} does not match logits' leading dims {tuple(leading)}"
        )
    targets = target_ids.reshape(n_rows).to(torch.int64)
    bad = ((targets < 0) | (targets >= n_vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        raise ValueError(
            f"target_ids: id {int(targets[bad][0])} is out of range [0, {n_vocab}) "
            f"(tp={size} shards of {n_local}) and is not ignore_index={ignore_index}"
        )
    return logits.reshape(n_rows, n_local), targets, rank * n_local, temperature, target_ids.shape


def _sharded_stats(z, targets, vocab_start, ignore_index, group, want_entropy):
    """z [T, V_local] (scaled, work dtype) -> logprob [T], entropy [T] or None, lse [T]; the
    four per-row all-reduces of the module docstring."""
    ignored = targets == ignore_index
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[1]) & ~ignored
    row_max = z.max(dim=1).values if z.shape[1] else z.new_full((z.shape[0],), -torch.inf)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # rows of all -inf: keep exp finite
    shifted = z - row_max[:, None]
    sum_exp = shifted.exp().sum(dim=1)
    target_logit = torch.where(owned, z.gather(1, torch.where(owned, local, 0)[:, None]).squeeze(1), 0.0)
    dist.all_reduce(sum_exp, group=group)
    dist.all_reduce(target_logit, group=group)
    lse = row_max + sum_exp.log()
    logprob = torch.where(ignored, 0.0, target_logit - lse)
    entropy = None
    if want_entropy:
        logp = (z - lse[:, None]).clamp_(min=torch.finfo(z.dtype).min)  # -inf logits: p = 0, 0 * log p = 0
        p_logp = (logp.exp() * logp).sum(dim=1)
        dist.all_reduce(p_logp, group=group)
        entropy = torch.where(ignored, 0.0, -p_logp)
    return logprob, entropy, lse


class VocabParallelLogprobsFunction(torch.autograd.Function):
    """Saves the local shard and per-row lse/entropy; backward is local to each rank."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, temperature, ignore_index, group, want_entropy):
        z = logits.to(work_dtype(logits.dtype)) / temperature
        logprob, entropy, lse = _sharded_stats(z, targets, vocab_start, ignore_index, group, want_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (vocab_start, temperature, ignore_index)
        ctx.set_materialize_grads(False)
        return (logprob, entropy) if want_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, ignore_index = ctx.args
        ignored = targets == ignore_index
        z = logits.to(work_dtype(logits.dtype)) / temperature
        logp = (z - lse[:, None]).clamp_(min=torch.finfo(z.dtype).min)  # [T, V_local]
        p = logp.exp()
        grad = torch.zeros_like(p)
        if grad_logprob is not None:  # d logprob / d z_j = [j = target] - p_j
            g_lp = torch.where(ignored, 0.0, grad_logprob.to(p.dtype))
            grad -= p * g_lp[:, None]
            local = targets - vocab_start
            owned = (local >= 0) & (local < p.shape[1]) & ~ignored
            grad.scatter_add_(1, torch.where(owned, local, 0)[:, None], torch.where(owned, g_lp, 0.0)[:, None])
        if grad_entropy is not None:  # d H / d z_j = -p_j (log p_j + H)
            g_ent = torch.where(ignored, 0.0, grad_entropy.to(p.dtype))
            grad -= p * (logp + entropy[:, None]) * g_ent[:, None]
        return (grad / temperature).to(logits.dtype), None, None, None, None, None, None


def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    cu_seqlens: torch.Tensor | None = None,
):
    """token_logprobs over the full vocabulary, given this rank's shard of the logits.

    logits [T, V/tp] or [B, S, V/tp]: rank r of `group` holds columns [r * V/tp, (r + 1) * V/tp)
    (a ColwiseParallel lm_head's local output); target_ids are global ids, the same on every
    rank. Returns what `grpo_kernels.token_logprobs` returns for the unsharded logits (float32,
    float64 for float64 logits; ignored rows give 0), identical on every rank. A collective:
    every rank of the group calls it with the same rows. With cu_seqlens the targets are the
    packed input ids, as in token_logprobs.
    """
    flat, targets, vocab_start, temperature, out_shape = check_vocab_parallel_inputs(
        logits, target_ids, group, temperature, ignore_index, cu_seqlens
    )
    args = (targets, vocab_start, temperature, ignore_index, group, return_entropy)
    if torch.is_grad_enabled() and flat.requires_grad:
        out = VocabParallelLogprobsFunction.apply(flat, *args)
        logprob, entropy = out if return_entropy else (out, None)
    else:
        with torch.no_grad():
            z = flat.to(work_dtype(flat.dtype)) / temperature
            logprob, entropy, _ = _sharded_stats(z, targets, vocab_start, ignore_index, group, return_entropy)
    if return_entropy:
        assert entropy is not None
        return logprob.reshape(out_shape), entropy.reshape(out_shape)
    return logprob.reshape(out_shape)
