"""Optimizer and LR scheduler from their config sections (import paths + kwargs)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from grpo_train.config.schema import OptimizerConfig, SchedulerEntry


def import_object(path: str, what: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{what} {path!r} must be a dotted import path such as torch.optim.AdamW")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported: {exc}") from None


def import_class(path: str, base: type, key: str) -> type:
    """The class at import path `path`, which must subclass `base` (a config names code to run:
    only optimizer and scheduler classes are accepted here, not any callable)."""
    obj = import_object(path, key)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{key}: {path!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return obj


def build_optimizer(params, cfg: OptimizerConfig, key: str = "policy.optimizer") -> torch.optim.Optimizer:
    cls = import_class(cfg.name, torch.optim.Optimizer, f"{key}.name")
    kwargs = dict(cfg.kwargs)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def build_scheduler(
    optimizer: torch.optim.Optimizer, entries: list[SchedulerEntry], key: str = "policy.scheduler"
) -> torch.optim.lr_scheduler.LRScheduler:
    """NeMo RL's format: scheduler entries chained by SequentialLR, `milestones` on the last entry."""
    milestones = None
    schedulers = []
    for i, entry in enumerate(entries):
        if entry.milestones is not None:
            milestones = entry.milestones
        if entry.name is not None:
            cls = import_class(entry.name, torch.optim.lr_scheduler.LRScheduler, f"{key}[{i}].name")
            schedulers.append(cls(optimizer, **entry.kwargs))
    if not schedulers:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if len(schedulers) == 1:
        return schedulers[0]
    if milestones is None or len(milestones) != len(schedulers) - 1:
        raise ValueError(f"{key}: {len(schedulers)} schedulers need {len(schedulers) - 1} milestones, got {milestones}")
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimizerConfig) -> None:
    """After a checkpoint's optimizer and scheduler states are loaded: this run's config kwargs
    replace the saved hyperparameters (the moment estimates and step counts stay the checkpoint's).

    A changed `lr` becomes the new base lr of the schedule: the current lr keeps its place in the
    schedule (lr = new_base * lr / old_base) and the scheduler's base lrs follow, so its next steps
    stay on the new scale. Unchanged values are left untouched (bitwise resume)."""
    kwargs = dict(cfg.kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    new_lr = kwargs.pop("lr", None)
    for group in optimizer.param_groups:
        for key, value in kwargs.items():
            if key in group and group[key] != value:
                group[key] = value
        old_base = group.get("initial_lr", group["lr"])
        if new_lr is not None and old_base != new_lr:
            group["lr"] = new_lr * (group["lr"] / old_base) if old_base else new_lr
            group["initial_lr"] = new_lr
    if new_lr is None:
        return
    for sched in (scheduler, *getattr(scheduler, "_schedulers", ())):
        sched.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        sched._last_lr = [group["lr"] for group in optimizer.param_groups]
