"""`ppo`, `value`, `value_loss_fn`: PPO's advantage estimator and its value model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_train.config.schema.base import Section
from grpo_train.config.schema.policy import (
    LoRAConfig,
    MicroBatchingConfig,
    OptimizerConfig,
    SchedulerEntry,
    SequencePackingConfig,
)

GROUP_RELATIVE_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus", "opo", "remax")
"""Estimators whose baseline is the prompt's group of samples: they belong to GRPO, not PPO."""


class AdvEstimatorConfig(Section):
    name: Literal["gae", "raw_reward"] = "gae"
    """gae: token-level GAE with the value model; raw_reward: the discounted reward-to-go (no baseline)."""
    gae_gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per token."""
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda for both advantages and value targets, unless the two lambdas below are set."""
    policy_gae_lambda: float | None = Field(default=None, ge=0, le=1)
    """Lambda of the policy's advantages (VAPO decoupled GAE); null: gae_lambda."""
    value_gae_lambda: float | None = Field(default=None, ge=0, le=1)
    """Lambda of the value targets (returns); null: gae_lambda."""
    length_adaptive_alpha: float | None = Field(default=None, gt=0)
    """VAPO length-adaptive policy lambda = 1 - 1/(alpha * response_length); overrides policy_gae_lambda."""
    normalize_advantages: bool = True
    """Whiten advantages over the valid tokens of the rollout batch (mean 0, std 1)."""

    @field_validator("name", mode="before")
    @classmethod
    def _not_group_relative(cls, name: Any) -> Any:
        if name in GROUP_RELATIVE_ESTIMATORS:
            raise ValueError(
                f"{name!r} is group-relative; use GRPO (remove the ppo section) or choose gae / raw_reward"
            )
        return name


class PPOConfig(Section):
    """Present => the run is PPO (grpo_train.ppo). The `grpo` section still supplies what the two
    algorithms share: prompts and samples per step, steps, epochs, validation, seed, reward
    scaling/shaping, overlong filtering, dynamic sampling, refit check. GRPO's group-baseline
    keys (normalize_rewards, use_leave_one_out_baseline, advantage clips) are not used."""

    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes of policy and value training over each rollout batch (prev logprobs and old values stay fixed)."""
    policy_training_start_step: int = Field(default=1, ge=1)
    """First step whose batch trains the policy; earlier steps train only the value model (critic warm-up)."""

    @model_validator(mode="before")
    @classmethod
    def _kl_in_reward_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("use_kl_in_reward" in data or "kl_in_reward_coef" in data):
            raise ValueError(
                "ppo.use_kl_in_reward / ppo.kl_in_reward_coef were replaced by loss_fn.use_kl_in_reward "
                "(NeMo RL's key): the KL moves from the loss into the token rewards with coefficient "
                "loss_fn.reference_policy_kl_penalty and estimator loss_fn.reference_policy_kl_type"
            )
        return data


class ValueLossConfig(Section):
    value_clip: float | None = Field(default=0.2, gt=0)
    """Clip of the new value around the rollout's value: old + clamp(v - old, +-value_clip); null: plain MSE."""
    token_level_loss: bool = True
    """Mean over all valid tokens of the global batch (false: mean of per-sequence means)."""


class ValueConfig(Section):
    model_name: str | None = None
    """Backbone checkpoint of the value model (HF name, path or builtin:); null: policy.model_name."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    train_global_batch_size: int | None = Field(default=None, ge=1)
    """Samples per value optimizer step; null: policy.train_global_batch_size."""
    train_micro_batch_size: int = Field(default=4, ge=1)
    """Samples per forward/backward."""
    inference_batch_size: int = Field(default=4, ge=1)
    """Samples per forward when computing the rollout's values."""
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    num_workers: int = Field(default=1, ge=1)
    """Data-parallel value workers (Ray actors), placed like policy.num_workers in a placement group
    of their own: one bundle each from the cluster, a GPU each when cluster.gpus_per_node > 0."""
    dynamic_batching: MicroBatchingConfig = MicroBatchingConfig()
    """As policy.dynamic_batching; logprob_mb_tokens budgets the rollout-time values pass."""
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    """As policy.sequence_packing; logprob_mb_tokens budgets the rollout-time values pass."""
    optimizer: OptimizerConfig = OptimizerConfig(
        kwargs={"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    )
    scheduler: list[SchedulerEntry] = []
    lora_cfg: LoRAConfig = LoRAConfig()
    """LoRA adapters (peft) on the value model's backbone, keys as policy.dtensor_cfg.lora_cfg: only the
    adapters and the value head (trained in full) get gradients and optimizer state. `refit` does not
    apply (the value model is never pushed to an engine) and is refused when set."""

    @field_validator("lora_cfg")
    @classmethod
    def _value_lora_has_no_refit(cls, value: LoRAConfig) -> LoRAConfig:
        if "refit" in value.model_fields_set:
            raise ValueError(
                "value.lora_cfg.refit: the value model is never pushed to a generation engine; "
                "set it only under policy.dtensor_cfg.lora_cfg"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_num_gpus(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_gpus" in data:
            raise ValueError(
                "value.num_gpus was replaced by value.num_workers: each value rank takes one GPU from "
                "the cluster when cluster.gpus_per_node > 0 (and one CPU otherwise)"
            )
        return data

    @model_validator(mode="after")
    def _batching(self) -> ValueConfig:
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError(
                "value.dynamic_batching and value.sequence_packing are mutually exclusive: enable at most one"
            )
        if self.train_global_batch_size is not None and self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                f"train_micro_batch_size ({self.train_micro_batch_size})"
            )
        return self
