"""Packed ("varlen") tensors: sequences laid end to end in one flat stream, described by
`cu_seqlens` (flash-attention's name) and per-token `position_ids`.

- `pack_sequences` / `unpack_sequences`: a list of [L_i, ...] tensors <-> flat [T, ...].
- `pack_padded` / `unpack_padded`: a right-padded batch [B, L, ...] <-> flat [T, ...]; both are
  differentiable (each one's backward is the other's row copy).

It knows nothing about models or which sequences share a bin (that is `grpo_kernels.packing`).
Devices: on CPU everything is plain PyTorch. On CUDA, position ids come from the extension's
kernel through the torch op `grpo_kernels::position_ids_from_cu_seqlens`, and the padded <->
flat row copies from the Triton gather / scatter kernels below (PyTorch indexing when triton is
not installed). A list of separate tensors is concatenated with `torch.cat`, which already is a
single batched copy on CUDA.

Triton is imported on first use, not with this module: the kernels are plain functions here and
`_triton_kernels()` jits them (string annotations thanks to `from __future__ import
annotations`, so `tl.constexpr` need not exist until then).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_kernels import _ext

logger = logging.getLogger(__name__)

# Tile of the row-copy kernels: rows (tokens) x columns (elements of one token's row).
BLOCK_ROWS = 16
BLOCK_COLS = 128

tl: Any = None  # triton.language, bound by _triton_kernels()

__all__ = [
    "PackedBatch",
    "pack_sequences",
    "unpack_sequences",
    "pack_padded",
    "unpack_padded",
    "gather_rows",
    "scatter_rows",
]

_ext.register_torch_ops()


@dataclass(frozen=True)
class PackedBatch:
    """Sequences laid end to end. Sequence i is flat[cu_seqlens[i] : cu_seqlens[i + 1]]."""

    flat: torch.Tensor  # [T, ...] the tokens (or any per-token rows) of all sequences
    cu_seqlens: torch.Tensor  # [n + 1] int64, 0 = cu_seqlens[0] <= ... <= cu_seqlens[n] = T
    position_ids: torch.Tensor  # [T] int64, index of each token inside its own sequence
    max_seqlen: int  # longest sequence (host int: flash-attention varlen wants it)

    @property
    def seqlens(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]


# ------------------------------------------------------------------------------------------
# Triton kernels (jitted lazily) and their host launchers
# ------------------------------------------------------------------------------------------
def _gather_rows_kernel(
    src_ptr, index_ptr, out_ptr, n_rows, row_size, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
    # out[r, :] = src[index[r], :] for a BLOCK_ROWS x BLOCK_COLS tile.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    src_rows = tl.load(index_ptr + rows, mask=row_mask, other=0)
    mask = row_mask[:, None] & (cols < row_size)[None, :]
    values = tl.load(src_ptr + src_rows[:, None] * row_size + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * row_size + cols[None, :], values, mask=mask)


def _scatter_rows_kernel(
    src_ptr, index_ptr, out_ptr, n_rows, row_size, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
    # out[index[r], :] = src[r, :] for a BLOCK_ROWS x BLOCK_COLS tile (index has no repeats).
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    dst_rows = tl.load(index_ptr + rows, mask=row_mask, other=0)
    mask = row_mask[:, None] & (cols < row_size)[None, :]
    values = tl.load(src_ptr + rows.to(tl.int64)[:, None] * row_size + cols[None, :], mask=mask)
    tl.store(out_ptr + dst_rows[:, None] * row_size + cols[None, :], values, mask=mask)


@functools.cache
def _triton_kernels() -> tuple[Any, Any]:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_gather_rows_kernel), triton.jit(_scatter_rows_kernel)


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _grid(n_rows: int, row_size: int) -> tuple[int, int]:
    return (-(-n_rows // BLOCK_ROWS), -(-row_size // BLOCK_COLS))


def _check_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    if src.dim() != 2 or out.dim() != 2 or src.shape[1] != out.shape[1]:
        raise ValueError(f"src and out must be 2-D with equal rows, got {tuple(src.shape)} and {tuple(out.shape)}")
    if index.dim() != 1 or index.dtype != torch.int64:
        raise ValueError(f"index must be a 1-D int64 tensor, got {index.dtype} {tuple(index.shape)}")
    if src.dtype != out.dtype or not (src.device == index.device == out.device):
        raise ValueError("src, index and out must share a device, and src and out a dtype")
    if not (src.is_contiguous() and index.is_contiguous() and out.is_contiguous()):
        raise ValueError("src, index and out must be contiguous")


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher: out[r] = src[index[r]] for src [R_src, D], index [R] int64 -> out [R, D].

    Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests). Indices are not
    bounds-checked (that would synchronise): they must lie in [0, R_src)."""
    if out is None:
        out = src.new_empty((index.shape[0], src.shape[1]))
    _check_rows(src, index, out)
    if index.shape[0] and src.shape[1]:
        gather, _ = _triton_kernels()
        gather[_grid(index.shape[0], src.shape[1])](
            src, index, out, index.shape[0], src.shape[1], BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS
        )
    return out


