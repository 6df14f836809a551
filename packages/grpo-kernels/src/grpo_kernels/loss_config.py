"""Options of the clipped policy-gradient loss (shared/GRPO-MATH.md), with NeMo RL's key names.

A plain frozen dataclass so that validating a config imports no torch; grpo-train's pydantic
config builds one of these from its `loss_fn` section. Combinations the loss cannot honour are
refused here, at config time, never half-applied at step time.
"""

from __future__ import annotations

from dataclasses import dataclass

KL_TYPES = ("k1", "k2", "k3")
TRUNCATION_TYPES = ("tis", "icepop", "seq-mask-tis")


@dataclass(frozen=True)
class PGLossConfig:
    """Clipped PG loss with KL, as in NeMo RL's `ClippedPGLossConfig`.

    ratio_clip_min / ratio_clip_max: r is clamped to [1 - ratio_clip_min, 1 + ratio_clip_max].
    ratio_clip_c: dual-clip bound c (> 1) applied where the advantage is negative; None = off.
    reference_policy_kl_penalty: beta; 0 skips the KL term and `ref` may then be None.
    reference_policy_kl_type: "k1", "k2" or "k3" (Schulman's estimators of KL(curr || ref)).
    kl_input_clamp_value: clamp of log(ref/curr) before the estimator; None = no clamp.
    kl_output_clamp_value: clamp of the per-token KL after the estimator; None = no clamp.
    use_on_policy_kl_approximation: weight the per-token KL by exp(curr - gen) (detached).
    use_importance_sampling_correction: weight the actor loss by w = exp(prev - gen) (detached).
    truncated_importance_sampling_type: "tis" (clamp w), "icepop" (zero tokens with w out of
        bounds) or "seq-mask-tis" (zero sequences whose geometric-mean w is out of bounds).
    truncated_importance_sampling_ratio: upper bound of w for the truncation; None = no bound.
    truncated_importance_sampling_ratio_min: lower bound of w for the truncation; None = none.
    token_level_loss: mean over all valid tokens of the global batch (True) or mean over
        sequences of the per-sequence token mean (False).
    sequence_level_importance_ratios: GSPO, one ratio exp(mean_t(curr - prev)) per sequence.
    disable_ppo_ratio: REINFORCE, the "ratio" is curr itself and nothing is clipped.
    """

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    disable_ppo_ratio: bool = False

    def __post_init__(self) -> None:
        def refuse(field: str, expected: str) -> None:
            raise ValueError(f"PGLossConfig.{field}={getattr(self, field)!r}: {expected}")

        if self.ratio_clip_min < 0 or self.ratio_clip_min >= 1:
            refuse("ratio_clip_min", "expected 0 <= ratio_clip_min < 1 (r is clamped at 1 - it)")
        if self.ratio_clip_max < 0:
            refuse("ratio_clip_max", "expected ratio_clip_max >= 0")
        if self.ratio_clip_c is not None and not self.ratio_clip_c > 1:
            refuse("ratio_clip_c", "the dual-clip bound must be > 1, or None to disable it")
        if self.reference_policy_kl_penalty < 0:
            refuse("reference_policy_kl_penalty", "expected beta >= 0")
        if self.reference_policy_kl_type not in KL_TYPES:
            refuse("reference_policy_kl_type", f"expected one of {KL_TYPES}")
        for clamp in ("kl_input_clamp_value", "kl_output_clamp_value"):
            if getattr(self, clamp) is not None and not getattr(self, clamp) > 0:
                refuse(clamp, "expected a positive clamp, or None for no clamp")
        if self.sequence_level_importance_ratios and self.token_level_loss:
            refuse(
                "sequence_level_importance_ratios",
                "GSPO sequence-level ratios need token_level_loss=False",
            )
        self._check_truncation(refuse)

    def _check_truncation(self, refuse) -> None:
        kind = self.truncated_importance_sampling_type
        hi = self.truncated_importance_sampling_ratio
        lo = self.truncated_importance_sampling_ratio_min
        if kind is None:
            if hi is not None:
                refuse("truncated_importance_sampling_ratio", "set without a truncation type")
            if lo is not None:
                refuse("truncated_importance_sampling_ratio_min", "set without a truncation type")
            return
        if kind not in TRUNCATION_TYPES:
            refuse("truncated_importance_sampling_type", f"expected one of {TRUNCATION_TYPES}")
        if not self.use_importance_sampling_correction:
            refuse(
                "truncated_importance_sampling_type",
                "truncation needs use_importance_sampling_correction=True",
            )
        if hi is None and lo is None:
            refuse("truncated_importance_sampling_ratio", "a truncation type needs a bound")
        if hi is not None and not hi > 0:
            refuse("truncated_importance_sampling_ratio", "expected a positive upper bound")
        if lo is not None and lo < 0:
            refuse("truncated_importance_sampling_ratio_min", "expected a lower bound >= 0")
        if hi is not None and lo is not None and lo > hi:
            refuse("truncated_importance_sampling_ratio_min", f"exceeds the upper bound {hi}")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            refuse(
                "truncated_importance_sampling_type",
                "seq-mask-tis masks sequences by token-level weights; it excludes GSPO ratios",
            )
