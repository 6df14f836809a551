"""RewardFnEnv: a plain Python function as a single-turn environment.

The function is named by import path (``"my_pkg.rewards:score"``) and takes the response text,
optionally followed by the sample's env_info dict (the dataset's ``ground_truth`` and any
``extra_env_info`` keys)::

    def score(response: str) -> float: ...
    def score(response: str, env_info: dict) -> float: ...

A second positional parameter, when the function has one, always receives env_info. The return
value must be a finite real number (bool and int are taken as floats); anything else makes that
sample fail, which the pool turns into reward 0 and a count in ``env/sample_errors``.
The function is imported where the environment is built (the pool's Ray actor), not pickled.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable

from grpo_envs.base import Environment, EnvOutput, MessageLog, response_text, single_turn_output
from grpo_envs.registry import load_object

CALLS = "reward_fn_calls"


def reward_fn_arity(fn: object, spec: str = "reward_fn") -> int:
    """1 when ``fn`` takes ``(response)``, 2 when it takes ``(response, env_info)``; TypeError
    naming the problem otherwise."""
    if not callable(fn):
        raise TypeError(f"{spec!r} is {fn!r:.100}, which is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 1  # a builtin without a signature: assume text in, float out
    for arity in (2, 1):
        try:
            sig.bind(*(["response", {}][:arity]))
            return arity
        except TypeError:
            continue
    raise TypeError(f"{spec!r} has signature {sig}; expected (response: str) or (response: str, env_info: dict)")


class RewardFnEnv(Environment):
    """Rewards are ``reward_fn(response[, env_info])``; every sample is done after one turn."""

    COUNT_METRICS = frozenset({CALLS})

    def __init__(self, reward_fn: str):
        self.spec = reward_fn
        self.fn: Callable = load_object(reward_fn)
        self.arity = reward_fn_arity(self.fn, reward_fn)

    def step(self, message_logs: list[MessageLog], env_infos: list[dict]) -> EnvOutput:
        rewards = [
            self._score(response_text(log) or "", info) for log, info in zip(message_logs, env_infos, strict=True)
        ]
        return single_turn_output(rewards, [{} for _ in rewards], {CALLS: float(len(rewards))})

    def _score(self, text: str, info: dict) -> float:
        value = self.fn(text, info) if self.arity == 2 else self.fn(text)
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise TypeError(f"{self.spec} returned {value!r:.100}; expected a finite float")
        return float(value)
