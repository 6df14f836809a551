"""The step every loop runs, one function per shared phase.

`sync_loop`, `async_loop` and `ppo.ppo_loop` are siblings that import this module and keep only
what is their own (where the groups come from, how the policy trains). The phases, in the order
of one step: `step_seed` / `sampling_spec` / `generate_phase` (draw prompts, reseed, roll out) ->
`train_step.prepare_batch` -> `train_step.add_logprobs` -> (the loop's advantages and training)
-> `push_and_check` (weight push, version bump, refit check) -> `step_metrics` -> `end_of_step`
(validation and a checkpoint when due). `PhaseTimer` times the phases; `RunClock` holds the save
deadline and the start-up time. The batch components themselves (`prepare_batch`,
`add_logprobs`, `add_advantages`, the refit check) live in `train_step.py` below this module.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from grpo_train.colocation import MemoryChoreography
from grpo_train.config.schema import CheckpointingConfig, GenerationConfig, GRPOConfig, GRPOMasterConfig
from grpo_train.deadline import SaveDeadline
from grpo_train.engine_faults import EngineSupervisor, checked_refit, supervise
from grpo_train.generation.base import SamplingSpec
from grpo_train.refit import push_weights
from grpo_train.rollout import rollout_batch
from grpo_train.rollout.dynamic_sampling import fill_with_signal
from grpo_train.run_state import TrainerState, save_checkpoint
from grpo_train.train_step import add_logprobs, logprob_plan, prepare_batch
from grpo_train.validation import validate, validation_turns

# Distinct seeds per step so a resumed run samples exactly what the uninterrupted run sampled.
_STEP_SEED_STRIDE = 1_000_003


def step_seed(grpo: GRPOConfig, step: int) -> int:
    """The generator's seed for `step`: a resumed run samples exactly what the uninterrupted one sampled."""
    return grpo.seed * _STEP_SEED_STRIDE + step


def sampling_spec(gen: GenerationConfig, n: int) -> SamplingSpec:
    """policy.generation's sampling, `n` samples per prompt (grpo.num_generations_per_prompt, or
    grpo.val_num_generations where validation asks)."""
    return SamplingSpec(
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k if gen.top_k is not None else -1,
        max_new_tokens=gen.max_new_tokens,
        stop_token_ids=tuple(gen.stop_token_ids or ()),
        stop_strings=tuple(gen.stop_strings or ()),
        n=n,
    )


def train_sampling(cfg: GRPOMasterConfig) -> SamplingSpec:
    """The training rollouts' sampling (`sampling_spec` of policy.generation, grpo's n per prompt)."""
    return sampling_spec(cfg.policy.generation, cfg.grpo.num_generations_per_prompt)


def total_steps(grpo: GRPOConfig, train_data) -> int:
    """grpo.max_num_steps, or fewer when the epochs run out (a mixed multi-dataset loader is endless)."""
    per_epoch = getattr(train_data, "batches_per_epoch", None)
    if per_epoch is None:
        return grpo.max_num_steps
    return min(grpo.max_num_steps, grpo.max_num_epochs * per_epoch)


def pad_id(tokenizer) -> int:
    """The batch's padding token: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def record_rewards(train_data, rollouts) -> None:
    """Mean reward per dataset for samplers that read training records (multiple dataloaders)."""
    if not hasattr(train_data, "set_records"):
        return
    sums: dict[str, list[float]] = {}
    for r in rollouts:
        sums.setdefault(r.dataset_name, []).append(r.reward)
    train_data.set_records({name: {"reward": sum(v) / len(v)} for name, v in sums.items() if name})


_IMPORTED_AT = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started, from the kernel's start time on Linux (so interpreter
    start-up and imports count); elsewhere, since this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of proc(5), counted after the ")" of the name
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


class PhaseTimer:
    """Wall time per named phase of a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.seconds.items()}
        out["timing/step_s"] = time.perf_counter() - self._start
        return out


class RunClock:
    """The run's save deadline (checkpointing.checkpoint_must_save_by) and its start-up time,
    measured when the clock is made (after the step-0 validation) and logged with the first step
    this process runs (a resumed run's too)."""

    def __init__(self, checkpointing: CheckpointingConfig) -> None:
        self.deadline = SaveDeadline(checkpointing.checkpoint_must_save_by)
        self._startup_s: float | None = process_age_s()  # process start -> first step

    def startup_metrics(self) -> dict[str, float]:
        """{"timing/startup_s": ...} the first time, {} after."""
        if self._startup_s is None:
            return {}
        out, self._startup_s = {"timing/startup_s": self._startup_s}, None
        return out

    def must_stop(self, step: int, last: int) -> bool:
        """The deadline says save now and stop (never on the last step, which saves anyway)."""
        return self.deadline.step_done() and step < last


