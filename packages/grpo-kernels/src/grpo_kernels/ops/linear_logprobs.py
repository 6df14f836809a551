"""Fused lm_head + token logprobs on the GPU: hidden [T, H] @ weight[V, H].T a chunk of rows at
a time (cuBLAS), each logits chunk reduced by the Triton logprob kernels of ops/logprobs.py, so
the full [T, V] logits never exist. Backward recomputes each chunk's logits, overwrites them
with d(logits) in place, and folds that into dX and dW (float32 accumulation for low-precision
weights).

The chunk loop, autograd Function and validation are the reference's
(`grpo_kernels.reference.linear_token_logprobs`); this module only supplies the per-chunk work.
"""

from __future__ import annotations

import torch

from grpo_kernels import reference as R
from grpo_kernels.ops.logprobs import token_logprobs_bwd, token_logprobs_fwd


def logits_chunk_forward(logits, targets, temperature, ignore_index, want_entropy, owned=False):
    """[C, V] logits (read in their own dtype, never upcast whole) -> logprob, entropy, lse."""
    return token_logprobs_fwd(logits, targets, temperature, ignore_index, want_entropy)


def logits_chunk_grad(
    logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index, owned=False
):
    """-> d(loss)/d(logits) [C, V] in logits' dtype, written over `logits` when it is owned."""
    return token_logprobs_bwd(
        logits,
        targets,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        temperature,
        ignore_index,
        out=logits if owned else None,
    )


TRITON_CHUNK_KERNELS = (logits_chunk_forward, logits_chunk_grad)


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
    """Same contract as `reference.linear_token_logprobs`, with the Triton per-chunk kernels."""
    return R.linear_token_logprobs(
        hidden,
        weight,
        target_ids,
        temperature,
        return_entropy,
        ignore_index,
        chunk_size,
        cu_seqlens,
        chunk_kernels=TRITON_CHUNK_KERNELS,
    )
