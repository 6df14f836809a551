"""Environment registry: a name maps to an Environment class.

Built-in environments are registered as ``"module:Class"`` strings and imported on first
``make``/``get``, so ``import grpo_envs`` stays cheap (no Ray, math-verify or torch).
Adding an environment is one file plus one line here (or one ``register`` call from user code).
Code outside grpo names its class by import path instead (``load_env_class("my_pkg.envs:MyEnv")``),
which is what ``env.<name>.class`` in a training config does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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
            f"environment {name!r} is already registered ({_REGISTRY[name]!r}); pass overwrite=True to replace it"
        )
    _REGISTRY[name] = cls


def get(name: str) -> type[Environment]:
    """The class registered under ``name``."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None
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


def load_object(spec: str) -> Any:
    """The object that ``"package.module:attr"`` names (``attr`` may be dotted: ``Outer.inner``).

    Raises ImportError (module missing or failing to import) or AttributeError, with a message
    that says which part of ``spec`` failed.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImportError(f"{spec!r} is not an import path of the form 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # the user's module raised while importing: report it, do not crash
        raise ImportError(f"importing module {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_env_class(spec: str) -> type[Environment]:
    """The Environment subclass at import path ``spec`` (TypeError when it is something else)."""
    obj = load_object(spec)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise TypeError(f"{spec!r} is {obj!r}, not a subclass of grpo_envs.base.Environment")
    if getattr(obj, "__abstractmethods__", None):
        raise TypeError(f"{spec!r} does not implement {', '.join(sorted(obj.__abstractmethods__))}")
    return obj


@contextmanager
def import_paths(paths: Sequence[str]) -> Iterator[None]:
    """``paths`` searched first by imports inside the block (and left on ``sys.path`` afterwards
    only if they were there before), so user modules next to a config import the same way in the
    driver's checks and in environment actors."""
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)
