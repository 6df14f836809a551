"""The trajectory collector of async GRPO: generates prompt groups ahead of training.

Job: draw the next step's prompts from its own dataloader, run the shared rollout
(`rollout_batch`: generate with the async vLLM engine, score in the environments) and push the
groups into the replay buffer, tagged with the weight version that generated them and the step
meant to consume them; stop when it is `max_trajectory_age_steps` ahead of the weights.
Boundary: no training, no advantages, no weights (the loop pushes them over the run's weight
transport straight into the engine and then tells the collector, `weights_loaded`); the
datasets, tokenizer and environment actors are the driver's (`SharedParts`), only the
dataloader's position is the collector's own. Runs as an async Ray actor whose production loop
is a background task, so a hold or a version change arrives while a batch decodes.

Timing rule. The batch for step t needs weight version >= t - 1 - max_age. Without in-flight
weight updates a push of version v also waits until the batch for step v + max_age has been
generated, so the batch for step t is generated with exactly version max(0, t - 1 - max_age):
the run does not depend on timing and a reseeded engine repeats it bitwise (max_age 0 is the
sync loop). With in-flight updates a push never waits: requests still decoding finish under the
new weights, and a batch is tagged with the version its requests were sent under (the oldest
weights that touched it), so the age bound still holds.

Holds. `hold()` waits for the batch being generated and then keeps the next one from starting
until `release()`: the loop holds the collector while it validates and saves a checkpoint, so
that the buffer, the collector's dataloader position and its next step are saved as one
consistent picture (a batch is drawn, generated and pushed under the same lock).

Engine deaths. When the engine dies under a batch, the production loop stops and keeps the
batch's prompts (`lost_engine` says so; a hold returns None instead of holding); the loop
restarts the engine (grpo_train.engine_faults) and hands the new one over (`replace_engine`),
and the same prompts are generated again for the same step with the same seed. Until then the
saved dataloader position is the one before those prompts: no group is lost or made twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import ray

from grpo_train.engine_faults import is_engine_fault
from grpo_train.replay_buffer import GroupEntry
from grpo_train.rollout import rollout_batch
from grpo_train.setup import build_train_iterator

# Distinct seeds per step: the sync loop's seeds, so max_age 0 samples what the sync loop samples.
from grpo_train.step import record_rewards, step_seed, train_sampling


@dataclass(frozen=True)
class SharedParts:
    """What the driver has already built and hands to the collector: Ray pickles the datasets
    and the tokenizer across, and the environment pools travel as actor handles (the driver
    owns those actors and shuts them down; the collector only calls them)."""

    tokenizer: Any
    train_sets: list  # the training datasets the driver's dataloader draws from
    envs: dict  # env name -> EnvPool


@dataclass
class CollectorParts:
    """The collector's `rollout.RolloutParts`: its engines (replaced after an engine restart)
    beside the driver's envs and tokenizer."""

    generator: Any
    envs: dict
    tokenizer: Any


