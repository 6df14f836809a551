"""Several datasets, one dataloader each, mixed into training batches by a sampling function.

Each dataset gets an `InfiniteDataLoader` whose batches hold `num_prompts_per_dataloader`
prompts. Every step a sampling function builds the step's prompts from those loaders; it sees
the training records set since (e.g. the last mean reward per dataset) and an rng seeded by
(seed, step), so a resumed run samples exactly as the original did. Built-in samplers:

- "round_robin": every loader in order contributes one batch. With datasets [a, b, c, d] and
  [1..8] at 2 prompts per loader the steps are [a, b, 1, 2], [c, d, 3, 4], [a, b, 5, 6], ...
- "reward_weighted": as many batches as there are loaders, each drawn from a loader chosen with
  weight r(1 - r) + floor, r = the dataset's last recorded reward clipped to [0, 1]: datasets
  the policy half-solves (most group-relative signal) are sampled most, solved or hopeless
  ones least; datasets without a record get weight 1/4 (as if r = 0.5).

A custom sampler is "package.module:function" taking a `SamplingContext`, returning the list.
grpo-data does not compute rewards; the training loop passes them in with `set_records`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import ConcatDataset

from grpo_data.config import DataConfig
from grpo_data.dataloader import InfiniteDataLoader
from grpo_data.errors import DataError
from grpo_data.registry import register, resolve

# Seeds of different loaders are this far apart so that loader i's epoch e never reuses
# another loader's (seed + epoch).
LOADER_SEED_STRIDE = 1_000_003
REWARD_KEY = "reward"
DEFAULT_SAMPLER = "round_robin"
WEIGHT_FLOOR = 0.01


@dataclass
class SamplingContext:
    """What a sampling function sees at one step."""

    loaders: Mapping[str, Iterator[list]]  # endless; next() gives num_prompts_per_dataloader items
    records: Mapping[str, Mapping[str, float]]  # dataset name -> latest training records
    step: int
    rng: random.Random  # seeded by (seed, step): sampling decisions replay on resume
    num_prompts_per_dataloader: int


Sampler = Callable[[SamplingContext], list]
SAMPLERS: dict[str, Sampler] = {}


def register_sampler(name: str) -> Callable[[Sampler], Sampler]:
    return register(SAMPLERS, name, "sampler")


def get_sampler(name_or_import_path: str | Sampler) -> Sampler:
    """A built-in sampler by name or a custom one by "package.module:function"."""
    return resolve(name_or_import_path, SAMPLERS, "sampler")


@register_sampler("round_robin")
def round_robin(ctx: SamplingContext) -> list:
    """One batch from every loader, in order."""
    return [item for it in ctx.loaders.values() for item in next(it)]


def learnability(reward: float | None) -> float:
    """r(1 - r) + floor for a reward in [0, 1]; 0.25 + floor when there is no record yet."""
    if reward is None:
        return 0.25 + WEIGHT_FLOOR
    r = min(1.0, max(0.0, float(reward)))
    return r * (1.0 - r) + WEIGHT_FLOOR


@register_sampler("reward_weighted")
def reward_weighted(ctx: SamplingContext) -> list:
    """len(loaders) batches, each from a loader drawn with weight `learnability(last reward)`."""
    names = list(ctx.loaders)
    weights = [learnability(ctx.records.get(n, {}).get(REWARD_KEY)) for n in names]
    chosen = ctx.rng.choices(names, weights=weights, k=len(names))
    return [item for name in chosen for item in next(ctx.loaders[name])]


class MultiDataLoader:
    """An endless iterator of training batches mixed from one loader per dataset."""

    def __init__(
        self,
        datasets: Mapping[str, Any],
        num_prompts_per_dataloader: int,
        seed: int,
        *,
        shuffle: bool = True,
        num_workers: int = 0,
        sampler: str | Sampler = DEFAULT_SAMPLER,
        expected_num_prompts: int | None = None,
    ) -> None:
        if not datasets:
            raise DataError("use_multiple_dataloader: no datasets to load from")
        self.seed = int(seed)
        self.num_prompts_per_dataloader = num_prompts_per_dataloader
        self.sampler_name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", "sampler")
        self.sampler = get_sampler(sampler)
        self.expected_num_prompts = expected_num_prompts
        self.loaders = {
            name: InfiniteDataLoader(
                ds, num_prompts_per_dataloader, shuffle, self.seed + i * LOADER_SEED_STRIDE, True, num_workers
            )
            for i, (name, ds) in enumerate(datasets.items())
        }
        self.records: dict[str, dict[str, float]] = {}
        self.step = 0

    def __iter__(self) -> MultiDataLoader:
        return self

    def __next__(self) -> list:
        ctx = SamplingContext(
            loaders=self.loaders,
            records=self.records,
            step=self.step,
            rng=random.Random(f"multi-dataloader:{self.seed}:{self.step}"),
            num_prompts_per_dataloader=self.num_prompts_per_dataloader,
        )
        batch = list(self.sampler(ctx))
        if self.expected_num_prompts is not None and len(batch) != self.expected_num_prompts:
            raise DataError(
                f"sampler {self.sampler_name!r} returned {len(batch)} prompts at step {self.step}, "
                f"expected num_prompts_per_step={self.expected_num_prompts}"
            )
        self.step += 1
        return batch

    def set_records(self, records: Mapping[str, Mapping[str, float]]) -> None:
        """Merge the latest training records per dataset, e.g. {"gsm8k": {"reward": 0.4}}."""
        for name, values in records.items():
            if name not in self.loaders:
                raise DataError(f"set_records: unknown dataset {name!r}; datasets are {sorted(self.loaders)}")
            self.records.setdefault(name, {}).update({k: float(v) for k, v in values.items()})

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "records": {name: dict(values) for name, values in self.records.items()},
            "loaders": {name: loader.state_dict() for name, loader in self.loaders.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state["loaders"]) - set(self.loaders)
        if unknown:
            raise DataError(f"the saved data state has datasets {sorted(unknown)} that this config does not")
        self.step = int(state["step"])
        self.records = {name: dict(values) for name, values in state["records"].items()}
        for name, loader_state in state["loaders"].items():
            self.loaders[name].load_state_dict(loader_state)


def make_train_iterator(
    data_cfg: DataConfig,
    train_datasets: Sequence[Any],
    num_prompts_per_step: int,
    seed: int,
) -> InfiniteDataLoader | MultiDataLoader:
    """The endless training-prompt iterator a data section asks for.

    Reads `shuffle`, `num_workers`, `use_multiple_dataloader`, `num_prompts_per_dataloader` and
    `custom_dataloader` (sampler name or "module:function"; none: "round_robin"). Without
    multiple dataloaders several datasets are concatenated.
    """
    if not train_datasets:
        raise DataError("data.train: no dataset configured")
    shuffle, num_workers = data_cfg.shuffle, data_cfg.num_workers
    if not data_cfg.use_multiple_dataloader:
        dataset = train_datasets[0] if len(train_datasets) == 1 else ConcatDataset(list(train_datasets))
        return InfiniteDataLoader(dataset, num_prompts_per_step, shuffle, seed, True, num_workers)
    per_loader = data_cfg.num_prompts_per_dataloader
    if not isinstance(per_loader, int) or per_loader < 1:
        raise DataError(
            f"data.num_prompts_per_dataloader={per_loader!r}; expected a positive integer with use_multiple_dataloader"
        )
    names = [getattr(ds, "name", f"dataset{i}") for i, ds in enumerate(train_datasets)]
    if len(set(names)) != len(names):
        raise DataError(f"data.train: dataset names must be unique for multiple dataloaders, got {names}")
    return MultiDataLoader(
        dict(zip(names, train_datasets)),
        per_loader,
        seed,
        shuffle=shuffle,
        num_workers=num_workers,
        sampler=data_cfg.custom_dataloader or DEFAULT_SAMPLER,
        expected_num_prompts=num_prompts_per_step,
    )
