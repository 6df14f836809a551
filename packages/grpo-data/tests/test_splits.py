import pytest

from grpo_data.arithmetic import ArithmeticDataset
from grpo_data.errors import DataError
from grpo_data.splits import Subset, carve_validation, validation_count


def test_validation_count():
    assert validation_count(100, None) == 0 and validation_count(100, 0) == 0
    assert validation_count(100, 0.05) == 5 and validation_count(10, 0.01) == 1
    assert validation_count(100, 7) == 7 and validation_count(100, 7.0) == 7
    for bad in (100, 1.5, -2, 0.5 + 2):
        with pytest.raises(DataError):
            validation_count(100, bad)


def test_carving_a_plain_map_style_dataset():
    rows = ArithmeticDataset(20, seed=0)
    train, val = carve_validation(rows, 5, seed=3)
    assert isinstance(train, Subset) and (len(train), len(val)) == (15, 5)
    assert sorted(train.indices + val.indices) == list(range(20))
    assert train.indices == sorted(train.indices)
    assert val[0] == rows[val.indices[0]]
    assert val.location(0) == f"{rows.source}, row {val.indices[0] + 1}"
    assert carve_validation(rows, 5, seed=3)[1].indices == val.indices
    assert carve_validation(rows, 0, seed=3) == (rows, None)
