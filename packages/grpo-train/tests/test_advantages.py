"""Advantages pinned by hand-computed cases (shared/GRPO-MATH.md, rewards -> advantages)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_train.advantages import compute_advantages, groups_with_signal, scale_rewards, shape_rewards
from grpo_train.config.schema import GRPOConfig, RewardScalingConfig, RewardShapingConfig

EPS = 1e-6


def cfg(**kw) -> GRPOConfig:
    return GRPOConfig(**kw)


def test_group_mean_and_bessel_std_without_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = compute_advantages(r, torch.ones(4), 4, cfg(use_leave_one_out_baseline=False))
    # mean 0.5; Bessel std = sqrt((4 * 0.25) / 3) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + EPS)
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_baseline_and_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = compute_advantages(r, torch.ones(4), 4, cfg(use_leave_one_out_baseline=True))
    # sample 0: others [0,0,0] -> baseline 0, std 0 -> A = 1 (not normalised)
    # samples 1..3: others e.g. [1,0,0] -> baseline 1/3, std = sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3)
    b = 1 / 3
    s = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = torch.tensor([1.0, -b / (s + EPS), -b / (s + EPS), -b / (s + EPS)])
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_without_normalisation():
    r = torch.tensor([3.0, 1.0, 2.0])
    adv = compute_advantages(r, torch.ones(3), 3, cfg(use_leave_one_out_baseline=True, normalize_rewards=False))
    torch.testing.assert_close(adv, torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0]))


def test_std_zero_group_gets_zero_advantage():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    for loo in (True, False):
        adv = compute_advantages(r, torch.ones(6), 3, cfg(use_leave_one_out_baseline=loo))
        torch.testing.assert_close(adv, torch.zeros(6))


def test_invalid_samples_are_excluded_and_zeroed():
    r = torch.tensor([1.0, 0.0, 5.0, 0.0])
    valid = torch.tensor([1, 1, 0, 1])
    adv = compute_advantages(r, valid, 4, cfg(use_leave_one_out_baseline=False, normalize_rewards=False))
    # valid rewards [1, 0, 0] -> mean 1/3; invalid sample gets 0
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]))


def test_group_with_one_valid_sample_gets_zero():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    valid = torch.tensor([1, 0, 1, 1])
    adv = compute_advantages(r, valid, 2, cfg(normalize_rewards=False, use_leave_one_out_baseline=False))
    # group 0 has one valid sample -> 0; group 1: mean 0.5
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, -0.5, 0.5]))


def test_advantage_clip():
    r = torch.tensor([10.0, 0.0])
    adv = compute_advantages(
        r,
        torch.ones(2),
        2,
        cfg(
            normalize_rewards=False, use_leave_one_out_baseline=False, advantage_clip_low=-1.0, advantage_clip_high=2.0
        ),
    )
    torch.testing.assert_close(adv, torch.tensor([2.0, -1.0]))


def test_bad_group_size():
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages(torch.zeros(6), torch.ones(6), 4, cfg())


def test_reward_scaling_and_shaping_by_hand():
    sc = RewardScalingConfig(enabled=True, source_min=0, source_max=2, target_min=-1, target_max=1)
    torch.testing.assert_close(
        scale_rewards(torch.tensor([-5.0, 0.0, 1.0, 2.0, 9.0]), sc), torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0])
    )
    sh = RewardShapingConfig(
        enabled=True, max_response_length=10, overlong_buffer_length=4, overlong_buffer_penalty=2.0
    )
    # L_exp = 6: L=5 -> 0; L=8 -> -(2/4)*2 = -1; L=10 -> -(4/4)*2 = -2
    out = shape_rewards(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([5, 8, 10]), torch.tensor([False, False, True]), sh)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, -1.0]))
    sh2 = RewardShapingConfig(
        enabled=True, max_response_length=100, overlong_buffer_length=4, stop_properly_penalty_coef=0.5
    )
    out = shape_rewards(torch.tensor([1.0, 1.0]), torch.tensor([5, 5]), torch.tensor([False, True]), sh2)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.5]))


def test_groups_with_signal():
    sig = groups_with_signal(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert sig.keep.tolist() == [False, True, False] and sig.num_kept == 1


def test_stop_properly_replaces_the_dapo_penalty_instead_of_scaling_it():
    # DAPO alone: L_exp = 6; the truncated L = 10 gets 1 - (4/4) * 1.6 = -0.6
    dapo = RewardShapingConfig(
        enabled=True, max_response_length=10, overlong_buffer_length=4, overlong_buffer_penalty=1.6
    )
    lengths, truncated = torch.tensor([5, 10]), torch.tensor([False, True])
    torch.testing.assert_close(
        shape_rewards(torch.tensor([1.0, 1.0]), lengths, truncated, dapo), torch.tensor([1.0, -0.6])
    )
    # With the coefficient the raw reward is scaled (1 * 0.5), not the penalised one (-0.6 * 0.5 = -0.3, a raise)
    stop = dapo.model_copy(update={"stop_properly_penalty_coef": 0.5})
    torch.testing.assert_close(
        shape_rewards(torch.tensor([1.0, 1.0]), lengths, truncated, stop), torch.tensor([1.0, 0.5])
    )
    zero = dapo.model_copy(update={"stop_properly_penalty_coef": 0.0})
    torch.testing.assert_close(
        shape_rewards(torch.tensor([1.0, 1.0]), lengths, truncated, zero), torch.tensor([1.0, 0.0])
    )


@pytest.mark.parametrize("coef", [-0.1, 1.5])
def test_stop_properly_coefficient_outside_0_1_is_refused_at_its_key(coef):
    from grpo_train.config import ConfigError, validate_config_dict

    with pytest.raises(ConfigError) as info:
        validate_config_dict({"grpo": {"reward_shaping": {"enabled": True, "stop_properly_penalty_coef": coef}}})
    assert info.value.key == "grpo.reward_shaping.stop_properly_penalty_coef"
