"""Per-token logprobs of a causal LM through grpo_kernels' ops.

Training logits are divided by the sampling temperature, exactly as in generation. With
`fused`, the lm_head matmul is fused into the logprob op so full logits never exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import grpo_kernels

IGNORE_INDEX = -100


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                      fused: bool = True, chunk_size: int | None = None) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1, 0 at t = 0 and on padding: [B, S] fp32."""
    B, S = input_ids.shape
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]  # [B, S-1, H]
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX).reshape(-1)  # [B*(S-1)]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    head = model.get_output_embeddings()
    kwargs = {"temperature": temperature, "ignore_index": IGNORE_INDEX}
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    if fused and getattr(head, "bias", None) is None:
        lp = grpo_kernels.linear_token_logprobs(hidden, head.weight, targets, **kwargs)
    else:
        lp = grpo_kernels.token_logprobs(head(hidden), targets, **kwargs)
    return F.pad(lp.view(B, S - 1).float(), (1, 0))
