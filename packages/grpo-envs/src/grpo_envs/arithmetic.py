"""Arithmetic: the offline demo's environment. Exact integer answers, no math-verify.

The answer is the first integer of the stripped response, so trailing end-of-sequence text or
spaces are tolerated ("46</s>" scores like "46") and a response without an integer scores 0.
Integers are compared as canonical strings, so a 10,000-digit response costs microseconds.
"""

from __future__ import annotations

from grpo_envs.answers import canonical_integer, first_integer
from grpo_envs.base import Environment, EnvOutput, preview, response_text, single_turn_output


class ArithmeticEnv(Environment):
    """Reward 1 when the response's first integer equals ``env_info["ground_truth"]``, else 0."""

    COUNT_METRICS = frozenset({"no_answer"})

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        rewards, metadata = [], []
        for i, (log, info) in enumerate(zip(message_logs, env_infos, strict=True)):
            gold = canonical_integer(str(info.get("ground_truth", "")))
            if gold is None:
                raise ValueError(
                    f"arithmetic env: sample {i}: ground_truth must be an integer string, "
                    f"got {info.get('ground_truth')!r}"
                )
            answer = first_integer(response_text(log) or "")
            correct = answer == gold
            rewards.append(1.0 if correct else 0.0)
            metadata.append({"answer": preview(answer), "ground_truth": gold, "correct": correct})
        n = len(rewards)
        metrics = {
            "accuracy": sum(rewards) / n if n else 0.0,
            "no_answer": float(sum(m["answer"] is None for m in metadata)),
        }
        return single_turn_output(rewards, metadata, metrics)
