import io

import pytest
import torch

from grpo_data.arithmetic import ArithmeticDataset
from grpo_data.dataloader import InfiniteDataLoader, epoch_permutation, make_dataloader
from grpo_data.datasets import ProcessedDataset
from grpo_data.errors import DataError
from grpo_data.records import DatumSpec, TaskSpec


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return ProcessedDataset(ArithmeticDataset(size=22, seed=0), "plain", TaskSpec("arithmetic"), tokenizer, 32)


def ids(batches):
    return [[d.idx for d in batch] for batch in batches]


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_batches_are_lists_of_datum_specs(prompts):
    batch = next(iter(make_dataloader(prompts, batch_size=4, shuffle=True, seed=0)))
    assert isinstance(batch, list) and len(batch) == 4
    assert all(isinstance(d, DatumSpec) for d in batch)


def test_order_is_seeded_and_independent_of_workers(prompts):
    plain = ids(make_dataloader(prompts, 4, shuffle=True, seed=3))
    assert plain == ids(make_dataloader(prompts, 4, shuffle=True, seed=3, num_workers=2))
    assert [i for b in plain for i in b] == epoch_permutation(22, 3, 0)[:20]
    assert plain != ids(make_dataloader(prompts, 4, shuffle=True, seed=4))
    assert ids(make_dataloader(prompts, 4, shuffle=False, seed=0))[0] == [0, 1, 2, 3]
    assert len(ids(make_dataloader(prompts, 4, shuffle=False, seed=0, drop_last=False))[-1]) == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_with_the_next_prompt(prompts, num_workers):
    loader = make_dataloader(prompts, 4, shuffle=True, seed=1, num_workers=num_workers)
    it = iter(loader)
    seen = [next(it) for _ in range(2)]
    state = roundtrip(loader.state_dict())
    rest = list(it)
    resumed = make_dataloader(prompts, 4, shuffle=True, seed=1, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert ids(resumed) == ids(rest)
    assert sorted(i for b in ids(seen) + ids(rest) for i in b) == sorted(epoch_permutation(22, 1, 0)[:20])
    # The resumed loader's next epoch is the same as the original's.
    assert ids(resumed) == ids(loader)


def test_iterating_again_reshuffles_with_seed_plus_epoch(prompts):
    loader = make_dataloader(prompts, 2, shuffle=True, seed=5)
    first, second = ids(loader), ids(loader)
    assert [i for b in first for i in b] == epoch_permutation(22, 5, 0)
    assert [i for b in second for i in b] == epoch_permutation(22, 5, 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_infinite_loader_reshuffles_and_resumes(prompts, num_workers):
    endless = InfiniteDataLoader(prompts, 4, shuffle=True, seed=2, num_workers=num_workers)
    assert endless.batches_per_epoch == 5
    head = [next(endless) for _ in range(7)]  # one epoch and two batches
    assert [i for b in ids(head[:5]) for i in b] == epoch_permutation(22, 2, 0)[:20]
    assert [i for b in ids(head[5:]) for i in b] == epoch_permutation(22, 2, 1)[:8]
    state = roundtrip(endless.state_dict())
    assert (state["epoch"], state["batches_in_epoch"]) == (1, 2)
    tail = [next(endless) for _ in range(6)]
    resumed = InfiniteDataLoader(prompts, 4, shuffle=True, seed=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert ids(next(resumed) for _ in range(6)) == ids(tail)


def test_infinite_loader_state_at_an_epoch_boundary_points_at_the_next_epoch(prompts):
    endless = InfiniteDataLoader(prompts, 4, shuffle=True, seed=2)
    for _ in range(5):
        next(endless)
    state = endless.state_dict()
    assert state == {"epoch": 1, "batches_in_epoch": 0, "loader": None}
    resumed = InfiniteDataLoader(prompts, 4, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    assert ids([next(resumed)]) == ids([next(endless)])


def test_empty_and_too_small_datasets_are_errors(prompts):
    with pytest.raises(DataError, match="empty"):
        make_dataloader([], 2, shuffle=False, seed=0)
    with pytest.raises(DataError, match="fewer than one batch"):
        InfiniteDataLoader(prompts, 23, shuffle=False, seed=0)
