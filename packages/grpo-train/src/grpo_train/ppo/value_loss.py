"""PPO's clipped MSE value loss (`value_loss_fn`), reduced like the policy loss.

Per token: v_c = old + clamp(v - old, -clip, clip); l = 1/2 max((v - R)^2, (v_c - R)^2).
Mask m = token_mask * sample_mask. The reduction divides by the global valid-token (or
sequence) count of the optimizer step, so a micro-batch loss is a partial sum of the global
mean and the gradient does not depend on the micro-batch size.
"""

from __future__ import annotations

import torch

from grpo_train.config.schema import ValueLossConfig


def value_loss_fn(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    cfg: ValueLossConfig,
    global_tokens: float,
    global_seqs: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """values (grad), old_values, returns, token_mask: [B, S]; sample_mask: [B]. Returns (loss, metrics)."""
    unclipped = (values - returns) ** 2  # [B, S]
    if cfg.value_clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
        clipped = (clipped_values - returns) ** 2  # [B, S]
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_hit = (clipped > unclipped).float()
    else:
        per_token = 0.5 * unclipped
        clip_hit = torch.zeros_like(unclipped)
    mask = token_mask * sample_mask.unsqueeze(1)  # [B, S]
    if cfg.token_level_loss:
        loss = (per_token * mask).sum() / global_tokens
    else:
        per_seq = (per_token * token_mask).sum(dim=1) / token_mask.sum(dim=1).clamp(min=1)  # [B]
        loss = (per_seq * sample_mask).sum() / global_seqs
    with torch.no_grad():
        metrics = {
            "value_clip_fraction": (clip_hit * mask).sum() / global_tokens,
            "value_mean": (values.detach() * mask).sum() / global_tokens,
            "value_mse": (unclipped.detach() * mask).sum() / global_tokens,
        }
    return loss, metrics
