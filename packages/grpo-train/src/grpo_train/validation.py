"""Validation: greedy accuracy (and pass@k with sampling) on the validation prompts.

With `max_turns` > 1 validation runs the same multi-turn rollout as training (tool calls, tool
results, per-turn stop strings), in lockstep so that greedy validation is reproducible; a
sample's reward is that of its whole conversation.
"""

from __future__ import annotations

from dataclasses import replace

from grpo_train.config.schema import GRPOConfig, PolicyConfig
from grpo_train.generation.base import SamplingSpec
from grpo_train.rollout import rollout
from grpo_train.rollout.multi_turn import multi_turn_rollout


def validate(
    generator,
    envs: dict,
    datums: list,
    sampling: SamplingSpec,
    num_generations: int,
    batch_size: int,
    *,
    max_turns: int = 1,
    tokenizer=None,
    max_total_len: int | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """Metrics over the validation set and a few samples to print.

    With one generation per prompt decoding is greedy and accuracy = pass@1. With k > 1
    samples per prompt (at the training temperature), pass@k = fraction of prompts with at
    least one correct (reward > 0) sample, and accuracy = mean reward. `max_turns` > 1 (with
    the tokenizer and the context length) validates over turns; `turns_mean` is then reported.
    """
    spec = replace(sampling, n=num_generations, greedy=num_generations == 1)
    if max_turns > 1 and (tokenizer is None or max_total_len is None):
        raise ValueError("validate: max_turns > 1 needs the tokenizer and max_total_len")
    rewards, lengths, samples, turns = [], [], [], []
    solved = 0
    for start in range(0, len(datums), batch_size):
        chunk = datums[start : start + batch_size]
        if max_turns > 1:
            result = multi_turn_rollout(generator, envs, chunk, spec, tokenizer, max_turns, max_total_len or 0)
        else:
            result = rollout(generator, envs, chunk, spec)
        turns.extend(r.turns for r in result.rollouts)
        for p in range(len(chunk)):
            group = result.rollouts[p * num_generations : (p + 1) * num_generations]
            solved += any(r.reward > 0 for r in group)
            rewards.extend(r.reward for r in group)
            lengths.extend(len(r.response_ids) for r in group)
        if not samples:
            samples = [
                {"prompt": chunk[r.prompt_index].message_log[-1]["content"], "response": r.text, "reward": r.reward}
                for r in result.rollouts[: 4 * num_generations]
            ]
    n = max(len(datums), 1)
    metrics = {
        "accuracy": sum(rewards) / max(len(rewards), 1),
        f"pass@{num_generations}": solved / n,
        "response_length": sum(lengths) / max(len(lengths), 1),
        "num_prompts": float(len(datums)),
    }
    if max_turns > 1:
        metrics["turns_mean"] = sum(turns) / max(len(turns), 1)
    return metrics, samples


def validation_turns(grpo: GRPOConfig, policy: PolicyConfig, tokenizer) -> dict:
    """The multi-turn keywords of `validate` for a run: as many turns as training rolls out."""
    return {
        "max_turns": grpo.max_rollout_turns,
        "tokenizer": tokenizer,
        "max_total_len": policy.max_total_sequence_length,
    }
