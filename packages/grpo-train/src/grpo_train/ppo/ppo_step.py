"""PPO's step components between rollout and optimizer: the batch, values, token-level advantages.

The batch is `grpo_train.train_step.prepare_batch`'s (reward scaling, shaping and overlong
filtering); only the advantages differ (token-level, from the value
model, instead of group-relative per sample). Also the value group and the run's components
with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grpo_train.batch import Rollout
from grpo_train.config.schema import GRPOConfig, GRPOMasterConfig, LossConfig, PolicyConfig, PPOConfig
from grpo_train.group_estimators import kl_in_reward
from grpo_train.ppo.estimators import EstimatorInput, compute_ppo_advantages
from grpo_train.ppo.gae import last_token_rewards
from grpo_train.ppo.value_group import ValueGroup
from grpo_train.setup import Components, build_components, ranks_per_node, resolve_model_path, threads_per_actor
from grpo_train.train_step import prepare_batch

EXPLAINED_VARIANCE_EPS = 1e-8


@dataclass
class PPOComponents(Components):
    value: Any = None  # ValueGroup: the data-parallel ValueWorkers (one or more)

    @property
    def extra_workers(self) -> dict[str, Any]:
        """Groups checkpointed beside the policy (folder name -> group with save/load)."""
        return {"value": self.value}

    def shutdown(self) -> None:
        super().shutdown()
        if self.value is not None:
            self.value.close()


def build_ppo_components(cfg: GRPOMasterConfig, model_path: str) -> PPOComponents:
    """GRPO's components plus the value group (backbone: value.model_name, else the policy's)."""
    from dataclasses import fields

    value_path = resolve_model_path(cfg.value.model_name, "value.model_name") if cfg.value.model_name else model_path
    global_batch = cfg.value.train_global_batch_size or cfg.policy.train_global_batch_size
    value_workers = cfg.value.num_workers if cfg.value is not None else 1  # a PPO config has a value section
    # Started first so that its start-up overlaps the policy's and the generator's.
    value = ValueGroup(
        value_path,
        cfg.value,
        cfg.value_loss_fn,
        cfg.cluster,
        global_batch,
        cfg.grpo.seed,
        num_threads=threads_per_actor(ranks_per_node(cfg.cluster, value_workers)),
        start=False,
    )
    try:
        parts = build_components(cfg, model_path)
    except BaseException:
        value.close()
        raise
    try:
        value.start()
        value.ping()
    except BaseException:
        parts.shutdown()
        value.close()
        raise
    return PPOComponents(**{f.name: getattr(parts, f.name) for f in fields(Components)}, value=value)


def prepare_ppo_batch(
    grpo: GRPOConfig, policy: PolicyConfig, rollouts: list[Rollout], pad_id: int
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """GRPO's `prepare_batch` (rewards scaled and shaped, overlong filtering, [B, S] tensors with
    `scores` [B]) plus the count of masked samples; advantages come later (they need values)."""
    batch, metrics = prepare_batch(grpo, policy, rollouts, pad_id)
    metrics["masked_samples"] = float((batch["sample_mask"] == 0).sum())
    return batch, metrics


def token_rewards(loss: LossConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S]: the sequence reward on the last response token, minus the optional per-token KL penalty.

    With loss_fn.use_kl_in_reward every response token's reward gets -beta * k(prev || ref), with
    beta = loss_fn.reference_policy_kl_penalty and k = loss_fn.reference_policy_kl_type (the policy
    worker then runs the loss with beta 0, so the KL is applied once). It is a reward term: no
    gradient flows through it.
    """
    rewards = last_token_rewards(batch["scores"], batch["token_mask"])
    if loss.use_kl_in_reward:
        rewards = rewards - kl_in_reward(
            batch["prev_logprobs"],
            batch["ref_logprobs"],
            batch["token_mask"],
            loss.reference_policy_kl_penalty,
            loss.reference_policy_kl_type,
            loss.kl_input_clamp_value,
            loss.kl_output_clamp_value,
        )
    return rewards


def add_values_and_advantages(
    ppo: PPOConfig, loss: LossConfig, value, batch: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Rollout-time values, token-level advantages and value targets into `batch`; returns their metrics."""
    batch["values"] = value.values(batch)  # [B, S] old values, fixed for the ppo_epochs
    mask = batch["token_mask"]
    x = EstimatorInput(
        rewards=token_rewards(loss, batch),
        values=batch["values"],
        token_mask=mask,
        sample_mask=batch["sample_mask"],
        response_lengths=mask.sum(dim=1),
    )
    batch["advantages"], batch["returns"] = compute_ppo_advantages(ppo.adv_estimator, x)
    n = mask.sum().clamp(min=1)
    residual = (batch["returns"] - batch["values"]) * mask
    returns_var = ((batch["returns"] - (batch["returns"] * mask).sum() / n) * mask).pow(2).sum() / n
    return {
        "advantage_abs_mean": float((batch["advantages"].abs() * mask).sum() / n),
        "returns_mean": float((batch["returns"] * mask).sum() / n),
        "values_mean": float((batch["values"] * mask).sum() / n),
        "value_explained_variance": float(1 - residual.pow(2).sum() / n / (returns_var + EXPLAINED_VARIANCE_EPS)),
        "reward_kl": float(((batch["prev_logprobs"] - batch["ref_logprobs"]) * mask).sum() / n)
        if "ref_logprobs" in batch
        else 0.0,
    }


def mean_over_epochs(per_epoch: list[dict[str, float]]) -> dict[str, float]:
    keys = per_epoch[0].keys() if per_epoch else ()
    return {k: sum(m[k] for m in per_epoch) / len(per_epoch) for k in keys}
