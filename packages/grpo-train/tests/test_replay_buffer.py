"""The replay buffer's rules: a step gets exactly its groups, never stale ones, and all is recorded."""

from __future__ import annotations

import pytest
import torch

from grpo_data.records import DatumSpec
from grpo_train.replay_buffer import GroupEntry, ReplayBuffer, is_stale


def entry(target: int, version: int, index: int) -> GroupEntry:
    datum = DatumSpec(
        message_log=[{"role": "user", "content": f"{target}.{index}", "token_ids": torch.tensor([1, 2])}],
        length=2,
        extra_env_info={},
        idx=100 * target + index,
    )
    return GroupEntry(target_step=target, weight_version=version, prompt_index=index, datum=datum, rollouts=[index])


def test_a_step_waits_for_all_its_groups_and_takes_only_them():
    buffer = ReplayBuffer(max_age=1)
    buffer.push([entry(3, 1, 1), entry(4, 2, 0)])
    assert buffer.take(3, trainer_version=2, count=2) is None  # one of two groups so far
    buffer.push([entry(3, 1, 0)])
    taken = buffer.take(3, trainer_version=2, count=2)
    assert [e.prompt_index for e in taken.fresh] == [0, 1] and taken.stale == []
    assert buffer.size() == 1 and buffer.count(4) == 1 and buffer.count(3) == 0
    assert [(r["step"], r["age"], r["dropped"]) for r in buffer.records] == [(3, 1, False), (3, 1, False)]


@pytest.mark.parametrize("max_age, version, stale", [(0, 4, False), (0, 3, True), (2, 2, False), (2, 1, True)])
def test_age_rule(max_age, version, stale):
    # Step 5 trains at weight version 4 on groups from versions >= 4 - max_age.
    assert is_stale(entry(5, version, 0), trainer_version=4, max_age=max_age) is stale


def test_stale_groups_are_dropped_and_recorded():
    buffer = ReplayBuffer(max_age=0)
    buffer.push([entry(5, 4, 0), entry(5, 3, 1)])
    taken = buffer.take(5, trainer_version=4, count=2)
    assert [e.prompt_index for e in taken.fresh] == [0] and [e.prompt_index for e in taken.stale] == [1]
    assert [r["dropped"] for r in buffer.records] == [False, True]
    buffer.record_regenerated([entry(5, 4, 1)], step=5, trainer_version=4)
    assert [(r["prompt"], r["dropped"]) for r in buffer.records] == [("5.0", False), ("5.1", True), ("5.1", False)]


def test_state_round_trip_keeps_entries_and_records_under_the_new_bound():
    buffer = ReplayBuffer(max_age=2)
    buffer.push([entry(2, 0, 0), entry(3, 1, 0), entry(4, 1, 0)])
    buffer.take(2, trainer_version=1, count=1)
    restored = ReplayBuffer(max_age=1)  # resumed with a tighter bound
    restored.load_state_dict(buffer.state_dict())
    assert restored.size() == 2 and restored.records == buffer.records
    taken = restored.take(4, trainer_version=3, count=1)  # version 1 < 3 - 1: stale under the new bound
    assert taken.fresh == [] and len(taken.stale) == 1


def test_negative_bound_names_the_key():
    with pytest.raises(ValueError, match="grpo.async_grpo.max_trajectory_age_steps"):
        ReplayBuffer(max_age=-1)
