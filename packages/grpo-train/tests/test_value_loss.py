"""The clipped MSE value loss: clipping cases, gradients and reductions by hand."""

from __future__ import annotations

import torch

from grpo_train.config.schema import ValueLossConfig
from grpo_train.ppo.value_loss import value_loss_fn

torch.set_num_threads(1)


def one_token(v: float, old: float, ret: float, clip: float | None = 0.2):
    values = torch.tensor([[v]], requires_grad=True)
    loss, metrics = value_loss_fn(
        values,
        torch.tensor([[old]]),
        torch.tensor([[ret]]),
        torch.ones(1, 1),
        torch.ones(1),
        ValueLossConfig(value_clip=clip),
        global_tokens=1.0,
        global_seqs=1.0,
    )
    loss.backward()
    return float(loss.detach()), float(values.grad), float(metrics["value_clip_fraction"])


def test_inside_the_clip_range_it_is_half_the_squared_error():
    loss, grad, clipped = one_token(v=0.6, old=0.5, ret=1.0)
    assert abs(loss - 0.5 * 0.4**2) < 1e-6 and abs(grad - (0.6 - 1.0)) < 1e-6 and clipped == 0.0


def test_a_value_moved_past_the_target_beyond_the_clip_keeps_the_clipped_error_and_no_gradient():
    # v_c = 0.5 + clamp(0.5, +-0.2) = 0.7: (0.7 - 1)^2 = 0.09 > (1 - 1)^2 = 0
    loss, grad, clipped = one_token(v=1.0, old=0.5, ret=1.0)
    assert abs(loss - 0.5 * 0.09) < 1e-6 and grad == 0.0 and clipped == 1.0


def test_a_value_moved_away_from_the_target_keeps_the_unclipped_error():
    # v_c = 0.3: (0.3 - 1)^2 = 0.49 < (0 - 1)^2 = 1, so the unclipped term (with gradient) wins.
    loss, grad, clipped = one_token(v=0.0, old=0.5, ret=1.0)
    assert abs(loss - 0.5) < 1e-6 and abs(grad - (-1.0)) < 1e-6 and clipped == 0.0


def test_without_clip_it_is_plain_mse():
    loss, grad, _ = one_token(v=1.0, old=0.5, ret=1.0, clip=None)
    assert loss == 0.0 and grad == 0.0
    loss, _, _ = one_token(v=3.0, old=0.0, ret=1.0, clip=None)
    assert abs(loss - 2.0) < 1e-6


def test_reductions_use_global_counts_and_masks():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    returns = torch.zeros(3, 3)
    token_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    sample_mask = torch.tensor([1.0, 1.0, 0.0])  # row 2 excluded
    tok, _ = value_loss_fn(
        values,
        values,
        returns,
        token_mask,
        sample_mask,
        ValueLossConfig(value_clip=None),
        global_tokens=6.0,
        global_seqs=4.0,
    )
    assert abs(float(tok) - 0.5 * (1 + 4 + 9) / 6.0) < 1e-6
    seq, _ = value_loss_fn(
        values,
        values,
        returns,
        token_mask,
        sample_mask,
        ValueLossConfig(value_clip=None, token_level_loss=False),
        global_tokens=6.0,
        global_seqs=4.0,
    )
    assert abs(float(seq) - 0.5 * ((1 + 4) / 2 + 9 / 1) / 4.0) < 1e-6


def test_micro_batch_partial_sums_add_up_to_the_full_batch_loss():
    g = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(4, 6, generator=g) for _ in range(3))
    token_mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    cfg = ValueLossConfig(value_clip=0.1)
    total = float(token_mask.sum())
    full, _ = value_loss_fn(values, old, returns, token_mask, torch.ones(4), cfg, total, 4.0)
    parts = sum(
        value_loss_fn(
            values[i : i + 2], old[i : i + 2], returns[i : i + 2], token_mask[i : i + 2], torch.ones(2), cfg, total, 4.0
        )[0]
        for i in (0, 2)
    )
    torch.testing.assert_close(parts, full)
