"""Number guessing: the multi-turn example environment.

The model guesses a secret integer; each wrong guess gets an observation message saying
"higher" or "lower" and the conversation continues, until the guess is right (reward 1, done)
or ``max_turns`` guesses have been made (reward 0, done). A guess is the first integer of the
response; a response without one counts as a turn and is told so.

env_info: ``{"target": int, "max_turns": int (optional)}``; ``ground_truth`` stands in for a
missing ``target``.
"""

from __future__ import annotations

from grpo_envs.answers import canonical_integer, first_integer
from grpo_envs.base import Environment, EnvOutput, count_turns, response_text

ROLE = "environment"


class NumberGuessEnv(Environment):
    """Reward 1 on the turn the secret number is guessed; observations steer the next guess."""

    COUNT_METRICS = frozenset({"solved", "failed"})

    def __init__(self, max_turns: int = 8) -> None:
        if max_turns < 1:
            raise ValueError(f"number_guess env: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        rewards, observations, terminateds, metadata = [], [], [], []
        for i, (log, info) in enumerate(zip(message_logs, env_infos, strict=True)):
            # `ground_truth` (what grpo-data's processors emit) serves when no `target` is given,
            # so any dataset with integer answers can drive a guessing conversation.
            target = canonical_integer(str(info.get("target", info.get("ground_truth", ""))))
            if target is None:
                raise ValueError(
                    f"number_guess env: sample {i}: 'target' must be an integer, got {info.get('target')!r}"
                )
            max_turns = int(info.get("max_turns", self.max_turns))
            turn = count_turns(log)
            guess = first_integer(response_text(log) or "")
            solved = guess == target
            out_of_turns = turn >= max_turns
            if solved:
                hint = "correct"
            elif guess is None:
                hint = "no number found; answer with an integer"
            else:
                hint = "higher" if _less(guess, target) else "lower"
            rewards.append(1.0 if solved else 0.0)
            terminateds.append(solved or out_of_turns)
            observations.append(None if solved or out_of_turns else {"role": ROLE, "content": hint})
            metadata.append({"turn": turn, "guess": guess, "hint": hint, "solved": solved})
        done = [m for m, t in zip(metadata, terminateds) if t]
        metrics = {
            "solved": float(sum(m["solved"] for m in done)),
            "failed": float(sum(not m["solved"] for m in done)),
            "mean_turn": sum(m["turn"] for m in metadata) / len(metadata) if metadata else 0.0,
        }
        return EnvOutput(rewards, observations, terminateds, metadata, metrics)


def _less(a: str, b: str) -> bool:
    """a < b for canonical integer strings of any length."""
    neg_a, neg_b = a.startswith("-"), b.startswith("-")
    if neg_a != neg_b:
        return neg_a
    key_a, key_b = (len(a), a), (len(b), b)
    return key_a > key_b if neg_a else key_a < key_b
