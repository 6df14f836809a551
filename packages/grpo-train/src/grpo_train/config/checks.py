"""Checks of a validated config that the schema alone cannot make, run before any actor starts.

`check_config` is what `grpo config validate`, `grpo train` and `grpo eval` run after the
schema: lengths that must fit together, environments that exist and accept their settings,
datasets that name configured environments, and optimizers and LR schedulers that build. Each
problem is a `ConfigError` naming the key path (one line, exit 2), instead of a Ray traceback a
minute into the run. The optimizer check builds the optimizer and scheduler on a one-element
dummy parameter and takes a step, so this module imports torch (only inside that check);
`grpo --help` and `grpo config show` do not import it.
"""

from __future__ import annotations

import inspect
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

from grpo_train.config import _is_union_label
from grpo_train.config.errors import ConfigError
from grpo_train.config.schema import (
    ENV_RESOURCE_NAMES,
    DatasetConfig,
    EnvConfig,
    GRPOMasterConfig,
    OptimizerConfig,
    SchedulerEntry,
)
from grpo_train.generation.base import SCORE_RESERVE  # positions the engines keep free for scoring


def check_config(cfg: GRPOMasterConfig, source: str = "<config>", optimizers: bool = True) -> None:
    """Every check below; the first problem raises a ConfigError naming `source` and the key.
    `optimizers=False` leaves out the optimizer check, for a caller that runs it itself
    (`grpo train` overlaps it with Ray's start: `check_optimizers_in_background`)."""
    try:
        check_lengths(cfg)
        check_envs(cfg)
        check_dataset_envs(cfg)
        if optimizers:
            check_optimizers(cfg)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=source, key=exc.key) from None


def check_optimizers_in_background(cfg: GRPOMasterConfig, source: str = "<config>") -> Future:
    """`check_optimizers` in a thread; `.result()` waits for it and raises its ConfigError (naming
    `source`). Building a torch optimizer imports torch and torch._dynamo (about 7 CPU-s, 3.8 of
    them dynamo's, on the 2-core demo machine: benchmarks/results/perf_profile_cpu.md), and Ray's
    start is mostly waiting for its processes: run together, the driver's start-up is shorter.
    The caller must take the result before it starts any actor."""

    def check() -> None:
        try:
            check_optimizers(cfg)
        except ConfigError as exc:
            raise ConfigError(exc.detail, file=source, key=exc.key) from None

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-optimizer-check")
    try:
        return pool.submit(check)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the check


# ------------------------------------------------------------------------------ lengths
def _dataset_entries(cfg: GRPOMasterConfig) -> list[tuple[str, DatasetConfig]]:
    out = []
    for part in ("train", "validation"):
        value = getattr(cfg.data, part)
        if isinstance(value, DatasetConfig):
            out.append((f"data.{part}", value))
        elif value is not None:
            out += [(f"data.{part}[{i}]", entry) for i, entry in enumerate(value)]
    return out


def check_lengths(cfg: GRPOMasterConfig) -> None:
    """Prompt + response must fit the generation context, and the context the trainer's limit.

    The engines left-truncate a prompt to context - max_new_tokens - SCORE_RESERVE tokens
    (generation.base.fit_prompts) and refuse to run when nothing is left; the trainer's
    micro-batches are sized by policy.max_total_sequence_length.
    """
    policy, gen = cfg.policy, cfg.policy.generation
    total = policy.max_total_sequence_length
    if gen.backend == "vllm":
        context, context_key = gen.vllm_cfg.max_model_len, "policy.generation.vllm_cfg.max_model_len"
        if context > total:
            raise ConfigError(
                f"{context} exceeds policy.max_total_sequence_length ({total}): the engine would "
                f"return sequences the trainer does not take",
                key=context_key,
            )
    else:
        context, context_key = total, "policy.max_total_sequence_length"
    if gen.max_new_tokens + SCORE_RESERVE >= context:
        raise ConfigError(
            f"{gen.max_new_tokens} leaves no room for a prompt in {context_key} ({context}; "
            f"{SCORE_RESERVE} position is kept for scoring)",
            key="policy.generation.max_new_tokens",
        )
    room = context - gen.max_new_tokens - SCORE_RESERVE
    if cfg.data.default.max_input_seq_length is not None:
        default = (cfg.data.default.max_input_seq_length, "data.default.max_input_seq_length")
    else:
        default = (cfg.data.max_input_seq_length, "data.max_input_seq_length")
    for where, entry in _dataset_entries(cfg):
        own = entry.max_input_seq_length
        limit, key = (own, f"{where}.max_input_seq_length") if own is not None else default
        if limit > room:
            raise ConfigError(
                f"{limit} + policy.generation.max_new_tokens ({gen.max_new_tokens}) + {SCORE_RESERVE} exceeds "
                f"{context_key} ({context}): accepted prompts would be cut again at generation; use at most {room}",
                key=key,
            )


