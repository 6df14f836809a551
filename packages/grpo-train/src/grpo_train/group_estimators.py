"""GRPO's advantage estimators, chosen by `grpo.adv_estimator.name` (one small class each).

Job: per-sample rewards of a prompt-major batch (groups of N samples of one prompt) -> [B, S]
advantages on the response tokens, as docs/algorithms.md (## Advantages) defines them. PPO's
value-model estimators live in `grpo_train.ppo.estimators`.

Every estimator runs once on the whole rollout batch, before it is split into micro-batches
or data-parallel shards, so the advantages cannot depend on micro-batching; the batch-wide
statistics (REINFORCE++, GDPO) are sums over samples/tokens, so the order of the groups does
not change any sample's advantage either.

KL in the reward (`loss_fn.use_kl_in_reward`): `kl_penalty` = beta * k(prev || ref) per token
is subtracted from each token's advantage (NeMo RL's placement: REINFORCE++ subtracts it before
its global whitening, GRPO and GDPO after their group normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_train.advantages import STD_EPS, clip_advantages, group_baseline_and_std, group_relative
from grpo_train.config.schema import GRPOConfig

WHITEN_VAR_EPS = 1e-8  # REINFORCE++: rsqrt(max(var, eps)), as NeMo RL and OpenRLHF


@dataclass
class GroupBatch:
    """What an estimator reads. Rows are prompt-major: prompt p's samples are p*N .. p*N+N-1."""

    rewards: torch.Tensor  # [B] scaled and shaped reward per sample
    valid: torch.Tensor  # [B] bool: the sample is part of its group's baseline (loss_multiplier > 0)
    token_mask: torch.Tensor  # [B, S] 1 on response tokens
    group_size: int
    components: torch.Tensor | None = None  # [B, K] reward components (GDPO), columns in sorted-name order
    kl_penalty: torch.Tensor | None = None  # [B, S] beta * k(prev || ref), 0 off the response tokens


def _per_token(adv: torch.Tensor, x: GroupBatch) -> torch.Tensor:
    """[B] -> [B, S] on the response tokens, minus the in-reward KL where there is one."""
    tok = adv.view(-1, 1).to(torch.float32) * x.token_mask
    return tok if x.kl_penalty is None else tok - x.kl_penalty * x.token_mask


class GRPOEstimator:
    """Group baseline (mean, or leave-one-out mean) and optional group std (shared/GRPO-MATH.md)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def __call__(self, x: GroupBatch) -> tuple[torch.Tensor, torch.Tensor]:
        adv, kept = group_relative(
            x.rewards, x.valid, x.group_size, self.cfg.normalize_group_rewards, self.cfg.leave_one_out
        )
        return _per_token(adv, x), kept


class GDPOEstimator:
    """GDPO (arXiv 2601.05242): normalise each reward component within its group, take the
    weighted sum, then normalise that sum over the batch's kept samples (mean 0, Bessel std 1)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def __call__(self, x: GroupBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if x.components is None or x.components.shape[1] < 2:
            k = 0 if x.components is None else x.components.shape[1]
            raise ValueError(
                f"grpo.adv_estimator.name 'gdpo' needs at least two reward components per sample "
                f"(the environment's metadata 'reward_components'); this batch has {k}"
            )
        n = x.components.shape[1]
        weights = self.cfg.adv_estimator.reward_weights or [1.0] * n
        if len(weights) != n:
            raise ValueError(
                f"grpo.adv_estimator.reward_weights has {len(weights)} entries but the samples have {n} "
                f"reward components"
            )
        combined = torch.zeros_like(x.rewards, dtype=torch.float64)
        kept = x.valid.bool()
        for k, w in enumerate(weights):
            adv_k, kept = group_relative(
                x.components[:, k].double(),
                x.valid,
                x.group_size,
                self.cfg.normalize_group_rewards,
                self.cfg.leave_one_out,
            )
            combined = combined + w * adv_k
        vals = combined[kept]
        if vals.numel() > 0:
            mean = vals.mean()
            std = vals.std() if vals.numel() > 1 else torch.zeros((), dtype=vals.dtype)
            combined = (combined - mean) / std if std > 0 else combined - mean
        return _per_token(combined, x), kept


class ReinforcePlusPlusEstimator:
    """REINFORCE++ (arXiv 2501.03262): per-token advantage whitened over all response tokens of the
    batch; with minus_baseline (REINFORCE++-baseline, the default) the group mean is subtracted first."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def __call__(self, x: GroupBatch) -> tuple[torch.Tensor, torch.Tensor]:
        adv = x.rewards.double()
        if self.cfg.adv_estimator.minus_baseline is not False:
            mean, _ = group_baseline_and_std(adv, x.valid, x.group_size, leave_one_out=False)
            adv = adv - mean
        tok = _per_token(adv, x).double()  # [B, S]
        kept = x.valid.bool()
        m = x.token_mask.double() * kept.view(-1, 1)
        n = m.sum()
        if n > 0:
            mean = (tok * m).sum() / n
            var = ((tok - mean) ** 2 * m).sum() / n
            tok = (tok - mean) * var.clamp(min=WHITEN_VAR_EPS).rsqrt()
        return (tok * x.token_mask).float(), kept


GROUP_ESTIMATORS = {"grpo": GRPOEstimator, "gdpo": GDPOEstimator, "reinforce_plus_plus": ReinforcePlusPlusEstimator}


def estimate_advantages(cfg: GRPOConfig, x: GroupBatch) -> torch.Tensor:
    """[B, S] advantages by `cfg.adv_estimator.name`, clipped; 0 for samples not kept and off the response."""
    if x.rewards.numel() % x.group_size:
        raise ValueError(f"{x.rewards.numel()} rewards do not split into groups of {x.group_size}")
    adv, kept = GROUP_ESTIMATORS[cfg.adv_estimator.name](cfg)(x)
    return clip_advantages(adv.float(), kept, cfg) * x.token_mask


def kl_in_reward(
    prev: torch.Tensor,
    ref: torch.Tensor,
    token_mask: torch.Tensor,
    beta: float,
    kl_type: str,
    input_clamp: float | None,
    output_clamp: float | None,
) -> torch.Tensor:
    """[B, S] beta * k(prev || ref) with the loss's estimator and clamps (shared/GRPO-MATH.md), 0 off the response.

    logr = clamp(ref - prev, +-input_clamp); k1 = -logr, k2 = logr^2 / 2, k3 = e^logr - 1 - logr.
    """
    from grpo_kernels.reference import kl_estimate

    logr = ref - prev
    if input_clamp is not None:
        logr = logr.clamp(-input_clamp, input_clamp)
    kl = kl_estimate(logr, kl_type)
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return beta * kl * token_mask


__all__ = ["GROUP_ESTIMATORS", "STD_EPS", "GroupBatch", "estimate_advantages", "kl_in_reward"]
