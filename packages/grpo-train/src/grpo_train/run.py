"""Entry points behind `grpo train` and `grpo eval`: run folder, Ray, components, the loop.

Returns process exit codes: 0 done, 1 the run stopped on a training problem (non-finite loss,
refit mismatch, an engine dead after its restarts: the last checkpoint stays intact), 2 a startup
problem a person must fix (among them: checkpoints exist but none is intact, or the config changed in a way resume refuses).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from grpo_train import resume_config
from grpo_train.config.errors import ConfigError
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.errors import NoIntactCheckpoint, NonFiniteLossError, StartupError, StateFileError
from grpo_train.state_io import verify_manifest

EXIT_OK, EXIT_RUN_STOPPED, EXIT_STARTUP = 0, 1, 2


def say(message: str) -> None:
    print(f"grpo: {message}", file=sys.stderr, flush=True)


def prepare_run_dir(run_dir: Path, raw: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def choose_resume_point(checkpoints, resolved: dict) -> Path | None:
    """The newest intact checkpoint, after checking that this run's config may resume it.

    Raises StartupError (one line) when checkpoints exist but none is intact, or when a key
    outside `resume_config.APPLIED_ON_RESUME` changed since the checkpoint was written."""
    if checkpoints is None:
        return None
    try:
        folder = checkpoints.newest_intact(say)
    except NoIntactCheckpoint as exc:
        raise StartupError(str(exc)) from None
    if folder is None:
        return None
    saved = checkpoints.load_run_config(folder)
    if saved is None:
        say(f"warning: {folder} holds no config.json; the config cannot be compared with the one it was written under")
        return folder
    applied, refused = resume_config.split_changes(saved, resolved)
    if refused:
        raise StartupError(
            f"cannot resume {folder}: changed since it was written: {resume_config.describe(refused)}; "
            "restore these values or start a new run (--run-dir). Changeable on resume: "
            + ", ".join(resume_config.APPLIED_ON_RESUME)
        )
    if applied:
        say(f"resuming with a changed config (applied): {resume_config.describe(applied)}")
    return folder


def train(
    cfg: GRPOMasterConfig, raw: dict, run_name: str, run_dir: str | None = None, config_file: str = "<config>"
) -> int:
    """A training run; 0, 1 or 2 (the module's exit codes). The optimizer check of the config
    (`config.checks.check_optimizers`, imports torch._dynamo) runs here, beside Ray's start, and
    raises its ConfigError (naming `config_file`) before any actor starts."""
    # function-level, as everywhere in this module: `import grpo_train.run` stays torch-free
    from grpo_train.config.checks import check_optimizers_in_background

    optimizers_checked = check_optimizers_in_background(cfg, config_file)  # first: the rest imports torch too
    # the run's parts (torch, Ray), after the optimizer check has started
    from grpo_train.checkpoint import CheckpointManager
    from grpo_train.engine_faults import EngineFailed
    from grpo_train.loggers import MetricsLogger
    from grpo_train.refit.check import RefitMismatchError
    from grpo_train.run_state import TrainerState, restore_checkpoint
    from grpo_train.setup import (
        actor_env_vars,
        build_components,
        check_model_options,
        check_plan,
        check_supported,
        init_ray,
        resolve_model_path,
    )
    from grpo_train.step import total_steps
    from grpo_train.sync_loop import train_sync

    if cfg.algorithm == "ppo":  # the config's `ppo:` section picks PPO: same parts plus a value worker
        # the PPO loop and its parts, only for a `ppo:` config
        from grpo_train.ppo.ppo_loop import train_ppo as train_sync
        from grpo_train.ppo.ppo_step import build_ppo_components as build_components
    started = time.perf_counter()
    run_path = Path(run_dir or Path(cfg.logger.log_dir) / run_name).resolve()
    try:
        for warning in check_supported(cfg):
            say(f"warning: {warning}")
        model_path = resolve_model_path(cfg.policy.model_name)
        check_model_options(cfg, model_path)
        check_plan(cfg, model_path)
    except StartupError as exc:
        say(str(exc))
        return EXIT_STARTUP
    ckpt_root = Path(cfg.checkpointing.checkpoint_dir or run_path / "checkpoints")
    checkpoints = (
        CheckpointManager(
            ckpt_root,
            cfg.checkpointing.keep_top_k,
            cfg.checkpointing.metric_name,
            cfg.checkpointing.higher_is_better,
            run_config=cfg.model_dump(mode="json"),
        )
        if cfg.checkpointing.enabled
        else None
    )
    try:
        resume_from = choose_resume_point(checkpoints, cfg.model_dump(mode="json"))
    except StartupError as exc:
        say(str(exc))
        return EXIT_STARTUP
    if resume_from is not None:
        done = TrainerState.from_json(CheckpointManager.load_trainer_state(resume_from)).step
        if done >= cfg.grpo.max_num_steps:  # the run's total is at most max_num_steps: no need to start Ray
            say(f"this run already finished {done} steps; pass --run-dir to start a new run")
            return EXIT_OK
    import ray

    ray_is_ours = not ray.is_initialized()  # a caller's Ray (a notebook, a test session) is left running
    init_ray(cfg.cluster, actor_env_vars())
    try:
        optimizers_checked.result()  # before any actor starts (and before the run folder is written)
    except ConfigError:
        if ray_is_ours:
            ray.shutdown()
        raise
    prepare_run_dir(run_path, raw)
    say(f"run folder {run_path}")
    parts = None
    logger = None
    try:
        try:
            parts = build_components(cfg, model_path)
        except StartupError as exc:
            say(str(exc))
            return EXIT_STARTUP
        state = TrainerState()
        if resume_from is not None:
            try:
                state = restore_checkpoint(resume_from, parts, getattr(parts, "extra_workers", None))
            except StateFileError as exc:  # matched its manifest, yet not a state file grpo wrote
                say(f"cannot resume {resume_from}: {str(getattr(exc, 'cause', None) or exc).splitlines()[0]}")
                return EXIT_STARTUP
            # function-level: `import grpo_train.run` stays torch-free
            from grpo_train.refit import push_weights

            push_weights(parts.policy, state.weight_version)
            say(f"resumed from {resume_from} (step {state.step}; every file matched its manifest)")
        last = total_steps(cfg.grpo, parts.train_data)
        if state.step >= last:
            say(f"this run already finished {state.step} steps; pass --run-dir to start a new run")
            return EXIT_OK
        if state.step == 0 and (run_path / "metrics.jsonl").is_file() and (run_path / "metrics.jsonl").stat().st_size:
            say(f"no checkpoint to resume: starting from step 0; the earlier logs in {run_path} are replaced")
        logger = MetricsLogger(cfg.logger, run_path, run_name, raw, total_steps=last, start_step=state.step)
        try:
            if cfg.grpo.async_grpo.enabled:
                # the async loop, only for grpo.async_grpo.enabled
                from grpo_train.async_loop import train_async

                state = train_async(cfg, parts, logger, checkpoints, state)
            else:
                state = train_sync(cfg, parts, logger, checkpoints, state)
        except (NonFiniteLossError, RefitMismatchError, EngineFailed) as exc:
            logger.close()  # ends the progress bar's line first
            logger = None
            say(f"run stopped at step {state.step + 1}: {exc}")
            return EXIT_RUN_STOPPED
        logger.close()
        logger = None
        say(f"finished {state.step} steps in {time.perf_counter() - started:.0f} s")
        if cfg.logger.plot_enabled:
            # matplotlib: only with logger.plot_enabled
            from grpo_train.plotting import plot_run

            say(f"plot:        {plot_run(run_path)}")
        say(f"metrics:     {run_path / 'metrics.jsonl'}")
        if checkpoints is not None and checkpoints.latest() is not None:
            say(f"checkpoints: {ckpt_root}")
        if cfg.logger.tensorboard_enabled:
            say(f"tensorboard: {run_path / 'tensorboard'}")
        if cfg.logger.wandb_enabled:
            say(f"wandb:       {run_path / 'wandb'}")
        return EXIT_OK
    finally:
        if logger is not None:
            logger.close()
        if parts is not None:
            parts.shutdown()


def checkpoint_model_path(checkpoint: str) -> str:
    """The model folder `grpo eval --checkpoint` serves: policy/model, an HF model in the compute dtype (for a
    LoRA run, the base with the adapters merged in), after the checkpoint's manifest checks out."""
    model_path = Path(checkpoint) / "policy" / "model"
    if not model_path.is_dir():
        raise StartupError(f"--checkpoint: {checkpoint} has no policy/model folder")
    if (problem := verify_manifest(Path(checkpoint))) is not None:
        raise StartupError(f"--checkpoint: {checkpoint} is damaged: {problem}")
    return str(model_path)


def evaluate(cfg: GRPOMasterConfig, raw: dict, checkpoint: str | None = None) -> int:
    """Validation metrics of the config's model (or a checkpoint's policy) on its validation set."""
    import json

    # Function-level, as in train: `import grpo_train.run` stays torch-free.
    from grpo_train.setup import actor_env_vars, build_components, init_ray, resolve_model_path
    from grpo_train.step import train_sampling
    from grpo_train.validation import validate, validation_turns

    try:
        model_path = checkpoint_model_path(checkpoint) if checkpoint else resolve_model_path(cfg.policy.model_name)
        init_ray(cfg.cluster, actor_env_vars())
        parts = build_components(cfg, model_path)
    except StartupError as exc:
        say(str(exc))
        return EXIT_STARTUP
    try:
        metrics, _ = validate(
            parts.generator,
            parts.envs,
            parts.val_datums,
            train_sampling(cfg),
            cfg.grpo.val_num_generations,
            cfg.grpo.val_batch_size,
            **validation_turns(cfg.grpo, cfg.policy, parts.tokenizer),
        )
        print(json.dumps(metrics, indent=2))
        return EXIT_OK
    finally:
        parts.shutdown()
