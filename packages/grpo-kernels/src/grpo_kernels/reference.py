"""Pure-PyTorch oracle for every grpo-kernels op: token logprobs, fused lm_head logprobs, and
the clipped policy-gradient loss of shared/GRPO-MATH.md.

This is the slow twin that the Triton paths are tested and benchmarked against, and the path
that runs on CPU. It is exact, differentiable and memory-bounded: logits are processed a chunk
of rows at a time and backward recomputes the softmax from saved per-row statistics, so no
float32 [T, V] intermediate ever exists. It knows nothing about models, data or Ray.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from grpo_kernels.loss_config import PGLossConfig

IGNORE_INDEX = -100
# One chunk of float32 logits rows is about this many bytes (the forward keeps ~2 such
# buffers alive at once, backward ~3).
DEFAULT_CHUNK_BYTES = 64 * 2**20
DEFAULT_LINEAR_CHUNK_ROWS = 1024

__all__ = [
    "IGNORE_INDEX",
    "token_logprobs",
    "linear_token_logprobs",
    "shift_targets_packed",
    "clipped_pg_loss",
    "kl_estimate",
    "vocab_parallel_token_logprobs",
]


# ----------------------------------------------------------------------------------------------
# Input checks (shared with the Triton launchers: the reference defines the contract)
# ----------------------------------------------------------------------------------------------
def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (gradcheck), everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_temperature(temperature: float) -> float:
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature={temperature!r}: expected a finite number > 0")
    return float(temperature)


def check_targets(
    target_ids: torch.Tensor,
    leading: torch.Size,
    n_classes: int,
    device: torch.device,
    ignore_index: int,
    what: str,
) -> torch.Tensor:
    """Flat int64 targets [T]; every id is in [0, n_classes) or equal to ignore_index."""
    if not isinstance(target_ids, torch.Tensor):
        raise ValueError(f"target_ids: expected a tensor, got {type(target_ids).__name__}")
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target_ids: expected int64 (or int32) ids, got {target_ids.dtype}")
    if target_ids.device != device:
        raise ValueError(f"target_ids: on {target_ids.device}, but {what} is on {device}")
    n_rows = math.prod(leading)
    if tuple(target_ids.shape) != tuple(leading) and tuple(target_ids.shape) != (n_rows,):
        raise ValueError(
            f"target_ids: shape {tuple(target_ids.shape)} does not match {what}'s leading dims {tuple(leading)}"
        )
    flat = target_ids.reshape(n_rows).to(torch.int64)
    if n_rows:
        bad = ((flat < 0) | (flat >= n_classes)) & (flat != ignore_index)
        if bool(bad.any()):
            first = int(flat[bad][0])
            raise ValueError(
                f"target_ids: id {first} is out of range [0, {n_classes}) and is not ignore_index={ignore_index}"
            )
    return flat


def check_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens [n+1] int64: starts at 0, non-decreasing, last entry <= n_tokens."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected a 1-D tensor [n_seqs + 1]")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens: expected int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, but the tokens are on {device}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()) or int(cu[-1]) > n_tokens:
        raise ValueError(
            f"cu_seqlens: must start at 0, never decrease and end at <= {n_tokens} (the number "
            f"of tokens); got {cu.tolist() if cu.numel() <= 16 else '...'}"
        )
    return cu


def shift_targets_packed(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Next-token targets of a packed stream: targets[t] = input_ids[t + 1] inside a sequence.

    The last position of each sequence (and every position after cu_seqlens[-1]) gets
    ignore_index, so logits never predict across a sequence boundary.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise ValueError("input_ids: expected a flat [T] tensor of token ids")
    n_tokens = input_ids.numel()
    cu = check_cu_seqlens(cu_seqlens, n_tokens, input_ids.device)
    targets = torch.full_like(input_ids, ignore_index, dtype=torch.int64)
    if n_tokens > 1:
        targets[:-1] = input_ids[1:]
    ends = cu[1:][cu[1:] > cu[:-1]] - 1  # last position of every non-empty sequence
    targets[ends] = ignore_index
    targets[int(cu[-1]) :] = ignore_index
    return targets


# ----------------------------------------------------------------------------------------------
# Shared softmax math on one chunk of scaled logits z = logits / temperature, [C, V] fp32/fp64
# ----------------------------------------------------------------------------------------------
def _chunk_forward(z: torch.Tensor, targets: torch.Tensor, ignore_index: int, want_entropy: bool):
    """-> logprob [C], entropy [C] or None, lse [C]; ignored rows give 0. z is consumed."""
    ignored = targets == ignore_index
    safe = torch.where(ignored, 0, targets)
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logprob = z.gather(1, safe[:, None]).squeeze(1) - lse
    logprob = torch.where(ignored, 0.0, logprob)
    entropy = None
    if want_entropy:
        logp = z.sub_(lse[:, None])  # [C, V], in place: z is not needed any more
        p = logp.exp()
        # -inf logits (masked vocabulary) have p = 0 and contribute 0, not 0 * -inf
        entropy = -p.mul_(logp.clamp_(min=torch.finfo(logp.dtype).min)).sum(-1)
        entropy = torch.where(ignored, 0.0, entropy)
    return logprob, entropy, lse


def _chunk_grad(
    z: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, [C, V] in z's dtype. z is consumed.

    d logprob_t / d z_j = [j = t] - p_j;  d H / d z_j = -p_j (log p_j + H);  z = logits / T.
    """
    ignored = targets == ignore_index
    logp = z.sub_(lse[:, None])  # [C, V]
    p = logp.exp()
    logp.clamp_(min=torch.finfo(logp.dtype).min)  # -inf logits: p = 0, keep 0 * log p finite
    g_lp = None if grad_logprob is None else torch.where(ignored, 0.0, grad_logprob.to(p.dtype))
    if grad_entropy is not None:
        g_ent = torch.where(ignored, 0.0, grad_entropy.to(p.dtype))
        grad = logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None])  # reuses logp
        if g_lp is not None:
            grad.sub_(p.mul_(g_lp[:, None]))
    elif g_lp is not None:
        del logp
        grad = p.mul_(-g_lp[:, None])  # reuses p
    else:
        return torch.zeros_like(p)
    if g_lp is not None:
        safe = torch.where(ignored, 0, targets)
        grad.scatter_add_(1, safe[:, None], g_lp[:, None])
    return grad.div_(temperature)


