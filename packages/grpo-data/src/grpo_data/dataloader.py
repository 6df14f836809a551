"""Dataloaders of prompts that resume exactly where a checkpoint left them.

`make_dataloader` returns a torchdata `StatefulDataLoader` whose batches are plain lists of the
dataset's items (`list[DatumSpec]` for a `ProcessedDataset`); its `state_dict()` taken after
k batches makes a fresh loader continue with batch k+1, with or without worker processes.

Shuffling is epoch-seeded: epoch e visits the dataset in `torch.randperm(n)` order drawn from a
generator seeded with `seed + e`, whatever `num_workers` is. `InfiniteDataLoader` never runs
out: when an epoch ends it starts the next one with the same rule, and its state round-trips.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from grpo_data.errors import DataError


def collate_as_list(items: list) -> list:
    """Identity collate: a batch is the list of items (module-level so workers can pickle it)."""
    return list(items)


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The visiting order of epoch `epoch`: a permutation of range(n) seeded with seed + epoch."""
    generator = torch.Generator()
    generator.manual_seed(int(seed) + int(epoch))
    return torch.randperm(n, generator=generator).tolist()


class EpochShuffleSampler(Sampler[int]):
    """Shuffled indices whose order depends only on (seed, epoch).

    torch's RandomSampler draws from a generator that the dataloader also uses (for worker
    seeds) and that is advanced once per `iter()`, which torchdata calls twice with workers; the
    order then depends on `num_workers`. Here the order is a function of (seed, epoch), and the
    epoch advances only when an iteration runs to its end.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        self.n = n
        self.seed = int(seed)
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> _EpochShuffleIterator:
        return _EpochShuffleIterator(self)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])


class _EpochShuffleIterator(Iterator[int]):
    def __init__(self, sampler: EpochShuffleSampler) -> None:
        self.sampler = sampler
        self._start(sampler.epoch, 0)

    def _start(self, epoch: int, yielded: int) -> None:
        self.epoch = epoch
        self.order = epoch_permutation(self.sampler.n, self.sampler.seed, epoch)
        self.yielded = yielded

    def __next__(self) -> int:
        if self.yielded >= len(self.order):
            self.sampler.epoch = max(self.sampler.epoch, self.epoch + 1)
            raise StopIteration
        index = self.order[self.yielded]
        self.yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start(int(state["epoch"]), int(state["yielded"]))


def make_dataloader(
    dataset,
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool = True,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """A `StatefulDataLoader` over a map-style `dataset` yielding `list` batches.

    Two loaders built with the same dataset, batch size and seed yield the same batches, for
    any `num_workers`; iterating the loader again starts the next epoch (seed + 1, ...).
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size}; expected a positive integer")
    if not isinstance(dataset, Sized) or len(dataset) == 0:
        raise DataError(f"the dataset is empty: {getattr(dataset, 'source', type(dataset).__name__)}")
    sampler = EpochShuffleSampler(len(dataset), seed) if shuffle else SequentialSampler(dataset)
    generator = torch.Generator()
    generator.manual_seed(int(seed))  # only seeds worker processes' RNGs
    with warnings.catch_warnings():
        # torchdata 0.11 calls a deprecated torch API on construction; the warning is not ours.
        warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            generator=generator,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_as_list,
        )


class InfiniteDataLoader:
    """Endless batches over `dataset`; epoch e is shuffled with `seed + e`.

    Each epoch is a fresh `make_dataloader(..., seed=seed + epoch)`, so epoch e's batches
    are exactly those of a plain loader with that seed. `state_dict()` records the epoch and
    the inner loader's state; `load_state_dict()` on a new instance (same dataset and
    arguments) continues with exactly the next batch. At an epoch boundary the state already
    points at the next epoch, so a resume never replays a finished epoch.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = True,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.num_workers = num_workers
        self._start_epoch(0)
        self.batches_per_epoch = len(self._loader)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the dataset has {len(dataset)} items, fewer than one batch of {batch_size} "
                "with drop_last=True; use a larger dataset or a smaller batch"
            )

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._batches_in_epoch = 0
        self._loader = make_dataloader(
            self.dataset, self.batch_size, self.shuffle, self.seed + epoch, self.drop_last, self.num_workers
        )
        self._iterator: Iterator | None = None

    def __iter__(self) -> InfiniteDataLoader:
        return self

    def __next__(self) -> list:
        if self._iterator is None:
            self._iterator = iter(self._loader)
        batch = next(self._iterator)
        self._batches_in_epoch += 1
        if self._batches_in_epoch == self.batches_per_epoch:
            self._start_epoch(self.epoch + 1)
        return batch

    def state_dict(self) -> dict[str, Any]:
        loader_state = self._loader.state_dict() if self._batches_in_epoch else None
        return {"epoch": self.epoch, "batches_in_epoch": self._batches_in_epoch, "loader": loader_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start_epoch(int(state["epoch"]))
        if state.get("loader") is not None:
            self._loader.load_state_dict(state["loader"])
            self._batches_in_epoch = int(state["batches_in_epoch"])
