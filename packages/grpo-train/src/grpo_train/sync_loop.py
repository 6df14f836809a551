"""Synchronous GRPO, top to bottom.

One step: draw prompts -> rollout (generate N per prompt, score) -> advantages -> prev/ref
logprobs -> train -> push weights into the generator (+ refit check) -> log -> validate ->
checkpoint. Generation always uses the weights of the start of the step. `memory.for_*` mark
the phases for an engine colocated on the trainer's GPUs (`colocation.py`; inactive otherwise).
"""

from __future__ import annotations

import ray

from grpo_train.colocation import MemoryChoreography
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.deadline import SaveDeadline
from grpo_train.engine_faults import EngineSupervisor, checked_refit, supervise
from grpo_train.generation.base import SamplingSpec
from grpo_train.rollout import rollout_batch
from grpo_train.rollout.dynamic_sampling import fill_with_signal
from grpo_train.run_state import TrainerState, save_checkpoint
from grpo_train.train_step import PhaseTimer, add_advantages, add_logprobs, prepare_batch, process_age_s, push_weights
from grpo_train.validation import validate

# Distinct seeds per step so a resumed run samples exactly what the uninterrupted run sampled.
_STEP_SEED_STRIDE = 1_000_003


def step_seed(cfg: GRPOMasterConfig, step: int) -> int:
    """The generator's seed for `step`: a resumed run samples exactly what the uninterrupted one sampled."""
    return cfg.grpo.seed * _STEP_SEED_STRIDE + step


def sampling_spec(cfg: GRPOMasterConfig) -> SamplingSpec:
    gen = cfg.policy.generation
    return SamplingSpec(
        temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k if gen.top_k is not None else -1,
        max_new_tokens=gen.max_new_tokens, stop_token_ids=tuple(gen.stop_token_ids or ()),
        stop_strings=tuple(gen.stop_strings or ()), n=cfg.grpo.num_generations_per_prompt,
    )


def total_steps(cfg: GRPOMasterConfig, train_data) -> int:
    """grpo.max_num_steps, or fewer when the epochs run out (a mixed multi-dataset loader is endless)."""
    per_epoch = getattr(train_data, "batches_per_epoch", None)
    if per_epoch is None:
        return cfg.grpo.max_num_steps
    return min(cfg.grpo.max_num_steps, cfg.grpo.max_num_epochs * per_epoch)


def record_rewards(train_data, rollouts) -> None:
    """Mean reward per dataset for samplers that read training records (multiple dataloaders)."""
    if not hasattr(train_data, "set_records"):
        return
    sums: dict[str, list[float]] = {}
    for r in rollouts:
        sums.setdefault(r.dataset_name, []).append(r.reward)
    train_data.set_records({name: {"reward": sum(v) / len(v)} for name, v in sums.items() if name})


def run_validation(cfg: GRPOMasterConfig, parts, logger, step: int,
                   engines: EngineSupervisor | None = None) -> dict[str, float]:
    if not parts.val_datums:
        return {}

    def attempt():
        return validate(parts.generator, parts.envs, parts.val_datums, sampling_spec(cfg),
                        cfg.grpo.val_num_generations, cfg.grpo.val_batch_size)

    metrics, samples = attempt() if engines is None else engines.retry("validation", attempt)
    logger.log(metrics, step, split="val")
    logger.log_samples(samples, step)
    return metrics


def validate_and_save(cfg: GRPOMasterConfig, parts, logger, checkpoints, state: TrainerState, last: int,
                      extra_workers: dict | None = None, force_save: bool = False,
                      engines: EngineSupervisor | None = None) -> None:
    """The end of a step: validation when due, then a checkpoint when due (ranked by val metrics)
    or forced (checkpointing.checkpoint_must_save_by)."""
    step = state.step
    memory = MemoryChoreography.of(parts)
    val_metrics = {}
    if (cfg.grpo.val_period and step % cfg.grpo.val_period == 0) or (step == last and cfg.grpo.val_at_end):
        memory.for_generation()
        val_metrics = run_validation(cfg, parts, logger, step, engines)
    if checkpoints is not None and (step % cfg.checkpointing.save_period == 0 or step == last or force_save):
        memory.for_training()
        ckpt_metrics = {f"val_{k}": v for k, v in val_metrics.items()} if val_metrics else None
        save_checkpoint(checkpoints, parts, state, ckpt_metrics, extra_workers)