def scatter_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton launcher: out[index[r]] = src[r] for src [R, D], index [R] int64 (no repeats),
    out [R_dst, D] (rows not named by index keep their values). Returns out."""
    if index.shape[0] != src.shape[0]:
        raise ValueError(f"index has {index.shape[0]} rows but src has {src.shape[0]}")
    _check_rows(src, index, out)
    if index.shape[0] and src.shape[1]:
        _, scatter = _triton_kernels()
        scatter[_grid(index.shape[0], src.shape[1])](
            src, index, out, index.shape[0], src.shape[1], BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS
        )
    return out


# ------------------------------------------------------------------------------------------
# One dispatch point per row copy: Triton on CUDA when installed, PyTorch otherwise.
# ------------------------------------------------------------------------------------------
def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and _has_triton()


def _gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [R_src, D], [R] -> [R, D]
    if _use_triton(src):
        logger.debug("gather rows: triton")
        return gather_rows(src.contiguous(), index.contiguous())
    logger.debug("gather rows: torch")
    return src.index_select(0, index)


def _scatter(src: torch.Tensor, index: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:  # [R, D] -> [n_rows, D]
    out = src.new_full((n_rows, src.shape[1]), fill)
    if _use_triton(src):
        logger.debug("scatter rows: triton")
        return scatter_rows(src.contiguous(), index.contiguous(), out)
    logger.debug("scatter rows: torch")
    return out.index_copy_(0, index, src)


class PackPaddedFunction(torch.autograd.Function):
    """flat[t] = padded_rows[index[t]]; backward scatters the gradient back (zeros at pads)."""

    @staticmethod
    def forward(ctx, padded_rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.n_rows = padded_rows.shape[0]
        return _gather(padded_rows, index)

    @staticmethod
    def backward(ctx, grad_flat: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _scatter(grad_flat.contiguous(), index, ctx.n_rows, 0.0), None


class UnpackPaddedFunction(torch.autograd.Function):
    """padded_rows[index[t]] = flat[t], other rows = fill; backward gathers the gradient."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, index: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:
        ctx.save_for_backward(index)
        return _scatter(flat, index, n_rows, fill)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (index,) = ctx.saved_tensors
        return _gather(grad_rows.contiguous(), index), None, None, None


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def _cu_seqlens(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=cu[1:])
    return cu.to(device, non_blocking=True)


def pack_sequences(seqs: Sequence[torch.Tensor]) -> PackedBatch:
    """Lays [L_i, ...] tensors end to end: flat [sum L_i, ...], cu_seqlens [n+1], position_ids.

    All tensors need the same trailing shape, dtype and device; empty ones (L_i = 0) are fine.
    """
    if len(seqs) == 0:
        raise ValueError("empty batch: pack_sequences needs at least one sequence")
    first = seqs[0]
    for i, s in enumerate(seqs):
        if not isinstance(s, torch.Tensor) or s.dim() < 1:
            raise ValueError(f"seqs[{i}] must be a tensor with a leading length dim, got {type(s).__name__}")
        if s.shape[1:] != first.shape[1:] or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                f"seqs[{i}] is {s.dtype} {tuple(s.shape)} on {s.device}; seqs[0] is "
                f"{first.dtype} {tuple(first.shape)} on {first.device} (trailing shape, dtype and device must match)"
            )
    lengths = [int(s.shape[0]) for s in seqs]
    cu_seqlens = _cu_seqlens(lengths, first.device)
    total = sum(lengths)
    return PackedBatch(
        flat=torch.cat(list(seqs), dim=0),
        cu_seqlens=cu_seqlens,
        position_ids=_ext.position_ids_from_cu_seqlens(cu_seqlens, total),
        max_seqlen=max(lengths),
    )


