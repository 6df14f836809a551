"""Fixtures of the grpo-kernels tests."""

from __future__ import annotations

from collections import Counter

import pytest


class _CountedKernel:
    """Stands in for a Triton kernel: counts `kernel[grid](...)` launches, then launches it."""

    def __init__(self, kernel, name: str, counts: Counter):
        self._kernel, self._name, self._counts = kernel, name, counts

    def __getitem__(self, grid):
        self._counts[self._name] += 1
        return self._kernel[grid]


@pytest.fixture
def count_launches(monkeypatch):
    """count_launches(module) -> a Counter of grid launches of the module's Triton kernels
    (its attributes named `*_kernel`, the STYLE.md layer-1 names), filled as they run."""

    def install(module) -> Counter:
        counts: Counter = Counter()
        for name in dir(module):
            if name.endswith("_kernel"):
                monkeypatch.setattr(module, name, _CountedKernel(getattr(module, name), name, counts))
        return counts

    return install