class TrajectoryCollector:
    """See the module docstring. Starts at step `next_target` with the generator at weight
    version `version` and its own dataloader, over the driver's datasets, at `dataloader_state`
    (None: the beginning)."""

    def __init__(
        self,
        cfg,
        shared: SharedParts,
        generator,
        buffer,
        last_step: int,
        next_target: int,
        version: int,
        dataloader_state: dict | None,
    ) -> None:
        self.cfg = cfg
        self.max_age = cfg.grpo.async_grpo.max_trajectory_age_steps
        self.train_data = build_train_iterator(cfg, shared.train_sets)
        if dataloader_state is not None:
            self.train_data.load_state_dict(dataloader_state)
        self.parts = CollectorParts(generator=generator, envs=shared.envs, tokenizer=shared.tokenizer)
        self.buffer = buffer
        self.sampling = train_sampling(cfg)
        self.last_step = last_step
        self.next_target = next_target
        self.version = version
        self._lock = asyncio.Lock()  # held while a batch is drawn, generated and pushed
        self._changed = asyncio.Condition()  # version or next_target moved
        self._task: asyncio.Task | None = None
        self.idle_s = 0.0  # waiting because it is max_age ahead, or held
        self.generate_s = 0.0
        self.batches = 0
        self._pending: tuple | None = None  # (target, datums, epoch, dataloader position before them)
        self._lost: str | None = None  # why the production loop stopped on a dead engine

    # -- the production loop --------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._produce())

    async def _produce(self) -> None:
        try:
            while self.next_target <= self.last_step:
                idle = time.perf_counter()
                await self._wait_for(lambda: self.version >= self.next_target - 1 - self.max_age)
                async with self._lock:
                    self.idle_s += time.perf_counter() - idle
                    generator = self.parts.generator  # the loop may replace it while this batch fails
                    try:
                        await asyncio.to_thread(self._generate_batch, self.next_target, self.version)
                    except Exception as exc:
                        if not is_engine_fault(exc) or not await asyncio.to_thread(generator.dead):
                            raise
                        self._lost = type(getattr(exc, "cause", None) or exc).__name__
                        return
                    self.next_target += 1
                await self._notify()
        finally:
            await self._notify()  # a hold waiting for a batch that will never come must wake up

    def _generate_batch(self, target: int, version: int) -> None:
        """Draw the prompts of step `target`, roll them out and push their groups (a thread)."""
        start = time.perf_counter()
        if self._pending is None or self._pending[0] != target:  # else: the prompts a dead engine left
            position = self.train_data.state_dict()
            self._pending = (target, next(self.train_data), getattr(self.train_data, "epoch", 0), position)
        _, datums, epoch, _ = self._pending
        entries = self.rollout(datums, target, version, epoch)
        ray.get(self.buffer.push.remote(entries))
        self._pending = None
        self.generate_s += time.perf_counter() - start
        self.batches += 1

    def rollout(self, datums: list, target: int, version: int, epoch: int = 0) -> list[GroupEntry]:
        self.parts.generator.reseed(step_seed(self.cfg.grpo, target))
        result = rollout_batch(self.cfg, self.parts, datums, self.sampling)
        record_rewards(self.train_data, result.rollouts)
        groups: list[list] = [[] for _ in datums]
        for r in result.rollouts:
            groups[r.prompt_index].append(r)
        return [
            GroupEntry(target, version, i, datum, group, epoch, result.env_metrics)
            for i, (datum, group) in enumerate(zip(datums, groups))
        ]

    # -- calls from the training loop -----------------------------------------------------------

    async def weights_loaded(self, version: int) -> None:
        """The generator now runs version `version` (the loop pushed it over the run's weight
        transport; without in-flight updates it held the collector meanwhile, see `hold`)."""
        self.version = version
        await self._notify()

    async def hold(self, until_version: int | None = None) -> float | None:
        """Wait until the batches that `until_version`'s push must not overtake are generated
        (see the module docstring), then keep the next batch from starting; returns seconds waited
        (None, holding nothing, when the engine died meanwhile: see `replace_engine`)."""
        start = time.perf_counter()
        if until_version is not None:
            last_old = min(until_version + self.max_age, self.last_step)
            await self._wait_for(lambda: self.next_target > last_old or self._stopped())
            if (error := await self.error()) is not None:
                raise RuntimeError(f"the trajectory collector stopped: {error}")
        if self._lost is not None:
            return None
        await self._lock.acquire()
        return time.perf_counter() - start

    async def release(self) -> None:
        self._lock.release()

    async def regenerate(self, entries: list[GroupEntry], version: int) -> list[GroupEntry]:
        """Generate stale groups' prompts again with the current weights (the caller holds)."""
        datums = [e.datum for e in entries]
        fresh = await asyncio.to_thread(self.rollout, datums, entries[0].target_step, version)
        for entry, new in zip(entries, fresh):
            new.prompt_index, new.epoch = entry.prompt_index, entry.epoch
        return fresh

    async def state_dict(self) -> dict:
        """Next step and dataloader position (call while held: they then match the buffer); the
        position before prompts a dead engine left ungenerated."""
        position = self._pending[3] if self._pending is not None else self.train_data.state_dict()
        return {"next_target": self.next_target, "dataloader": position}

    async def lost_engine(self) -> str | None:
        """Why production stopped on a dead engine (the error's name), or None."""
        return self._lost

    async def replace_engine(self, generator, version: int) -> None:
        """Generate with `generator` from now on, which holds weight `version` (a restarted engine
        loaded with the trainer's current weights); production resumes where it stopped."""
        self.parts.generator = generator
        self.version = version
        if self._lost is not None:
            self._lost = None
            self._task = asyncio.get_running_loop().create_task(self._produce())
        await self._notify()

    async def stats(self) -> dict[str, float]:
        """Cumulative seconds idle and generating, batches generated, the next step to generate."""
        return {
            "idle_s": self.idle_s,
            "generate_s": self.generate_s,
            "batches": float(self.batches),
            "next_target": float(self.next_target),
        }

    async def error(self) -> str | None:
        """The production loop's exception, if it died (the loop checks while it waits)."""
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            return f"{type(exc).__name__}: {exc}"
        return None

    def _stopped(self) -> bool:
        return self._task is not None and self._task.done()

    async def shutdown(self) -> None:
        """Stop generating (the environments are the driver's: it shuts them down)."""
        if self._task is not None:
            self._task.cancel()

    # -- helpers --------------------------------------------------------------------------------

    async def _wait_for(self, predicate) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def make_collector_actor(
    cfg,
    shared: SharedParts,
    generator,
    buffer,
    last_step: int,
    next_target: int,
    version: int,
    dataloader_state: dict | None,
):
    """Start a `TrajectoryCollector` as an async Ray actor (concurrent calls: hold, weights_loaded, stats)."""
    return ray.remote(num_cpus=0, max_concurrency=16)(TrajectoryCollector).remote(
        cfg, shared, generator, buffer, last_step, next_target, version, dataloader_state
    )
