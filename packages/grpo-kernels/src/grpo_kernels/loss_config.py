"""Options of the clipped policy-gradient loss (shared/GRPO-MATH.md), with NeMo RL's key names.

A plain frozen dataclass so that validating a config imports no torch; grpo-train's pydantic
config builds one of these from its `loss_fn` section. Combinations the loss cannot honour are
refused here, at config time, never half-applied at step time, with a LossOptionError naming
the key. Formulas and papers of every option: docs/algorithms.md (section Loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The choices are Literal types so that grpo-train's pydantic `loss_fn` section, which takes its
# fields from this class, refuses a wrong name at its key path with the list of choices.
KLType = Literal["k1", "k2", "k3"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]
# verl's `loss_agg_mode` names (docs/algorithms.md has the formulas).
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KL_TYPES: tuple[str, ...] = get_args(KLType)
TRUNCATION_TYPES: tuple[str, ...] = get_args(TruncationType)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


class LossOptionError(ValueError):
    """A refused loss option; `field` is the PGLossConfig (= `loss_fn`) key it names."""

    def __init__(self, field: str, value, expected: str):
        self.field, self.reason = field, expected
        super().__init__(f"PGLossConfig.{field}={value!r}: {expected}")


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
    token_level_loss: True = loss_aggregation "token-mean", False = "seq-mean-token-mean";
        None follows loss_aggregation (token-mean when both are None). Resolved to a bool.
    loss_aggregation: how per-token terms become the loss (verl's loss_agg_mode): "token-mean",
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm" (Dr.GRPO);
        None follows token_level_loss. Resolved to a name.
    loss_scale_factor: the constant length L of "seq-mean-token-sum-norm" (verl's key; e.g. the
        maximum response length). Required by that mode, refused by the others.
    sequence_level_importance_ratios: GSPO, one ratio exp(mean_t(curr - prev)) per sequence, and
        one train/inference weight exp(sum_t (prev - gen)) per sequence.
    disable_ppo_ratio: REINFORCE, the "ratio" is curr itself and nothing is clipped.
    force_on_policy_ratio: the ratio is exp(curr - sg(curr)) = 1 with the gradient of curr, never
        clipped (NeMo RL's key; for one optimizer step per rollout).
    use_cispo: CISPO (MiniMax-M1): per token -A * sg(clamp(r, 1 - min, 1 + max)) * curr.
    kl_true_gradient: keep the KL term's importance weight in the graph (exp(curr - gen) with
        on-policy KL, else exp(curr - sg(curr)) = 1), so the KL gradient is the gradient of
        KL(curr || ref) itself (arXiv 2506.09477; NeMo RL >= 0.7). False detaches it.
    positive_example_nll_weight: mu of VAPO's NLL term on positive-advantage sequences,
        mu * aggregate(-curr * [mean_t A_i > 0]); 0 = off.
    """

    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: KLType = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: TruncationType | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool | None = None
    sequence_level_importance_ratios: bool = False
    disable_ppo_ratio: bool = False
    loss_aggregation: Aggregation | None = None
    loss_scale_factor: float | None = None
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    kl_true_gradient: bool = True
    positive_example_nll_weight: float = 0.0

    def __post_init__(self) -> None:
        def refuse(field: str, expected: str) -> None:
            raise LossOptionError(field, getattr(self, field), expected)

        self._resolve_aggregation(refuse)

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
        if self.sequence_level_importance_ratios and self.loss_aggregation != "seq-mean-token-mean":
            refuse(
                "sequence_level_importance_ratios",
                "GSPO's objective is a mean over sequences of one term each: it needs "
                f"token_level_loss=False (loss_aggregation seq-mean-token-mean), not {self.loss_aggregation}",
            )
        if not self.positive_example_nll_weight >= 0:
            refuse("positive_example_nll_weight", "expected mu >= 0 (0 turns the NLL term off)")
        self._check_ratio_variants(refuse)
        self._check_truncation(refuse)

    def _resolve_aggregation(self, refuse) -> None:
        """Fill token_level_loss and loss_aggregation from each other (frozen: object.__setattr__)."""
        agg, tok = self.loss_aggregation, self.token_level_loss
        if agg is not None and agg not in AGGREGATIONS:
            refuse("loss_aggregation", f"expected one of {AGGREGATIONS}")
        if agg is None:
            agg = "token-mean" if tok is None or tok else "seq-mean-token-mean"
        if tok is not None and tok != (agg == "token-mean"):
            refuse(
                "loss_aggregation",
                f"contradicts token_level_loss={tok} (True means token-mean, "
                "False seq-mean-token-mean); set only one of the two",
            )
        object.__setattr__(self, "loss_aggregation", agg)
        object.__setattr__(self, "token_level_loss", agg == "token-mean")
        if agg == "seq-mean-token-sum-norm":
            if self.loss_scale_factor is None or not self.loss_scale_factor > 0:
                refuse(
                    "loss_scale_factor",
                    "seq-mean-token-sum-norm divides by this constant length "
                    "(Dr.GRPO): expected a number > 0, e.g. the maximum response length",
                )
        elif self.loss_scale_factor is not None:
            refuse("loss_scale_factor", "only loss_aggregation seq-mean-token-sum-norm uses it")

    def _check_ratio_variants(self, refuse) -> None:
        if self.force_on_policy_ratio:
            for other in ("disable_ppo_ratio", "sequence_level_importance_ratios", "use_cispo"):
                if getattr(self, other):
                    refuse("force_on_policy_ratio", f"replaces the ratio, and so does {other}; choose one")
            if self.ratio_clip_c is not None:
                refuse(
                    "force_on_policy_ratio",
                    "the ratio is 1, so the dual clip ratio_clip_c never binds; set ratio_clip_c to null",
                )
        if self.use_cispo:
            if self.disable_ppo_ratio:
                refuse("use_cispo", "CISPO clips the importance ratio; disable_ppo_ratio has none")
            if self.sequence_level_importance_ratios:
                refuse(
                    "use_cispo",
                    "CISPO clips token-level ratios; GSPO (sequence_level_importance_ratios) "
                    "replaces them by one per sequence (NeMo RL refuses this pair too)",
                )
            if self.ratio_clip_c is not None:
                refuse(
                    "use_cispo",
                    "the dual clip bounds -A*r, but CISPO's term is -A*sg(r_c)*curr: "
                    "undefined together; set ratio_clip_c to null",
                )

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
