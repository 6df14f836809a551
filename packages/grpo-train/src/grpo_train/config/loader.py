"""YAML configs with `defaults:` inheritance, dotted command-line overrides and `${...}` interpolation.

Pure data (dicts, lists, scalars): nothing here knows the schema, which is applied afterwards
by `grpo_train.config.schema`. Rules:
- `defaults: a.yaml` (or a list) names parent files relative to the child; parents merge in
  order, later wins, the child wins over all of them. A mapping with `_override_: true`
  replaces the inherited subtree instead of merging into it.
- Overrides: `a.b=v` sets an existing key, `+a.b=v` adds a new one, `~a.b` deletes. Values
  are parsed as YAML (`[1, 2]`, `null`, `1e-4`, `true`).
- `${a.b}` is replaced by that key's value (its type kept when it is the whole string);
  `${mul:x,y}`, `${add:...}`, `${sub:x,y}`, `${div:x,y}`, `${max:...}`, `${min:...}` compute.
- Bounds, so that a hostile or broken file fails in one line and fast instead of with a
  traceback or by exhausting memory: a file is at most `MAX_CONFIG_BYTES` of UTF-8 text,
  nests at most `MAX_CONFIG_DEPTH` levels, and expands (through YAML aliases or `${...}`
  references: the "billion laughs") to at most `MAX_CONFIG_VALUES` values.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError

from grpo_train.config.errors import ConfigError

OVERRIDE_MARK = "_override_"
_MAX_INTERPOLATION_DEPTH = 32
MAX_CONFIG_BYTES = 256 << 10
"""Largest config file read: the built-in ones are a few kB, and PyYAML parses ~100 kB per CPU second."""
MAX_CONFIG_DEPTH = 32
"""Deepest nesting of mappings and lists (the schema is five levels deep)."""
MAX_CONFIG_VALUES = 100_000
"""Most values a config may expand to, aliases and `${...}` references counted at every use."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats, so `1e-4` is a number (YAML 1.1 makes it a string), that
    refuses nesting deeper than MAX_CONFIG_DEPTH and alias expansion past MAX_CONFIG_VALUES
    while it composes (before any Python object is built)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._open: list[int] = []  # expanded-value count at the start of each open node
        self._expanded = 0
        self._sizes: dict[int, int] = {}  # id(node) -> values it expands to (what an alias adds)
        self._aliases = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            self._aliases += 1
            self._count(self._sizes.get(id(node), 1), mark)
            return node
        if len(self._open) >= MAX_CONFIG_DEPTH:
            raise ComposerError(None, None, f"nested deeper than {MAX_CONFIG_DEPTH} levels", mark)
        self._open.append(self._expanded)
        try:
            node = super().compose_node(parent, index)
        finally:
            start = self._open.pop()
        self._count(1, mark)
        self._sizes[id(node)] = self._expanded - start
        return node

    def _count(self, values: int, mark) -> None:
        self._expanded += values
        if self._expanded > MAX_CONFIG_VALUES:
            how = f" ({self._aliases} aliases expanded)" if self._aliases else ""
            raise ComposerError(None, None, f"expands to more than {MAX_CONFIG_VALUES} values{how}", mark)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


_RESOLVERS = {
    "mul": lambda *a: math.prod(a),
    "add": lambda *a: sum(a),
    "sub": lambda a, b: a - b,
    "div": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "max": lambda *a: max(a),
    "min": lambda *a: min(a),
}


def find_config(name: str | Path, search_dirs: list[Path]) -> Path:
    """A path as given if it exists, else a bare name looked up in `search_dirs`."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    for folder in search_dirs:
        for candidate in (folder / str(name), folder / f"{name}.yaml"):
            if candidate.is_file():
                return candidate.resolve()
    known = sorted(p.name for d in search_dirs if d.is_dir() for p in d.glob("*.yaml"))
    hint = f"; built-in configs: {', '.join(known)}" if known else ""
    raise ConfigError(f"config file not found{hint}", file=str(name))


def load_yaml_file(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{size} bytes; a config file is at most {MAX_CONFIG_BYTES} bytes of YAML", file=str(path)
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(path)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}); save the file as UTF-8", file=str(path)
        ) from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"invalid YAML{line}: {getattr(exc, 'problem', exc)}", file=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}", file=str(path))
    return data


def merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `child` into a copy of `base`; `_override_: true` replaces a subtree."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and value.get(OVERRIDE_MARK):
            out[key] = {k: copy.deepcopy(v) for k, v in value.items() if k != OVERRIDE_MARK}
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _strip_override_marks(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_override_marks(v) for k, v in node.items() if k != OVERRIDE_MARK}
    if isinstance(node, list):
        return [_strip_override_marks(v) for v in node]
    return node


def load_with_defaults(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load `path` and, recursively, the files its `defaults:` names (relative to it)."""
    path = path.resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"circular defaults: {cycle}", file=str(path), key="defaults")
    data = load_yaml_file(path)
    parents = data.pop("defaults", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(
            f"expected a file name or a list of file names, got {parents!r}", file=str(path), key="defaults"
        )
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise ConfigError(
                f"parent config {parent!r} not found (looked at {parent_path})", file=str(path), key="defaults"
            )
        merged = merge(merged, load_with_defaults(parent_path, (*_chain, path)))
    return merge(merged, data)


def _split_key(key: str, origin: str) -> list[str]:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"bad key {key!r} in override {origin!r}", key=key)
    return parts


