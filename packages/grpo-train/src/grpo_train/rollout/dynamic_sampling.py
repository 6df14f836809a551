"""DAPO dynamic sampling: keep only groups whose rewards differ, sample more until enough.

Rounds stop at `grpo.dynamic_sampling_max_gen_batches`; if still short, zero-signal groups
fill the batch (their advantages are 0, so they add no gradient) and the shortfall is logged.
"""

from __future__ import annotations

import torch

from grpo_train.advantages import groups_with_signal
from grpo_train.rollout import RolloutResult, rollout_batch


def fill_with_signal(cfg, parts, sampling, state, first: RolloutResult) -> tuple[RolloutResult, dict[str, float]]:
    n, target = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step
    kept, spare = [], []
    result, rounds = first, 1
    generate_s, reward_s, env_metrics = 0.0, 0.0, {}
    while True:
        generate_s += result.generate_s
        reward_s += result.reward_s
        env_metrics = result.env_metrics
        rewards = torch.tensor([r.reward for r in result.rollouts])
        signal = groups_with_signal(rewards, n)
        for p, keep in enumerate(signal.keep.tolist()):
            (kept if keep else spare).append(result.rollouts[p * n : (p + 1) * n])
        if len(kept) >= target or rounds >= cfg.grpo.dynamic_sampling_max_gen_batches:
            break
        datums = [d for _ in range(cfg.grpo.batch_multiplier) for d in next(parts.train_data)]
        state.consumed_prompts += len(datums)
        result = rollout_batch(cfg, parts, datums, sampling)
        rounds += 1
    groups = kept[:target] + spare[: max(0, target - len(kept))]
    rollouts = []
    for p, group in enumerate(groups):
        for r in group:
            r.prompt_index = p
            rollouts.append(r)
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/groups_short": float(max(0, target - len(kept))),
    }
    return RolloutResult(rollouts, env_metrics, generate_s, reward_s), metrics
