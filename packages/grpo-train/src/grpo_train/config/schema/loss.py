"""`loss_fn`: the policy loss; its keys are grpo_kernels.PGLossConfig's plus those grpo-train reads."""

from __future__ import annotations

import typing

from pydantic import ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from grpo_kernels.loss_config import LossOptionError, PGLossConfig
from grpo_train.config.schema.base import Section, section_of

# The loss op's options are declared once, in grpo_kernels.PGLossConfig (with their meaning in its
# docstring); this section takes its fields from there, and the op refuses bad values at config
# time through `_loss_options` below. grpo-kernels stays free of pydantic; its config is torch-free.
if typing.TYPE_CHECKING:  # the static view of the same section: the op config's fields on a Section
    # Both bases are frozen at run time; pyright reads Section's frozen from its model_config only.
    class _PGLossSection(Section, PGLossConfig): ...  # pyright: ignore[reportGeneralTypeIssues]
else:
    _PGLossSection = section_of(PGLossConfig, "PGLossSection")


class LossConfig(_PGLossSection):
    """`loss_fn`: grpo_kernels.PGLossConfig's fields, plus the keys that grpo-train alone reads."""

    use_kl_in_reward: bool = False
    """Move the KL from the loss into the reward: every response token's reward (advantage) gets
    -reference_policy_kl_penalty * k(prev || ref) with k = reference_policy_kl_type, and the loss's KL
    term is off (beta 0 in the loss). The KL is then never in both places. Needs beta > 0."""

    @model_validator(mode="after")
    def _combinations(self) -> LossConfig:
        if self.sequence_level_importance_ratios and self.token_level_loss is True:
            raise ValueError("sequence_level_importance_ratios (GSPO) requires token_level_loss: false")
        if self.truncated_importance_sampling_type and not self.use_importance_sampling_correction:
            raise ValueError("truncated_importance_sampling_type requires use_importance_sampling_correction: true")
        if self.truncated_importance_sampling_type and self.truncated_importance_sampling_ratio is None:
            raise ValueError("truncated_importance_sampling_type requires truncated_importance_sampling_ratio")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1 (dual clip), got {self.ratio_clip_c}")
        return self

    def loss_op_config(self) -> PGLossConfig:
        """The loss op's own config (grpo_kernels.PGLossConfig) from the keys it declares; keys
        of this section that other components consume (use_kl_in_reward: the rollout's advantages)
        are not passed, and with the KL in the reward the loss's beta is 0 (applied once)."""
        op_keys = PGLossConfig.__dataclass_fields__
        fields = {k: getattr(self, k) for k in op_keys}
        fields["reference_policy_kl_penalty"] = self.loss_kl_penalty
        return PGLossConfig(**fields)

    @model_validator(mode="after")
    def _loss_options(self) -> LossConfig:
        """Every value and combination the loss op refuses (grpo_kernels.PGLossConfig), at its key
        path; checked on the keys as written (a negative beta is refused with use_kl_in_reward too)."""
        try:
            PGLossConfig(**{k: getattr(self, k) for k in PGLossConfig.__dataclass_fields__})
        except LossOptionError as err:
            detail = InitErrorDetails(
                type=PydanticCustomError("loss_option", "{reason}", {"reason": err.reason}),
                loc=(err.field,),
                input=getattr(self, err.field),
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    @field_validator("use_kl_in_reward")
    @classmethod
    def _kl_in_reward_needs_beta(cls, on: bool, info: ValidationInfo) -> bool:
        if on and info.data.get("reference_policy_kl_penalty") == 0:
            raise ValueError(
                "the in-reward KL coefficient is loss_fn.reference_policy_kl_penalty, which is 0; "
                "set it > 0 or turn use_kl_in_reward off"
            )
        if on and info.data.get("use_on_policy_kl_approximation"):
            raise ValueError(
                "use_on_policy_kl_approximation weights the loss's KL term, which use_kl_in_reward "
                "turns off; set one of them"
            )
        return on

    @property
    def loss_kl_penalty(self) -> float:
        """beta of the loss's KL term: 0 when the KL is in the reward instead."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty
