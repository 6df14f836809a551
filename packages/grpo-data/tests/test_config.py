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
    DatasetEntry,
    DatasetKeyError,
)


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
