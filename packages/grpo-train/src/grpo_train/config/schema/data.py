"""`data`: the dataset entries (grpo-data's keys, grpo_data.config.DatasetEntry) and the dataloader."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

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
            detail = InitErrorDetails(type=PydanticCustomError("dataset_key", "{reason}", {"reason": err.reason}),
                                      loc=(err.key,), input=getattr(self, err.key))
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self


class DataConfig(Section):
    max_input_seq_length: int = Field(default=512, ge=1)
    """Longer prompts are truncated and get loss_multiplier 0 (counted)."""
    shuffle: bool = True
    num_workers: int = Field(default=0, ge=0)
    """DataLoader worker processes."""
    default: DatasetConfig = DatasetConfig()
    """Defaults filled into every dataset entry (only the keys that apply to its kind)."""
    train: DatasetConfig | list[DatasetConfig] = DatasetConfig(dataset_name="arithmetic")
    validation: DatasetConfig | list[DatasetConfig] | None = None
    use_multiple_dataloader: bool = False
    num_prompts_per_dataloader: int | None = None
    custom_dataloader: str | None = None
    """`module:function` sampling function over several dataloaders."""
    bad_rows: Literal["refuse", "skip"] = "refuse"
    """Rows of data files that cannot become prompts (wrong types, invalid Unicode or UTF-8, deep
    nesting, a failing processor; checked once when the datasets are built): refuse stops with
    the file and row; skip leaves them out and logs the count (grpo_data.bad_rows)."""
