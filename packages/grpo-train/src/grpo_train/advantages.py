"""Rewards to advantages, exactly as shared/GRPO-MATH.md defines them.

Samples are laid out prompt-major: the N generations of prompt p are rows p*N .. p*N+N-1.
Everything here is per sequence ([B] tensors); broadcasting to tokens happens in `batch.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_train.config.schema import GRPOConfig, RewardScalingConfig, RewardShapingConfig

STD_EPS = 1e-6


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """r <- t_min + (clamp(r, s_min, s_max) - s_min) / (s_max - s_min) * (t_max - t_min)."""
    if not cfg.enabled:
        return rewards
    clamped = rewards.clamp(cfg.source_min, cfg.source_max)
    return cfg.target_min + (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min) * (
        cfg.target_max - cfg.target_min
    )


def shape_rewards(
    rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor, cfg: RewardShapingConfig
) -> torch.Tensor:
    """DAPO overlong penalty, or "stop properly" instead of it: r * coef for truncated samples.

    The two are alternatives (shared/GRPO-MATH.md): with stop_properly_penalty_coef set the DAPO
    penalty is not applied, so the coefficient scales the raw (scaled) reward, never an already
    penalised one (0.5 * -0.6 would *raise* a penalised reward).
    """
    if not cfg.enabled:
        return rewards
    if cfg.stop_properly_penalty_coef is not None:
        return torch.where(truncated, rewards * cfg.stop_properly_penalty_coef, rewards)
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    over = (response_lengths.to(rewards.dtype) - expected) / cfg.overlong_buffer_length
    return rewards + torch.clamp(-over * cfg.overlong_buffer_penalty, max=0.0)


def group_baseline_and_std(
    rewards: torch.Tensor, valid: torch.Tensor, group_size: int, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and Bessel-corrected std over the valid samples of its group.

    With leave_one_out, both are taken over the *other* valid samples of the group. A std over
    fewer than two values is 0 (no normalisation).
    """
    r = rewards.view(-1, group_size).double()  # [P, N]
    v = valid.view(-1, group_size).double()  # [P, N]
    rv = r * v
    n = v.sum(dim=1, keepdim=True)  # [P, 1]
    s1 = rv.sum(dim=1, keepdim=True)
    s2 = (rv * r).sum(dim=1, keepdim=True)
    if leave_one_out:
        # Remove sample i from the sums where it is valid itself.
        n_i = n - v
        s1_i = s1 - rv
        s2_i = s2 - rv * r
    else:
        n_i, s1_i, s2_i = n.expand_as(r), s1.expand_as(r), s2.expand_as(r)
    mean = torch.where(n_i > 0, s1_i / n_i.clamp(min=1), torch.zeros_like(r))
    var = torch.where(n_i > 1, (s2_i - n_i * mean * mean) / (n_i - 1).clamp(min=1), torch.zeros_like(r))
    std = var.clamp(min=0).sqrt()
    return mean.view(-1).to(rewards.dtype), std.view(-1).to(rewards.dtype)


def group_relative(
    rewards: torch.Tensor, valid: torch.Tensor, group_size: int, normalize: bool, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = r_i - b_i, divided by (std_i + 1e-6) where normalising and std_i > 0; [B] -> [B].

    Returns (advantages, kept [B] bool). Invalid samples and samples of groups with at most one
    valid sample are not kept and get advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    valid = valid.bool()
    baseline, std = group_baseline_and_std(rewards, valid, group_size, leave_one_out)
    adv = rewards - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + STD_EPS), adv)
    group_valid = valid.view(-1, group_size).sum(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
    kept = valid & (group_valid > 1)
    return torch.where(kept, adv, torch.zeros_like(adv)), kept


def clip_advantages(adv: torch.Tensor, kept: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Optional clamp to [advantage_clip_low, advantage_clip_high]; 0 where not kept. adv [B] or [B, S], kept [B]."""
    if cfg.advantage_clip_low is not None or cfg.advantage_clip_high is not None:
        adv = adv.clamp(cfg.advantage_clip_low, cfg.advantage_clip_high)
    kept = kept.view(-1, *([1] * (adv.dim() - 1)))
    return torch.where(kept, adv, torch.zeros_like(adv))


def compute_advantages(rewards: torch.Tensor, valid: torch.Tensor, group_size: int, cfg: GRPOConfig) -> torch.Tensor:
    """The GRPO estimator per sample, [B] -> [B], clipped (grpo_train.group_estimators has them all)."""
    adv, kept = group_relative(rewards, valid, group_size, cfg.normalize_group_rewards, cfg.leave_one_out)
    return clip_advantages(adv, kept, cfg)


@dataclass
class GroupSignal:
    """Which groups carry a learning signal (non-zero reward spread), for DAPO dynamic sampling."""

    keep: torch.Tensor  # [P] bool
    num_kept: int


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> GroupSignal:
    r = rewards.view(-1, group_size)
    keep = (r.max(dim=1).values - r.min(dim=1).values) > 0
    return GroupSignal(keep=keep, num_kept=int(keep.sum()))
