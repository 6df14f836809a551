"""The one dispatch point of each op: the compiled CUDA extension where it has the op (today
token_logprobs) and was built with CUDA, else Triton on CUDA tensors when triton imports, else
the pure-PyTorch reference (always on CPU tensors). The vocab-parallel op's fallback is its
sharded torch op (`grpo_kernels.vocab_parallel`), not the gather-everything reference twin. The
choice is logged at debug level.

This module imports neither torch nor triton at import time, so `import grpo_kernels` stays
cheap; the chosen implementation is imported on first call.
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo_kernels.loss_config import PGLossConfig

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


@cache
def triton_available() -> bool:
    """True when triton imports (the `grpo-kernels[triton]` extra)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _on_cuda(tensor) -> bool:
    return bool(tensor.is_cuda)


def _pick(op: str, triton_module: str, tensor, why_not: str | None = None, fallback: str = "grpo_kernels.reference"):
    """-> the implementation of `op` for this call: the Triton one, else `fallback`'s."""
    if why_not is None:
        if not _on_cuda(tensor):
            why_not = "CPU tensors"
        elif not triton_available():
            why_not = "triton is not installed"
        else:
            try:
                impl = getattr(importlib.import_module(triton_module), op)
            except ImportError as err:  # e.g. a triton too old for the kernels
                _warn_once(f"grpo_kernels.{op}: Triton path unavailable ({err}); using the reference")
                why_not = f"Triton import failed: {err}"
            else:
                logger.debug("grpo_kernels.%s -> triton", op)
                return impl
    logger.debug(
        "grpo_kernels.%s -> %s (%s)", op, "reference" if fallback == "grpo_kernels.reference" else "torch op", why_not
    )
    return getattr(importlib.import_module(fallback), op)


def _pick_with_extension(op: str, triton_module: str, tensor):
    """-> the compiled extension's `op` when it serves this call, else `_pick`'s choice."""
    from grpo_kernels import _ext  # cheap: imports neither torch nor the extension's CUDA

    if _ext.cuda_extension_serves(tensor):
        logger.debug("grpo_kernels.%s -> cuda extension", op)
        return getattr(_ext, op)
    if _on_cuda(tensor):
        logger.debug("grpo_kernels.%s: cuda extension not used (%s)", op, _extension_gap(tensor))
    return _pick(op, triton_module, tensor)


def _extension_gap(tensor) -> str:
    from grpo_kernels import _ext

    if not _ext.has_extension():
        return "grpo_kernels._C is not built"
    if not _ext.has_cuda_extension():
        return "grpo_kernels._C was built without CUDA"
    return f"dtype {tensor.dtype} is not supported"


@cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """log softmax(logits / temperature)[target] (and entropy) per row; see
    `grpo_kernels.reference.token_logprobs` for the contract. chunk_size only bounds the
    reference path's memory (the CUDA and Triton kernels never materialise a row block)."""
    impl = _pick_with_extension("token_logprobs", "grpo_kernels.ops.logprobs", logits)
    return impl(logits, target_ids, temperature, return_entropy, ignore_index, chunk_size, cu_seqlens)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = 1024,
    cu_seqlens: torch.Tensor | None = None,
):
    """token_logprobs(hidden @ weight.T, ...) without materialising the logits; see
    `grpo_kernels.reference.linear_token_logprobs`."""
    impl = _pick("linear_token_logprobs", "grpo_kernels.ops.linear_logprobs", hidden)
    return impl(hidden, weight, target_ids, temperature, return_entropy, ignore_index, chunk_size, cu_seqlens)


def pick_vocab_parallel_token_logprobs(logits):
    """-> the implementation `vocab_parallel_token_logprobs` uses for these logits: Triton's
    (`ops.vocab_parallel`) on CUDA tensors when triton imports, else the torch op."""
    return _pick(
        "vocab_parallel_token_logprobs",
        "grpo_kernels.ops.vocab_parallel",
        logits,
        fallback="grpo_kernels.vocab_parallel",
    )


def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group=None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    cu_seqlens: torch.Tensor | None = None,
):
    """token_logprobs over the full vocabulary from this rank's shard of tensor-parallel logits
    (a collective over `group`); see `grpo_kernels.vocab_parallel.vocab_parallel_token_logprobs`
    for the contract."""
    impl = pick_vocab_parallel_token_logprobs(logits)
    return impl(logits, target_ids, group, temperature, return_entropy, ignore_index, cu_seqlens)


def clipped_pg_loss(
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    ref: torch.Tensor | None,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    config: PGLossConfig,
    global_valid_tokens,
    global_valid_seqs,
    cu_seqlens: torch.Tensor | None = None,
):
    """The clipped PG + KL loss of shared/GRPO-MATH.md -> (loss, metrics); see
    `grpo_kernels.reference.clipped_pg_loss`. Options the Triton kernel does not implement
    (positive_example_nll_weight; see `ops.pg_loss.unsupported`) run on the reference path,
    logged at debug level with the option named."""
    why_not = None
    if getattr(config, "positive_example_nll_weight", 0.0) != 0:
        why_not = "positive_example_nll_weight"
    impl = _pick("clipped_pg_loss", "grpo_kernels.ops.pg_loss", curr, why_not)
    return impl(
        curr,
        prev,
        gen,
        ref,
        advantages,
        token_mask,
        sample_mask,
        config,
        global_valid_tokens,
        global_valid_seqs,
        cu_seqlens,
    )
