"""Triton token logprobs (+ entropy) from materialised logits, in one pass over V.

Forward reads each row of logits once with an online logsumexp and writes only per-row
results (logprob, entropy, lse); no [T, V] float32 intermediate exists. Backward recomputes the
softmax from the saved lse and writes d(logits) in the logits' dtype. Programs loop over rows,
so any T runs on a grid of at most MAX_PROGRAMS programs. The reference twin is
`grpo_kernels.reference.token_logprobs`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_kernels import reference as R

# Grid cap; every program walks rows pid, pid + grid, ... (CUDA allows 2^31 - 1 on axis 0,
# but a bounded grid keeps launch overhead flat at T = 10^6).
MAX_PROGRAMS = 65536
MAX_BLOCK_V = 4096


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,
    stride_outer,
    stride_inner,
    n_inner,  # row r sits at (r // n_inner, r % n_inner)
    targets_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    n_rows,
    n_cols,
    temp_hi,
    temp_lo,
    ignore_index,
    RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    temperature = tl.cast(temp_hi, ACC) + tl.cast(temp_lo, ACC)  # float args arrive as fp32: see _split
    pid = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    zero_block = tl.zeros([BLOCK_V], dtype=ACC)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner
        # Online logsumexp over blocks of V: m = running max, s = sum e^(z - m),
        # a = sum e^(z - m) (z - m) (for the entropy, kept relative to m against cancellation).
        m = tl.max(zero_block - float("inf"), 0)
        s = tl.sum(zero_block, 0)
        a = tl.sum(zero_block, 0)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + cols0
            in_row = cols < n_cols
            z = tl.load(row_ptr + cols, mask=in_row, other=-float("inf")).to(ACC) / temperature
            m_new = tl.maximum(m, tl.max(z, 0))
            # While only -inf logits were seen (masked vocabulary), shift by 0, not by -inf.
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            scale = tl.exp(m - m_safe)
            e = tl.exp(z - m_safe)
            if RETURN_ENTROPY:
                shift = s * tl.where(s > 0, m - m_safe, 0.0)  # re-base old terms on m_new
                a = scale * (a + shift) + tl.sum(e * tl.where(e > 0, z - m_safe, 0.0), 0)
            s = s * scale + tl.sum(e, 0)
            m = m_new
        log_s = tl.log(s)
        target = tl.load(targets_ptr + row)
        ignored = target == ignore_index
        z_t = tl.load(row_ptr + tl.where(ignored, 0, target)).to(ACC) / temperature
        tl.store(logprobs_ptr + row, tl.where(ignored, 0.0, z_t - m - log_s))
        tl.store(lse_ptr + row, m + log_s)
        if RETURN_ENTROPY:
            # H = lse - E[z] = (m + log s) - (m + a / s)
            tl.store(entropy_ptr + row, tl.where(ignored, 0.0, log_s - a / s))


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,
    stride_outer,
    stride_inner,
    n_inner,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    grad_logits_ptr,
    n_rows,
    n_cols,
    temp_hi,
    temp_lo,
    ignore_index,
    HAS_GRAD_LOGPROBS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    temperature = tl.cast(temp_hi, ACC) + tl.cast(temp_lo, ACC)
    # d logprob / d z_j = [j = target] - p_j;  d H / d z_j = -p_j (log p_j + H);  z = x / T
    pid = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner
        out_ptr = grad_logits_ptr + row * n_cols
        target = tl.load(targets_ptr + row)
        keep = target != ignore_index
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
            grad = tl.where(cols == target, grad + g_lp, grad)
            tl.store(out_ptr + cols, grad / temperature, mask=in_row)


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers (take validated tensors; callable on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------
def _rows_view(logits: torch.Tensor):
    """-> (logits as [outer, inner, V] view, its strides) without copying, or ValueError."""
    if logits.dim() < 2:
        raise ValueError(f"logits: expected [T, V] or [B, S, V], got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        raise ValueError("logits: the vocabulary dimension must be contiguous (stride 1)")
    if logits.dim() == 2:
        view = logits.unsqueeze(0)
    else:
        try:
            view = logits.view(-1, logits.shape[-2], logits.shape[-1])
        except RuntimeError as err:
            raise ValueError(f"logits: leading dims cannot be merged without a copy ({err})") from None
    return view, view.stride(0), view.stride(1), view.shape[1]


def split_float(value: float) -> tuple[float, float]:
    """value = hi + lo with hi, lo float32-representable: Triton passes Python floats as fp32,
    and a float64 kernel rebuilds the value to ~48 bits (a float32 one gets exactly hi)."""
    hi = float(torch.tensor(value, dtype=torch.float32))
    return hi, float(torch.tensor(value - hi, dtype=torch.float32))


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _launch_config(n_rows: int, n_cols: int, block_v: int | None):
    block_v = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(n_cols))
    num_warps = 8 if block_v >= 2048 else 4
    return (min(n_rows, MAX_PROGRAMS),), block_v, num_warps


def token_logprobs_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    block_v: int | None = None,
    max_programs: int | None = None,
):
    """logits [T, V] or [B, S, V] (V contiguous), targets [T] int64 -> logprob [T], entropy [T]
    or None, lse [T]; float32 (float64 for float64 logits)."""
    view, stride_outer, stride_inner, n_inner = _rows_view(logits)
    n_cols = logits.shape[-1]
    n_rows = targets.numel()
    out_dtype = R.work_dtype(logits.dtype)
    logprobs = torch.empty(n_rows, dtype=out_dtype, device=logits.device)
    lse = torch.empty(n_rows, dtype=out_dtype, device=logits.device)
    entropy = torch.empty(n_rows, dtype=out_dtype, device=logits.device) if return_entropy else None
    if n_rows == 0:
        return logprobs, entropy, lse
    grid, block_v, num_warps = _launch_config(n_rows, n_cols, block_v)
    if max_programs:
        grid = (min(grid[0], max_programs),)
    _token_logprobs_fwd_kernel[grid](
        view,
        stride_outer,
        stride_inner,
        n_inner,
        targets,
        logprobs,
        entropy if return_entropy else logprobs,
        lse,
        n_rows,
        n_cols,
        *split_float(temperature),
        int(ignore_index),
        RETURN_ENTROPY=return_entropy,
        ACC=_acc_dtype(logits.dtype),
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return logprobs, entropy, lse


def token_logprobs_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    block_v: int | None = None,
    max_programs: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> d(loss)/d(logits), contiguous, with logits' shape and dtype. `out` may be the
    (contiguous) logits themselves: each element is read before it is overwritten."""
    view, stride_outer, stride_inner, n_inner = _rows_view(logits)
    n_cols = logits.shape[-1]
    n_rows = targets.numel()
    if out is None:
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    elif out.shape != logits.shape or out.dtype != logits.dtype or not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor with logits' shape and dtype")
    else:
        grad_logits = out
    if n_rows == 0:
        return grad_logits
    if grad_entropy is not None and entropy is None:
        raise ValueError("entropy: needed for the entropy gradient (run forward with entropy)")
    grid, block_v, num_warps = _launch_config(n_rows, n_cols, block_v)
    if max_programs:
        grid = (min(grid[0], max_programs),)
    grad_lp = None if grad_logprobs is None else grad_logprobs.reshape(-1).contiguous()
    grad_ent = None if grad_entropy is None else grad_entropy.reshape(-1).contiguous()
    _token_logprobs_bwd_kernel[grid](
        view,
        stride_outer,
        stride_inner,
        n_inner,
        targets,
        lse,
        entropy if entropy is not None else lse,
        grad_lp if grad_lp is not None else lse,
        grad_ent if grad_ent is not None else lse,
        grad_logits,
        n_rows,
        n_cols,
        *split_float(temperature),
        int(ignore_index),
        HAS_GRAD_LOGPROBS=grad_lp is not None,
        HAS_GRAD_ENTROPY=grad_ent is not None,
        ACC=_acc_dtype(logits.dtype),
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return grad_logits


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd Function
# ----------------------------------------------------------------------------------------------
class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, ignore_index, return_entropy, block_v=None):
        logprobs, entropy, lse = token_logprobs_fwd(logits, targets, temperature, ignore_index, return_entropy, block_v)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (temperature, ignore_index, block_v)
        ctx.set_materialize_grads(False)
        return (logprobs, entropy) if return_entropy else logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, block_v = ctx.args
        grad_logits = token_logprobs_bwd(
            logits,
            targets,
            lse,
            entropy,
            grad_logprobs,
            grad_entropy,
            temperature,
            ignore_index,
            block_v,
        )
        return grad_logits, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Layer 4: the op
# ----------------------------------------------------------------------------------------------
def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = R.IGNORE_INDEX,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
):
    """Same contract as `reference.token_logprobs` (chunk_size is accepted and unused: the
    kernel streams V and never holds a row block). Logits may be a strided [B, S, V] view such
    as `logits[:, :-1]` as long as V is contiguous; nothing is copied."""
    targets, temperature, _ = R.check_logits_inputs(
        logits, target_ids, temperature, ignore_index, chunk_size, cu_seqlens
    )
    out_shape = targets.shape if cu_seqlens is not None else target_ids.shape
    targets = targets.contiguous()
    _rows_view(logits)  # layout errors before any launch
    out = TokenLogprobsFunction.apply(logits, targets, temperature, ignore_index, return_entropy, block_v)
    if return_entropy:
        return out[0].reshape(out_shape), out[1].reshape(out_shape)
    return out.reshape(out_shape)
