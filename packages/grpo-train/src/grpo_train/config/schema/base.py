"""The base of every config section, and sections made from a leaf package's own config class."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def section_of(component_config: type, name: str) -> type[Section]:
    """A section whose fields are those of a component's own frozen dataclass (type and default),
    so that each key is declared once, by the package that reads it. `__declared_in__` names that
    class for test_schema_walk's check that no key is declared twice."""
    hints = typing.get_type_hints(component_config)
    fields: dict[str, Any] = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(component_config)}
    section = create_model(name, __base__=Section, **fields)
    section.__declared_in__ = component_config  # type: ignore[attr-defined]
    return section
