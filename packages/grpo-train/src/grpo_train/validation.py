"""Validation: greedy accuracy (and pass@k with sampling) on the validation prompts."""

from __future__ import annotations

from dataclasses import replace

from grpo_train.generation.base import SamplingSpec
from grpo_train.rollout import rollout


def validate(generator, envs: dict, datums: list, sampling: SamplingSpec, num_generations: int, batch_size: int) -> tuple[dict[str, float], list[dict]]:
    """Metrics over the validation set and a few samples to print.

    With one generation per prompt decoding is greedy and accuracy = pass@1. With k > 1
    samples per prompt (at the training temperature), pass@k = fraction of prompts with at
    least one correct (reward > 0) sample, and accuracy = mean reward.
    """
    spec = replace(sampling, n=num_generations, greedy=num_generations == 1)
    rewards, lengths, samples = [], [], []
    solved = 0
    for start in range(0, len(datums), batch_size):
        chunk = datums[start : start + batch_size]
        result = rollout(generator, envs, chunk, spec)
        for p in range(len(chunk)):
            group = result.rollouts[p * num_generations : (p + 1) * num_generations]
            solved += any(r.reward > 0 for r in group)
            rewards.extend(r.reward for r in group)
            lengths.extend(len(r.response_ids) for r in group)
        if not samples:
            samples = [{"prompt": chunk[r.prompt_index].message_log[-1]["content"], "response": r.text, "reward": r.reward}
                       for r in result.rollouts[: 4 * num_generations]]
    n = max(len(datums), 1)
    metrics = {
        "accuracy": sum(rewards) / max(len(rewards), 1),
        f"pass@{num_generations}": solved / n,
        "response_length": sum(lengths) / max(len(lengths), 1),
        "num_prompts": float(len(datums)),
    }
    return metrics, samples
