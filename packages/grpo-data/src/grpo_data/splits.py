"""Carving a validation set out of a training set, deterministically by seed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grpo_data.errors import DataError


class Subset:
    """Rows `indices` of a map-style dataset (keeps the parent's `source` for messages)."""

    def __init__(self, dataset, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = list(indices)
        self.source = getattr(dataset, "source", type(dataset).__name__)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def location(self, i: int) -> str:
        inner = getattr(self.dataset, "location", None)
        return inner(self.indices[i]) if inner else f"{self.source}, row {self.indices[i] + 1}"


def validation_count(n: int, size: float | int | None) -> int:
    """How many of n rows `split_validation_size` asks for: a fraction in (0, 1) or a count."""
    if not size:
        return 0
    if isinstance(size, float) and 0 < size < 1:
        k = max(1, round(n * size))
    elif float(size) == int(size) and size >= 1:
        k = int(size)
    else:
        raise DataError(f"split_validation_size={size!r}; expected a fraction in (0, 1) or a row count >= 1")
    if k >= n:
        raise DataError(f"split_validation_size={size!r} leaves no training rows out of {n}")
    return k


def carve_validation(dataset, size: float | int | None, seed: int):
    """(train, validation) parts; validation is None when `size` is 0/None.

    The validation rows are the first k of a permutation of the row indices drawn with
    numpy's default_rng(seed); both parts keep the original row order.
    """
    n = len(dataset)
    k = validation_count(n, size)
    if k == 0:
        return dataset, None
    order = np.random.default_rng(int(seed)).permutation(n)
    val_idx, train_idx = np.sort(order[:k]).tolist(), np.sort(order[k:]).tolist()
    if hasattr(dataset, "select"):
        return dataset.select(train_idx), dataset.select(val_idx)
    return Subset(dataset, train_idx), Subset(dataset, val_idx)
