"""The training batch: rollouts laid out as right-padded [B, S] tensors.

Token t of a row holds log p(x_t | x_<t); position 0 has no logprob. `token_mask` marks the
response tokens (the ones trained on). Rows are prompt-major (prompt p's N samples together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rollout:
    """One (prompt, sample) pair after generation and scoring."""

    prompt_index: int  # position of the prompt in this step's prompt list
    prompt_ids: list[int]
    response_ids: list[int]
    gen_logprobs: list[float]  # sampling logprob per response token
    text: str
    truncated: bool  # generation stopped at the length limit
    reward: float = 0.0
    loss_multiplier: float = 1.0  # 0 for prompts that were truncated by the processor
    task_name: str = ""
    dataset_name: str = ""
    env_metadata: dict = field(default_factory=dict)
    # Multi-turn: 1 where response_ids holds a generated token, 0 for environment observation
    # tokens (not trained on). None means every response token was generated.
    response_mask: list[int] | None = None
    turns: int = 1
    # Multi-turn tool envs: 1 on the generated tokens of turns whose tool calls were written wrong
    # (grpo.invalid_tool_call_advantage replaces their advantage); None: no such turn.
    invalid_call_mask: list[int] | None = None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_train_batch(
    rollouts: list[Rollout], advantages: torch.Tensor, sample_mask: torch.Tensor, pad_id: int, divisible_by: int = 1
) -> dict[str, torch.Tensor]:
    """Lay rollouts out as [B, S] tensors (S = longest prompt+response, rounded up)."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    B, S = len(rollouts), round_up(max(lengths), divisible_by)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    token_mask = torch.zeros((B, S), dtype=torch.float32)
    gen_logprobs = torch.zeros((B, S), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, : p + n] = torch.tensor(r.prompt_ids + r.response_ids, dtype=torch.long)
        attention_mask[i, : p + n] = 1
        token_mask[i, p : p + n] = (
            1.0 if r.response_mask is None else torch.tensor(r.response_mask, dtype=torch.float32)
        )
        gen_logprobs[i, p : p + n] = torch.tensor(r.gen_logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,  # [B, S] int64, right-padded
        "attention_mask": attention_mask,  # [B, S] int64
        "token_mask": token_mask,  # [B, S] fp32, 1 on generated response tokens
        "gen_logprobs": gen_logprobs,  # [B, S] fp32, the generator's sampling logprobs
        "advantages": advantages.float().view(B, 1) * token_mask,  # [B, S] per-sample advantage on response tokens
        "sample_mask": sample_mask.float(),  # [B]
    }


def invalid_call_token_mask(rollouts: list[Rollout], shape: tuple[int, int]) -> torch.Tensor:
    """[B, S] bool: the response tokens of each row that `Rollout.invalid_call_mask` marks, laid
    out as `build_train_batch` lays out the rows."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, r in enumerate(rollouts):
        if r.invalid_call_mask is not None:
            p = len(r.prompt_ids)
            mask[i, p : p + len(r.invalid_call_mask)] = torch.tensor(r.invalid_call_mask, dtype=torch.bool)
    return mask


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].shape[0]


def select_rows(batch: dict[str, torch.Tensor], rows: slice | torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of every per-sample tensor, trimmed to the longest remaining sequence."""
    out = {k: v[rows] for k, v in batch.items()}
    width = int(out["attention_mask"].sum(dim=1).max().item()) if out["attention_mask"].numel() else 1
    return {k: (v[:, : max(width, 2)] if v.dim() == 2 else v) for k, v in out.items()}


def seq_mult_prob_error(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] per sequence: masked mean over response tokens of exp(|prev - gen|) (the step's
    token_mult_prob_error, per sequence; 1.0 = trainer and generator agree). 1.0 for a row
    without response tokens."""
    m = batch["token_mask"]
    err = torch.exp((batch["prev_logprobs"] - batch["gen_logprobs"]).abs() * m) * m
    n = m.sum(dim=1)
    return torch.where(n > 0, err.sum(dim=1) / n.clamp(min=1), torch.ones_like(n))
