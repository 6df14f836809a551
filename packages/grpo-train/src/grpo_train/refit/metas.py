"""Tensor metadata: what a receiver must know to rebuild the tensors of a push from flat buckets.

Job: `TensorMeta` (name, shape, dtype) and its plain-row form, which crosses vLLM's msgpack RPC
into an engine process. Boundary: torch only inside methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to rebuild one tensor from a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        import torch

        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_row(self) -> list:
        """Plain [name, shape, dtype]: what crosses vLLM's msgpack RPC into an engine process."""
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_row(cls, row: TensorMeta | list | tuple) -> TensorMeta:
        if isinstance(row, TensorMeta):
            return row
        name, shape, dtype = row
        return cls(str(name), tuple(int(d) for d in shape), str(dtype))


def tensor_metadata(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


__all__ = ["TensorMeta", "tensor_metadata"]
