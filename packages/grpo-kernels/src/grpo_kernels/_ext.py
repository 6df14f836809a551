"""The one door to the compiled extension `grpo_kernels._C`.

Nothing else in grpo-kernels imports `_C`. This file turns its raw entry points into:
- plain functions on numpy int64 arrays for the packers (`pack_first_fit_decreasing`, ...),
  which raise an ImportError that says how to rebuild when the extension is missing;
- the torch op `grpo_kernels::position_ids_from_cu_seqlens`, registered with
  `torch.library.custom_op` plus a fake (shape-only) implementation so `torch.compile` can trace
  through it. Its CUDA kernel is the extension's when it was built with CUDA; every other case
  (CPU tensors, a CPU-only build) runs the same computation in PyTorch.

Importing this module is cheap: it does not import torch. The torch op is registered by
`register_torch_ops()`, which `grpo_kernels.pack_tensors` calls when it is imported.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

EXTENSION_MODULE = "grpo_kernels._C"
POSITION_IDS_OP = "grpo_kernels::position_ids_from_cu_seqlens"

__all__ = [
    "has_extension",
    "has_cuda_extension",
    "require_extension",
    "pack_first_fit_decreasing",
    "pack_best_fit_decreasing",
    "pack_modified_ffd",
    "split_bins_across_ranks",
    "group_by_bin",
    "register_torch_ops",
    "position_ids_from_cu_seqlens",
]


def _load(name: str = EXTENSION_MODULE) -> tuple[ModuleType | None, ImportError | None]:
    try:
        return importlib.import_module(name), None
    except ImportError as err:  # a missing .so, or one built for another Python/ABI
        return None, err


_C, _IMPORT_ERROR = _load()


def _missing_message(error: BaseException | None) -> str:
    return (
        f"The compiled extension {EXTENSION_MODULE} is not available ({error!r}). It is built from "
        "the top-level csrc/ by scikit-build-core when grpo-kernels is installed, which needs a "
        "C++17 compiler, CMake >= 3.18 and pybind11. In the workspace, rebuild it with "
        "`uv sync --reinstall-package grpo-kernels` and read the build log; outside it, reinstall "
        "grpo-kernels from source with pip. The packers also run without it: pass "
        "implementation='python' (slow: meant for tests and small batches)."
    )


def has_extension() -> bool:
    """True when `grpo_kernels._C` imported (the C++ packers are available)."""
    return _C is not None


def has_cuda_extension() -> bool:
    """True when `grpo_kernels._C` was compiled with its CUDA kernels (says nothing about
    whether a GPU is present now; the torch op checks the tensors' device)."""
    return _C is not None and bool(getattr(_C, "with_cuda", False))


def require_extension() -> ModuleType:
    """The extension module, or an ImportError that says how to rebuild it."""
    if _C is None:
        raise ImportError(_missing_message(_IMPORT_ERROR)) from _IMPORT_ERROR
    return _C


# ------------------------------------------------------------------------------------------
# Packing entry points: numpy int64 arrays in and out. The C++ copies its input, then runs
# with the GIL released.
# ------------------------------------------------------------------------------------------
def pack_first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index per item, first fit decreasing ([n] int64 -> [n] int64)."""
    return require_extension().pack_first_fit_decreasing(lengths, capacity)


def pack_best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index per item, best fit decreasing ([n] int64 -> [n] int64)."""
    return require_extension().pack_best_fit_decreasing(lengths, capacity)


def pack_modified_ffd(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Bin index per item, Johnson & Garey modified first fit decreasing."""
    return require_extension().pack_modified_ffd(lengths, capacity)


def split_bins_across_ranks(bin_tokens: np.ndarray, world: int) -> np.ndarray:
    """Rank per bin ([n_bins] int64, n_bins a multiple of `world`)."""
    return require_extension().split_bins_across_ranks(bin_tokens, world)


def group_by_bin(bin_of: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n_bins + 1], items [n]): item indices grouped by bin, increasing within a bin."""
    return require_extension().group_by_bin(bin_of, n_bins)


# ------------------------------------------------------------------------------------------
# Torch op
# ------------------------------------------------------------------------------------------
_registered: Any = None
_register_lock = threading.Lock()


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    import torch

    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int64:
        raise ValueError(f"cu_seqlens must be int64, got {cu_seqlens.dtype}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")


def _position_ids_torch(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids in plain PyTorch: token t of sequence s gets t - cu_seqlens[s]."""
    import torch

    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], seqlens, output_size=total)
    return torch.arange(total, dtype=torch.int64, device=cu_seqlens.device) - starts


def register_torch_ops() -> Any:
    """Registers `torch.ops.grpo_kernels.position_ids_from_cu_seqlens` (idempotent) and returns it."""
    global _registered
    with _register_lock:
        if _registered is not None:
            return _registered
        import torch

        # Explicit schema: annotations are strings here (no module-level torch import).
        @torch.library.custom_op(POSITION_IDS_OP, mutates_args=(), schema="(Tensor cu_seqlens, SymInt total) -> Tensor")
        def position_ids_op(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
            """[n+1] int64 cu_seqlens (0, ..., total) -> [total] int64 position ids."""
            _check_cu_seqlens(cu_seqlens, total)
            if cu_seqlens.device.type == "cpu":
                _check_cpu_values(cu_seqlens, total)
            return _position_ids_torch(cu_seqlens, total)

        @position_ids_op.register_kernel("cuda")
        def _position_ids_cuda(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
            # Values are not checked here: that would synchronise. The kernel clamps its writes.
            _check_cu_seqlens(cu_seqlens, total)
            if not has_cuda_extension():
                return _position_ids_torch(cu_seqlens, total)
            cu_seqlens = cu_seqlens.contiguous()
            out = torch.empty(total, dtype=torch.int64, device=cu_seqlens.device)
            with torch.cuda.device(cu_seqlens.device):
                stream = torch.cuda.current_stream(cu_seqlens.device).cuda_stream
                require_extension().position_ids_from_cu_seqlens_cuda(
                    cu_seqlens.data_ptr(), cu_seqlens.numel() - 1, out.data_ptr(), total, stream
                )
            return out

        @position_ids_op.register_fake
        def _position_ids_fake(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
            _check_cu_seqlens(cu_seqlens, total)
            return cu_seqlens.new_empty((total,), dtype=torch.int64)

        _registered = position_ids_op
        return _registered


def _check_cpu_values(cu_seqlens: torch.Tensor, total: int) -> None:
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != total:
        raise ValueError(f"cu_seqlens must run from 0 to total={total}, got {first} .. {last}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids of a packed stream: [n+1] int64 cu_seqlens -> [total] int64 (on its device).

    Eager CPU calls skip the dispatcher: the first call of any custom op imports torch._dynamo
    (seconds), which a CPU-only data path should not pay. CUDA tensors and traced code go
    through the registered op."""
    import torch

    op = register_torch_ops()
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return op(cu_seqlens, total)
    _check_cu_seqlens(cu_seqlens, total)
    _check_cpu_values(cu_seqlens, total)
    return _position_ids_torch(cu_seqlens, total)
