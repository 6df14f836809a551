"""Synchronous PPO with a value model, top to bottom.

One step: draw prompts -> rollout (generate, score) -> batch (reward scaling/shaping,
overlong filtering) -> prev/ref logprobs -> values -> GAE advantages and returns -> ppo_epochs
passes of value training and (from `ppo.policy_training_start_step`) policy training -> push
weights into the generator (+ refit check) -> log -> validate -> checkpoint (policy, value
model, dataloader, RNG). Rollout, logprobs, weight push, validation and checkpoints are the
GRPO loop's own components; steps before the policy starts training push no weights. The
`memory.for_*` phases are the sync loop's (colocation.py). The value ranks hold GPUs of their own.
A dead generation engine is restarted and the phase retried as in the GRPO loop (engine_faults).
"""

from __future__ import annotations

import ray

from grpo_train.colocation import MemoryChoreography
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.deadline import SaveDeadline
from grpo_train.engine_faults import checked_refit, supervise
from grpo_train.ppo.ppo_step import PPOComponents, add_values_and_advantages, mean_over_epochs, prepare_ppo_batch
from grpo_train.run_state import TrainerState
from grpo_train.sync_loop import (
    generate_step,
    record_rewards,
    run_validation,
    sampling_spec,
    total_steps,
    validate_and_save,
)
from grpo_train.train_step import PhaseTimer, add_logprobs, mask_by_logprob_error, process_age_s, push_weights


def train_epochs(cfg: GRPOMasterConfig, parts: PPOComponents, batch, train_policy: bool) -> dict[str, float]:
    """ppo_epochs passes over the batch: the value model always, the policy when asked."""
    value_metrics, policy_metrics = [], []
    for _ in range(cfg.ppo.ppo_epochs):
        value_metrics.append(ray.get(parts.value.train.remote(batch)))
        if train_policy:
            policy_metrics.append(ray.get(parts.policy.train.remote(batch)))
    return mean_over_epochs(value_metrics) | mean_over_epochs(policy_metrics)


def train_ppo(cfg: GRPOMasterConfig, parts: PPOComponents, logger, checkpoints, state: TrainerState) -> TrainerState:
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
        batch, metrics = prepare_ppo_batch(cfg, result.rollouts, pad_id)
        memory.for_training()
        with timer("logprob"):
            add_logprobs(cfg, parts.policy, batch)
        metrics |= mask_by_logprob_error(cfg, batch)
        with timer("values"):
            metrics |= add_values_and_advantages(cfg, parts.value, batch)
        train_policy = step >= cfg.ppo.policy_training_start_step
        with timer("train"):
            metrics |= train_epochs(cfg, parts, batch, train_policy)
        if train_policy:
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
        metrics["policy_trained"] = float(train_policy)
        if startup_s is not None:  # the first step this process runs (a resumed run's too)
            metrics["timing/startup_s"], startup_s = startup_s, None
        logger.log(metrics, step)
        stop = deadline.step_done() and step < last
        validate_and_save(cfg, parts, logger, checkpoints, state, last, parts.extra_workers, force_save=stop,
                          engines=engines)
        if stop:
            deadline.announce(step)
            break
    return state