# ----------------------------------------------------------------------------------------------
# token_logprobs: logits [T, V] -> logprob of the target (and entropy)
# ----------------------------------------------------------------------------------------------
def default_chunk_rows(n_cols: int) -> int:
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, n_cols)))


def logits_chunk_forward(logits, targets, temperature, ignore_index, want_entropy, owned=False):
    """Per-chunk work of the forward: logits [C, V] -> logprob [C], entropy [C] or None, lse
    [C]. `owned`: logits is a scratch buffer (a fresh matmul output) that may be overwritten."""
    wd = work_dtype(logits.dtype)
    z = logits.div_(temperature) if owned and logits.dtype == wd else logits.to(wd) / temperature
    return _chunk_forward(z, targets, ignore_index, want_entropy)


def logits_chunk_grad(
    logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index, owned=False
):
    """Per-chunk work of the backward: -> d(loss)/d(logits) [C, V] in logits' dtype."""
    wd = work_dtype(logits.dtype)
    z = logits.div_(temperature) if owned and logits.dtype == wd else logits.to(wd) / temperature
    grad = _chunk_grad(z, targets, ignore_index, lse, entropy, grad_logprob, grad_entropy, temperature)
    return grad.to(logits.dtype)


# (forward, backward) per-chunk functions; the Triton path of the fused lm_head swaps in its own.
REFERENCE_CHUNK_KERNELS = (logits_chunk_forward, logits_chunk_grad)


def _rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[start:stop]


def _chunked_forward(
    logits_of, n_rows, targets, temperature, ignore_index, chunk_rows, want_entropy, chunk_forward, dtype, device, owned
):
    """Run chunk_forward on logits_of(start, stop) for every chunk of rows -> logprob, entropy
    or None, lse, each [T] of the work dtype."""
    wd = work_dtype(dtype)
    logprob = torch.empty(n_rows, dtype=wd, device=device)
    lse = torch.empty(n_rows, dtype=wd, device=device)
    entropy = torch.empty(n_rows, dtype=wd, device=device) if want_entropy else None
    for start in range(0, n_rows, chunk_rows):
        stop = min(start + chunk_rows, n_rows)
        lp, ent, ls = chunk_forward(
            logits_of(start, stop), targets[start:stop], temperature, ignore_index, want_entropy, owned
        )
        logprob[start:stop] = lp
        lse[start:stop] = ls
        if want_entropy:
            entropy[start:stop] = ent
    return logprob, entropy, lse


