"""Fused lm_head + token logprobs on the GPU: hidden [T, H] @ weight[V, H].T a chunk of rows at
a time (cuBLAS), each logits chunk reduced by the Triton logprob kernels, so the full [T, V]
logits never exist. Backward recomputes each chunk's logits, turns them into d(logits) in
place, and folds that into dX and dW (float32 accumulation for low-precision weights).

The reference twin is `grpo_kernels.reference.linear_token_logprobs`; this file differs from
it only in using the Triton kernels for the per-chunk softmax work.
"""

from __future__ import annotations

import torch

from grpo_kernels import reference as R
from grpo_kernels.ops.logprobs import token_logprobs_bwd, token_logprobs_fwd


# Layers 1-2 (kernels, launchers) are those of ops/logprobs.py, applied per chunk.
def linear_token_logprobs_fwd(hidden, weight, targets, temperature, ignore_index, chunk_rows, return_entropy):
    """-> logprob [T], entropy [T] or None, lse [T] (float32; float64 for float64 input)."""
    n_rows = hidden.shape[0]
    out_dtype = R.work_dtype(hidden.dtype)
    logprob = torch.empty(n_rows, dtype=out_dtype, device=hidden.device)
    lse = torch.empty(n_rows, dtype=out_dtype, device=hidden.device)
    entropy = torch.empty(n_rows, dtype=out_dtype, device=hidden.device) if return_entropy else None
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        logits = hidden[start:stop] @ weight.t()  # [C, V], hidden's dtype
        lp, ent, ls = token_logprobs_fwd(logits, targets[start:stop], temperature, ignore_index, return_entropy)
        logprob[start:stop], lse[start:stop] = lp, ls
        if return_entropy:
            entropy[start:stop] = ent
    return logprob, entropy, lse


def linear_token_logprobs_bwd(hidden, weight, targets, lse, entropy, grad_logprob, grad_entropy,
                              temperature, ignore_index, chunk_rows, need_hidden, need_weight):
    """-> (d hidden or None, d weight or None)."""
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
    grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
    for start in range(0, hidden.shape[0], chunk_rows):
        stop = min(start + chunk_rows, hidden.shape[0])
        h = hidden[start:stop]
        logits = h @ weight.t()
        grad_logits = token_logprobs_bwd(
            logits, targets[start:stop], lse[start:stop],
            None if entropy is None else entropy[start:stop],
            None if grad_logprob is None else grad_logprob[start:stop],
            None if grad_entropy is None else grad_entropy[start:stop],
            temperature, ignore_index, out=logits,
        )
        if need_hidden:
            torch.matmul(grad_logits, weight, out=grad_hidden[start:stop])
        if need_weight:
            if acc_dtype == hidden.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            else:
                grad_weight.add_(grad_logits.t() @ h)
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


# Layer 3
class LinearTokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, chunk_rows, return_entropy):
        logprob, entropy, lse = linear_token_logprobs_fwd(
            hidden, weight, targets, temperature, ignore_index, chunk_rows, return_entropy
        )
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (temperature, ignore_index, chunk_rows)
        ctx.set_materialize_grads(False)
        return (logprob, entropy) if return_entropy else logprob

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, chunk_rows = ctx.args
        grad_hidden, grad_weight = linear_token_logprobs_bwd(
            hidden, weight, targets, lse, entropy, grad_logprob, grad_entropy,
            temperature, ignore_index, chunk_rows, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
        )
        return grad_hidden, grad_weight, None, None, None, None, None


# Layer 4
def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = R.IGNORE_INDEX,
    chunk_size: int = R.DEFAULT_LINEAR_CHUNK_ROWS,
    cu_seqlens: torch.Tensor | None = None,
):
    """Same contract as `reference.linear_token_logprobs`."""
    hidden2d, targets, temperature = R.check_linear_inputs(
        hidden, weight, target_ids, temperature, ignore_index, chunk_size, cu_seqlens
    )
    out_shape = targets.shape if cu_seqlens is not None else target_ids.shape
    args = (targets, temperature, ignore_index, chunk_size, return_entropy)
    if torch.is_grad_enabled() and (hidden2d.requires_grad or weight.requires_grad):
        out = LinearTokenLogprobsFunction.apply(hidden2d, weight, *args)
    else:
        with torch.no_grad():
            lp, ent, _ = linear_token_logprobs_fwd(hidden2d, weight, *args)
        out = (lp, ent) if return_entropy else lp
    if return_entropy:
        return out[0].reshape(out_shape), out[1].reshape(out_shape)
    return out.reshape(out_shape)
