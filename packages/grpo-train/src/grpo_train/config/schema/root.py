"""`GRPOMasterConfig`: the root of the schema, its sections, and the checks that span sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo, field_validator, model_validator

from grpo_train.config.schema.base import Section
from grpo_train.config.schema.data import DataConfig
from grpo_train.config.schema.env import EnvConfig
from grpo_train.config.schema.grpo import GRPOConfig
from grpo_train.config.schema.loss import LossConfig
from grpo_train.config.schema.policy import PolicyConfig
from grpo_train.config.schema.ppo import PPOConfig, ValueConfig, ValueLossConfig
from grpo_train.config.schema.runtime import CheckpointingConfig, ClusterConfig, LoggerConfig


class GRPOMasterConfig(Section):
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig = PolicyConfig()
    data: DataConfig = DataConfig()
    env: dict[str, EnvConfig] = {"math": EnvConfig()}
    logger: LoggerConfig = LoggerConfig()
    cluster: ClusterConfig = ClusterConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    ppo: PPOConfig | None = None
    """The algorithm switch: absent => GRPO; a `ppo:` section (even `ppo: {}`) => PPO with a value model."""
    value: ValueConfig | None = None
    """PPO's value model; filled with defaults when `ppo` is present."""
    value_loss_fn: ValueLossConfig | None = None
    """PPO's clipped MSE value loss; filled with defaults when `ppo` is present."""

    @property
    def algorithm(self) -> Literal["grpo", "ppo"]:
        return "ppo" if self.ppo is not None else "grpo"

    @model_validator(mode="before")
    @classmethod
    def _ppo_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("ppo") is None:
            return data
        return {**data, "value": data.get("value") or {}, "value_loss_fn": data.get("value_loss_fn") or {}}

    @field_validator("value", "value_loss_fn")
    @classmethod
    def _only_with_ppo(cls, section: Any, info: ValidationInfo) -> Any:
        if section is not None and "ppo" in info.data and info.data["ppo"] is None:  # absent: ppo itself failed
            raise ValueError("only PPO has a value model; add a `ppo:` section or remove this one")
        return section

    @model_validator(mode="after")
    def _cross_section(self) -> GRPOMasterConfig:
        if self.ppo is not None:
            assert self.value is not None  # _ppo_sections fills it whenever ppo is present
            self._check_ppo(self.value)
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples % self.policy.train_global_batch_size:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) must be a multiple of "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size})"
            )
        if self.policy.generation.vllm_cfg.async_engine and not self.grpo.async_grpo.enabled:
            raise ValueError(
                "policy.generation.vllm_cfg.async_engine: the async engine runs only with async GRPO; set "
                "false, or set grpo.async_grpo.enabled: true"
            )
        if self.grpo.async_grpo.enabled:
            if not self.loss_fn.use_importance_sampling_correction:
                raise ValueError("grpo.async_grpo requires loss_fn.use_importance_sampling_correction: true")
            if self.grpo.use_dynamic_sampling:
                raise ValueError("grpo.async_grpo does not support grpo.use_dynamic_sampling")
            if self.policy.generation.colocated.enabled and self.cluster.gpus_per_node > 0:
                raise ValueError("grpo.async_grpo needs policy.generation.colocated.enabled: false on GPUs")
            if self.policy.generation.backend != "vllm":
                raise ValueError(
                    f"grpo.async_grpo needs policy.generation.backend: vllm (its async engine generates "
                    f"ahead of training), got {self.policy.generation.backend!r}"
                )
            lora = self.policy.dtensor_cfg.lora_cfg
            if lora.enabled and lora.refit == "adapter":
                raise ValueError(
                    "grpo.async_grpo with policy.dtensor_cfg.lora_cfg.refit: adapter is not supported (the "
                    "async engine's in-flight updates would need each request to keep its adapter id and "
                    "folder until it ends); set refit: merged or grpo.async_grpo.enabled: false"
                )
            if self.policy.generation.weight_transport == "ipc":
                raise ValueError(
                    "grpo.async_grpo: policy.generation.weight_transport 'ipc' needs engines colocated on "
                    "the trainer's GPUs, which async GRPO does not run; use 'collective', 'object_store' "
                    "or 'auto'"
                )
        return self

    @model_validator(mode="after")
    def _on_policy_ratio(self) -> GRPOMasterConfig:
        """A forced ratio of 1 is exact only when each rollout feeds one optimizer step."""
        if not self.loss_fn.force_on_policy_ratio:
            return self
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples != self.policy.train_global_batch_size or (self.ppo is not None and self.ppo.ppo_epochs > 1):
            raise ValueError(
                f"loss_fn.force_on_policy_ratio sets the ratio to 1, exact only for one optimizer step per rollout: "
                f"needs grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) == "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}) and ppo.ppo_epochs 1"
            )
        return self

    def _check_ppo(self, value: ValueConfig) -> None:
        if "adv_estimator" in self.grpo.model_fields_set:
            raise ValueError("grpo.adv_estimator chooses GRPO's group estimator; PPO uses ppo.adv_estimator")
        if self.grpo.async_grpo.enabled:
            raise ValueError("grpo.async_grpo: PPO runs synchronously; set grpo.async_grpo.enabled: false")
        if self.grpo.invalid_tool_call_advantage is not None:
            raise ValueError(
                "grpo.invalid_tool_call_advantage replaces GRPO's advantages; PPO's come from GAE and do "
                "not take it: remove it (the env's invalid_call_penalty works with PPO)"
            )
        if self.grpo.use_dynamic_sampling and self.grpo.num_generations_per_prompt < 2:
            raise ValueError(
                "grpo.use_dynamic_sampling keeps prompts whose samples differ in reward; with PPO it "
                "needs grpo.num_generations_per_prompt >= 2"
            )
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        value_batch = value.train_global_batch_size or self.policy.train_global_batch_size
        if samples % value_batch:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) must be a "
                f"multiple of value.train_global_batch_size ({value_batch})"
            )
        if value_batch % value.train_micro_batch_size:
            raise ValueError(
                f"value.train_global_batch_size ({value_batch}) must be a multiple of "
                f"value.train_micro_batch_size ({value.train_micro_batch_size})"
            )
        if value_batch % value.num_workers:
            raise ValueError(
                f"value.train_global_batch_size ({value_batch}) must be a multiple of value.num_workers "
                f"({value.num_workers}): each value optimizer step splits evenly over the workers"
            )
        self._check_ppo_gpus(value)
        self._check_ppo_local_cpus(value)

    def _check_ppo_local_cpus(self, value: ValueConfig) -> None:
        """A local CPU Ray of cluster.num_cpus CPUs holds a CPU per policy rank, value rank and engine."""
        cluster = self.cluster
        if cluster.gpus_per_node > 0 or cluster.address is not None or cluster.num_cpus is None:
            return
        wanted = self.policy.num_workers + value.num_workers + 1
        if wanted > cluster.num_cpus:
            raise ValueError(
                f"policy.num_workers ({self.policy.num_workers}) + value.num_workers ({value.num_workers}) + 1 "
                f"generation engine = {wanted} CPUs, but cluster.num_cpus is {cluster.num_cpus}; lower the workers "
                f"or raise cluster.num_cpus"
            )

    def _check_ppo_gpus(self, value: ValueConfig) -> None:
        """On GPUs every policy rank, separate generation GPU and value rank takes a GPU of its own."""
        if self.cluster.gpus_per_node == 0:
            return
        gen = self.policy.generation.colocated
        generation = 0 if gen.enabled else (gen.resources.gpus_per_node or 0) * (gen.resources.num_nodes or 1)
        wanted = self.policy.num_workers + generation + value.num_workers
        have = self.cluster.gpus_per_node * self.cluster.num_nodes
        if wanted > have:
            raise ValueError(
                f"policy.num_workers ({self.policy.num_workers}) + policy.generation.colocated.resources GPUs "
                f"({generation}) + value.num_workers ({value.num_workers}) = {wanted} GPUs, but the cluster has "
                f"cluster.gpus_per_node * cluster.num_nodes = {have}; lower one of them or add GPUs"
            )