# --------------------------------------------------------------------------- environments
def env_import_paths() -> list[str]:
    """Where `env.<name>.class` / `reward_fn` modules are found besides PYTHONPATH: the directory
    `grpo train` runs from (as `python -m` finds modules there); env actors search it too."""
    return [os.getcwd()]


def check_envs(cfg: GRPOMasterConfig) -> None:
    """Each `env.<name>` is a registered environment, or names an importable Environment class or
    reward function; its settings fit the class's constructor; its resources exist."""
    # grpo_envs: only `config validate` and `train` check envs; `config show` stays light
    from grpo_envs import registry

    for name, env_cfg in cfg.env.items():
        _check_env_resources(cfg, name, env_cfg.resources)
        with registry.import_paths(env_import_paths()):
            cls = _env_class(name, env_cfg)
        settings = dict(env_cfg.model_extra or {})
        if env_cfg.reward_fn is not None:
            continue  # RewardFnEnv takes only the function, checked by _env_class
        try:
            _constructor_model(cls).model_validate(settings)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"] if not _is_union_label(p))
            msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
            accepted = ", ".join(sorted(_constructor_model(cls).model_fields))
            raise ConfigError(
                f"{msg} (environment {name!r} takes: {accepted or 'no settings'})",
                key=f"env.{name}.{loc}" if loc else f"env.{name}",
            ) from None


def _env_class(name: str, env_cfg: EnvConfig) -> type:
    """The class `env.<name>` runs, imported here so that a bad path fails before any actor starts."""
    # grpo_envs: only `config validate` and `train` check envs; `config show` stays light
    from grpo_envs import registry

    if env_cfg.class_ is not None:
        key = f"env.{name}.class"
        try:
            return registry.load_env_class(env_cfg.class_)
        except (ImportError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{exc} (modules are found on PYTHONPATH and in {os.getcwd()})", key=key) from None
    if env_cfg.reward_fn is not None:
        # grpo_envs: only `config validate` and `train` check envs; `config show` stays light
        from grpo_envs.reward_fn import RewardFnEnv, reward_fn_arity

        key = f"env.{name}.reward_fn"
        try:
            reward_fn_arity(registry.load_object(env_cfg.reward_fn), env_cfg.reward_fn)
        except (ImportError, AttributeError, TypeError) as exc:
            raise ConfigError(f"{exc} (modules are found on PYTHONPATH and in {os.getcwd()})", key=key) from None
        return RewardFnEnv
    try:
        return registry.get(name)
    except KeyError:
        raise ConfigError(
            f"unknown environment; registered: {', '.join(registry.names())} (or give "
            f"env.{name}.class / env.{name}.reward_fn)",
            key=f"env.{name}",
        ) from None


def _check_env_resources(cfg: GRPOMasterConfig, name: str, resources: dict[str, float] | None) -> None:
    """A local Ray has CPUs and GPUs only: an actor asking for a custom resource would never start."""
    custom = sorted(set(resources or {}) - set(ENV_RESOURCE_NAMES))
    if custom and cfg.cluster.address is None:
        raise ConfigError(
            f"unknown resource(s) {', '.join(custom)}; a local Ray has only {', '.join(ENV_RESOURCE_NAMES)} "
            f"(custom Ray resources need a cluster started with them: cluster.address)",
            key=f"env.{name}.resources",
        )


def _constructor_model(cls: type) -> type:
    """A pydantic model of `cls.__init__`'s keyword parameters (types from its annotations)."""
    fields: dict[str, Any] = {}
    extra = "forbid"
    params = []  # a class without its own __init__ takes no settings
    if cls.__init__ is not object.__init__:
        try:
            signature = inspect.signature(cls.__init__, eval_str=True)
        except Exception:  # noqa: BLE001 - a user's annotation that only a type checker resolves: check names only
            signature = inspect.signature(cls.__init__)
        params = list(signature.parameters.values())[1:]
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            extra = "allow"
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            annotation = (
                Any if param.annotation is param.empty or isinstance(param.annotation, str) else param.annotation
            )
            fields[param.name] = (annotation, ... if param.default is param.empty else param.default)
    # strict: the environment receives these very values, so "2" is not a number here
    config = ConfigDict(extra=extra, arbitrary_types_allowed=True, strict=True)
    return create_model(f"{cls.__name__}Settings", __config__=config, **fields)


def check_dataset_envs(cfg: GRPOMasterConfig) -> None:
    """Datasets route prompts to environments by name; each named one must be configured.
    (Rows that name their own environment are checked when the datasets are built.)"""
    entries = [("data.default", cfg.data.default), *_dataset_entries(cfg)]
    for where, entry in entries:
        if entry.env_name is not None and entry.env_name not in cfg.env:
            raise ConfigError(
                f"{entry.env_name!r} is not configured in the env section (configured: "
                f"{', '.join(sorted(cfg.env)) or 'none'})",
                key=f"{where}.env_name",
            )


# ------------------------------------------------------------------------ optimizers
def check_optimizers(cfg: GRPOMasterConfig) -> None:
    """Build each optimizer and its scheduler on a dummy parameter and take one step."""
    sections = [("policy", cfg.policy.optimizer, cfg.policy.scheduler)]
    if cfg.value is not None:
        sections.append(("value", cfg.value.optimizer, cfg.value.scheduler))
    for prefix, optimizer_cfg, scheduler_cfg in sections:
        optimizer = _check_optimizer(optimizer_cfg, f"{prefix}.optimizer")
        _check_scheduler(optimizer, scheduler_cfg, f"{prefix}.scheduler")


def _dummy_optimizer(optimizer_cfg: OptimizerConfig, key: str):
    # Function-level: torch loads only for this check, so `grpo --help` and `config show` stay torch-free.
    import torch

    from grpo_train.policy.optim import build_optimizer  # torch: only `config validate`, never `--help`/`show`

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], optimizer_cfg, key=key)
    param.grad = torch.zeros(1)
    optimizer.step()
    return optimizer


