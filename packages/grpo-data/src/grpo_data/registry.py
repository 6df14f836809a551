"""Named callables: processors and samplers are found by registered name or by import path.

"package.module:function" names a user's function without registering it, so a config can
point at code the package has never seen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from grpo_data.errors import DataError

F = TypeVar("F", bound=Callable)


def register(registry: dict[str, F], name: str, kind: str) -> Callable[[F], F]:
    """Decorator adding a function to `registry` under a unique `name`."""

    def decorator(fn: F) -> F:
        if name in registry and registry[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered ({registry[name].__module__})")
        registry[name] = fn
        return fn

    return decorator


def resolve(name_or_import_path: str | F, registry: dict[str, F], kind: str) -> F:
    """A callable as is, a registered name, or "package.module:function"."""
    if callable(name_or_import_path):
        return name_or_import_path
    name = str(name_or_import_path)
    if name in registry:
        return registry[name]
    if ":" not in name:
        raise DataError(
            f"unknown {kind} {name!r}; built-in {kind}s are {sorted(registry)}, or give 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DataError(f"{kind} {name!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise DataError(f"{kind} {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn
