"""The refit check: trainer and engine score the same probe tokens after a push, and the gate.

Job: the statistics of trainer vs generator logprobs on a probe batch (`refit_stats`), the
per-precision default limits and probe sizes, and the gate that stops a run whose engine is not
running the trainer's weights (`gate_refit`, `RefitMismatchError`). The loop decides when to
check and what probe to score (`train_step.check_refit`).
Boundary: plain floats in, no torch, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RefitStats:
    """Trainer vs generator logprobs of the same probe tokens after a weight push.

    Per token d = trainer - generator logprob. `token_mult_prob_error` = mean(exp|d|) and
    `gen_kl_error` = mean(k3(gen || trainer)) = mean(e^d - 1 - d) are the training metrics of
    the same names (GRPO-MATH.md) on the probe. `seq_logratio_rms` = sqrt(sum_s D_s^2 / sum_s L_s),
    D_s the sum of d over sequence s (its log importance ratio log pi_trainer(y)/pi_generator(y)),
    L_s its token count: a broken refit moves every token of a sequence the same way, so D_s grows
    like L_s, while a healthy pair's rounding noise has no sign and largely cancels (the normalisation
    by sqrt(L) keeps noise of independent tokens length-free). `worst` is the token of the largest
    |d|: (sequence, token, trainer value, generator value)."""

    max_abs_diff: float
    mean_abs_diff: float
    token_mult_prob_error: float
    gen_kl_error: float
    tokens: int
    worst: tuple[int, int, float, float] | None
    seq_logratio_rms: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "refit/max_abs_logprob_diff": self.max_abs_diff,
            "refit/mean_abs_logprob_diff": self.mean_abs_diff,
            "refit/seq_logratio_rms": self.seq_logratio_rms,
            "refit/token_mult_prob_error": self.token_mult_prob_error,
            "refit/gen_kl_error": self.gen_kl_error,
        }


@dataclass(frozen=True)
class RefitLimits:
    """Thresholds of the refit gate (None: that statistic is not gated)."""

    max_abs_diff: float | None
    mean_abs_diff: float | None
    seq_logratio_rms: float | None = None


# Defaults per compute precision of the trainer/engine pair (the lower one decides), measured
# on the bundled demo model (benchmarks/results/refit_gate_bf16.md, 3 seeds). Healthy fp32 pairs
# agree to ~1e-5 on the worst token (mean ~1e-6), so one token off by 1e-3 is a broken refit. A
# healthy bf16 pair differs by up to ~0.29 on rare low-probability tokens and by a mean |d| of up
# to 0.017, while one tensor skipped for 10 steps gives a mean of only 0.025-0.076: no per-token
# statistic separates them by more than ~1.5x. The per-sequence log-ratio RMS does best (healthy
# <= 0.038, skipped >= 0.069, stale >= 1.08, fp8 cast >= 0.15): gated at 0.05; the mean stays
# gated at 0.05 as a backstop.
DEFAULT_LIMITS = {
    "float32": RefitLimits(max_abs_diff=1e-3, mean_abs_diff=1e-4),
    "bfloat16": RefitLimits(max_abs_diff=None, mean_abs_diff=0.05, seq_logratio_rms=0.05),
    "float16": RefitLimits(max_abs_diff=None, mean_abs_diff=0.05, seq_logratio_rms=0.05),
}
# Probe sequences per refit check: bf16's statistics are noisy over few sequences. Resampling the
# measured probes (3 seeds, 10 steps): 32 sequences let a healthy pair exceed seq_logratio_rms 0.05
# in up to 1.8% of checks, 64 in none of 400, while a skipped tensor still trips in 99.8%; 4 (the
# fp32 default) would stop a healthy bf16 run in up to 25% of checks.
DEFAULT_PROBE_SEQUENCES = {"float32": 4, "bfloat16": 64, "float16": 64}

_ORDER = ("float32", "float16", "bfloat16")  # increasing rounding error


def gate_precision(*precisions: str) -> str:
    """The precision whose defaults gate a trainer/engine pair: the coarser of the two."""
    return max(precisions, key=_ORDER.index)


class RefitMismatchError(RuntimeError):
    """The generator's logprobs disagree with the trainer's after a weight push."""

    def __init__(self, stats: RefitStats, statistic: str, threshold: float) -> None:
        self.stats, self.statistic, self.threshold = stats, statistic, threshold
        self.max_abs_diff = stats.max_abs_diff
        self.where = stats.worst[:2] if stats.worst is not None else None
        value = getattr(stats, statistic)
        location = ""
        if stats.worst is not None:
            i, j, a, b = stats.worst
            location = (
                f"; worst token: sequence {i}, token {j} (trainer {a:.6f}, generator {b:.6f}, "
                f"|diff| {stats.max_abs_diff:.3g})"
            )
        super().__init__(
            f"refit check failed: {statistic} of |trainer - generator| logprobs over {stats.tokens} probe "
            f"tokens is {value:.3g} > threshold {threshold:.3g} (grpo.refit_check.{_KEYS[statistic]})"
            f"{location}. The generator is not running the trainer's weights (a missed tensor, a stale "
            f"tied lm_head or prefix cache, a wrong dtype cast) or the two disagree on temperature or dtype."
        )


_KEYS = {
    "max_abs_diff": "max_abs_logprob_diff",
    "mean_abs_diff": "max_mean_abs_logprob_diff",
    "seq_logratio_rms": "max_seq_logratio_rms",
}


def refit_stats(trainer_logprobs: list[list[float]], generator_logprobs: list[list[float]]) -> RefitStats:
    """The statistics of a probe batch; both inputs are per-sequence lists of per-token
    logprobs of the same tokens. A NaN anywhere counts as an infinite difference."""
    if len(trainer_logprobs) != len(generator_logprobs):
        raise ValueError(
            f"refit check: {len(trainer_logprobs)} trainer sequences vs {len(generator_logprobs)} generator sequences"
        )
    worst, where, n, total, mult, kl, squares = 0.0, None, 0, 0.0, 0.0, 0.0, 0.0
    for i, (a_seq, b_seq) in enumerate(zip(trainer_logprobs, generator_logprobs)):
        seq_sum = 0.0
        if len(a_seq) != len(b_seq):
            raise ValueError(
                f"refit check: sequence {i} has {len(a_seq)} trainer logprobs but {len(b_seq)} generator logprobs"
            )
        for j, (a, b) in enumerate(zip(a_seq, b_seq)):
            d = float(a) - float(b)
            diff = math.inf if math.isnan(d) else abs(d)
            n, total = n + 1, total + diff
            seq_sum += d if not math.isnan(d) else math.inf
            mult += math.exp(min(diff, 700.0))
            kl += math.inf if not math.isfinite(d) or d > 700 else math.exp(d) - 1.0 - d
            if diff > worst or where is None:
                worst, where = diff, (i, j, float(a), float(b))
        squares += seq_sum * seq_sum
    count = max(n, 1)
    return RefitStats(
        worst,
        total / count,
        mult / count if n else 1.0,
        kl / count,
        n,
        where,
        math.sqrt(squares / count) if math.isfinite(squares) else math.inf,
    )


def gate_refit(
    trainer_logprobs: list[list[float]], generator_logprobs: list[list[float]], limits: RefitLimits
) -> RefitStats:
    """`refit_stats`, raising `RefitMismatchError` when a gated statistic exceeds its limit."""
    stats = refit_stats(trainer_logprobs, generator_logprobs)
    for statistic in ("max_abs_diff", "mean_abs_diff", "seq_logratio_rms"):
        threshold = getattr(limits, statistic)
        if threshold is not None and not getattr(stats, statistic) <= threshold:
            raise RefitMismatchError(stats, statistic, threshold)
    return stats


def check_refit(trainer_logprobs: list[list[float]], generator_logprobs: list[list[float]], threshold: float) -> float:
    """Max absolute logprob difference over a probe batch; raises `RefitMismatchError` above
    `threshold` (the max-only gate of `gate_refit`)."""
    return gate_refit(trainer_logprobs, generator_logprobs, RefitLimits(threshold, None)).max_abs_diff


__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_PROBE_SEQUENCES",
    "RefitLimits",
    "RefitMismatchError",
    "RefitStats",
    "check_refit",
    "gate_precision",
    "gate_refit",
    "refit_stats",
]
