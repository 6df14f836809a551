"""The one door to the compiled extension `grpo_kernels._C`.

Nothing else in grpo-kernels imports `_C`. This file turns its raw entry points into:
- plain functions on numpy int64 arrays for the packers (`pack_first_fit_decreasing`, ...),
  which raise an ImportError that says how to rebuild when the extension is missing;
- the torch op `grpo_kernels::position_ids_from_cu_seqlens`, registered with
  `torch.library.custom_op` plus a fake (shape-only) implementation so `torch.compile` can trace
  through it. Its CUDA kernel is the extension's when it was built with CUDA; every other case
  (CPU tensors, a CPU-only build) runs the same computation in PyTorch.
- the differentiable torch op `grpo_kernels::token_logprobs` (custom_op + fake + autograd, its
  backward a second op `grpo_kernels::token_logprobs_backward`) over the CUDA kernels of
  csrc/cuda/token_logprobs.cu, and `token_logprobs()`, the public contract on top of it that
  `grpo_kernels.dispatch` picks for CUDA tensors when the extension was built with CUDA.

Importing this module is cheap: it does not import torch. The torch ops are registered by
`register_torch_ops()` (position ids; `grpo_kernels.pack_tensors` calls it when imported) and
`register_logprob_ops()` (on the first `token_logprobs` call).
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
    "cuda_extension_serves",
    "register_logprob_ops",
    "token_logprobs",
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


# ------------------------------------------------------------------------------------------
# Token logprobs: torch ops grpo_kernels::token_logprobs (+ its backward) over the CUDA kernels
# of csrc/cuda/token_logprobs.cu. The ops' default implementation is the reference's chunk math
# in PyTorch (any device): it serves CPU tensors (tests, opcheck) and a CPU-only build.
# ------------------------------------------------------------------------------------------
TOKEN_LOGPROBS_OP = "grpo_kernels::token_logprobs"
TOKEN_LOGPROBS_BACKWARD_OP = "grpo_kernels::token_logprobs_backward"
# torch dtype name -> the name the CUDA entry points take.
CUDA_LOGITS_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}

_logprob_ops: Any = None


def cuda_extension_serves(logits: torch.Tensor) -> bool:
    """True when the compiled CUDA token_logprobs kernels take these logits (CUDA tensor, a
    supported dtype, extension built with CUDA)."""
    return logits.is_cuda and has_cuda_extension() and _dtype_name(logits) in CUDA_LOGITS_DTYPES


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_logprob_args(logits: torch.Tensor, targets: torch.Tensor) -> None:
    import torch

    if logits.dim() < 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits: expected floating-point [T, V] or [B, S, V], got {logits.dtype} {tuple(logits.shape)}"
        )
    n_rows = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    if targets.dim() != 1 or targets.dtype != torch.int64 or targets.numel() != n_rows:
        raise ValueError(f"targets: expected int64 [{n_rows}], got {targets.dtype} {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets: on {targets.device}, but logits is on {logits.device}")


def _rows_layout(logits: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """-> (logits as an [outer, inner, V] view, outer stride, inner stride, inner size). Row r
    sits at (r // inner) * outer_stride + (r % inner) * inner_stride; a strided [B, S, V] view
    such as logits[:, :-1] is not copied. V must be contiguous (else the logits are copied)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 2:
        view = logits.unsqueeze(0)
    else:
        try:
            view = logits.view(-1, logits.shape[-2], logits.shape[-1])
        except RuntimeError:  # leading dims not mergeable: one copy
            view = logits.contiguous().view(-1, logits.shape[-2], logits.shape[-1])
    return view, view.stride(0), view.stride(1), view.shape[1]


def _current_stream(device: torch.device) -> int:
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def _logprobs_fwd_torch(logits, targets, temperature, ignore_index, return_entropy):
    from grpo_kernels import reference as R

    rows = logits.reshape(-1, logits.shape[-1])
    logprobs, entropy, lse = R.logits_chunk_forward(rows, targets, temperature, ignore_index, return_entropy)
    return logprobs, entropy if return_entropy else logprobs.new_empty(0), lse


def _logprobs_fwd_cuda(logits, targets, temperature, ignore_index, return_entropy):
    import torch

    from grpo_kernels.reference import work_dtype

    n_rows, n_cols = targets.numel(), logits.shape[-1]
    out = dict(dtype=work_dtype(logits.dtype), device=logits.device)
    logprobs, lse = torch.empty(n_rows, **out), torch.empty(n_rows, **out)
    entropy = torch.empty(n_rows if return_entropy else 0, **out)
    if n_rows == 0:
        return logprobs, entropy, lse
    view, stride_outer, stride_inner, n_inner = _rows_layout(logits)
    with torch.cuda.device(logits.device):
        require_extension().token_logprobs_fwd_cuda(
            _dtype_name(logits),
            view.data_ptr(),
            stride_outer,
            stride_inner,
            n_inner,
            targets.contiguous().data_ptr(),
            n_rows,
            n_cols,
            temperature,
            ignore_index,
            logprobs.data_ptr(),
            entropy.data_ptr() if return_entropy else 0,
            lse.data_ptr(),
            _current_stream(logits.device),
        )
    return logprobs, entropy, lse


def _logprobs_bwd_torch(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index):
    from grpo_kernels import reference as R

    rows = logits.reshape(-1, logits.shape[-1])
    grad = R.logits_chunk_grad(rows, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index)
    return grad.reshape(logits.shape)


def _logprobs_bwd_cuda(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index):
    import torch

    n_rows, n_cols = targets.numel(), logits.shape[-1]
    grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return grad_logits
    view, stride_outer, stride_inner, n_inner = _rows_layout(logits)
    # Per-row inputs in the accumulation dtype; None -> a null pointer (no such gradient).
    rows = [None if t is None else t.to(lse.dtype).contiguous() for t in (entropy, grad_logprobs, grad_entropy)]
    with torch.cuda.device(logits.device):
        require_extension().token_logprobs_bwd_cuda(
            _dtype_name(logits),
            view.data_ptr(),
            stride_outer,
            stride_inner,
            n_inner,
            targets.contiguous().data_ptr(),
            lse.contiguous().data_ptr(),
            *(0 if t is None else t.data_ptr() for t in rows),
            grad_logits.data_ptr(),
            n_rows,
            n_cols,
            temperature,
            ignore_index,
            _current_stream(logits.device),
        )
    return grad_logits


def register_logprob_ops() -> Any:
    """Registers `torch.ops.grpo_kernels.token_logprobs` and its backward (idempotent) and
    returns the forward op: (logits [..., V], targets [T] int64, temperature, ignore_index,
    return_entropy) -> (logprobs [T], entropy [T] (or [0] when not asked for), lse [T]), all in
    float32 (float64 for float64 logits). Ignored rows give logprob and entropy 0; their lse is
    unspecified (the CUDA kernel skips those rows and writes 0). Differentiable in logits."""
    global _logprob_ops
    with _register_lock:
        if _logprob_ops is None:
            _logprob_ops = _define_logprob_ops()
        return _logprob_ops


def _define_logprob_ops() -> Any:
    import torch

    @torch.library.custom_op(
        TOKEN_LOGPROBS_OP,
        mutates_args=(),
        schema="(Tensor logits, Tensor targets, float temperature, int ignore_index, bool return_entropy)"
        " -> (Tensor, Tensor, Tensor)",
    )
    def forward_op(logits, targets, temperature, ignore_index, return_entropy):
        _check_logprob_args(logits, targets)
        return _logprobs_fwd_torch(logits, targets, temperature, ignore_index, return_entropy)

    @forward_op.register_kernel("cuda")
    def _forward_cuda(logits, targets, temperature, ignore_index, return_entropy):
        _check_logprob_args(logits, targets)
        if not cuda_extension_serves(logits):
            return _logprobs_fwd_torch(logits, targets, temperature, ignore_index, return_entropy)
        return _logprobs_fwd_cuda(logits, targets, temperature, ignore_index, return_entropy)

    @forward_op.register_fake
    def _forward_fake(logits, targets, temperature, ignore_index, return_entropy):
        _check_logprob_args(logits, targets)
        from grpo_kernels.reference import work_dtype

        n_rows = targets.shape[0]
        out = dict(dtype=work_dtype(logits.dtype))
        return (
            logits.new_empty(n_rows, **out),
            logits.new_empty(n_rows if return_entropy else 0, **out),
            logits.new_empty(n_rows, **out),
        )

    backward_op = _define_logprobs_backward_op()

    def setup_context(ctx, inputs, output):
        logits, targets, temperature, ignore_index, return_entropy = inputs
        _, entropy, lse = output
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (temperature, ignore_index, return_entropy)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, return_entropy = ctx.args
        if not return_entropy:
            entropy = grad_entropy = None
        grad = backward_op(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index)
        return grad, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op


def _define_logprobs_backward_op() -> Any:
    import torch

    @torch.library.custom_op(
        TOKEN_LOGPROBS_BACKWARD_OP,
        mutates_args=(),
        schema="(Tensor logits, Tensor targets, Tensor lse, Tensor? entropy, Tensor? grad_logprobs,"
        " Tensor? grad_entropy, float temperature, int ignore_index) -> Tensor",
    )
    def backward_op(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index):
        """-> d(loss)/d(logits), contiguous, with the logits' shape and dtype."""
        _check_logprob_args(logits, targets)
        if grad_entropy is not None and entropy is None:
            raise ValueError("entropy: the entropy gradient needs the forward's entropy")
        return _logprobs_bwd_torch(
            logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index
        )

    @backward_op.register_kernel("cuda")
    def _backward_cuda(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index):
        _check_logprob_args(logits, targets)
        args = (logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index)
        if grad_entropy is not None and entropy is None:
            raise ValueError("entropy: the entropy gradient needs the forward's entropy")
        return _logprobs_bwd_cuda(*args) if cuda_extension_serves(logits) else _logprobs_bwd_torch(*args)

    @backward_op.register_fake
    def _backward_fake(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature, ignore_index):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    return backward_op


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """`reference.token_logprobs`' contract through the compiled CUDA kernels (the dispatch
    sends CUDA tensors here when the extension was built with CUDA). chunk_size is accepted and
    unused: the kernels stream V one row at a time and hold no [rows, V] block."""
    from grpo_kernels import reference as R

    targets, temperature, _ = R.check_logits_inputs(
        logits, target_ids, temperature, ignore_index, chunk_size, cu_seqlens
    )
    out_shape = targets.shape if cu_seqlens is not None else target_ids.shape
    op = register_logprob_ops()
    logprobs, entropy, _ = op(logits, targets.contiguous(), temperature, int(ignore_index), return_entropy)
    if return_entropy:
        return logprobs.reshape(out_shape), entropy.reshape(out_shape)
    return logprobs.reshape(out_shape)
