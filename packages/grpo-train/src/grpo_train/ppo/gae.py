"""Token-level returns and advantages: GAE over the response tokens of a [B, S] batch.

Pure tensor maths, no model. Alignment follows the batch: token t of a row is the action
x_t, `values[:, t]` is V(x_<t), the value of the state in which x_t was chosen, and
`rewards[:, t]` the reward for choosing it. Tokens with mask 0 (prompt, padding, environment
observations in multi-turn) are skipped: the recursion passes through them unchanged, so the
next valid token's value and advantage reach the previous valid token with one step of
discount. After the last valid token the episode ends (V = 0).
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def last_token_rewards(scores: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence rewards placed on each row's last valid token: [B, S] (rows with no valid token get 0)."""
    S = token_mask.shape[1]
    positions = torch.arange(S, device=token_mask.device).expand_as(token_mask)
    last = torch.where(token_mask > 0, positions, -1).max(dim=1).values  # [B]
    rewards = torch.zeros_like(token_mask, dtype=scores.dtype)
    has_tokens = last >= 0
    rows = torch.arange(len(scores), device=scores.device)[has_tokens]
    rewards[rows, last[has_tokens]] = scores[has_tokens]
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, token_mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> torch.Tensor:
    """A_t = delta_t + gamma * lam * A_next, delta_t = r_t + gamma * V_next - V_t, on valid tokens.

    rewards, values, token_mask: [B, S]; lam: a float or one lambda per row [B]. Returns [B, S],
    0 on masked tokens.
    """
    B, S = rewards.shape
    dtype = torch.float64  # the recursion sums up to S terms; keep it exact for long responses
    r, v, m = rewards.to(dtype), values.to(dtype), token_mask.to(dtype)
    lam = torch.as_tensor(lam, dtype=dtype).expand(B)  # [B]
    advantages = torch.zeros(B, S, dtype=dtype)
    next_value = torch.zeros(B, dtype=dtype)  # [B] value of the next valid token's state
    next_adv = torch.zeros(B, dtype=dtype)  # [B] advantage of the next valid token
    for t in range(S - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = adv_t * mt
        next_adv = torch.where(mt > 0, adv_t, next_adv)
        next_value = torch.where(mt > 0, v[:, t], next_value)
    return advantages.to(rewards.dtype)


def returns_from_gae(
    rewards: torch.Tensor, values: torch.Tensor, token_mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> torch.Tensor:
    """Value targets R_t = A_t(lam) + V_t on valid tokens, 0 elsewhere: [B, S]."""
    return (gae(rewards, values, token_mask, gamma, lam) + values) * token_mask


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's lambda_policy = 1 - 1 / (alpha * l) per row, clamped to [0, 1]: [B]."""
    lengths = response_lengths.double().clamp(min=1)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + eps) over the tokens with mask 1; 0 elsewhere: [B, S]."""
    n = mask.sum()
    if n < 2:
        return x * mask
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + WHITEN_EPS) * mask
