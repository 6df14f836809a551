"""Synchronous GRPO, top to bottom.

One step: draw prompts -> rollout (generate N per prompt, score) -> advantages -> prev/ref
logprobs -> train -> push weights into the generator (+ refit check) -> log -> validate ->
checkpoint. Generation always uses the weights of the start of the step. `memory.for_*` (inside
`step.py`'s phases) mark the phases for an engine colocated on the trainer's GPUs
(`colocation.py`; inactive otherwise). Every shared phase is `step.py`'s; this loop's own are
the order and GRPO's group-relative advantages.
"""

from __future__ import annotations

from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.run_state import TrainerState
from grpo_train.step import SyncRun
from grpo_train.train_step import add_advantages, prepare_batch


def train_sync(cfg: GRPOMasterConfig, parts, logger, checkpoints, state: TrainerState) -> TrainerState:
    run = SyncRun(cfg, parts, logger, checkpoints, state)
    while (step := run.next_step()) is not None:
        result, sampling_metrics = run.generate(step)
        batch, metrics = run.batch(result.rollouts, prepare_batch)
        metrics |= add_advantages(cfg.grpo, cfg.loss_fn, result.rollouts, batch)
        with run.timer("train"):
            metrics |= parts.policy.train(batch)
        metrics |= run.push_and_check(result.rollouts)
        if run.finish(step, metrics, result, sampling_metrics):
            break
    return state