def _check_optimizer(optimizer_cfg: OptimizerConfig, key: str):
    # Function-level: torch loads only for this check, so `grpo --help` and `config show` stay torch-free.
    import torch

    from grpo_train.policy.optim import import_class  # torch: only `config validate`, never `--help`/`show`

    try:
        import_class(optimizer_cfg.name, torch.optim.Optimizer, f"{key}.name")
    except ValueError as exc:
        raise ConfigError(_without_key(str(exc), f"{key}.name"), key=f"{key}.name") from None
    try:
        return _dummy_optimizer(optimizer_cfg, key)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the config's
        culprit = _culprit(
            optimizer_cfg.kwargs, lambda kw: _dummy_optimizer(optimizer_cfg.model_copy(update={"kwargs": kw}), key)
        )
        raise ConfigError(
            f"{_value(optimizer_cfg.kwargs, culprit)}{type(exc).__name__}: {exc}",
            key=f"{key}.kwargs.{culprit}" if culprit else f"{key}.kwargs",
        ) from None


def _check_scheduler(optimizer, entries: list[SchedulerEntry], key: str) -> None:
    # Function-level: torch loads only for this check, so `grpo --help` and `config show` stay torch-free.
    import torch

    from grpo_train.policy.optim import build_scheduler, import_class  # torch: only `config validate`

    for i, entry in enumerate(entries):
        if entry.name is None:
            continue
        try:
            import_class(entry.name, torch.optim.lr_scheduler.LRScheduler, f"{key}[{i}].name")
        except ValueError as exc:
            raise ConfigError(_without_key(str(exc), f"{key}[{i}].name"), key=f"{key}[{i}].name") from None
        try:
            _step(optimizer, build_scheduler(optimizer, [entry], key=key))
        except Exception as exc:  # noqa: BLE001
            culprit = _culprit(
                entry.kwargs,
                lambda kw, entry=entry: _step(
                    optimizer, build_scheduler(optimizer, [entry.model_copy(update={"kwargs": kw})], key=key)
                ),
            )
            raise ConfigError(
                f"{_value(entry.kwargs, culprit)}{type(exc).__name__}: {exc}",
                key=f"{key}[{i}].kwargs.{culprit}" if culprit else f"{key}[{i}].kwargs",
            ) from None
    try:
        _step(optimizer, build_scheduler(optimizer, entries, key=key))
    except Exception as exc:  # noqa: BLE001 - e.g. milestones that do not match the entries
        raise ConfigError(f"{type(exc).__name__}: {exc}", key=key) from None


def _step(optimizer, scheduler) -> None:
    with warnings.catch_warnings():  # the dummy's step order is not a user's concern
        warnings.simplefilter("ignore")
        optimizer.step()
        scheduler.step()


def _culprit(kwargs: dict[str, Any], build) -> str | None:
    """The keyword argument without which the build succeeds (None if no single one is to blame)."""
    for name in kwargs:
        try:
            build({k: v for k, v in kwargs.items() if k != name})
        except Exception:  # noqa: BLE001
            continue
        return name
    return None


def _value(kwargs: dict[str, Any], culprit: str | None) -> str:
    return f"{kwargs[culprit]!r} is refused: " if culprit else ""


def _without_key(message: str, key: str) -> str:
    return message.removeprefix(f"{key}: ").removeprefix(f"{key} ")
