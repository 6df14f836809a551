"""grpo_data.config: the keys of a dataset entry, declared once and torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo_data.config import (
    ARITHMETIC_KEYS,
    COMMON_KEYS,
    DATASET_KEYS,
    FILE_KEYS,
    POSITIVE_KEYS,
    DataConfig,
    DatasetEntry,
    DatasetKeyError,
)
from grpo_data.errors import DataError


def test_key_groups_partition_the_declared_keys():
    assert ARITHMETIC_KEYS | FILE_KEYS | COMMON_KEYS == DATASET_KEYS
    assert not ARITHMETIC_KEYS & FILE_KEYS and not COMMON_KEYS & (ARITHMETIC_KEYS | FILE_KEYS)
    assert len(DATASET_KEYS) == 24  # counted by hand in DatasetEntry
    assert {"dataset_name", "seed", "env_name"} <= COMMON_KEYS and "repeat" in FILE_KEYS


@pytest.mark.parametrize("key", POSITIVE_KEYS)
def test_counts_below_one_are_refused_naming_the_key(key):
    with pytest.raises(DatasetKeyError, match=rf"^{key}=0: ") as err:
        DatasetEntry(**{key: 0})
    assert err.value.key == key
    assert getattr(DatasetEntry(**{key: 1}), key) == 1


def test_unset_keys_are_none():
    entry = DatasetEntry(dataset_name="arithmetic")
    assert entry.seed is None and entry.size is None and entry.operations is None


def test_importing_the_config_imports_no_torch():
    code = "import sys, grpo_data.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_mapping_becomes_the_typed_section():
    section = DataConfig.from_mapping({
        "shuffle": False, "custom_dataloader": None, "default": {"processor": "math"},
        "train": [{"dataset_name": "arithmetic", "size": 5}, {"dataset_name": "GSM8K"}],
        "validation": {"dataset_name": "AIME2024", "repeat": 2},
    })  # fmt: skip
    assert section.shuffle is False and section.num_workers == 0 and section.max_input_seq_length == 512
    assert section.custom_dataloader is None and section.bad_rows == "refuse"
    assert section.default == DatasetEntry(processor="math")
    assert section.entries("train") == [
        ("data.train[0]", DatasetEntry(dataset_name="arithmetic", size=5)),
        ("data.train[1]", DatasetEntry(dataset_name="GSM8K")),
    ]
    assert section.entries("validation") == [("data.validation", DatasetEntry(dataset_name="AIME2024", repeat=2))]
    assert DataConfig.from_mapping({}).entries("train") == [("data.train", DatasetEntry(dataset_name="arithmetic"))]
    assert DatasetEntry(size=3, seed=None).set_keys() == {"size": 3}


@pytest.mark.parametrize(
    "section, message",
    [
        ({"shufle": True}, r"^data\.shufle: unknown key"),
        ({"train": [{"dataset_name": "arithmetic"}, {"sise": 3}]}, r"^data\.train\[1\]\.sise: unknown key"),
        ({"default": {"repeat": 0}}, r"^data\.default\.repeat=0: "),
        ({"num_workers": -1}, r"^data\.num_workers=-1: "),
        ({"max_input_seq_length": 0}, r"^data\.max_input_seq_length=0: "),
        ({"bad_rows": "drop"}, r"^data\.bad_rows='drop': expected one of"),
        ({"validation": "x.jsonl"}, r"^data\.validation: expected a dataset mapping"),
    ],
)  # fmt: skip
def test_bad_section_keys_are_refused_at_their_key_path(section, message):
    with pytest.raises(DataError, match=message):
        DataConfig.from_mapping(section)
