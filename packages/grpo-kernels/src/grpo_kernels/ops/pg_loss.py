"""Triton clipped PG loss + KL (shared/GRPO-MATH.md): one launch forward, one launch backward
on the token-level path.

Forward: each program takes BLOCK tokens and writes a row of 16 partial statistics (loss terms,
metric sums, ratio extrema), then bumps a counter; the program that finishes last folds all
rows in a fixed order, in the same launch (deterministic: no float atomics, so the sums do not
depend on which program ran when). Backward recomputes the per-token terms and writes
d loss / d curr. Everything per sequence that the token-level kernel cannot see is prepared on
the host (torch ops, the "second pass" of the sequence-level paths): the per-sequence weight
1 / n_i of seq-mean-token-mean, the sequence keep-mask of seq-mask-tis, and for GSPO each
sequence's log-ratio mean_t(curr - prev) (an input with gradient: the kernel's actor gradient
wrt it flows back to curr through torch) and its truncated train/inference weight
exp(sum_t m (prev - gen)). The other loss_aggregation modes differ only in the host's global
normaliser. VAPO's positive-example NLL is not implemented here (`dispatch` routes it to the
reference). The reference twin is `grpo_kernels.reference.clipped_pg_loss`; the formulas are
in docs/algorithms.md.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl

from grpo_kernels import reference as R
from grpo_kernels.loss_config import PGLossConfig

BLOCK = 1024
REDUCE_BLOCK = 256
# Layout of the statistics vector: 12 sums, then min, min, max, max.
STATS = (
    "actor_sum",
    "kl_sum",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "sampling_importance_ratio",
    "approx_entropy",
    "ratio_mean",
    "clipped_ratio_mean",
    "clip_fraction",
    "is_oob_fraction",
    "ratio_min",
    "clipped_ratio_min",
    "ratio_max",
    "clipped_ratio_max",
)
N_SUMS = 12
N_STATS = len(STATS)
assert N_STATS == 16  # the kernels lay out 16 statistics per row (a power of two for tl.arange)
TRUNCATION_CODES = {None: 0, "tis": 1, "icepop": 2, "seq-mask-tis": 3}
KL_CODES = {"k1": 1, "k2": 2, "k3": 3}


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _kl_value(logr, KL_TYPE: tl.constexpr):
    if KL_TYPE == 1:
        k = -logr
    elif KL_TYPE == 2:
        k = logr * logr * 0.5
    else:
        k = tl.exp(logr) - 1.0 - logr
    return k


@triton.jit
def _finite_or_zero(x):
    return tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)


@triton.jit
def _pg_token_terms(
    offs,
    curr_ptr,
    prev_ptr,
    gen_ptr,
    ref_ptr,
    adv_ptr,
    token_mask_ptr,
    seq_mask_ptr,
    seq_weight_ptr,
    seq_keep_ptr,
    lr_ptr,
    isw_ptr,
    params_ptr,
    n_tokens,
    row_len,
    REINFORCE: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    USE_IS: tl.constexpr,
    TRUNCATION: tl.constexpr,
    HAS_IS_LO: tl.constexpr,
    HAS_IS_HI: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TYPE: tl.constexpr,
    KL_IN_CLAMP: tl.constexpr,
    KL_OUT_CLAMP: tl.constexpr,
    ON_POLICY_KL: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    FORCE_RATIO: tl.constexpr,
    CISPO: tl.constexpr,
    KL_TRUE_GRAD: tl.constexpr,
    GSPO: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per-token terms of the loss for the tokens `offs` (shared by forward and backward)."""
    in_range = offs < n_tokens
    seq = offs // row_len
    valid = in_range & (tl.load(token_mask_ptr + offs, mask=in_range, other=0) != 0)
    valid = valid & (tl.load(seq_mask_ptr + seq, mask=in_range, other=0) != 0)
    c = tl.where(valid, tl.load(curr_ptr + offs, mask=valid, other=0.0).to(ACC), 0.0)
    p = tl.where(valid, tl.load(prev_ptr + offs, mask=valid, other=0.0).to(ACC), 0.0)
    g = tl.where(valid, tl.load(gen_ptr + offs, mask=valid, other=0.0).to(ACC), 0.0)
    adv = tl.where(valid, tl.load(adv_ptr + offs, mask=valid, other=0.0).to(ACC), 0.0)
    clip_lo = tl.load(params_ptr + 0)
    clip_hi = tl.load(params_ptr + 1)

    # Ratio, clipped surrogate, and its derivative wrt curr (torch's tie rule: half each way).
    if FORCE_RATIO:  # exp(curr - sg(curr)): value 1, derivative 1, never clipped
        ratio = tl.full(c.shape, 1.0, ACC)
        ratio_clamped = ratio
        d_ratio = ratio
        d_clamped = ratio
    elif REINFORCE:
        ratio = c
        ratio_clamped = c
        d_ratio = tl.full(c.shape, 1.0, ACC)
        d_clamped = d_ratio
    else:
        if GSPO:  # exp(mean_t(curr - prev)) of the token's sequence, from the host; d/d(log ratio)
            ratio = tl.exp(tl.load(lr_ptr + offs, mask=valid, other=0.0).to(ACC))
        else:
            ratio = tl.exp(c - p)
        ratio_clamped = tl.minimum(tl.maximum(ratio, clip_lo), clip_hi)
        d_ratio = ratio
        d_clamped = tl.where((ratio >= clip_lo) & (ratio <= clip_hi), ratio, 0.0)
    loss1 = -adv * ratio
    loss2 = -adv * ratio_clamped
    if CISPO:  # -A * sg(r_c) * curr: the clipped ratio is a weight, the gradient is curr's
        pg = loss2 * c
        d_pg = -adv * ratio_clamped
    else:
        pg = tl.maximum(loss1, loss2)
        d1 = -adv * d_ratio
        d2 = -adv * d_clamped
        d_pg = tl.where(loss1 > loss2, d1, tl.where(loss2 > loss1, d2, 0.5 * (d1 + d2)))
    if DUAL_CLIP:
        loss3 = -adv * tl.load(params_ptr + 2)
        negative = adv < 0
        d_pg = tl.where(negative, tl.where(pg < loss3, d_pg, tl.where(pg > loss3, 0.0, 0.5 * d_pg)), d_pg)
        pg = tl.where(negative, tl.minimum(pg, loss3), pg)

    # Importance weight exp(prev - gen) (no gradient), truncated as configured; under GSPO the
    # host's per-sequence weight w_i, already truncated.
    if GSPO:
        weight = tl.load(isw_ptr + offs, mask=valid, other=0.0).to(ACC)
    else:
        weight = _finite_or_zero(tl.exp(p - g))
    oob = offs < 0  # all False
    if HAS_IS_LO:
        oob = oob | (weight < tl.load(params_ptr + 3))
    if HAS_IS_HI:
        oob = oob | (weight > tl.load(params_ptr + 4))
    if TRUNCATION == 1:
        if HAS_IS_LO:
            weight = tl.maximum(weight, tl.load(params_ptr + 3))
        if HAS_IS_HI:
            weight = tl.minimum(weight, tl.load(params_ptr + 4))
    elif TRUNCATION == 2:
        weight = tl.where(oob, 0.0, weight)
    elif TRUNCATION == 3:
        weight = weight * tl.load(seq_keep_ptr + seq, mask=in_range, other=0.0).to(ACC)
    if USE_IS:
        actor = weight * pg
        d_actor = weight * d_pg
    else:
        actor = pg
        d_actor = d_pg

    # KL(curr || ref) estimate with its clamps, and its derivative wrt curr.
    kl = tl.zeros(c.shape, dtype=ACC)
    d_kl = tl.zeros(c.shape, dtype=ACC)
    if HAS_KL:
        rf = tl.where(valid, tl.load(ref_ptr + offs, mask=valid, other=0.0).to(ACC), 0.0)
        logr = rf - c
        d_logr = tl.full(c.shape, -1.0, ACC)
        if KL_IN_CLAMP:
            kl_in = tl.load(params_ptr + 5)
            d_logr = tl.where((logr >= -kl_in) & (logr <= kl_in), d_logr, 0.0)
            logr = tl.minimum(tl.maximum(logr, -kl_in), kl_in)
        kl = _kl_value(logr, KL_TYPE)
        if KL_TYPE == 1:
            d_k = tl.full(c.shape, -1.0, ACC)
        elif KL_TYPE == 2:
            d_k = logr
        else:
            d_k = tl.exp(logr) - 1.0
        d_kl = d_k * d_logr  # dk/dcurr through logr (0 where the input clamp binds)
        if ON_POLICY_KL or KL_TRUE_GRAD:
            # weight omega = exp(curr - gen) (on-policy KL) or exp(curr - sg(curr)) = 1
            omega = tl.full(c.shape, 1.0, ACC)
            if ON_POLICY_KL:
                omega = _finite_or_zero(tl.exp(c - g))
            d_kl = d_kl * omega
            if KL_TRUE_GRAD:  # + k * d omega / d curr = k * omega, unless the input clamp binds
                d_kl = d_kl + tl.where(d_logr != 0.0, kl * omega, 0.0)
            kl = kl * omega
        if KL_OUT_CLAMP:
            kl_out = tl.load(params_ptr + 6)
            d_kl = tl.where((kl >= -kl_out) & (kl <= kl_out), d_kl, 0.0)
            kl = tl.minimum(tl.maximum(kl, -kl_out), kl_out)

    seq_weight = tl.full(c.shape, 1.0, ACC)
    if SEQ_LEVEL:
        seq_weight = tl.load(seq_weight_ptr + seq, mask=in_range, other=0.0).to(ACC)
    return (
        valid,
        c,
        p,
        g,
        ratio,
        ratio_clamped,
        loss1,
        loss2,
        weight,
        oob,
        seq_weight * actor,
        seq_weight * kl,
        seq_weight * d_actor,
        seq_weight * d_kl,
    )


@triton.jit
def _pg_loss_fwd_kernel(
    curr_ptr,
    prev_ptr,
    gen_ptr,
    ref_ptr,
    adv_ptr,
    token_mask_ptr,
    seq_mask_ptr,
    seq_weight_ptr,
    seq_keep_ptr,
    lr_ptr,
    isw_ptr,
    params_ptr,
    partials_ptr,
    counter_ptr,
    stats_ptr,
    n_tokens,
    row_len,
    REINFORCE: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    USE_IS: tl.constexpr,
    TRUNCATION: tl.constexpr,
    HAS_IS_LO: tl.constexpr,
    HAS_IS_HI: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TYPE: tl.constexpr,
    KL_IN_CLAMP: tl.constexpr,
    KL_OUT_CLAMP: tl.constexpr,
    ON_POLICY_KL: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    FORCE_RATIO: tl.constexpr,
    CISPO: tl.constexpr,
    KL_TRUE_GRAD: tl.constexpr,
    GSPO: tl.constexpr,
    N_SUMS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program pid writes partials[pid] (16 statistics of its BLOCK tokens); the last program
    to finish folds partials [n_programs, 16] into stats [16]."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    (valid, c, p, g, ratio, ratio_clamped, loss1, loss2, weight, oob, actor, kl, _, _) = _pg_token_terms(
        offs,
        curr_ptr,
        prev_ptr,
        gen_ptr,
        ref_ptr,
        adv_ptr,
        token_mask_ptr,
        seq_mask_ptr,
        seq_weight_ptr,
        seq_keep_ptr,
        lr_ptr,
        isw_ptr,
        params_ptr,
        n_tokens,
        row_len,
        REINFORCE,
        DUAL_CLIP,
        USE_IS,
        TRUNCATION,
        HAS_IS_LO,
        HAS_IS_HI,
        HAS_KL,
        KL_TYPE,
        KL_IN_CLAMP,
        KL_OUT_CLAMP,
        ON_POLICY_KL,
        SEQ_LEVEL,
        FORCE_RATIO,
        CISPO,
        KL_TRUE_GRAD,
        GSPO,
        ACC,
    )
    # Mismatch metrics between the trainer (prev) and the sampler (gen).
    log_mix = tl.maximum(p, g) + tl.log(0.5 * tl.exp(p - tl.maximum(p, g)) + 0.5 * tl.exp(g - tl.maximum(p, g)))
    a = p - log_mix
    b = g - log_mix
    js = 0.5 * (tl.exp(a) - a - 1.0) + 0.5 * (tl.exp(b) - b - 1.0)
    out = partials_ptr + pid * 16
    tl.store(out + 0, tl.sum(tl.where(valid, actor, 0.0), 0))
    tl.store(out + 1, tl.sum(tl.where(valid, kl, 0.0), 0))
    tl.store(out + 2, tl.sum(tl.where(valid, tl.exp(tl.abs(g - p)), 0.0), 0))
    tl.store(out + 3, tl.sum(tl.where(valid, _kl_value(p - g, KL_TYPE), 0.0), 0))
    tl.store(out + 4, tl.sum(tl.where(valid, _kl_value(g - p, KL_TYPE), 0.0), 0))
    tl.store(out + 5, tl.sum(tl.where(valid, js, 0.0), 0))
    tl.store(out + 6, tl.sum(tl.where(valid, weight, 0.0), 0))
    tl.store(out + 7, tl.sum(tl.where(valid, -tl.exp(c - g) * c, 0.0), 0))
    tl.store(out + 8, tl.sum(tl.where(valid, ratio, 0.0), 0))
    tl.store(out + 9, tl.sum(tl.where(valid, ratio_clamped, 0.0), 0))
    tl.store(out + 10, tl.sum(tl.where(valid & (loss2 > loss1), 1.0, 0.0), 0))
    tl.store(out + 11, tl.sum(tl.where(valid & oob, 1.0, 0.0), 0))
    tl.store(out + 12, tl.min(tl.where(valid, ratio, float("inf")), 0))
    tl.store(out + 13, tl.min(tl.where(valid, ratio_clamped, float("inf")), 0))
    tl.store(out + 14, tl.max(tl.where(valid, ratio, -float("inf")), 0))
    tl.store(out + 15, tl.max(tl.where(valid, ratio_clamped, -float("inf")), 0))
    # Barrier, then an acq_rel gpu-scope atomic: this program's row is visible to whichever
    # program sees the counter reach n_programs - 1, and that program reads every row.
    tl.debug_barrier()
    n_parts = tl.num_programs(0)
    finished_before = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if finished_before == n_parts - 1:
        _fold_partials(partials_ptr, stats_ptr, n_parts, N_SUMS, ACC, BLOCK_P)


