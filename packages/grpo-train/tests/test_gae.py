"""GAE, returns and the PPO advantage estimators against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from grpo_train.config.schema import AdvEstimatorConfig
from grpo_train.ppo.estimators import EstimatorInput, compute_ppo_advantages
from grpo_train.ppo.gae import gae, last_token_rewards, length_adaptive_lambda, returns_from_gae, whiten

torch.set_num_threads(1)

# One row: two prompt tokens, three response tokens, reward 1 on the last one.
MASK = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]])
VALUES = torch.tensor([[0.0, 0.0, 0.5, 0.6, 0.7]])
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])


def test_reward_lands_on_the_last_response_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = last_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]


def test_gae_matches_hand_computation():
    # gamma 0.9, lambda 0.8 (gamma*lambda = 0.72):
    # t4: delta = 1 - 0.7 = 0.3                      A = 0.3
    # t3: delta = 0.9*0.7 - 0.6 = 0.03               A = 0.03 + 0.72*0.3 = 0.246
    # t2: delta = 0.9*0.6 - 0.5 = 0.04               A = 0.04 + 0.72*0.246 = 0.21712
    adv = gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.21712, 0.246, 0.3]]))
    returns = returns_from_gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.0, 0.71712, 0.846, 1.0]]))


def test_gamma_one_lambda_one_is_monte_carlo_return_minus_value():
    adv = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns_from_gae(REWARDS, VALUES, MASK, 1.0, 1.0), MASK)


def test_lambda_zero_is_the_one_step_td_error():
    # delta_t = r_t + V_{t+1} - V_t: 0.6-0.5, 0.7-0.6, 1-0.7
    adv = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.1, 0.1, 0.3]]))


def test_masked_tokens_inside_the_response_are_skipped():
    # An observation token (mask 0) between two generated tokens carries junk value 9: the
    # recursion passes over it, so the numbers equal the contiguous case above.
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.0, 0.5, 9.0, 0.6, 0.7, 3.0]])
    rewards = last_token_rewards(torch.tensor([1.0]), mask)
    adv = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.21712, 0.0, 0.246, 0.3, 0.0]]))


def test_per_row_lambda_and_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([4, 1]), alpha=0.5)  # 1 - 1/(0.5*4) = 0.5; 1 - 1/0.5 < 0 -> 0
    torch.testing.assert_close(lam, torch.tensor([0.5, 0.0], dtype=torch.float64))
    rows = gae(REWARDS.repeat(2, 1), VALUES.repeat(2, 1), MASK.repeat(2, 1), gamma=1.0, lam=torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(rows, torch.tensor([[0.0, 0.0, 0.5, 0.4, 0.3], [0.0, 0.0, 0.1, 0.1, 0.3]]))


def test_whiten_uses_only_masked_tokens():
    x = torch.tensor([[100.0, 1.0, 2.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    out = whiten(x, mask)
    valid = out[mask > 0]
    assert abs(float(valid.mean())) < 1e-6 and abs(float(valid.std()) - 1.0) < 1e-6
    assert out[mask == 0].tolist() == [0.0, 0.0]


def inputs(scores=(1.0, 0.0)) -> EstimatorInput:
    mask = MASK.repeat(2, 1)
    return EstimatorInput(
        rewards=last_token_rewards(torch.tensor(scores), mask),
        values=VALUES.repeat(2, 1),
        token_mask=mask,
        sample_mask=torch.ones(2),
        response_lengths=torch.tensor([3, 3]),
    )


def test_gae_estimator_with_separate_policy_and_value_lambdas():
    cfg = AdvEstimatorConfig(
        name="gae", gae_gamma=1.0, policy_gae_lambda=0.0, value_gae_lambda=1.0, normalize_advantages=False
    )
    adv, returns = compute_ppo_advantages(cfg, inputs())
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 0.0, 0.1, 0.1, 0.3]))  # lambda 0: TD errors
    torch.testing.assert_close(returns[0], MASK[0])  # lambda 1: Monte Carlo return
    torch.testing.assert_close(returns[1], torch.zeros(5))


def test_length_adaptive_alpha_overrides_the_policy_lambda():
    cfg = AdvEstimatorConfig(gae_gamma=1.0, gae_lambda=1.0, length_adaptive_alpha=1 / 3, normalize_advantages=False)
    adv, _ = compute_ppo_advantages(cfg, inputs())  # length 3 -> lambda 0
    torch.testing.assert_close(adv[0], torch.tensor([0.0, 0.0, 0.1, 0.1, 0.3]))


def test_raw_reward_estimator_is_the_discounted_reward_to_go():
    cfg = AdvEstimatorConfig(name="raw_reward", gae_gamma=0.5, normalize_advantages=False)
    adv, returns = compute_ppo_advantages(cfg, inputs(scores=(2.0, -1.0)))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.5, 1.0, 2.0], [0.0, 0.0, -0.25, -0.5, -1.0]]))
    torch.testing.assert_close(returns, adv)


def test_normalised_advantages_skip_masked_samples():
    x = inputs()
    x.sample_mask = torch.tensor([1.0, 0.0])
    adv, _ = compute_ppo_advantages(AdvEstimatorConfig(gae_gamma=1.0, gae_lambda=1.0), x)
    assert adv[1].abs().sum() == 0
    assert abs(float(adv[0, 2:].mean())) < 1e-6


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_relative_estimators_are_refused(name):
    from grpo_train.config import ConfigError, validate_config_dict

    with pytest.raises(ConfigError, match=rf"ppo\.adv_estimator\.name: '{name}' is group-relative; use GRPO"):
        validate_config_dict({"ppo": {"adv_estimator": {"name": name}}})
