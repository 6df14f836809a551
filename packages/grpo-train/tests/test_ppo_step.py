"""PPO's batch preparation: GRPO's reward scaling, shaping and overlong filtering; token rewards with KL."""

from __future__ import annotations

import math

import torch

from grpo_train.batch import Rollout
from grpo_train.config import validate_config_dict
from grpo_train.ppo.ppo_step import prepare_ppo_batch, token_rewards

torch.set_num_threads(1)


def rollouts() -> list[Rollout]:
    def one(i, reward, n, truncated):
        return Rollout(
            prompt_index=i // 2,
            prompt_ids=[5, 6],
            response_ids=list(range(7, 7 + n)),
            gen_logprobs=[-0.5] * n,
            text="",
            truncated=truncated,
            reward=reward,
        )

    return [one(0, 1.0, 2, False), one(1, 0.0, 4, True), one(2, 1.0, 3, False), one(3, 1.0, 4, True)]


def cfg(**ppo_and_more):
    base = {
        "grpo": {
            "num_prompts_per_step": 2,
            "num_generations_per_prompt": 2,
            "overlong_filtering": True,
            "reward_scaling": {"enabled": True, "source_min": 0, "source_max": 1, "target_min": -1, "target_max": 1},
        },
        "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 4},
        "ppo": {},
    }
    return validate_config_dict(base | ppo_and_more)


def test_batch_has_scaled_scores_and_filters_truncated_samples():
    batch, metrics = prepare_ppo_batch(cfg().grpo, cfg().policy, rollouts(), pad_id=0)
    assert batch["scores"].tolist() == [1.0, -1.0, 1.0, 1.0]  # [0, 1] scaled onto [-1, 1]
    assert batch["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]  # truncated: no gradient
    assert batch["token_mask"].sum(dim=1).tolist() == [2.0, 4.0, 3.0, 4.0]
    assert metrics["accuracy"] == 0.75 and metrics["masked_samples"] == 2.0 and metrics["truncated_fraction"] == 0.5


def test_token_rewards_put_the_score_last_and_subtract_the_kl_per_token():
    # beta = 0.1 with k3: logr = ref - prev = -1 -> k3 = e^-1 - 1 + 1 = e^-1 per token
    c = cfg(loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k3"})
    batch, _ = prepare_ppo_batch(c.grpo, c.policy, rollouts()[:2], pad_id=0)
    batch["prev_logprobs"] = -0.5 * batch["token_mask"]
    batch["ref_logprobs"] = -1.5 * batch["token_mask"]
    k = 0.1 * math.exp(-1)
    rewards = token_rewards(c.loss_fn, batch)
    torch.testing.assert_close(rewards[0], torch.tensor([0.0, 0.0, -k, 1 - k, 0.0, 0.0]))
    torch.testing.assert_close(rewards[1], torch.tensor([0.0, 0.0, -k, -k, -k, -1 - k]))
    k1 = cfg(loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1"})
    torch.testing.assert_close(token_rewards(k1.loss_fn, batch)[0], torch.tensor([0.0, 0.0, -0.1, 0.9, 0.0, 0.0]))
    without = token_rewards(cfg().loss_fn, batch)
    assert without[1].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]


def test_kl_in_reward_turns_the_losss_kl_term_off():
    from grpo_train.policy.worker import pg_loss_config

    c = cfg(loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1})
    assert pg_loss_config(c.loss_fn).reference_policy_kl_penalty == 0.0  # not applied twice
    assert c.loss_fn.reference_policy_kl_penalty == 0.1  # the reference is still loaded for the reward


def test_old_ppo_kl_keys_are_refused_with_the_new_key():
    import pytest

    from grpo_train.config import ConfigError

    with pytest.raises(ConfigError, match="loss_fn.use_kl_in_reward"):
        cfg(ppo={"use_kl_in_reward": True, "kl_in_reward_coef": 0.1})