def apply_override(
    config: dict[str, Any], override: str, schema_has: Callable[[list[str]], bool] | None = None
) -> None:
    """Apply one `a.b=v`, `+a.b=v` or `~a.b` in place.

    `a.b=v` needs the key to exist: in the YAML, or (when `schema_has` is given) in the typed
    schema, whose defaults fill keys a file leaves out.
    """
    if override.startswith("~"):
        parts = _split_key(override[1:], override)
        parent = _walk(config, parts[:-1], override, create=False)
        if parts[-1] not in parent:
            raise ConfigError(f"cannot delete {override[1:]!r}: no such key", key=override[1:])
        del parent[parts[-1]]
        return
    adding = override.startswith("+")
    body = override[1:] if adding else override
    if "=" not in body:
        raise ConfigError(f"override {override!r} must look like key=value, +key=value or ~key")
    key, raw = body.split("=", 1)
    parts = _split_key(key.strip(), override)
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(
            f"value {raw!r} in override {override!r} is not valid YAML (quote strings with special characters)", key=key
        ) from None
    in_schema = not adding and schema_has is not None and schema_has(parts) and not _present(config, parts)
    parent = _walk(config, parts[:-1], override, create=adding or in_schema)
    if not adding and not in_schema and parts[-1] not in parent:
        raise ConfigError(f"unknown key in override {override!r} (use +{key}=... to add a key)", key=key)
    if adding and parts[-1] in parent:
        raise ConfigError(f"key already exists in override {override!r} (drop the '+' to change it)", key=key)
    parent[parts[-1]] = value


def _present(config: dict[str, Any], parts: list[str]) -> bool:
    node: Any = config
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _walk(config: dict[str, Any], parts: list[str], origin: str, *, create: bool) -> dict[str, Any]:
    node = config
    for i, part in enumerate(parts):
        if part not in node and create:
            node[part] = {}
        if not isinstance(node.get(part), dict):
            path = ".".join(parts[: i + 1])
            raise ConfigError(f"{path!r} is not a mapping (in override {origin!r})", key=path)
        node = node[part]
    return node


_INTERP = re.compile(r"\$\{([^${}]+)\}")


def _lookup(config: dict[str, Any], dotted: str, at: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ConfigError(f"interpolation ${{{dotted}}} refers to a missing key", key=at)
    return node


def _parse_number(text: str, at: str) -> Any:
    value = parse_yaml(text.strip())
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"resolver argument {text.strip()!r} is not a number", key=at)
    return value


def _resolve_one(expr: str, config: dict[str, Any], at: str) -> Any:
    if ":" in expr:
        name, args = expr.split(":", 1)
        fn = _RESOLVERS.get(name.strip())
        if fn is None:
            raise ConfigError(f"unknown resolver {name!r}; known: {', '.join(sorted(_RESOLVERS))}", key=at)
        values = [_parse_number(a, at) for a in args.split(",")]
        try:
            return fn(*values)
        except (TypeError, ZeroDivisionError) as exc:
            raise ConfigError(f"resolver ${{{expr}}} failed: {exc}", key=at) from None
    return _lookup(config, expr.strip(), at)


def _resolve_string(text: str, config: dict[str, Any], at: str) -> Any:
    for _ in range(_MAX_INTERPOLATION_DEPTH):
        match = _INTERP.search(text)
        if match is None:
            return text
        value = _resolve_one(match.group(1), config, at)
        if match.span() == (0, len(text)):
            if isinstance(value, str) and "${" in value:
                text = value
                continue
            return copy.deepcopy(value)
        text = text[: match.start()] + str(value) + text[match.end() :]
    raise ConfigError(f"interpolation nested deeper than {_MAX_INTERPOLATION_DEPTH} levels (a cycle?)", key=at)


def resolve_interpolations(config: dict[str, Any]) -> dict[str, Any]:
    """Replace every `${...}` in string values, resolving references recursively; the result
    may hold at most MAX_CONFIG_VALUES values nested at most MAX_CONFIG_DEPTH deep (references
    to references multiply like aliases do)."""
    produced = 0

    def visit(node: Any, path: str, depth: int) -> Any:
        nonlocal produced
        produced += 1
        if produced > MAX_CONFIG_VALUES:
            raise ConfigError(f"expands to more than {MAX_CONFIG_VALUES} values through ${{...}} references", key=path)
        if isinstance(node, (dict, list)) and depth >= MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"nested deeper than {MAX_CONFIG_DEPTH} levels (a ${{...}} reference to itself?)", key=path
            )
        if isinstance(node, dict):
            return {k: visit(v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in node.items()}
        if isinstance(node, list):
            return [visit(v, f"{path}.{i}", depth + 1) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return visit(_resolve_string(node, config, path), path, depth)
        return node

    return visit(config, "", 0)


def load_config_dict(
    name: str | Path,
    overrides: Sequence[str] = (),
    search_dirs: Sequence[Path] = (),
    schema_has: Callable[[list[str]], bool] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The resolved plain-dict config and the file it came from."""
    path = find_config(name, list(search_dirs))
    config = _strip_override_marks(load_with_defaults(path))
    for override in overrides:
        try:
            apply_override(config, override, schema_has)
        except ConfigError as exc:
            raise ConfigError(exc.detail, file="command line", key=exc.key) from None
    try:
        return path, resolve_interpolations(config)
    except ConfigError as exc:
        raise ConfigError(exc.detail, file=str(path), key=exc.key) from None
