"""Synchronous PPO with a value model, top to bottom.

One step: draw prompts -> rollout (generate, score) -> batch (reward scaling/shaping,
overlong filtering) -> prev/ref logprobs -> values -> GAE advantages and returns -> ppo_epochs
passes of value training and (from `ppo.policy_training_start_step`) policy training -> push
weights into the generator (+ refit check) -> log -> validate -> checkpoint (policy, value
model, dataloader, RNG). Rollout, logprobs, weight push, validation and checkpoints are the
shared phases of `step.py`; steps before the policy starts training push no weights. The
`memory.for_*` phases are `step.py`'s, as in the sync loop (colocation.py). The value ranks hold GPUs of their own.
A dead generation engine is restarted and the phase retried as in the GRPO loop (engine_faults).
"""

from __future__ import annotations

from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.ppo.ppo_step import PPOComponents, add_values_and_advantages, mean_over_epochs, prepare_ppo_batch
from grpo_train.run_state import TrainerState
from grpo_train.step import SyncRun
from grpo_train.train_step import mask_by_logprob_error


def train_epochs(cfg: GRPOMasterConfig, parts: PPOComponents, batch, train_policy: bool) -> dict[str, float]:
    """ppo_epochs passes over the batch: the value model always, the policy when asked."""
    value_metrics, policy_metrics = [], []
    for _ in range(cfg.ppo.ppo_epochs):
        value_metrics.append(parts.value.train(batch))
        if train_policy:
            policy_metrics.append(parts.policy.train(batch))
    return mean_over_epochs(value_metrics) | mean_over_epochs(policy_metrics)


def train_ppo(cfg: GRPOMasterConfig, parts: PPOComponents, logger, checkpoints, state: TrainerState) -> TrainerState:
    ppo = cfg.ppo
    assert ppo is not None  # algorithm: ppo has its section (config.schema.root)
    run = SyncRun(cfg, parts, logger, checkpoints, state)
    while (step := run.next_step()) is not None:
        result, sampling_metrics = run.generate(step)
        batch, metrics = run.batch(result.rollouts, prepare_ppo_batch)
        metrics |= mask_by_logprob_error(cfg.grpo, batch)
        with run.timer("values"):
            metrics |= add_values_and_advantages(ppo, cfg.loss_fn, parts.value, batch)
        train_policy = step >= ppo.policy_training_start_step
        with run.timer("train"):
            metrics |= train_epochs(cfg, parts, batch, train_policy)
        if train_policy:
            metrics |= run.push_and_check(result.rollouts)
        if run.finish(
            step, metrics, result, sampling_metrics, {"policy_trained": float(train_policy)}, parts.extra_workers
        ):
            break
    return state