@triton.jit
def _fold_partials(partials_ptr, stats_ptr, n_parts, N_SUMS: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr):
    """stats[k] = sum / min / max over the rows of partials [n_parts, 16], in row order."""
    cols = tl.arange(0, 16)
    rows0 = tl.arange(0, BLOCK_P)
    is_sum = cols < N_SUMS
    is_min = (cols >= N_SUMS) & (cols < N_SUMS + 2)
    acc_sum = tl.zeros([BLOCK_P, 16], dtype=ACC)
    acc_min = acc_sum + float("inf")
    acc_max = acc_sum - float("inf")
    for start in range(0, n_parts, BLOCK_P):
        rows = start + rows0
        inside = (rows < n_parts)[:, None]
        # .cg: read from L2, where the other programs' rows are (never a stale L1 line).
        tile = tl.load(partials_ptr + rows[:, None] * 16 + cols[None, :], mask=inside, other=0.0, cache_modifier=".cg")
        acc_sum += tile
        acc_min = tl.minimum(acc_min, tl.where(inside, tile, float("inf")))
        acc_max = tl.maximum(acc_max, tl.where(inside, tile, -float("inf")))
    stats = tl.where(is_sum, tl.sum(acc_sum, 0), tl.where(is_min, tl.min(acc_min, 0), tl.max(acc_max, 0)))
    tl.store(stats_ptr + cols, stats)