def run_validation(
    cfg: GRPOMasterConfig, parts, logger, step: int, engines: EngineSupervisor | None = None
) -> dict[str, float]:
    if not parts.val_datums:
        return {}

    def attempt():
        return validate(
            parts.generator,
            parts.envs,
            parts.val_datums,
            train_sampling(cfg),
            cfg.grpo.val_num_generations,
            cfg.grpo.val_batch_size,
            **validation_turns(cfg.grpo, cfg.policy, parts.tokenizer),
        )

    metrics, samples = attempt() if engines is None else engines.retry("validation", attempt)
    logger.log(metrics, step, split="val")
    logger.log_samples(samples, step)
    return metrics


def validate_at_start(
    cfg: GRPOMasterConfig, parts, logger, state: TrainerState, engines: EngineSupervisor, memory: MemoryChoreography
) -> None:
    """grpo.val_at_start: the step-0 validation of a fresh run (a resumed run skips it)."""
    if state.step == 0 and cfg.grpo.val_at_start:
        memory.for_generation()
        run_validation(cfg, parts, logger, 0, engines)


def collect_rollouts(cfg: GRPOMasterConfig, parts, sampling: SamplingSpec, state: TrainerState):
    """One rollout; with dynamic sampling, more rounds until enough groups carry signal."""
    datums = next(parts.train_data)
    state.consumed_prompts += len(datums)
    result = rollout_batch(cfg, parts, datums, sampling)
    if not cfg.grpo.use_dynamic_sampling:
        return result, {}
    return fill_with_signal(cfg, parts, sampling, state, result)


def generate_step(
    cfg: GRPOMasterConfig, parts, sampling: SamplingSpec, state: TrainerState, step: int, engines: EngineSupervisor
):
    """Reseed the engines for `step` and collect its rollouts; after an engine restart, again from
    the same data position (same prompts, same seed, same weights: the same samples)."""
    position, consumed = parts.train_data.state_dict(), state.consumed_prompts

    def attempt():
        parts.generator.reseed(step_seed(cfg.grpo, step))
        return collect_rollouts(cfg, parts, sampling, state)

    def rewind() -> None:
        parts.train_data.load_state_dict(position)
        state.consumed_prompts = consumed

    return engines.retry("generation", attempt, rewind)


def generate_phase(
    cfg: GRPOMasterConfig,
    parts,
    sampling: SamplingSpec,
    state: TrainerState,
    step: int,
    engines: EngineSupervisor,
    memory: MemoryChoreography,
    timer: PhaseTimer,
):
    """The synchronous loops' rollout phase: engines in the generation phase, `generate_step`,
    its generate/reward times, the rewards recorded for the samplers that read them."""
    memory.for_generation()
    result, sampling_metrics = generate_step(cfg, parts, sampling, state, step, engines)
    timer.add("generate", result.generate_s)
    timer.add("reward", result.reward_s)
    record_rewards(parts.train_data, result.rollouts)
    return result, sampling_metrics


def batch_with_logprobs(
    cfg: GRPOMasterConfig,
    parts,
    memory: MemoryChoreography,
    timer: PhaseTimer,
    rollouts: list,
    pad: int,
    prepare: Callable = prepare_batch,
) -> tuple[dict, dict[str, float]]:
    """The batch of `rollouts` (`prepare`: `train_step.prepare_batch`, or PPO's), then the
    trainer's phase and the prev (and ref) logprobs under the start-of-step weights."""
    batch, metrics = prepare(cfg.grpo, cfg.policy, rollouts, pad)
    memory.for_training()
    with timer("logprob"):
        add_logprobs(logprob_plan(cfg), parts.policy, batch)
    return batch, metrics


def push_and_check(
    cfg: GRPOMasterConfig,
    parts,
    engines: EngineSupervisor,
    memory: MemoryChoreography,
    timer: PhaseTimer,
    state: TrainerState,
    rollouts: list,
    push: Callable[[int], object] | None = None,
    before_push: Callable[[int], object] | None = None,
) -> dict[str, float]:
    """The refit phase: bump the weight version, push the trained weights into the engines
    (`push(version)`, by default `refit.push_weights`; retried through the engine-fault
    supervisor, `before_push(version)` once before it), then the refit check when due
    (grpo.refit_check.enabled, every grpo.refit_check.period versions). Returns the check's metrics."""
    memory.for_refit()
    with timer("refit"):
        state.weight_version += 1
        version = state.weight_version
        if before_push is not None:
            before_push(version)
        send = push if push is not None else (lambda v: push_weights(parts.policy, v))
        engines.retry("the weight push", lambda: send(version))
    refit = cfg.grpo.refit_check
    if not (refit.enabled and state.weight_version % refit.period == 0):
        return {}
    with timer("refit_check"):
        return checked_refit(cfg, parts, engines, rollouts)


def step_metrics(result, sampling_metrics: dict, timer: PhaseTimer, engines: EngineSupervisor) -> dict[str, float]:
    """The synchronous loops' step metrics beside the training ones: the environments', dynamic
    sampling's, the phase times, the supervisor's, and the generation throughput."""
    generated_tokens = sum(len(r.response_ids) for r in result.rollouts)
    metrics = result.env_metrics | sampling_metrics | timer.metrics() | engines.metrics()
    metrics["tokens_per_s"] = generated_tokens / max(result.generate_s, 1e-9)
    return metrics


