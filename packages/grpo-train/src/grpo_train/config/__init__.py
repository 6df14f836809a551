"""Configuration: YAML loading (`loader`), the typed schema (`schema`), and `load_config`.

Imports no torch, so the CLI can validate a config without starting the heavy stack.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from grpo_train.config.errors import ConfigError
from grpo_train.config.loader import load_config_dict
from grpo_train.config.schema import GRPOMasterConfig

__all__ = ["ConfigError", "GRPOMasterConfig", "load_config", "validate_config_dict"]


def _describe_value(config: dict[str, Any], loc: tuple) -> str:
    node: Any = config
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return ""
    if isinstance(node, (dict, list)):
        return ""
    return f" (got {node!r})"


def validate_config_dict(config: dict[str, Any], source: str = "<config>") -> GRPOMasterConfig:
    """Validate a resolved dict; the first problem becomes a ConfigError naming the key path."""
    try:
        return GRPOMasterConfig.model_validate(config)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        # A union (one dataset or a list of them) reports every branch; the branch that got
        # furthest names the real problem.
        label_at = next((i for i, p in enumerate(first["loc"]) if _is_union_label(p)), None)
        if label_at is not None:
            prefix = first["loc"][:label_at]
            first = max((e for e in errors if e["loc"][:label_at] == prefix), key=lambda e: len(e["loc"]))
        loc = tuple(p for p in first["loc"] if not _is_union_label(p))
        key = ".".join(str(p) for p in loc) or "<root>"
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 and label_at is None else ""
        raise ConfigError(f"{msg}{_describe_value(config, loc)}{more}", file=source, key=key) from None


def _is_union_label(part: object) -> bool:
    return isinstance(part, str) and (part[:1].isupper() or "[" in part)


def schema_has(parts: list[str], model: type[BaseModel] = GRPOMasterConfig) -> bool:
    """Whether a dotted key names a field of the typed schema (through nested sections)."""
    head, rest = parts[0], parts[1:]
    field = model.model_fields.get(head)
    if field is None:
        return False
    if not rest:
        return True
    sections = [
        a
        for a in typing.get_args(field.annotation) or (field.annotation,)
        if isinstance(a, type) and issubclass(a, BaseModel)
    ]
    return any(schema_has(rest, section) for section in sections)


def load_config(
    name: str | Path, overrides: Sequence[str] = (), search_dirs: Sequence[Path] = ()
) -> tuple[GRPOMasterConfig, dict[str, Any]]:
    """Load, merge, override, interpolate and validate. Returns the model and the resolved dict."""
    path, raw = load_config_dict(name, list(overrides), list(search_dirs), schema_has)
    return validate_config_dict(raw, str(path)), raw
