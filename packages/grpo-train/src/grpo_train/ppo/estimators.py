"""Advantage estimators of PPO, chosen by `ppo.adv_estimator.name` (one small class each).

Group-relative estimators (GRPO, RLOO, ...) live in `grpo_train.advantages`; the config
refuses them here. An estimator turns token rewards and the rollout's values into
(advantages for the policy, returns for the value model), both [B, S].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_train.config.schema import AdvEstimatorConfig
from grpo_train.ppo.gae import gae, length_adaptive_lambda, returns_from_gae, whiten


@dataclass
class EstimatorInput:
    rewards: torch.Tensor  # [B, S] per-token reward (sequence reward on the last response token)
    values: torch.Tensor  # [B, S] V(x_<t) from the value model at rollout time
    token_mask: torch.Tensor  # [B, S] 1 on generated response tokens
    sample_mask: torch.Tensor  # [B] 0 for samples excluded from the loss
    response_lengths: torch.Tensor  # [B] generated tokens per row


class GAEEstimator:
    """Generalised advantage estimation; separate lambdas for policy and value optional (VAPO)."""

    def __init__(self, cfg: AdvEstimatorConfig):
        self.cfg = cfg

    def policy_lambda(self, x: EstimatorInput) -> float | torch.Tensor:
        if self.cfg.length_adaptive_alpha is not None:
            return length_adaptive_lambda(x.response_lengths, self.cfg.length_adaptive_alpha)
        return self.cfg.policy_gae_lambda if self.cfg.policy_gae_lambda is not None else self.cfg.gae_lambda

    def __call__(self, x: EstimatorInput) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        value_lam = cfg.value_gae_lambda if cfg.value_gae_lambda is not None else cfg.gae_lambda
        returns = returns_from_gae(x.rewards, x.values, x.token_mask, cfg.gae_gamma, value_lam)
        advantages = gae(x.rewards, x.values, x.token_mask, cfg.gae_gamma, self.policy_lambda(x))
        return advantages, returns


class RawRewardEstimator:
    """No baseline: advantage = return = discounted reward-to-go (GAE with V = 0 and lambda = 1)."""

    def __init__(self, cfg: AdvEstimatorConfig):
        self.cfg = cfg

    def __call__(self, x: EstimatorInput) -> tuple[torch.Tensor, torch.Tensor]:
        to_go = gae(x.rewards, torch.zeros_like(x.values), x.token_mask, self.cfg.gae_gamma, 1.0)
        return to_go, to_go.clone()


ESTIMATORS = {"gae": GAEEstimator, "raw_reward": RawRewardEstimator}


def compute_ppo_advantages(cfg: AdvEstimatorConfig, x: EstimatorInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, S]; advantages whitened over the trained tokens if asked."""
    advantages, returns = ESTIMATORS[cfg.name](cfg)(x)
    if cfg.normalize_advantages:
        advantages = whiten(advantages, x.token_mask * x.sample_mask.unsqueeze(1))
    return advantages, returns