def _host_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.int64:
        raise ValueError(f"cu_seqlens must be a 1-D int64 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to {total} (the flat length), got {cu[0]} .. {cu[-1]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = {cu[i + 1]} < {cu[i]}")
    return cu


def unpack_sequences(flat: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `pack_sequences`: the n sequences as views of `flat` (no copy).

    Reads cu_seqlens on the host (one synchronisation when it lives on a GPU)."""
    if flat.dim() < 1:
        raise ValueError("flat must have a leading token dim")
    cu = _host_cu_seqlens(cu_seqlens, int(flat.shape[0]))
    return [flat[a:b] for a, b in zip(cu[:-1], cu[1:])]


def _padded_rows(lengths: Sequence[int], max_len: int, position_ids: torch.Tensor) -> torch.Tensor:
    """Row of each packed token in the padded batch viewed as [B * max_len, ...]."""
    starts = torch.arange(len(lengths), dtype=torch.int64, device=position_ids.device) * max_len
    counts = torch.tensor(list(lengths), dtype=torch.int64).to(position_ids.device)
    return torch.repeat_interleave(starts, counts, output_size=position_ids.shape[0]) + position_ids


def pack_padded(padded: torch.Tensor, lengths: Sequence[int] | torch.Tensor) -> PackedBatch:
    """Right-padded [B, L, ...] with sequence b in padded[b, :lengths[b]] -> PackedBatch.

    Differentiable in `padded` (pads get zero gradient)."""
    if padded.dim() < 2:
        raise ValueError(f"padded must be [B, L, ...], got shape {tuple(padded.shape)}")
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    batch, max_len = int(padded.shape[0]), int(padded.shape[1])
    if len(lens) != batch:
        raise ValueError(f"{len(lens)} lengths for a batch of {batch}")
    for b, n in enumerate(lens):
        if not 0 <= n <= max_len:
            raise ValueError(f"lengths[{b}] = {n} is outside [0, {max_len}] (the padded length)")
    if batch == 0:
        raise ValueError("empty batch: pack_padded needs at least one sequence")
    total = sum(lens)
    cu_seqlens = _cu_seqlens(lens, padded.device)
    position_ids = _ext.position_ids_from_cu_seqlens(cu_seqlens, total)
    rows = padded.reshape(batch * max_len, math.prod(padded.shape[2:]))
    flat = PackPaddedFunction.apply(rows, _padded_rows(lens, max_len, position_ids))
    return PackedBatch(
        flat=flat.reshape(total, *padded.shape[2:]),
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        max_seqlen=max(lens),
    )


def unpack_padded(
    flat: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int | None = None, pad_value: float = 0
) -> torch.Tensor:
    """Packed flat [T, ...] -> right-padded [B, max_len, ...] filled with pad_value past each
    sequence's end. max_len defaults to the longest sequence. Differentiable in `flat`."""
    if flat.dim() < 1:
        raise ValueError("flat must have a leading token dim")
    cu = _host_cu_seqlens(cu_seqlens, int(flat.shape[0]))
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    longest = max(lens, default=0)
    max_len = longest if max_len is None else int(max_len)
    if max_len < longest:
        raise ValueError(f"max_len = {max_len} is shorter than the longest sequence ({longest})")
    total, batch = int(flat.shape[0]), len(lens)
    position_ids = _ext.position_ids_from_cu_seqlens(cu_seqlens.to(flat.device), total)
    rows = flat.reshape(total, math.prod(flat.shape[1:]))
    padded_rows = UnpackPaddedFunction.apply(
        rows, _padded_rows(lens, max_len, position_ids), batch * max_len, pad_value
    )
    return padded_rows.reshape(batch, max_len, *flat.shape[1:])