def collect_rollouts(cfg: GRPOMasterConfig, parts, sampling: SamplingSpec, state: TrainerState):
    """One rollout; with dynamic sampling, more rounds until enough groups carry signal."""
    datums = next(parts.train_data)
    state.consumed_prompts += len(datums)
    result = rollout_batch(cfg, parts, datums, sampling)
    if not cfg.grpo.use_dynamic_sampling:
        return result, {}
    return fill_with_signal(cfg, parts, sampling, state, result)


def generate_step(cfg: GRPOMasterConfig, parts, sampling: SamplingSpec, state: TrainerState, step: int,
                  engines: EngineSupervisor):
    """Reseed the engines for `step` and collect its rollouts; after an engine restart, again from
    the same data position (same prompts, same seed, same weights: the same samples)."""
    position, consumed = parts.train_data.state_dict(), state.consumed_prompts

    def attempt():
        ray.get(parts.generator.reseed.remote(step_seed(cfg, step)))
        return collect_rollouts(cfg, parts, sampling, state)

    def rewind() -> None:
        parts.train_data.load_state_dict(position)
        state.consumed_prompts = consumed

    return engines.retry("generation", attempt, rewind)


def train_sync(cfg: GRPOMasterConfig, parts, logger, checkpoints, state: TrainerState) -> TrainerState:
    sampling = sampling_spec(cfg)
    last = total_steps(cfg, parts.train_data)
    pad_id = parts.tokenizer.pad_token_id if parts.tokenizer.pad_token_id is not None else parts.tokenizer.eos_token_id
    engines = supervise(cfg, parts, state)
    memory = MemoryChoreography.of(parts)
    if state.step == 0 and cfg.grpo.val_at_start:
        memory.for_generation()
        run_validation(cfg, parts, logger, 0, engines)
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by)
    startup_s = process_age_s()  # process start -> first step (after the step-0 validation)
    while state.step < last:
        step = state.step + 1
        timer = PhaseTimer()

        memory.for_generation()
        result, sampling_metrics = generate_step(cfg, parts, sampling, state, step, engines)
        timer.add("generate", result.generate_s)
        timer.add("reward", result.reward_s)
        record_rewards(parts.train_data, result.rollouts)
        batch, metrics = prepare_batch(cfg, result.rollouts, pad_id)
        memory.for_training()
        with timer("logprob"):
            add_logprobs(cfg, parts.policy, batch)
        metrics |= add_advantages(cfg, result.rollouts, batch)
        with timer("train"):
            metrics |= ray.get(parts.policy.train.remote(batch))
        memory.for_refit()
        with timer("refit"):
            state.weight_version += 1
            engines.retry("the weight push", lambda: push_weights(parts.policy, parts.generator, state.weight_version))
        refit = cfg.grpo.refit_check
        if refit.enabled and state.weight_version % refit.period == 0:
            with timer("refit_check"):
                metrics |= checked_refit(cfg, parts, engines, result.rollouts)

        state.step = step
        state.epoch = getattr(parts.train_data, "epoch", 0)
        generated_tokens = sum(len(r.response_ids) for r in result.rollouts)
        metrics |= result.env_metrics | sampling_metrics | timer.metrics() | engines.metrics()
        metrics["tokens_per_s"] = generated_tokens / max(result.generate_s, 1e-9)
        if startup_s is not None:  # the first step this process runs (a resumed run's too)
            metrics["timing/startup_s"], startup_s = startup_s, None
        logger.log(metrics, step)
        stop = deadline.step_done() and step < last
        validate_and_save(cfg, parts, logger, checkpoints, state, last, force_save=stop, engines=engines)
        if stop:
            deadline.announce(step)
            break
    return state