@triton.jit
def _pg_loss_bwd_kernel(
    curr_ptr,
    prev_ptr,
    gen_ptr,
    ref_ptr,
    adv_ptr,
    token_mask_ptr,
    seq_mask_ptr,
    seq_weight_ptr,
    seq_keep_ptr,
    lr_ptr,
    isw_ptr,
    params_ptr,
    grad_stats_ptr,
    grad_curr_ptr,
    grad_lr_ptr,
    n_tokens,
    row_len,
    REINFORCE: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    USE_IS: tl.constexpr,
    TRUNCATION: tl.constexpr,
    HAS_IS_LO: tl.constexpr,
    HAS_IS_HI: tl.constexpr,
    HAS_KL: tl.constexpr,
    KL_TYPE: tl.constexpr,
    KL_IN_CLAMP: tl.constexpr,
    KL_OUT_CLAMP: tl.constexpr,
    ON_POLICY_KL: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    FORCE_RATIO: tl.constexpr,
    CISPO: tl.constexpr,
    KL_TRUE_GRAD: tl.constexpr,
    GSPO: tl.constexpr,
    ACTOR_TO_LR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    (valid, _, _, _, _, _, _, _, _, _, _, _, d_actor, d_kl) = _pg_token_terms(
        offs,
        curr_ptr,
        prev_ptr,
        gen_ptr,
        ref_ptr,
        adv_ptr,
        token_mask_ptr,
        seq_mask_ptr,
        seq_weight_ptr,
        seq_keep_ptr,
        lr_ptr,
        isw_ptr,
        params_ptr,
        n_tokens,
        row_len,
        REINFORCE,
        DUAL_CLIP,
        USE_IS,
        TRUNCATION,
        HAS_IS_LO,
        HAS_IS_HI,
        HAS_KL,
        KL_TYPE,
        KL_IN_CLAMP,
        KL_OUT_CLAMP,
        ON_POLICY_KL,
        SEQ_LEVEL,
        FORCE_RATIO,
        CISPO,
        KL_TRUE_GRAD,
        GSPO,
        ACC,
    )
    # Only the two loss sums carry gradient; the metrics are detached. GSPO's actor term depends
    # on curr through the sequence log-ratio: its gradient goes there, and torch on the host
    # carries it back to the sequence's tokens.
    g_actor = tl.load(grad_stats_ptr + 0).to(ACC) * d_actor
    grad = tl.load(grad_stats_ptr + 1).to(ACC) * d_kl
    if ACTOR_TO_LR:
        tl.store(grad_lr_ptr + offs, tl.where(valid, g_actor, 0.0), mask=offs < n_tokens)
    else:
        grad = grad + g_actor
    tl.store(grad_curr_ptr + offs, tl.where(valid, grad, 0.0), mask=offs < n_tokens)


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _params(config: PGLossConfig, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The config's float constants as a device tensor of the accumulation dtype (exact in
    float64, where Triton's float arguments would be rounded to float32)."""
    c = config
    values = [
        1.0 - c.ratio_clip_min,
        1.0 + c.ratio_clip_max,
        c.ratio_clip_c or 0.0,
        c.truncated_importance_sampling_ratio_min or 0.0,
        c.truncated_importance_sampling_ratio or 0.0,
        c.kl_input_clamp_value or 0.0,
        c.kl_output_clamp_value or 0.0,
        c.reference_policy_kl_penalty,
    ]
    return torch.tensor(values, dtype=dtype, device=device)


def _flags(config: PGLossConfig) -> dict:
    c = config
    flags = dict(
        REINFORCE=c.disable_ppo_ratio,
        DUAL_CLIP=c.ratio_clip_c is not None,
        USE_IS=c.use_importance_sampling_correction,
        TRUNCATION=TRUNCATION_CODES[c.truncated_importance_sampling_type],
        HAS_IS_LO=c.truncated_importance_sampling_ratio_min is not None,
        HAS_IS_HI=c.truncated_importance_sampling_ratio is not None,
        HAS_KL=c.reference_policy_kl_penalty != 0,
        KL_TYPE=KL_CODES[c.reference_policy_kl_type],
        KL_IN_CLAMP=c.kl_input_clamp_value is not None,
        KL_OUT_CLAMP=c.kl_output_clamp_value is not None,
        ON_POLICY_KL=c.use_on_policy_kl_approximation,
        SEQ_LEVEL=c.loss_aggregation == "seq-mean-token-mean",
        FORCE_RATIO=c.force_on_policy_ratio,
        CISPO=c.use_cispo,
        KL_TRUE_GRAD=c.kl_true_gradient,
        GSPO=c.sequence_level_importance_ratios,
    )
    if c.sequence_level_importance_ratios:  # the host truncates the sequence weights
        flags.update(TRUNCATION=0, HAS_IS_LO=False, HAS_IS_HI=False)
    return flags


def _actor_to_log_ratio(config: PGLossConfig) -> bool:
    """GSPO's clipped surrogate differentiates through the sequence log-ratio (not CISPO's
    detached weight, not REINFORCE's curr)."""
    return config.sequence_level_importance_ratios and not (config.use_cispo or config.disable_ppo_ratio)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def pg_loss_fwd(tokens: dict, config: PGLossConfig, block: int = BLOCK) -> torch.Tensor:
    """tokens: flat [N] curr/prev/gen/ref/advantages/token_mask, seq_mask/seq_weight/seq_keep
    indexed by token // row_len, and row_len. -> unnormalised statistics [16] (see STATS)."""
    curr = tokens["curr"]
    n_tokens = curr.numel()
    acc_dtype = R.work_dtype(curr.dtype)
    n_blocks = max(1, triton.cdiv(n_tokens, block))
    partials = torch.empty((n_blocks, N_STATS), dtype=acc_dtype, device=curr.device)
    stats = torch.empty(N_STATS, dtype=acc_dtype, device=curr.device)
    # A fresh counter per call (a 4-byte memset, not a kernel of ours): safe across streams and
    # CUDA graphs, where a cached self-resetting counter would be shared.
    counter = torch.zeros(1, dtype=torch.int32, device=curr.device)
    _pg_loss_fwd_kernel[(n_blocks,)](
        *_pointers(tokens),
        _params(config, curr.device, acc_dtype),
        partials,
        counter,
        stats,
        n_tokens,
        tokens["row_len"],
        **_flags(config),
        N_SUMS=N_SUMS,
        ACC=_acc(curr.dtype),
        BLOCK=block,
        BLOCK_P=min(REDUCE_BLOCK, triton.next_power_of_2(n_blocks)),
    )
    return stats


def pg_loss_bwd(tokens: dict, config: PGLossConfig, grad_stats: torch.Tensor, block: int = BLOCK):
    """-> (d loss / d curr [N] in curr's dtype, d loss / d log_ratio [N] under GSPO else None),
    for the upstream gradient of the statistics."""
    curr = tokens["curr"]
    n_tokens = curr.numel()
    acc_dtype = R.work_dtype(curr.dtype)
    grad_curr = torch.empty_like(curr)
    to_lr = _actor_to_log_ratio(config)
    grad_lr = torch.empty_like(tokens["log_ratio"]) if to_lr else None
    if n_tokens == 0:
        return grad_curr, grad_lr
    _pg_loss_bwd_kernel[(triton.cdiv(n_tokens, block),)](
        *_pointers(tokens),
        _params(config, curr.device, acc_dtype),
        grad_stats.contiguous(),
        grad_curr,
        grad_lr if to_lr else grad_curr,
        n_tokens,
        tokens["row_len"],
        **_flags(config),
        ACTOR_TO_LR=to_lr,
        ACC=_acc(curr.dtype),
        BLOCK=block,
    )
    return grad_curr, grad_lr


def _pointers(tokens: dict) -> tuple:
    curr = tokens["curr"]
    ref = tokens["ref"] if tokens["ref"] is not None else curr
    seq_weight = tokens["seq_weight"] if tokens["seq_weight"] is not None else curr
    seq_keep = tokens["seq_keep"] if tokens["seq_keep"] is not None else curr
    log_ratio = tokens.get("log_ratio") if tokens.get("log_ratio") is not None else curr
    is_weight = tokens.get("is_weight") if tokens.get("is_weight") is not None else curr
    return (
        curr,
        tokens["prev"],
        tokens["gen"],
        ref,
        tokens["advantages"],
        tokens["token_mask"],
        tokens["seq_mask"],
        seq_weight,
        seq_keep,
        log_ratio,
        is_weight,
    )


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd Function
# ----------------------------------------------------------------------------------------------
class ClippedPGLossFunction(torch.autograd.Function):
    """curr [N] (and GSPO's per-token sequence log-ratio [N]) -> statistics [16] (STATS); only
    actor_sum and kl_sum carry gradient."""

    @staticmethod
    def forward(ctx, curr, log_ratio, tokens, config, block):
        tokens = dict(tokens, curr=curr, log_ratio=log_ratio)
        stats = pg_loss_fwd(tokens, config, block)
        ctx.tokens, ctx.config, ctx.block = tokens, config, block
        ctx.save_for_backward(curr, log_ratio)
        return stats

    @staticmethod
    def backward(ctx, grad_stats):
        curr, log_ratio = ctx.saved_tensors
        tokens = dict(ctx.tokens, curr=curr, log_ratio=log_ratio)
        grad_curr, grad_lr = pg_loss_bwd(tokens, ctx.config, grad_stats, ctx.block)
        return grad_curr, grad_lr, None, None, None


# ----------------------------------------------------------------------------------------------
# Layer 4: the op
# ----------------------------------------------------------------------------------------------
def _mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _count(value, name: str):
    """Global count as a Python float or a 0-dim tensor, floored at 1 (no host sync)."""
    if isinstance(value, torch.Tensor):
        return R.global_count(
            value, name, value.device, torch.float64 if value.dtype == torch.float64 else torch.float32
        )
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: expected a non-negative count of the global batch")
    return max(float(value), 1.0)


def unsupported(config: PGLossConfig) -> str | None:
    """The option of `config` this kernel does not implement, or None. VAPO's NLL term needs a
    per-sequence positive mask and a statistic of its own; it runs on the reference (`dispatch`
    logs the route)."""
    if config.positive_example_nll_weight != 0:
        return "positive_example_nll_weight"
    return None


def _gspo_extras(curr, prev, gen, token_mask, sample_mask, config, n_seqs, cu):
    """GSPO's per-sequence terms, computed by torch on the host (the "second pass"):
    -> log_ratio [N] = mean_t(curr - prev) of each token's sequence (differentiable: the
    kernel's gradient wrt it flows back to curr through torch), the truncated sequence weight
    w_i = exp(sum_t m (prev - gen)) per token [N], and the per-sequence metrics (sums of the
    weights and of the out-of-bounds flags over the valid sequences)."""
    seq_id, valid = R.token_layout(curr, token_mask, sample_mask, n_seqs, cu)
    wd = R.work_dtype(curr.dtype)

    def seq_sum(t):
        return torch.zeros(n_seqs + 1, dtype=t.dtype, device=t.device).index_add(0, seq_id, t)

    counts = seq_sum(valid.to(wd)).clamp_min(1.0)
    diff = torch.where(valid, curr.reshape(-1).to(wd) - prev.reshape(-1).to(wd), 0.0)
    log_ratio = (seq_sum(diff) / counts)[seq_id]
    with torch.no_grad():
        lo, hi = config.truncated_importance_sampling_ratio_min, config.truncated_importance_sampling_ratio
        log_w = torch.where(valid, prev.reshape(-1).to(wd) - gen.reshape(-1).to(wd), 0.0)
        weight = torch.nan_to_num(torch.exp(seq_sum(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
        outside = torch.zeros_like(weight, dtype=torch.bool)
        if lo is not None:
            outside |= weight < lo
        if hi is not None:
            outside |= weight > hi
        kind = config.truncated_importance_sampling_type
        if kind == "tis":
            weight = weight.clamp(lo, hi)
        elif kind == "icepop":
            weight = torch.where(outside, 0.0, weight)
        sample_ok = sample_mask.reshape(-1) != 0
        weight_sum = torch.where(sample_ok, weight[:-1], 0.0).sum()
        oob_sum = (outside[:-1] & sample_ok).sum().to(wd) if kind is not None else None
    return log_ratio, weight[seq_id].contiguous(), weight_sum, oob_sum


def _sequence_extras(curr, prev, gen, token_mask, sample_mask, config, n_seqs, cu):
    """Per-sequence inputs the token kernel cannot compute: -> seq_weight (1 / valid tokens of
    the sequence), seq_keep (seq-mask-tis), oob (seq-mask-tis count) and the token layout."""
    seq_id, valid = R.token_layout(curr, token_mask, sample_mask, n_seqs, cu)
    wd = R.work_dtype(curr.dtype)
    counts = torch.zeros(n_seqs + 1, dtype=wd, device=curr.device).index_add_(0, seq_id, valid.to(wd))
    seq_weight = 1.0 / counts.clamp_min(1.0)
    seq_keep = oob = None
    if config.truncated_importance_sampling_type == "seq-mask-tis":
        log_w = torch.nan_to_num(prev.reshape(-1).to(wd) - gen.reshape(-1).to(wd), nan=0.0, posinf=0.0, neginf=0.0)
        sums = torch.zeros_like(counts).index_add_(0, seq_id, torch.where(valid, log_w, 0.0))
        geo_mean = torch.exp(sums * seq_weight)
        outside = torch.zeros_like(geo_mean, dtype=torch.bool)
        if config.truncated_importance_sampling_ratio_min is not None:
            outside |= geo_mean < config.truncated_importance_sampling_ratio_min
        if config.truncated_importance_sampling_ratio is not None:
            outside |= geo_mean > config.truncated_importance_sampling_ratio
        seq_keep = (~outside).to(wd)
        oob = (outside[:-1] & (sample_mask.reshape(-1) != 0)).sum().to(wd)
    return seq_id, seq_weight, seq_keep, oob


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
    *,
    block: int = BLOCK,
):
    """Same contract as `reference.clipped_pg_loss`, except the options of `unsupported`
    (refused: `dispatch` sends them to the reference)."""
    n_seqs, cu = R.check_pg_inputs(curr, prev, gen, ref, advantages, token_mask, sample_mask, config, cu_seqlens)
    why = unsupported(config)
    if why is not None:
        raise ValueError(f"config: {why} is served by reference.clipped_pg_loss")
    g_tok = _count(global_valid_tokens, "global_valid_tokens")
    g_seq = _count(global_valid_seqs, "global_valid_seqs")
    seq_level = config.loss_aggregation == "seq-mean-token-mean"
    needs_sequences = seq_level or config.truncated_importance_sampling_type == "seq-mask-tis"
    tokens = dict(
        prev=prev.reshape(-1).contiguous(),
        gen=gen.reshape(-1).contiguous(),
        ref=None if ref is None or not config.reference_policy_kl_penalty else ref.reshape(-1).contiguous(),
        advantages=advantages.reshape(-1).contiguous(),
        token_mask=_mask_bytes(token_mask.reshape(-1).contiguous()),
        seq_mask=_mask_bytes(sample_mask.contiguous()),
        seq_weight=None,
        seq_keep=None,
        is_weight=None,
        row_len=curr.shape[1] if curr.dim() == 2 else 1,
    )
    oob = None
    if cu is not None or needs_sequences:
        seq_id, seq_weight, seq_keep, oob = _sequence_extras(
            curr, prev, gen, token_mask, sample_mask, config, n_seqs, cu
        )
        if cu is not None:  # packed: index everything per token
            sample_ok = torch.cat([sample_mask.reshape(-1) != 0, sample_mask.new_zeros(1, dtype=torch.bool)])
            tokens["seq_mask"] = _mask_bytes(sample_ok[seq_id])
            seq_weight = seq_weight[seq_id]
            seq_keep = None if seq_keep is None else seq_keep[seq_id]
        tokens["seq_weight"] = seq_weight.contiguous() if seq_level else None
        tokens["seq_keep"] = None if seq_keep is None else seq_keep.contiguous()

    log_ratio = None
    if config.sequence_level_importance_ratios:
        log_ratio, tokens["is_weight"], weight_sum, gspo_oob = _gspo_extras(
            curr, prev, gen, token_mask, sample_mask, config, n_seqs, cu
        )
        oob = gspo_oob
    stats = ClippedPGLossFunction.apply(curr.reshape(-1), log_ratio, tokens, config, block)
    g_loss = R.loss_normaliser(config, g_tok, g_seq)
    actor_loss = stats[0] / g_loss
    kl = stats[1] / g_loss
    loss = actor_loss + config.reference_policy_kl_penalty * kl
    with torch.no_grad():
        means = (stats[2:N_SUMS] / g_tok).float()
        metrics = dict(zip(STATS[2:N_SUMS], means.unbind()))
        if oob is not None:
            metrics["is_oob_fraction"] = (oob / g_seq).float()
        if config.sequence_level_importance_ratios:  # one weight per sequence: mean over sequences
            metrics["sampling_importance_ratio"] = (weight_sum / g_seq).float()
        metrics.update(zip(STATS[N_SUMS:], stats[N_SUMS:].float().unbind()))
        metrics.update(
            kl_penalty=kl.detach().float(),
            actor_loss=actor_loss.detach().float(),
            positive_nll=torch.zeros((), device=curr.device),
            loss=loss.detach().float(),
        )
    return loss, metrics
