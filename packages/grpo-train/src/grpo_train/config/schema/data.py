"""`data`: grpo-data's own section (grpo_data.config.DataConfig) with its dataset entries (DatasetEntry)."""

from __future__ import annotations

import dataclasses
import typing

from pydantic import ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

import grpo_data.config
from grpo_data.config import DATASET_KEYS, DatasetEntry, DatasetKeyError
from grpo_train.config.schema.base import Section, section_of

# grpo-data declares the keys of a dataset entry (grpo_data.config.DatasetEntry, torch-free);
# this section takes its fields from there, and the values it refuses at their key path.
if typing.TYPE_CHECKING:  # the static view of the same section (see loss._PGLossSection)
    # Both bases are frozen at run time; pyright reads Section's frozen from its model_config only.
    class _DatasetSection(Section, DatasetEntry): ...  # pyright: ignore[reportGeneralTypeIssues]
else:
    _DatasetSection = section_of(DatasetEntry, "DatasetSection")


class DatasetConfig(_DatasetSection):
    """One dataset entry; the keys are grpo-data's (grpo_data.config) and are checked again there
    against the dataset's kind (a file key on a synthetic dataset is refused)."""

    @model_validator(mode="after")
    def _entry_values(self) -> DatasetConfig:
        try:
            DatasetEntry(**{k: getattr(self, k) for k in DATASET_KEYS})
        except DatasetKeyError as err:
            detail = InitErrorDetails(
                type=PydanticCustomError("dataset_key", "{reason}", {"reason": err.reason}),
                loc=(err.key,),
                input=getattr(self, err.key),
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self


# The data section's keys are grpo-data's too (grpo_data.config.DataConfig, which build_data and
# make_train_iterator take); its dataset entries become DatasetConfig sections here.
if typing.TYPE_CHECKING:  # the static view of the same section (see loss._PGLossSection)

    class _DataSection(Section, grpo_data.config.DataConfig): ...  # pyright: ignore[reportGeneralTypeIssues]
else:
    _DataSection = section_of(grpo_data.config.DataConfig, "DataSection", nested={DatasetEntry: DatasetConfig})


class DataConfig(_DataSection):
    """`data`: grpo_data.config.DataConfig's keys; grpo-data reads them from `data_config()`."""

    @model_validator(mode="after")
    def _section_values(self) -> DataConfig:
        try:
            self.data_config()
        except DatasetKeyError as err:
            detail = InitErrorDetails(
                type=PydanticCustomError("data_key", "{reason}", {"reason": err.reason}),
                loc=(err.key,),
                input=getattr(self, err.key),
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    def data_config(self) -> grpo_data.config.DataConfig:
        """grpo-data's own config of this section (what build_data and make_train_iterator take)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(grpo_data.config.DataConfig)}
        values["default"] = _entry(self.default)
        for part in ("train", "validation"):
            value = values[part]
            values[part] = (
                _entry(value)
                if isinstance(value, DatasetConfig)
                else (None if value is None else [_entry(e) for e in value])
            )
        return grpo_data.config.DataConfig(**values)


def _entry(section: DatasetEntry) -> DatasetEntry:  # a DatasetConfig (statically a DatasetEntry)
    return DatasetEntry(**{k: getattr(section, k) for k in DATASET_KEYS})
