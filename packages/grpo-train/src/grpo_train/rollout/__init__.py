"""Rollout: the training rollout the config asks for, one turn or multi-turn conversations.

`rollout_batch` is the one dispatch point; `single_turn` holds the pieces of a turn (generate in
chunks, step the environments) that `multi_turn` reuses; `dynamic_sampling` (DAPO) calls
`rollout_batch` again until enough groups carry a learning signal.
"""

from __future__ import annotations

from typing import Any, Protocol

from grpo_train.generation.base import SamplingSpec
from grpo_train.rollout.multi_turn import multi_turn_rollout
from grpo_train.rollout.single_turn import RolloutResult, rollout

__all__ = ["RolloutParts", "RolloutResult", "rollout", "rollout_batch"]


class RolloutParts(Protocol):
    """What a rollout uses of a run's components: the engines (a `GeneratorGroup`), the
    environment pools by name, and the tokenizer (multi-turn renders). The driver's `Components`
    and the async collector's `CollectorParts` both provide them."""

    @property
    def generator(self) -> Any: ...

    @property
    def envs(self) -> dict: ...

    @property
    def tokenizer(self) -> Any: ...


def rollout_batch(cfg, parts: RolloutParts, datums: list, sampling: SamplingSpec) -> RolloutResult:
    """The training rollout the config asks for: one turn, or multi-turn conversations."""
    if cfg.grpo.max_rollout_turns > 1:
        return multi_turn_rollout(
            parts.generator,
            parts.envs,
            datums,
            sampling,
            parts.tokenizer,
            cfg.grpo.max_rollout_turns,
            cfg.policy.max_total_sequence_length,
            chunk_size=cfg.policy.generation_batch_size,
            per_sample=cfg.grpo.per_sample_turns,
        )
    return rollout(parts.generator, parts.envs, datums, sampling, chunk_size=cfg.policy.generation_batch_size)
