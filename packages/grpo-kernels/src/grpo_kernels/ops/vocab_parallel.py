"""Triton token logprobs (+ entropy) of vocab-sharded logits: the tensor-parallel lm_head's output.

Each rank holds [T, V / tp] (rank r: ids [r * V / tp, (r + 1) * V / tp)). Forward reads its shard
once: per row the kernel writes four partials (the shard's max m_r, sum e^(z - m_r), the target's
logit where this shard owns the target id, else 0, and sum e^(z - m_r) (z - m_r) for the entropy).
Around it sit the collectives of `grpo_kernels.vocab_parallel`: a MAX all-reduce of the maxima,
then one SUM all-reduce of the partials re-based on the global max (one [3, T] tensor instead of
three calls). Backward is local: [j = target] - p_j over the shard's own columns, from the saved
global lse. The torch twin (CPU path) is `grpo_kernels.vocab_parallel`, the oracle
`grpo_kernels.reference.vocab_parallel_token_logprobs`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from grpo_kernels import reference as R
from grpo_kernels.ops.logprobs import _acc_dtype, _launch_config, split_float
from grpo_kernels.vocab_parallel import check_vocab_parallel_inputs

# Rows of the partials tensor written by the forward kernel.
MAX, SUM_EXP, TARGET, SUM_EXP_Z = range(4)


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _vocab_parallel_token_logprobs_fwd_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    partials_ptr,  # partials [3 or 4, n_rows]: see MAX .. SUM_EXP_Z
    n_rows,
    n_cols,
    vocab_start,
    temp_hi,
    temp_lo,
    ignore_index,
    RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Float args arrive as fp32: see split_float. (Triton's stubs type ACC as constexpr, not a dtype.)
    temperature = tl.cast(temp_hi, ACC) + tl.cast(temp_lo, ACC)  # pyright: ignore[reportArgumentType]
    pid = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    zero_block = tl.zeros([BLOCK_V], dtype=ACC)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + row * stride_row
        # Online logsumexp over this shard's columns, as in ops.logprobs (a kept relative to m).
        m = tl.max(zero_block - float("inf"), 0)
        s = tl.sum(zero_block, 0)
        a = tl.sum(zero_block, 0)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + cols0
            z = tl.load(row_ptr + cols, mask=cols < n_cols, other=-float("inf")).to(ACC) / temperature
            m_new = tl.maximum(m, tl.max(z, 0))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # only -inf seen so far: shift by 0
            scale = tl.exp(m - m_safe)
            e = tl.exp(z - m_safe)
            if RETURN_ENTROPY:
                shift = s * tl.where(m == -float("inf"), 0.0, m - m_safe)  # s = 0 while only -inf was seen
                a = scale * (a + shift) + tl.sum(e * tl.where(e > 0, z - m_safe, 0.0), 0)
            s = s * scale + tl.sum(e, 0)
            m = m_new
        target = tl.load(targets_ptr + row)
        local = target - vocab_start
        owned = (target != ignore_index) & (local >= 0) & (local < n_cols)
        z_t = tl.load(row_ptr + tl.where(owned, local, 0)).to(ACC) / temperature
        tl.store(partials_ptr + row, m)
        tl.store(partials_ptr + n_rows + row, s)
        tl.store(partials_ptr + 2 * n_rows + row, tl.where(owned, z_t, 0.0))
        if RETURN_ENTROPY:
            tl.store(partials_ptr + 3 * n_rows + row, a)


@triton.jit
def _vocab_parallel_token_logprobs_bwd_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    n_rows,
    n_cols,
    vocab_start,
    temp_hi,
    temp_lo,
    ignore_index,
    HAS_GRAD_LOGPROBS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    temperature = tl.cast(temp_hi, ACC) + tl.cast(temp_lo, ACC)  # pyright: ignore[reportArgumentType]
    # d logprob / d z_j = [j = target] - p_j;  d H / d z_j = -p_j (log p_j + H);  z = x / T,
    # with p_j = exp(z_j - lse) over the global lse: no collective.
    pid = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + row * stride_row
        out_ptr = grad_logits_ptr + row * n_cols
        target = tl.load(targets_ptr + row)
        keep = target != ignore_index
        local = target - vocab_start  # outside [0, n_cols) when another shard owns the target
        lse = tl.load(lse_ptr + row)
        g_lp = 0.0
        g_ent = 0.0
        entropy = 0.0
        if HAS_GRAD_LOGPROBS:
            g_lp = tl.where(keep, tl.load(grad_logprobs_ptr + row).to(ACC), 0.0)
        if HAS_GRAD_ENTROPY:
            g_ent = tl.where(keep, tl.load(grad_entropy_ptr + row).to(ACC), 0.0)
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + cols0
            in_row = cols < n_cols
            z = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(ACC) / temperature
            logp = z - lse
            p = tl.exp(logp)
            logp = tl.where(p > 0, logp, 0.0)  # -inf logits: p = 0, no 0 * -inf
            grad = -p * (g_lp + g_ent * (logp + entropy))
            grad = tl.where(cols == local, grad + g_lp, grad)
            tl.store(out_ptr + cols, grad / temperature, mask=in_row)


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers (take validated flat tensors; callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------
def _check_flat(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(
            f"logits: expected a flat [T, V/tp] shard with contiguous columns, got shape "
            f"{tuple(logits.shape)}, strides {logits.stride()}"
        )


def shard_partials(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    block_v: int | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """logits [T, V_local], targets [T] int64 (global ids) -> this shard's partials [3 or 4, T]
    (rows MAX, SUM_EXP, TARGET and, with the entropy, SUM_EXP_Z) in the work dtype. No collective."""
    _check_flat(logits)
    n_rows, n_cols = logits.shape
    partials = torch.empty(3 + return_entropy, n_rows, dtype=R.work_dtype(logits.dtype), device=logits.device)
    if n_rows == 0:
        return partials
    grid, block_v, num_warps = _launch_config(n_rows, n_cols, block_v)
    if max_programs:
        grid = (min(grid[0], max_programs),)
    _vocab_parallel_token_logprobs_fwd_kernel[grid](
        logits,
        logits.stride(0),
        targets,
        partials,
        n_rows,
        n_cols,
        int(vocab_start),
        *split_float(temperature),
        int(ignore_index),
        RETURN_ENTROPY=return_entropy,
        ACC=_acc_dtype(logits.dtype),
        BLOCK_V=block_v,
        num_warps=num_warps,  # pyright: ignore[reportCallIssue]  (a launch option, not a kernel parameter)
    )
    return partials


def combine_partials(partials: torch.Tensor, targets: torch.Tensor, ignore_index: int, group):
    """Every shard's partials [3 or 4, T] -> (logprob [T], entropy [T] or None, lse [T]), the same
    on every rank: MAX all-reduce, then one SUM all-reduce of the partials re-based on the global max."""
    local_max = partials[MAX]
    row_max = local_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # rows of all -inf: keep exp finite
    has_mass = partials[SUM_EXP] > 0  # a shard of only -inf logits contributes nothing (no -inf * 0)
    weight = torch.where(has_mass, (local_max - row_max).exp(), 0.0)  # e^(m_r - M)
    sums = torch.stack([partials[SUM_EXP] * weight, partials[TARGET]])
    if partials.shape[0] > SUM_EXP_Z:  # sum e^(z - M) (z - M) = e^(m_r - M) (a_r + s_r (m_r - M))
        rebased = partials[SUM_EXP_Z] + partials[SUM_EXP] * torch.where(has_mass, local_max - row_max, 0.0)
        sums = torch.cat([sums, (rebased * weight)[None]])
    dist.all_reduce(sums, group=group)
    ignored = targets == ignore_index
    log_sum = sums[0].log()
    lse = row_max + log_sum
    logprob = torch.where(ignored, 0.0, sums[1] - lse)
    entropy = None
    if partials.shape[0] > SUM_EXP_Z:  # H = lse - E[z] = log S - A / S
        entropy = torch.where(ignored, 0.0, log_sum - sums[2] / sums[0])
    return logprob, entropy, lse


def vocab_parallel_token_logprobs_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    ignore_index: int,
    group,
    return_entropy: bool,
    block_v: int | None = None,
    max_programs: int | None = None,
):
    """-> (logprob [T], entropy [T] or None, lse [T]): the kernel, then the two all-reduces."""
    partials = shard_partials(
        logits, targets, vocab_start, temperature, ignore_index, return_entropy, block_v, max_programs
    )
    return combine_partials(partials, targets, ignore_index, group)


def vocab_parallel_token_logprobs_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    block_v: int | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """-> d(loss)/d(this shard) [T, V_local], contiguous, in the logits' dtype. No collective."""
    _check_flat(logits)
    n_rows, n_cols = logits.shape
    grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return grad_logits
    if grad_entropy is not None and entropy is None:
        raise ValueError("entropy: needed for the entropy gradient (run forward with entropy)")
    grid, block_v, num_warps = _launch_config(n_rows, n_cols, block_v)
    if max_programs:
        grid = (min(grid[0], max_programs),)
    grad_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1).contiguous()
    grad_ent = None if grad_entropy is None else grad_entropy.reshape(-1).contiguous()
    _vocab_parallel_token_logprobs_bwd_kernel[grid](
        logits,
        logits.stride(0),
        targets,
        lse,
        entropy if entropy is not None else lse,
        grad_lp if grad_lp is not None else lse,
        grad_ent if grad_ent is not None else lse,
        grad_logits,
        n_rows,
        n_cols,
        int(vocab_start),
        *split_float(temperature),
        int(ignore_index),
        HAS_GRAD_LOGPROBS=grad_lp is not None,
        HAS_GRAD_ENTROPY=grad_ent is not None,
        ACC=_acc_dtype(logits.dtype),
        BLOCK_V=block_v,
        num_warps=num_warps,  # pyright: ignore[reportCallIssue]  (a launch option, not a kernel parameter)
    )
    return grad_logits


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd Function
# ----------------------------------------------------------------------------------------------
class VocabParallelTokenLogprobsFunction(torch.autograd.Function):
    """Saves the local shard and the global lse / entropy per row; backward is local to each rank."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, temperature, ignore_index, group, return_entropy, block_v=None):
        logprob, entropy, lse = vocab_parallel_token_logprobs_fwd(
            logits, targets, vocab_start, temperature, ignore_index, group, return_entropy, block_v
        )
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (vocab_start, temperature, ignore_index, block_v)
        ctx.set_materialize_grads(False)
        return (logprob, entropy) if return_entropy else logprob

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, ignore_index, block_v = ctx.args
        grad_logits = vocab_parallel_token_logprobs_bwd(
            logits,
            targets,
            vocab_start,
            lse,
            entropy,
            grad_logprobs,
            grad_entropy,
            temperature,
            ignore_index,
            block_v,
        )
        return grad_logits, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Layer 4: the op
# ----------------------------------------------------------------------------------------------
def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = R.IGNORE_INDEX,
    cu_seqlens: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
):
    """Same contract as `grpo_kernels.vocab_parallel.vocab_parallel_token_logprobs` (a collective
    over `group`; rank r holds columns [r * V/tp, (r + 1) * V/tp)). A [B, S, V/tp] input whose rows
    cannot be flattened without a copy is copied once; the shard's columns must be contiguous."""
    flat, targets, vocab_start, temperature, out_shape = check_vocab_parallel_inputs(
        logits, target_ids, group, temperature, ignore_index, cu_seqlens
    )
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = VocabParallelTokenLogprobsFunction.apply(
        flat, targets.contiguous(), vocab_start, temperature, ignore_index, group, return_entropy, block_v
    )
    if return_entropy:
        return out[0].reshape(out_shape), out[1].reshape(out_shape)
    return out.reshape(out_shape)
