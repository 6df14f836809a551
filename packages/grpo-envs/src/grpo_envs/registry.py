"""Environment registry: a name maps to an Environment class.

Built-in environments are registered as ``"module:Class"`` strings and imported on first
``make``/``get``, so ``import grpo_envs`` stays cheap (no Ray, math-verify or torch).
Adding an environment is one file plus one line here (or one ``register`` call from user code).
"""

from __future__ import annotations

import importlib

from grpo_envs.base import Environment

_REGISTRY: dict[str, type[Environment] | str] = {
    "arithmetic": "grpo_envs.arithmetic:ArithmeticEnv",
    "math": "grpo_envs.math_env:MathEnv",
    "code": "grpo_envs.code_env:CodeEnv",
    "reward_model": "grpo_envs.reward_model:RewardModelEnv",
    "number_guess": "grpo_envs.number_guess:NumberGuessEnv",
    "calculator": "grpo_envs.calculator_env:CalculatorEnv",
    "code_interpreter": "grpo_envs.code_interpreter_env:CodeInterpreterEnv",
}


def register(name: str, cls: type[Environment] | str, *, overwrite: bool = False) -> None:
    """Register ``cls`` (a class, or ``"module:Class"`` imported lazily) under ``name``."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register({name!r}, ...): expected an Environment subclass, got {cls!r}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] != cls:
        raise ValueError(
            f"environment {name!r} is already registered ({_REGISTRY[name]!r}); "
            "pass overwrite=True to replace it"
        )
    _REGISTRY[name] = cls


def get(name: str) -> type[Environment]:
    """The class registered under ``name``."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))}"
        ) from None
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(entry, type) and issubclass(entry, Environment)):
            raise TypeError(f"environment {name!r} points to {entry!r}, not an Environment class")
        _REGISTRY[name] = entry
    return entry


def make(name: str, **config) -> Environment:
    """Build the environment registered under ``name`` with its keyword settings."""
    cls = get(name)
    try:
        return cls(**config)
    except TypeError as exc:
        raise TypeError(f"environment {name!r} ({cls.__name__}): bad config {config!r}: {exc}") from exc


def names() -> list[str]:
    """Registered environment names, sorted."""
    return sorted(_REGISTRY)
