"""GRPO's advantage estimators (grpo.adv_estimator.name) pinned by hand-computed cases.

Numbers are worked out by hand in the comments (docs/algorithms.md, ## Advantages).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_train.config.schema import GRPOConfig
from grpo_train.group_estimators import GroupBatch, estimate_advantages, kl_in_reward

torch.set_num_threads(1)


def mask_of(lengths: list[int], width: int = 3) -> torch.Tensor:
    m = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        m[i, :n] = 1.0
    return m


def est(name: str, **kw) -> GRPOConfig:
    return GRPOConfig(adv_estimator={"name": name, **kw})


def batch(rewards, lengths, group_size=2, valid=None, components=None, kl=None) -> GroupBatch:
    r = torch.tensor(rewards, dtype=torch.float32)
    return GroupBatch(
        rewards=r,
        valid=torch.ones(len(r), dtype=torch.bool) if valid is None else torch.tensor(valid),
        token_mask=mask_of(lengths),
        group_size=group_size,
        components=None if components is None else torch.tensor(components, dtype=torch.float32),
        kl_penalty=kl,
    )


def tokens(adv: torch.Tensor, lengths: list[int]) -> list[float]:
    return [float(adv[i, t]) for i, n in enumerate(lengths) for t in range(n)]


# ------------------------------------------------------------------------------ grpo
def test_grpo_broadcasts_the_group_advantage_to_every_response_token():
    lengths = [1, 2, 1, 1]
    adv = estimate_advantages(
        est("grpo", normalize_rewards=False, use_leave_one_out_baseline=False), batch([1, 0, 1, 1], lengths)
    )
    # groups [1, 0] (mean 0.5) and [1, 1] (mean 1)
    assert tokens(adv, lengths) == [0.5, -0.5, -0.5, 0.0, 0.0]
    assert adv[0, 1:].tolist() == [0.0, 0.0] and adv[1, 2] == 0.0  # nothing off the response


def test_grpo_adv_estimator_keys_override_the_top_level_ones():
    cfg = GRPOConfig(adv_estimator={"name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": True})
    assert not cfg.normalize_group_rewards and cfg.leave_one_out
    # RLOO without std: [3, 1, 2] -> 3 - 1.5, 1 - 2.5, 2 - 2
    adv = estimate_advantages(cfg, batch([3, 1, 2], [1, 1, 1], group_size=3))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.5, -1.5, 0.0]))


# ------------------------------------------------------------------- reinforce_plus_plus
def test_reinforce_plus_plus_baseline_whitens_over_all_response_tokens():
    lengths = [1, 2, 1, 1]
    adv = estimate_advantages(est("reinforce_plus_plus"), batch([1, 0, 1, 1], lengths))
    # minus group mean: [0.5, -0.5, 0, 0] -> tokens [0.5, -0.5, -0.5, 0, 0]; mean -0.1;
    # deviations [0.6, -0.4, -0.4, 0.1, 0.1], population var 0.7 / 5 = 0.14
    s = 1 / math.sqrt(0.14)
    torch.testing.assert_close(torch.tensor(tokens(adv, lengths)), torch.tensor([0.6, -0.4, -0.4, 0.1, 0.1]) * s)


def test_reinforce_plus_plus_without_baseline():
    lengths = [1, 2, 1, 1]
    adv = estimate_advantages(est("reinforce_plus_plus", minus_baseline=False), batch([1, 0, 1, 1], lengths))
    # tokens [1, 0, 0, 1, 1]: mean 0.6, var (3 * 0.16 + 2 * 0.36) / 5 = 0.24
    s = 1 / math.sqrt(0.24)
    torch.testing.assert_close(torch.tensor(tokens(adv, lengths)), torch.tensor([0.4, -0.6, -0.6, 0.4, 0.4]) * s)


def test_reinforce_plus_plus_subtracts_the_kl_before_whitening():
    lengths = [1, 2, 1, 1]
    kl = torch.zeros(4, 3)
    kl[0, 0] = 0.2
    adv = estimate_advantages(est("reinforce_plus_plus"), batch([1, 0, 1, 1], lengths, kl=kl))
    # tokens [0.3, -0.5, -0.5, 0, 0]: mean -0.14, deviations [0.44, -0.36, -0.36, 0.14, 0.14], var 0.492 / 5
    s = 1 / math.sqrt(0.0984)
    torch.testing.assert_close(torch.tensor(tokens(adv, lengths)), torch.tensor([0.44, -0.36, -0.36, 0.14, 0.14]) * s)


def test_reinforce_plus_plus_ignores_invalid_samples_in_baseline_and_statistics():
    lengths = [1, 1, 1, 1]
    adv = estimate_advantages(est("reinforce_plus_plus"), batch([1, 0, 5, 1], lengths, valid=[True, True, False, True]))
    # group 1 keeps only its last sample (1 - 1 = 0); tokens of kept samples [0.5, -0.5, 0]: mean 0, var 1/6
    s = 1 / math.sqrt(1 / 6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5 * s, -0.5 * s, 0.0, 0.0]))


# ------------------------------------------------------------------------------ gdpo
def test_gdpo_normalises_each_component_in_its_group_then_the_sum_over_the_batch():
    lengths = [1, 1, 1, 1]
    comps = [[1, 0], [0, 1], [1, 1], [1, 0]]  # columns: two reward components
    cfg = est("gdpo", normalize_rewards=False, use_leave_one_out_baseline=False)
    adv = estimate_advantages(cfg, batch([0, 0, 0, 0], lengths, components=comps))
    # component 1: groups [1, 0], [1, 1] -> [0.5, -0.5, 0, 0]; component 2: [0, 1], [1, 0] -> [-0.5, 0.5, 0.5, -0.5]
    # sum [0, 0, 0.5, -0.5]: mean 0, Bessel std sqrt(0.5 / 3)
    s = 1 / math.sqrt(0.5 / 3)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.0, 0.5 * s, -0.5 * s]))
    weighted = estimate_advantages(
        est("gdpo", normalize_rewards=False, use_leave_one_out_baseline=False, reward_weights=[2.0, 1.0]),
        batch([0, 0, 0, 0], lengths, components=comps),
    )
    # 2 * [0.5, -0.5, 0, 0] + [-0.5, 0.5, 0.5, -0.5] = [0.5, -0.5, 0.5, -0.5]: std sqrt(1 / 3)
    torch.testing.assert_close(weighted[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5]) * math.sqrt(3))


def test_gdpo_needs_two_components_and_matching_weights():
    with pytest.raises(ValueError, match="at least two reward components"):
        estimate_advantages(est("gdpo"), batch([1, 0], [1, 1], components=[[1], [0]]))
    with pytest.raises(ValueError, match="reward_weights has 3 entries"):
        estimate_advantages(
            est("gdpo", reward_weights=[1.0, 1.0, 1.0]), batch([1, 0], [1, 1], components=[[1, 0], [0, 1]])
        )


# --------------------------------------------------------------- invariances, clips, KL
@pytest.mark.parametrize("name", ["grpo", "gdpo", "reinforce_plus_plus"])
def test_group_order_does_not_change_any_samples_advantage(name):
    lengths = [1, 2, 3, 1, 2, 2]
    rewards = [1, 0, 0.5, 1, 1, 0]
    comps = [[1, 0], [0, 1], [1, 1], [1, 0], [0, 0], [1, 1]]
    adv = estimate_advantages(est(name), batch(rewards, lengths, group_size=2, components=comps))
    order = [4, 5, 0, 1, 2, 3]  # groups 2, 0, 1
    swapped = estimate_advantages(
        est(name),
        batch(
            [rewards[i] for i in order], [lengths[i] for i in order], group_size=2, components=[comps[i] for i in order]
        ),
    )
    torch.testing.assert_close(swapped, adv[order])


def test_grpo_groups_are_independent_so_any_split_of_the_batch_agrees():
    rewards, lengths = [1, 0, 0.5, 1, 1, 0], [1, 2, 3, 1, 2, 2]
    whole = estimate_advantages(est("grpo"), batch(rewards, lengths))
    halves = torch.cat(
        [
            estimate_advantages(est("grpo"), batch(rewards[:2], lengths[:2])),
            estimate_advantages(est("grpo"), batch(rewards[2:], lengths[2:])),
        ]
    )
    torch.testing.assert_close(whole, halves)


def test_clips_apply_to_every_estimator():
    cfg = GRPOConfig(advantage_clip_low=-1.0, advantage_clip_high=1.0, adv_estimator={"name": "reinforce_plus_plus"})
    adv = estimate_advantages(cfg, batch([1, 0, 1, 1], [1, 2, 1, 1]))
    assert float(adv.max()) == 1.0 and float(adv.min()) == -1.0  # 1.60 and -1.07 before the clamp


def test_kl_in_reward_uses_the_configured_estimator():
    prev = torch.tensor([[-0.5, -0.5]])
    ref = torch.tensor([[-1.5, -0.5]])
    m = torch.tensor([[1.0, 0.0]])
    # logr = ref - prev = -1 on the response token: k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1 = e^-1
    for kind, k in (("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1))):
        torch.testing.assert_close(kl_in_reward(prev, ref, m, 0.1, kind, 20.0, 10.0), torch.tensor([[0.1 * k, 0.0]]))
    # input clamp: logr -1 clamped to -0.5 -> k1 = 0.5
    torch.testing.assert_close(kl_in_reward(prev, ref, m, 1.0, "k1", 0.5, None), torch.tensor([[0.5, 0.0]]))
