"""The base of every config section, and sections made from a leaf package's own config class."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def section_of(component_config: type, name: str, nested: dict[type, type[Section]] | None = None) -> type[Section]:
    """A section whose fields are those of a component's own frozen dataclass (type and default),
    so that each key is declared once, by the package that reads it. `__declared_in__` names that
    class for test_schema_walk's check that no key is declared twice. `nested` maps the
    component's nested dataclasses to the sections made of them (in field types and defaults)."""
    nested = nested or {}
    hints = typing.get_type_hints(component_config)
    fields: dict[str, Any] = {
        f.name: (_nested_type(hints[f.name], nested), _nested_value(f.default, nested))
        for f in dataclasses.fields(component_config)
    }
    section = create_model(name, __base__=Section, **fields)
    section.__declared_in__ = component_config  # type: ignore[attr-defined]
    return section


def _nested_type(hint: Any, nested: dict[type, type[Section]]) -> Any:
    """`hint` with each nested dataclass replaced by its section (inside unions and lists too)."""
    if hint in nested:
        return nested[hint]
    args = typing.get_args(hint)
    if not args or typing.get_origin(hint) is typing.Literal:
        return hint
    inner = tuple(_nested_type(a, nested) for a in args)
    if typing.get_origin(hint) is list:
        return list[inner[0]]  # pyright: ignore[reportInvalidTypeArguments]
    return typing.Union[inner]  # noqa: UP007  (a runtime union of computed members)


def _nested_value(value: Any, nested: dict[type, type[Section]]) -> Any:
    section = nested.get(type(value))
    if section is None:
        return value
    return section(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
