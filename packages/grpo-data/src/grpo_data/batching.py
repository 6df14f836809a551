"""Padding a batch of prompts into tensors for generation or scoring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo_data.errors import DataError
from grpo_data.records import DatumSpec

PADDING_SIDES = ("left", "right")


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # [B, L] int64, L = longest prompt, padded with pad_token_id
    attention_mask: torch.Tensor  # [B, L] int64, 1 on prompt tokens, 0 on padding
    lengths: torch.Tensor  # [B] int64, prompt tokens per row
    loss_multiplier: torch.Tensor  # [B] float32, 0 for truncated prompts


def pad_prompts(batch: Sequence[DatumSpec], pad_token_id: int, padding_side: str = "left") -> PromptBatch:
    """Stack the prompts of `batch`; left padding puts every prompt's last token in the last column."""
    if padding_side not in PADDING_SIDES:
        raise DataError(f"padding_side={padding_side!r}; expected one of {PADDING_SIDES}")
    if not batch:
        raise DataError("pad_prompts: empty batch")
    prompts = [d.token_ids for d in batch]
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(lengths.max())
    input_ids = torch.full((len(batch), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        cols = slice(width - n, width) if padding_side == "left" else slice(0, n)
        input_ids[row, cols] = prompt
        attention_mask[row, cols] = 1
    loss_multiplier = torch.tensor([d.loss_multiplier for d in batch], dtype=torch.float32)
    return PromptBatch(input_ids, attention_mask, lengths, loss_multiplier)
