"""Asynchronous GRPO, top to bottom.

A trajectory collector (`collector.py`) generates prompt groups ahead of training into a replay
buffer (`replay_buffer.py`); this loop trains on them. One step: take the groups targeted at
this step (waiting if generation is behind) -> advantages -> prev/ref logprobs -> train -> push
weights over the run's transport (object_store or collective) and tell the collector (+ refit
check) -> log -> validate -> checkpoint. Every shared phase is `step.py`'s; what differs
is where the groups come from and how old their weights are (and that the async engine never shares
the trainer's GPUs, so the `memory.for_*` phases of colocation.py, called at the sync loop's points,
issue nothing): step s trains at weight version
s - 1 on groups generated at versions >= s - 1 - max_trajectory_age_steps, and the loss's
importance-sampling correction accounts for the gap.

Metrics of the pipeline (`async/`): trajectory age mean/max, buffer size after the take,
generation idle time, trainer starvation time (waiting for groups) and exposed generation time
(starvation plus the time a weight push waited for generation to catch up).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import ray

from grpo_data.records import DatumSpec
from grpo_train.batch import Rollout
from grpo_train.collector import SharedParts, make_collector_actor
from grpo_train.colocation import MemoryChoreography
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.engine_faults import EngineSupervisor, supervise
from grpo_train.refit import push_weights
from grpo_train.replay_buffer import GroupEntry, make_replay_buffer_actor
from grpo_train.run_state import TrainerState, save_checkpoint
from grpo_train.state_io import load_state
from grpo_train.step import (
    PhaseTimer,
    RunClock,
    batch_with_logprobs,
    due_at_end,
    pad_id,
    push_and_check,
    total_steps,
    validate_and_save,
    validate_at_start,
)
from grpo_train.train_step import add_advantages, prepare_batch

POLL_S = 0.02  # how often the trainer looks into the buffer while it waits for groups
BUFFER_FILE, COLLECTOR_FILE = "replay_buffer", "collector"  # checkpoint state files (state_io), beside "dataloader"


def train_async(cfg: GRPOMasterConfig, parts, logger, checkpoints, state: TrainerState) -> TrainerState:
    last = total_steps(cfg.grpo, parts.train_data)
    pad = pad_id(parts.tokenizer)
    in_flight = cfg.grpo.async_grpo.in_flight_weight_updates
    buffer, collector = make_collector(cfg, parts, checkpoints, state, last)  # starts up meanwhile
    engines = supervise(cfg, parts, state)  # a restarted engine is handed to the collector too
    engines.listeners.append(
        lambda generator: ray.get(collector.replace_engine.remote(generator, state.weight_version))
    )
    memory = MemoryChoreography.of(parts)
    try:
        validate_at_start(cfg, parts, logger, state, engines, memory)
        ray.get(collector.start.remote())
        before = ray.get(collector.stats.remote())
        clock = RunClock(cfg.checkpointing)
        while state.step < last:
            step = state.step + 1
            timer = PhaseTimer()

            with timer("wait_for_groups"):
                groups = take_groups(cfg, buffer, collector, step, state.weight_version, engines)
            rollouts = [r for g in groups for r in g.rollouts]
            state.consumed_prompts += len(groups)
            batch, metrics = batch_with_logprobs(cfg, parts, memory, timer, rollouts, pad, prepare_batch)
            metrics |= add_advantages(cfg.grpo, cfg.loss_fn, rollouts, batch)
            with timer("train"):
                metrics |= parts.policy.train(batch)
            held = not in_flight  # the push waits for older batches, then holds the next one
            waited: list[float] = []
            metrics |= push_and_check(
                cfg,
                parts,
                engines,
                memory,
                timer,
                state,
                rollouts,
                push=lambda version: push_for_collector(cfg, parts, collector, version),
                before_push=hold_for_push(collector, engines, waited) if held else None,
            )
            push_wait = waited[0] if waited else 0.0

            state.step = step
            state.epoch = groups[-1].epoch
            stats = ray.get(collector.stats.remote())
            metrics |= groups[0].env_metrics
            metrics |= pipeline_metrics(groups, ray.get(buffer.size.remote()), stats, before, timer, push_wait)
            before = stats
            metrics |= timer.metrics() | engines.metrics()
            logger.log(metrics | clock.startup_metrics(), step)

            stop = clock.must_stop(step, last)
            due_val, due_ckpt = due_at_end(cfg, checkpoints, step, last, stop)
            if (due_val or due_ckpt) and not held:
                hold(collector, engines)
                held = True
            validate_and_save(
                cfg,
                parts,
                logger,
                step,
                due_val,
                due_ckpt,
                engines,
                memory,
                lambda metrics: save_async_checkpoint(checkpoints, parts, buffer, collector, state, metrics),
            )
            if held:
                ray.get(collector.release.remote())
            if stop:
                clock.deadline.announce(step)
                break
    finally:
        stop_collector(buffer, collector)
    return state


def make_collector(cfg: GRPOMasterConfig, parts, checkpoints, state: TrainerState, last: int):
    """The replay buffer and collector actors (not yet generating), restored from the latest
    checkpoint on resume.

    The collector draws from the driver's datasets with its own dataloader, started at the
    driver's position (the `dataloader` state file of an async checkpoint holds the collector's); a sync
    checkpoint has no buffer, so generation restarts at the next step.
    """
    buffer = make_replay_buffer_actor(cfg.grpo.async_grpo.max_trajectory_age_steps)
    next_target = state.step + 1
    folder = checkpoints.latest() if checkpoints is not None and state.step > 0 else None
    if folder is not None and (Path(folder) / f"{COLLECTOR_FILE}.json").is_file():
        buffer_state = load_state(folder, BUFFER_FILE, types=(GroupEntry, Rollout, DatumSpec))
        ray.get(buffer.load_state_dict.remote(buffer_state))
        next_target = load_state(folder, COLLECTOR_FILE)["next_target"]
    shared = SharedParts(parts.tokenizer, parts.train_sets, parts.envs)
    collector = make_collector_actor(
        cfg, shared, parts.generator, buffer, last, next_target, state.weight_version, parts.train_data.state_dict()
    )
    return buffer, collector


def push_for_collector(cfg: GRPOMasterConfig, parts, collector, version: int) -> None:
    """`refit.push_weights` with the async engine's pause options; then the collector may
    generate with the new weights."""
    flags = cfg.grpo.async_grpo
    push_weights(
        parts.policy,
        version,
        in_flight=flags.in_flight_weight_updates,
        reset_running_kv=flags.recompute_kv_cache_after_weight_updates,
    )
    ray.get(collector.weights_loaded.remote(version))


def take_groups(
    cfg: GRPOMasterConfig, buffer, collector, step: int, version: int, engines: EngineSupervisor
) -> list[GroupEntry]:
    """The groups targeted at `step`, waiting for them (and restarting the engine if it died under
    the collector); stale ones (possible only after a resume with a smaller age bound) are dropped
    and their prompts generated again with the current weights."""
    count = cfg.grpo.num_prompts_per_step
    while (taken := ray.get(buffer.take.remote(step, version, count))) is None:
        if (error := ray.get(collector.error.remote())) is not None:
            raise RuntimeError(f"the trajectory collector stopped: {error}")
        recover_collector(collector, engines)
        time.sleep(POLL_S)
    if not taken.stale:
        return taken.fresh
    hold(collector, engines)
    try:
        fresh = engines.retry("generation", lambda: ray.get(collector.regenerate.remote(taken.stale, version)))
    finally:
        ray.get(collector.release.remote())
    ray.get(buffer.record_regenerated.remote(fresh, step, version))
    return sorted(taken.fresh + fresh, key=lambda g: g.prompt_index)


def recover_collector(collector, engines: EngineSupervisor) -> None:
    """If the engine died under the collector: restart it (the supervisor's listener hands it to
    the collector), or hand over the engine a restart already brought up."""
    if (lost := ray.get(collector.lost_engine.remote())) is None:
        return
    if not engines.restart_dead("generation", lost):
        for listener in engines.listeners:
            listener(engines.parts.generator)


def hold_for_push(collector, engines: EngineSupervisor, waited: list[float]) -> Callable[[int], None]:
    """A push's `before_push` when weight updates are not in flight: wait until the collector
    finished the older batches, hold the next one, and append the seconds waited to `waited`."""
    return lambda version: waited.append(hold(collector, engines, version))


def hold(collector, engines: EngineSupervisor, until_version: int | None = None) -> float:
    """`collector.hold`, restarting the engine first whenever it died under the collector."""
    while (waited := ray.get(collector.hold.remote(until_version))) is None:
        recover_collector(collector, engines)
    return waited


def pipeline_metrics(
    groups: list[GroupEntry], buffer_size: int, stats: dict, before: dict, timer: PhaseTimer, push_wait: float
) -> dict[str, float]:
    ages = [(g.target_step - 1) - g.weight_version for g in groups]
    starvation = timer.seconds.get("wait_for_groups", 0.0)
    return {
        "async/trajectory_age_mean": sum(ages) / len(ages),
        "async/trajectory_age_max": float(max(ages)),
        "async/buffer_size": float(buffer_size),
        "async/generation_idle_s": stats["idle_s"] - before["idle_s"],
        "async/trainer_starvation_s": starvation,
        "async/exposed_generation_s": starvation + push_wait,
        "timing/generate_s": stats["generate_s"] - before["generate_s"],
    }


def save_async_checkpoint(checkpoints, parts, buffer, collector, state: TrainerState, metrics) -> Path:
    """The sync checkpoint plus the buffer and the collector's position (the caller holds the
    collector, so the three agree: no group is lost or generated twice on resume)."""
    collector_state = ray.get(collector.state_dict.remote())
    extra = {
        "dataloader": collector_state["dataloader"],
        BUFFER_FILE: ray.get(buffer.state_dict.remote()),
        COLLECTOR_FILE: {"next_target": collector_state["next_target"]},
    }
    return save_checkpoint(checkpoints, parts, state, metrics, extra_files=extra)


def stop_collector(buffer, collector) -> None:
    try:
        ray.get(collector.shutdown.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - best effort at exit; the actors are killed either way
        pass
    ray.kill(collector)
    ray.kill(buffer)