def _logprobs_forward(logits, targets, temperature, ignore_index, chunk_rows, want_entropy):
    return _chunked_forward(
        lambda a, b: logits[a:b],
        logits.shape[0],
        targets,
        temperature,
        ignore_index,
        chunk_rows,
        want_entropy,
        logits_chunk_forward,
        logits.dtype,
        logits.device,
        owned=False,
    )


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Saves logits (already alive) and per-row lse/entropy; backward recomputes the softmax."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, ignore_index, chunk_rows, want_entropy):
        logprob, entropy, lse = _logprobs_forward(logits, targets, temperature, ignore_index, chunk_rows, want_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (temperature, ignore_index, chunk_rows)
        ctx.set_materialize_grads(False)
        return (logprob, entropy) if want_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, chunk_rows = ctx.args
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits.shape[0])
            grad_logits[start:stop] = logits_chunk_grad(
                logits[start:stop],
                targets[start:stop],
                lse[start:stop],
                _rows(entropy, start, stop),
                _rows(grad_logprob, start, stop),
                _rows(grad_entropy, start, stop),
                temperature,
                ignore_index,
            )
        return grad_logits, None, None, None, None, None


def check_logits_inputs(logits, target_ids, temperature, ignore_index, chunk_size, cu_seqlens):
    """Validate token_logprobs' inputs -> (targets [T] int64, temperature, chunk rows)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits: expected a floating-point tensor [T, V] or [B, S, V]")
    if logits.dim() < 2:
        raise ValueError(f"logits: expected at least 2 dims [T, V], got shape {tuple(logits.shape)}")
    temperature = check_temperature(temperature)
    n_cols = logits.shape[-1]
    if n_cols < 1:
        raise ValueError("logits: the vocabulary dimension is empty")
    if not isinstance(target_ids, torch.Tensor):
        raise ValueError(f"target_ids: expected a tensor, got {type(target_ids).__name__}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive number of rows or None")
    if cu_seqlens is not None:
        if logits.dim() != 2 or target_ids.dim() != 1:
            raise ValueError("cu_seqlens: packed input needs flat logits [T, V] and input ids [T]")
        target_ids = shift_targets_packed(target_ids, cu_seqlens, ignore_index)
    targets = check_targets(target_ids, logits.shape[:-1], n_cols, logits.device, ignore_index, "logits")
    return targets, temperature, chunk_size or default_chunk_rows(n_cols)


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """log softmax(logits / temperature)[target] per row, chunked over rows.

    logits [T, V] or [B, S, V] (any float dtype); target_ids with the leading shape (or flat).
    Returns logprobs (and entropies) with target_ids' shape, float32 (float64 for float64
    logits); rows whose target is ignore_index give 0 for both. chunk_size = rows per chunk
    (default: ~64 MiB of float32 logits). With cu_seqlens [n+1], target_ids are the *input ids*
    of a packed [T] stream and position t scores input_ids[t + 1] within its sequence (the last
    position of each sequence gives 0); `torch.roll(out, 1)` aligns that to "token t holds
    log p(x_t | x_<t)" with 0 at every sequence start.
    """
    targets, temperature, chunk_rows = check_logits_inputs(
        logits, target_ids, temperature, ignore_index, chunk_size, cu_seqlens
    )
    logits2d = logits.reshape(-1, logits.shape[-1])
    out_shape = targets.shape if cu_seqlens is not None else target_ids.shape
    if torch.is_grad_enabled() and logits2d.requires_grad:
        out = _ChunkedTokenLogprobs.apply(logits2d, targets, temperature, ignore_index, chunk_rows, return_entropy)
        logprob, entropy = out if return_entropy else (out, None)
    else:
        with torch.no_grad():
            logprob, entropy, _ = _logprobs_forward(
                logits2d, targets, temperature, ignore_index, chunk_rows, return_entropy
            )
    if return_entropy:
        return logprob.reshape(out_shape), entropy.reshape(out_shape)
    return logprob.reshape(out_shape)


# ----------------------------------------------------------------------------------------------
# linear_token_logprobs: hidden [T, H] @ weight[V, H].T fused with the above, chunked over rows
# ----------------------------------------------------------------------------------------------
def _linear_forward(
    hidden, weight, targets, temperature, ignore_index, chunk_rows, want_entropy, chunk_kernels=REFERENCE_CHUNK_KERNELS
):
    return _chunked_forward(
        lambda a, b: hidden[a:b] @ weight.t(),
        hidden.shape[0],
        targets,
        temperature,
        ignore_index,
        chunk_rows,
        want_entropy,
        chunk_kernels[0],
        hidden.dtype,
        hidden.device,
        owned=True,
    )


class _ChunkedLinearTokenLogprobs(torch.autograd.Function):
    """Saves hidden/weight (already alive) and per-row lse/entropy; backward recomputes each
    logits chunk, turns it into d(logits) and folds that into dX and dW at once. The per-chunk
    softmax work is `chunk_kernels` (the reference's, or the Triton launchers)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, chunk_rows, want_entropy, chunk_kernels):
        logprob, entropy, lse = _linear_forward(
            hidden, weight, targets, temperature, ignore_index, chunk_rows, want_entropy, chunk_kernels
        )
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (temperature, ignore_index, chunk_rows, chunk_kernels[1])
        ctx.set_materialize_grads(False)
        return (logprob, entropy) if want_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index, chunk_rows, chunk_grad = ctx.args
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_x else None
        # Low-precision dW is summed over chunks in float32, then cast once.
        acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            h = hidden[start:stop]
            grad_logits = chunk_grad(
                h @ weight.t(),
                targets[start:stop],
                lse[start:stop],
                _rows(entropy, start, stop),
                _rows(grad_logprob, start, stop),
                _rows(grad_entropy, start, stop),
                temperature,
                ignore_index,
                owned=True,
            )  # [C, V], hidden's dtype
            if need_x:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:stop])
            if need_w:
                if acc_dtype == hidden.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t() @ h)
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def check_linear_inputs(hidden, weight, target_ids, temperature, ignore_index, chunk_size, cu_seqlens):
    """Validate the fused lm_head inputs -> (hidden [T, H], targets [T] int64, temperature)."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise ValueError("hidden: expected a floating-point tensor [T, H] or [B, S, H]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight: expected the lm_head weight [V, H]")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, but hidden is on {hidden.device}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive number of rows")
    if not isinstance(target_ids, torch.Tensor):
        raise ValueError(f"target_ids: expected a tensor, got {type(target_ids).__name__}")
    temperature = check_temperature(temperature)
    if cu_seqlens is not None:
        if hidden.dim() != 2 or target_ids.dim() != 1:
            raise ValueError("cu_seqlens: packed input needs flat hidden [T, H] and input ids [T]")
        target_ids = shift_targets_packed(target_ids, cu_seqlens, ignore_index)
    targets = check_targets(target_ids, hidden.shape[:-1], weight.shape[0], hidden.device, ignore_index, "hidden")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    return hidden2d, targets, temperature


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = DEFAULT_LINEAR_CHUNK_ROWS,
    cu_seqlens: torch.Tensor | None = None,
    *,
    chunk_kernels=REFERENCE_CHUNK_KERNELS,
):
    """token_logprobs(hidden @ weight.T, ...) without ever holding more than chunk_size rows of
    logits. hidden [T, H] or [B, S, H], weight [V, H] (the lm_head). Exact: forward and backward
    (dX, dW) match the unfused computation; under torch.no_grad() nothing is saved. With
    cu_seqlens, target_ids are the packed input ids (as in token_logprobs). `chunk_kernels` is
    the (forward, backward) per-chunk softmax work; the GPU path passes its Triton launchers.
    """
    hidden2d, targets, temperature = check_linear_inputs(
        hidden, weight, target_ids, temperature, ignore_index, chunk_size, cu_seqlens
    )
    out_shape = targets.shape if cu_seqlens is not None else target_ids.shape
    args = (targets, temperature, ignore_index, chunk_size, return_entropy, chunk_kernels)
    if torch.is_grad_enabled() and (hidden2d.requires_grad or weight.requires_grad):
        out = _ChunkedLinearTokenLogprobs.apply(hidden2d, weight, *args)
        logprob, entropy = out if return_entropy else (out, None)
    else:
        with torch.no_grad():
            logprob, entropy, _ = _linear_forward(hidden2d, weight, *args)
    if return_entropy:
        return logprob.reshape(out_shape), entropy.reshape(out_shape)
    return logprob.reshape(out_shape)


# ----------------------------------------------------------------------------------------------
# vocab_parallel_token_logprobs' twin: gather the shards, then the unsharded op
# ----------------------------------------------------------------------------------------------
def vocab_parallel_token_logprobs(
    logits, target_ids, group=None, temperature=1.0, return_entropy=False, ignore_index=IGNORE_INDEX, cu_seqlens=None
):
    """The oracle of `grpo_kernels.vocab_parallel`: all-gather every rank's shard [.., V/tp] into
    the full logits (this rank's slice stays in the autograd graph, the others are constants:
    every rank computes the same loss, so its shard's gradient is its slice of the full one)
    and run `token_logprobs` on them. Memory of the full [T, V]: for tests only."""
    import torch.distributed as dist

    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.detach().contiguous(), group=group)
    shards[dist.get_rank(group)] = logits
    return token_logprobs(
        torch.cat(shards, dim=-1), target_ids, temperature, return_entropy, ignore_index, cu_seqlens=cu_seqlens
    )


# ----------------------------------------------------------------------------------------------
# clipped_pg_loss: the loss of shared/GRPO-MATH.md
# ----------------------------------------------------------------------------------------------
def kl_estimate(logr: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Schulman's estimators of KL(p || q) from logr = log q - log p at samples of p."""
    if kl_type == "k1":
        return -logr
    if kl_type == "k2":
        return logr.square() / 2
    if kl_type == "k3":
        return torch.exp(logr) - 1 - logr
    raise ValueError(f"kl_type={kl_type!r}: expected 'k1', 'k2' or 'k3'")


def global_count(value, name: str, device, dtype) -> torch.Tensor:
    """Global count as a 0-dim tensor, floored at 1 so an all-masked global batch gives 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar count, got shape {tuple(value.shape)}")
        count = value.reshape(()).to(device=device, dtype=dtype)
    elif isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
        count = torch.tensor(float(value), device=device, dtype=dtype)
    else:
        raise ValueError(f"{name}={value!r}: expected a non-negative count of the global batch")
    return count.clamp_min(1.0)


def check_pg_inputs(curr, prev, gen, ref, advantages, token_mask, sample_mask, config, cu_seqlens):
    """Validate shapes, dtypes, devices and layout -> (n_seqs, cu_seqlens as int64 or None)."""
    if not isinstance(config, PGLossConfig):
        raise ValueError(f"config: expected a PGLossConfig, got {type(config).__name__}")
    if not isinstance(curr, torch.Tensor) or not curr.is_floating_point():
        raise ValueError("curr: expected a floating-point tensor of logprobs [B, S] or [T]")
    if ref is None and config.reference_policy_kl_penalty != 0:
        raise ValueError("ref: None, but reference_policy_kl_penalty != 0 needs reference logprobs")
    named = {"prev": prev, "gen": gen, "advantages": advantages}
    if ref is not None:
        named["ref"] = ref
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.shape != curr.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from curr's {tuple(curr.shape)}")
        if t.dtype != curr.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from curr's {curr.dtype}")
        if t.device != curr.device:
            raise ValueError(f"{name}: on {t.device}, but curr is on {curr.device}")
    for name, t in (("token_mask", token_mask), ("sample_mask", sample_mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.device != curr.device:
            raise ValueError(f"{name}: on {t.device}, but curr is on {curr.device}")
        if t.is_complex():
            raise ValueError(f"{name}: expected a bool or 0/1 numeric mask, got {t.dtype}")
    if token_mask.shape != curr.shape:
        raise ValueError(f"token_mask: shape {tuple(token_mask.shape)} differs from curr's {tuple(curr.shape)}")
    cu = None
    if curr.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: given for padded [B, S] input; packed input is flat [T]")
        n_seqs = curr.shape[0]
    elif curr.dim() == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: required for packed [T] input")
        cu = check_cu_seqlens(cu_seqlens, curr.numel(), curr.device)
        n_seqs = cu.numel() - 1
    else:
        raise ValueError(f"curr: expected [B, S] or packed [T], got shape {tuple(curr.shape)}")
    if sample_mask.shape != (n_seqs,):
        raise ValueError(f"sample_mask: shape {tuple(sample_mask.shape)}, expected ({n_seqs},)")
    return n_seqs, cu


def token_layout(curr, token_mask, sample_mask, n_seqs, cu):
    """-> seq_id [N] (tokens after cu_seqlens[-1] belong to a dummy masked sequence n_seqs)
    and valid [N] = token_mask & sample_mask of the token's sequence."""
    device = curr.device
    if cu is None:
        seq_id = torch.arange(n_seqs, device=device).repeat_interleave(curr.shape[1])
    else:
        lengths = torch.cat([cu.diff(), (curr.numel() - cu[-1:])])
        seq_id = torch.arange(n_seqs + 1, device=device).repeat_interleave(lengths)
    sample_ok = torch.cat([sample_mask.reshape(-1) != 0, sample_mask.new_zeros(1, dtype=torch.bool)])
    valid = (token_mask.reshape(-1) != 0) & sample_ok[seq_id]
    return seq_id, valid


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PG loss + beta * KL (+ mu * positive NLL) of one micro-batch as a partial sum of
    the global loss; every option of PGLossConfig, formulas in docs/algorithms.md:
    ratio (PPO / GSPO / REINFORCE / forced 1), surrogate (clipped, dual clip, CISPO), the
    train/inference weight (per token, or per sequence under GSPO, truncated), the KL term
    (k1/k2/k3, clamps, detached or true-gradient weight) and loss_aggregation.

    curr/prev/gen/ref/advantages/token_mask: [B, S] (token t holds log p(x_t | x_<t)) with
    sample_mask [B], or packed [T] with cu_seqlens [n+1] and sample_mask [n]. Masked positions
    may hold anything (NaN, -inf): they never reach the loss or its gradient. Gradients flow to
    curr only. global_valid_tokens / global_valid_seqs count the whole global batch, so summing
    the returned loss (and the mean-type metrics) over micro-batches and ranks gives the global
    value. Metrics are detached 0-dim float32 tensors.
    """
    n_seqs, cu = check_pg_inputs(curr, prev, gen, ref, advantages, token_mask, sample_mask, config, cu_seqlens)
    seq_id, valid = token_layout(curr, token_mask, sample_mask, n_seqs, cu)
    cfg = config
    wd = work_dtype(curr.dtype)
    g_tok = global_count(global_valid_tokens, "global_valid_tokens", curr.device, wd)
    g_seq = global_count(global_valid_seqs, "global_valid_seqs", curr.device, wd)

    def clean(t: torch.Tensor) -> torch.Tensor:  # [N], zero where invalid (grad too)
        return torch.where(valid, t.reshape(-1).to(wd), 0.0)

    def seq_sum(t: torch.Tensor) -> torch.Tensor:  # [N] -> [n_seqs + 1]
        return torch.zeros(n_seqs + 1, dtype=t.dtype, device=t.device).index_add(0, seq_id, t)

    tokens_per_seq = seq_sum(valid.to(wd)).clamp_min(1.0)  # [n_seqs + 1]

    def seq_mean(t: torch.Tensor) -> torch.Tensor:  # per-sequence mean over valid tokens
        return seq_sum(t) / tokens_per_seq

    def reduce_tok(t: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, t, 0.0).sum() / g_tok

    reduce_loss = loss_reducer(cfg, valid, seq_mean, g_tok, g_seq)
    curr_v, prev_v, gen_v, adv = clean(curr), clean(prev), clean(gen), clean(advantages)
    ref_v = clean(ref) if ref is not None else None

    ratio, ratio_clamped = _ratios(cfg, curr_v, prev_v, seq_mean, seq_id)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio_clamped
    if cfg.use_cispo:  # the clipped ratio is a detached weight; the gradient flows through curr
        pg = -adv * ratio_clamped.detach() * curr_v
    else:
        pg = torch.maximum(loss_unclipped, loss_clipped)
    if cfg.ratio_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.ratio_clip_c), pg)

    # Importance weight between the trainer's and the sampler's policy, [N], never a grad path.
    with torch.no_grad():
        is_weight, out_of_bounds, seq_weight = _importance_weights(cfg, prev_v, gen_v, valid, seq_id, seq_sum, seq_mean)
    actor_loss = reduce_loss((is_weight if cfg.use_importance_sampling_correction else 1.0) * pg)

    beta = cfg.reference_policy_kl_penalty
    if beta != 0:
        kl = reduce_loss(kl_per_token(cfg, curr_v, ref_v, gen_v))
    else:
        kl = torch.zeros((), dtype=wd, device=curr.device)
    mu = cfg.positive_example_nll_weight
    if mu != 0:  # VAPO: NLL of the sequences whose (mean) advantage is positive
        positive = (seq_mean(adv) > 0)[seq_id] & valid
        nll = reduce_loss(torch.where(positive, -curr_v, 0.0))
    else:
        nll = torch.zeros((), dtype=wd, device=curr.device)
    loss = actor_loss + beta * kl + mu * nll

    with torch.no_grad():
        metrics = _metrics(
            cfg,
            curr_v,
            prev_v,
            gen_v,
            valid,
            ratio,
            ratio_clamped,
            loss_unclipped,
            loss_clipped,
            is_weight,
            out_of_bounds,
            reduce_tok,
            g_seq,
            sample_mask,
            seq_weight,
        )
        metrics.update(kl_penalty=kl, actor_loss=actor_loss, positive_nll=nll, loss=loss)
        metrics = {k: v.detach().to(torch.float32).reshape(()) for k, v in metrics.items()}
    return loss, metrics


def loss_normaliser(cfg: PGLossConfig, g_tok, g_seq):
    """The global denominator of the loss: G_tok (token-mean), G_seq (seq-mean-token-mean /
    -sum) or G_seq * L (seq-mean-token-sum-norm, L = loss_scale_factor)."""
    if cfg.loss_aggregation == "token-mean":
        return g_tok
    if cfg.loss_aggregation == "seq-mean-token-sum-norm":
        return g_seq * cfg.loss_scale_factor
    return g_seq


def loss_reducer(cfg: PGLossConfig, valid, seq_mean, g_tok, g_seq):
    """-> reduce(t [N]) = this micro-batch's partial sum of the configured aggregation."""
    denominator = loss_normaliser(cfg, g_tok, g_seq)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = torch.where(valid, t, 0.0)
        if cfg.loss_aggregation == "seq-mean-token-mean":
            return seq_mean(t).sum() / denominator
        return t.sum() / denominator

    return reduce


def _ratios(cfg: PGLossConfig, curr_v, prev_v, seq_mean, seq_id):
    """-> (r, r_c) per token [N]: PPO/GSPO ratio and its clamp, REINFORCE's curr, or the forced 1."""
    if cfg.force_on_policy_ratio:  # value 1, gradient d curr (NeMo RL's force_on_policy_ratio)
        ratio = torch.exp(curr_v - curr_v.detach())
        return ratio, ratio
    if cfg.disable_ppo_ratio:
        return curr_v, curr_v
    log_ratio = curr_v - prev_v
    if cfg.sequence_level_importance_ratios:
        ratio = torch.exp(seq_mean(log_ratio))[seq_id]
    else:
        ratio = torch.exp(log_ratio)
    return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def kl_per_token(cfg: PGLossConfig, curr_v, ref_v, gen_v) -> torch.Tensor:
    """The per-token KL term [N] with its clamps and importance weight.

    The weight is exp(curr - gen) with on-policy KL, else exp(curr - sg(curr)) (value 1). With
    kl_true_gradient it stays in the graph: d/dcurr of w * k is w * (k + dk/dcurr), whose
    expectation over samples of curr is the gradient of E[k] = KL(curr || ref) for k1 and k3
    (the score-function term; arXiv 2506.09477). Where the input clamp binds, the weight is
    detached too (NeMo RL's rule), so a clamped token carries no gradient at all.
    """
    raw = ref_v - curr_v
    logr = raw
    if cfg.kl_input_clamp_value is not None:
        logr = raw.clamp(-cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
    kl_tok = kl_estimate(logr, cfg.reference_policy_kl_type)
    weight = None
    if cfg.use_on_policy_kl_approximation:
        weight = _finite_or_zero(torch.exp(curr_v - gen_v))
    elif cfg.kl_true_gradient:
        weight = torch.exp(curr_v - curr_v.detach())
    if weight is not None:
        if not cfg.kl_true_gradient:
            weight = weight.detach()
        elif cfg.kl_input_clamp_value is not None:
            weight = torch.where(raw == logr, weight, weight.detach())
        kl_tok = kl_tok * weight
    if cfg.kl_output_clamp_value is not None:
        kl_tok = kl_tok.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl_tok


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def _importance_weights(cfg, prev_v, gen_v, valid, seq_id, seq_sum, seq_mean):
    """Train/inference weights, truncated as configured -> (w [N], oob, w_i [n_seqs + 1] or None).

    Token level: w = exp(prev - gen) per token. GSPO (sequence_level_importance_ratios): one
    weight per sequence, w_i = exp(sum_t m (prev - gen)), broadcast to its tokens; truncation
    acts on w_i. nan/inf weights become 0. oob marks what truncation touched: per token for
    tis/icepop, per sequence [n_seqs + 1] for seq-mask-tis and for GSPO, None without
    truncation. w is computed even when the loss does not use it, so that
    sampling_importance_ratio always reports the train/inference mismatch.
    """
    kind = cfg.truncated_importance_sampling_type
    lo, hi = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio

    def outside(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x, dtype=torch.bool)
        if lo is not None:
            out |= x < lo
        if hi is not None:
            out |= x > hi
        return out

    if cfg.sequence_level_importance_ratios:
        weight = _finite_or_zero(torch.exp(seq_sum(torch.where(valid, prev_v - gen_v, 0.0))))  # [n_seqs + 1]
        oob = outside(weight) if kind is not None else None
        if kind == "tis":
            weight = weight.clamp(lo, hi)
        elif kind == "icepop":
            weight = torch.where(oob, 0.0, weight)
        return weight[seq_id], oob, weight
    weight = _finite_or_zero(torch.exp(prev_v - gen_v))
    if kind == "tis":
        return weight.clamp(lo, hi), outside(weight), None
    if kind == "icepop":
        oob = outside(weight)
        return torch.where(oob, 0.0, weight), oob, None
    if kind == "seq-mask-tis":
        geo_mean = torch.exp(seq_mean(torch.where(valid, _finite_or_zero(prev_v - gen_v), 0.0)))
        oob_seq = outside(geo_mean)  # [n_seqs + 1]
        return torch.where(oob_seq[seq_id], 0.0, weight), oob_seq, None
    return weight, None, None


def _metrics(
    cfg,
    curr_v,
    prev_v,
    gen_v,
    valid,
    ratio,
    ratio_clamped,
    loss_unclipped,
    loss_clipped,
    is_weight,
    out_of_bounds,
    reduce_tok,
    g_seq,
    sample_mask,
    seq_weight,
):
    kl_type = cfg.reference_policy_kl_type
    log_mix = torch.logaddexp(prev_v, gen_v) - math.log(2.0)  # log(e^prev / 2 + e^gen / 2)
    a, b = prev_v - log_mix, gen_v - log_mix
    js = 0.5 * (torch.exp(a) - a - 1) + 0.5 * (torch.exp(b) - b - 1)
    inf = torch.full((1,), math.inf, dtype=ratio.dtype, device=ratio.device)

    def vmin(t):
        return torch.cat([torch.where(valid, t, math.inf), inf]).min()

    def vmax(t):
        return torch.cat([torch.where(valid, t, -math.inf), -inf]).max()

    sample_ok = sample_mask.reshape(-1) != 0
    if out_of_bounds is None:
        oob = torch.zeros((), device=curr_v.device)
    elif cfg.truncated_importance_sampling_type == "seq-mask-tis" or cfg.sequence_level_importance_ratios:
        oob = (out_of_bounds[:-1] & sample_ok).sum() / g_seq
    else:
        oob = reduce_tok(out_of_bounds.to(curr_v.dtype))
    if seq_weight is not None:  # GSPO: one weight per sequence, so the mean over sequences
        sampling_ratio = torch.where(sample_ok, seq_weight[:-1], 0.0).sum() / g_seq
    else:
        sampling_ratio = reduce_tok(is_weight)
    return {
        "token_mult_prob_error": reduce_tok(torch.exp((gen_v - prev_v).abs())),
        "gen_kl_error": reduce_tok(kl_estimate(prev_v - gen_v, kl_type)),
        "policy_kl_error": reduce_tok(kl_estimate(gen_v - prev_v, kl_type)),
        "js_divergence_error": reduce_tok(js),
        "sampling_importance_ratio": sampling_ratio,
        "approx_entropy": -reduce_tok(torch.exp(curr_v - gen_v) * curr_v),
        "ratio_mean": reduce_tok(ratio),
        "clipped_ratio_mean": reduce_tok(ratio_clamped),
        "clip_fraction": reduce_tok((loss_clipped > loss_unclipped).to(curr_v.dtype)),
        "is_oob_fraction": oob,
        "ratio_min": vmin(ratio),
        "ratio_max": vmax(ratio),
        "clipped_ratio_min": vmin(ratio_clamped),
        "clipped_ratio_max": vmax(ratio_clamped),
    }
