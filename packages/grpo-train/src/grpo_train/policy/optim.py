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


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    cls = import_object(cfg.name, "policy.optimizer.name")
    kwargs = dict(cfg.kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, entries: list[SchedulerEntry]) -> torch.optim.lr_scheduler.LRScheduler:
    """NeMo RL's format: scheduler entries chained by SequentialLR, `milestones` on the last entry."""
    milestones = None
    schedulers = []
    for entry in entries:
        if entry.milestones is not None:
            milestones = entry.milestones
        if entry.name is not None:
            cls = import_object(entry.name, "policy.scheduler.name")
            schedulers.append(cls(optimizer, **entry.kwargs))
    if not schedulers:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if len(schedulers) == 1:
        return schedulers[0]
    if milestones is None or len(milestones) != len(schedulers) - 1:
        raise ValueError(f"policy.scheduler: {len(schedulers)} schedulers need {len(schedulers) - 1} milestones, got {milestones}")
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)
