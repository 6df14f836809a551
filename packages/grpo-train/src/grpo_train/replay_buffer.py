"""The replay buffer of async GRPO: prompt groups waiting for the training step meant to use them.

Job: hold `GroupEntry`s (one prompt's N samples, tagged with the weight version that generated
them and the step that will consume them), hand a step exactly the groups targeted at it, drop
those older than `max_trajectory_age_steps`, and keep a record of every group it handed out or
dropped (the record is how tests and people check the age bound over a whole run).
Boundary: no generation, no training, no Ray in the class itself (`make_replay_buffer_actor`
wraps it); entries are opaque beyond their tags.

The age rule: training step s runs at weight version s - 1 (one refit per step) and takes only
groups generated at versions >= s - 1 - max_trajectory_age_steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupEntry:
    """One prompt group: the N rollouts of one prompt, and where it came from and goes to."""

    target_step: int  # the training step meant to consume it
    weight_version: int  # refits the generator had received when the group's requests were sent
    prompt_index: int  # position of the prompt in its step's batch
    datum: Any  # the prompt's DatumSpec (kept so a dropped group's prompt can be generated again)
    rollouts: list = field(default_factory=list)  # [N] Rollout, in sample order
    epoch: int = 0  # the dataloader's epoch after the prompt was drawn
    env_metrics: dict = field(default_factory=dict)  # the environments' metrics of the rollout it came from


@dataclass
class Taken:
    """What a step gets from the buffer: the groups it trains on, and the stale ones dropped."""

    fresh: list[GroupEntry]
    stale: list[GroupEntry]


def is_stale(entry: GroupEntry, trainer_version: int, max_age: int) -> bool:
    return entry.weight_version < trainer_version - max_age


class ReplayBuffer:
    """Prompt groups keyed by target step; see the module docstring for the age rule."""

    def __init__(self, max_age: int) -> None:
        if max_age < 0:
            raise ValueError(f"grpo.async_grpo.max_trajectory_age_steps must be >= 0, got {max_age}")
        self.max_age = max_age
        self.entries: list[GroupEntry] = []
        self.records: list[dict] = []  # one per group handed out or dropped, in order

    def push(self, entries: list[GroupEntry]) -> int:
        """Add groups; returns the buffer's size."""
        self.entries.extend(entries)
        return len(self.entries)

    def count(self, step: int) -> int:
        """Groups waiting for `step`."""
        return sum(e.target_step == step for e in self.entries)

    def size(self) -> int:
        return len(self.entries)

    def take(self, step: int, trainer_version: int, count: int) -> Taken | None:
        """All groups targeted at `step` once `count` of them are here (None before): the fresh
        ones in prompt order and the stale ones, which are dropped. Recorded either way."""
        mine = [e for e in self.entries if e.target_step == step]
        if len(mine) < count:
            return None
        self.entries = [e for e in self.entries if e.target_step != step]
        mine.sort(key=lambda e: e.prompt_index)
        taken = Taken([], [])
        for entry in mine:
            stale = is_stale(entry, trainer_version, self.max_age)
            (taken.stale if stale else taken.fresh).append(entry)
            self.records.append(_record(entry, step, trainer_version, stale))
        return taken

    def record_regenerated(self, entries: list[GroupEntry], step: int, trainer_version: int) -> None:
        """Groups generated again for a step whose own ones were stale (trained at once)."""
        self.records.extend(_record(e, step, trainer_version, False) for e in entries)

    def state_dict(self) -> dict:
        return {"max_age": self.max_age, "entries": list(self.entries), "records": list(self.records)}

    def load_state_dict(self, state: dict) -> None:
        """Entries and records of a checkpoint; the age bound stays this run's (stale entries
        are dropped when their step takes them, by the same rule as during the run)."""
        self.entries = list(state["entries"])
        self.records = list(state["records"])


def _record(entry: GroupEntry, step: int, trainer_version: int, dropped: bool) -> dict:
    prompt = entry.datum.message_log[0]["content"] if getattr(entry.datum, "message_log", None) else ""
    return {
        "step": step,
        "trainer_version": trainer_version,
        "weight_version": entry.weight_version,
        "age": trainer_version - entry.weight_version,
        "prompt_index": entry.prompt_index,
        "datum_idx": int(getattr(entry.datum, "idx", -1)),
        "prompt": prompt,
        "dropped": dropped,
    }


def make_replay_buffer_actor(max_age: int):
    """A `ReplayBuffer` in its own Ray actor (a fraction of a CPU: it only moves references)."""
    import ray

    return ray.remote(num_cpus=0)(ReplayBuffer).remote(max_age)
