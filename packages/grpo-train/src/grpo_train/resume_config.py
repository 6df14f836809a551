"""Which config changes a resumed run takes, and which it refuses.

A checkpoint holds the resolved config it was written under (`config.json`). On resume the
run's config is compared with it key by key. A change to a key matched by `APPLIED_ON_RESUME`
takes effect for real: those keys are read afresh from the config after the restore (the
optimizer kwargs through `policy.optim.apply_optimizer_config`, since a restored optimizer
otherwise keeps the saved ones). Every other change is refused: it would change what the
saved state means (model, data order, group shape, seeds, schedule state, loss or batch
layout) or its effect on a restored run is not tested. Boundary: plain dicts, no torch.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

APPLIED_ON_RESUME: tuple[str, ...] = (
    "policy.optimizer.kwargs.*",  # lr, weight_decay, betas, eps: replace the restored hyperparameters
    "value.optimizer.kwargs.*",
    "grpo.max_num_steps",
    "grpo.max_num_epochs",
    "grpo.async_grpo.max_trajectory_age_steps",  # restored groups older than the new bound are regenerated
    "grpo.val_*",
    "grpo.max_val_samples",
    "logger.*",
    "checkpointing.*",
    "cluster.address",
    "cluster.num_cpus",
)
"""Key path patterns (fnmatch, `*` spans dots) whose change a resumed run applies."""


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key path -> leaf value; lists are leaves."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


_ABSENT = "<absent>"


def config_changes(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """key path -> (saved value, current value) for every leaf that differs."""
    old, new = flatten(saved), flatten(current)
    return {
        k: (old.get(k, _ABSENT), new.get(k, _ABSENT))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, _ABSENT) != new.get(k, _ABSENT)
    }


def is_applied_on_resume(path: str) -> bool:
    return any(fnmatchcase(path, pattern) for pattern in APPLIED_ON_RESUME)


def split_changes(saved: dict, current: dict) -> tuple[dict, dict]:
    """(applied, refused) changes between a checkpoint's config and the run's."""
    changes = config_changes(saved, current)
    applied = {k: v for k, v in changes.items() if is_applied_on_resume(k)}
    return applied, {k: v for k, v in changes.items() if k not in applied}


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{path} ({old!r} -> {new!r})" for path, (old, new) in changes.items())