def due_at_end(cfg: GRPOMasterConfig, checkpoints, step: int, last: int, stop: bool) -> tuple[bool, bool]:
    """(validation due, checkpoint due) after `step`: every grpo.val_period steps and at the end
    (grpo.val_at_end); a checkpoint every checkpointing.save_period steps, at the end, or when the
    deadline stops the run (`stop`)."""
    due_val = bool((cfg.grpo.val_period and step % cfg.grpo.val_period == 0) or (step == last and cfg.grpo.val_at_end))
    due_ckpt = checkpoints is not None and (step % cfg.checkpointing.save_period == 0 or step == last or stop)
    return due_val, due_ckpt


def validate_and_save(
    cfg: GRPOMasterConfig,
    parts,
    logger,
    step: int,
    due_val: bool,
    due_ckpt: bool,
    engines: EngineSupervisor,
    memory: MemoryChoreography,
    save: Callable[[dict[str, float] | None], object],
) -> None:
    """Validation when due, then `save(metrics)` when a checkpoint is due, ranked by the
    validation's metrics (as val_*) when there are any."""
    val_metrics = {}
    if due_val:
        memory.for_generation()
        val_metrics = run_validation(cfg, parts, logger, step, engines)
    if due_ckpt:
        memory.for_training()
        save({f"val_{k}": v for k, v in val_metrics.items()} if val_metrics else None)


def end_of_step(
    cfg: GRPOMasterConfig,
    parts,
    logger,
    checkpoints,
    state: TrainerState,
    last: int,
    clock: RunClock,
    engines: EngineSupervisor,
    memory: MemoryChoreography,
    extra_workers: dict | None = None,
) -> bool:
    """The synchronous loops' end of a step: validation and a checkpoint when due (`due_at_end`);
    True when the save deadline stops the run here (announced)."""
    step = state.step
    stop = clock.must_stop(step, last)
    due_val, due_ckpt = due_at_end(cfg, checkpoints, step, last, stop)
    validate_and_save(
        cfg,
        parts,
        logger,
        step,
        due_val,
        due_ckpt,
        engines,
        memory,
        lambda metrics: save_checkpoint(checkpoints, parts, state, metrics, extra_workers),
    )
    if stop:
        clock.deadline.announce(step)
    return stop


class SyncRun:
    """What a synchronous loop (sync GRPO, PPO) holds over its run, with the phases it shares:
    sampling, the last step, the pad token, the engine supervisor, the memory choreography, the
    clock, and the current step's `timer`. Made after the step-0 validation is due (it runs it)."""

    def __init__(self, cfg: GRPOMasterConfig, parts, logger, checkpoints, state: TrainerState) -> None:
        self.cfg, self.parts, self.logger, self.checkpoints, self.state = cfg, parts, logger, checkpoints, state
        self.sampling = train_sampling(cfg)
        self.last = total_steps(cfg.grpo, parts.train_data)
        self.pad = pad_id(parts.tokenizer)
        self.engines = supervise(cfg, parts, state)
        self.memory = MemoryChoreography.of(parts)
        validate_at_start(cfg, parts, logger, state, self.engines, self.memory)
        self.clock = RunClock(cfg.checkpointing)
        self.timer = PhaseTimer()

    def next_step(self) -> int | None:
        """The next step to run (its timer started), or None after the last."""
        if self.state.step >= self.last:
            return None
        self.timer = PhaseTimer()
        return self.state.step + 1

    def generate(self, step: int):
        return generate_phase(
            self.cfg, self.parts, self.sampling, self.state, step, self.engines, self.memory, self.timer
        )

    def batch(self, rollouts: list, prepare: Callable = prepare_batch) -> tuple[dict, dict[str, float]]:
        return batch_with_logprobs(self.cfg, self.parts, self.memory, self.timer, rollouts, self.pad, prepare)

    def push_and_check(self, rollouts: list) -> dict[str, float]:
        return push_and_check(self.cfg, self.parts, self.engines, self.memory, self.timer, self.state, rollouts)

    def finish(
        self,
        step: int,
        metrics: dict,
        result,
        sampling_metrics: dict,
        extra: dict | None = None,
        extra_workers: dict | None = None,
    ) -> bool:
        """`step` done: the state advanced, its metrics (then `extra`) logged, validation and a
        checkpoint when due (`extra_workers` saved beside the policy). True when the run stops here."""
        self.state.step = step
        self.state.epoch = getattr(self.parts.train_data, "epoch", 0)
        metrics |= step_metrics(result, sampling_metrics, self.timer, self.engines) | (extra or {})
        self.logger.log(metrics | self.clock.startup_metrics(), step)
        return end_of_step(
            self.cfg,
            self.parts,
            self.logger,
            self.checkpoints,
            self.state,
            self.last,
            self.clock,
            self.engines,
            self.memory,
            extra_workers,
        )
