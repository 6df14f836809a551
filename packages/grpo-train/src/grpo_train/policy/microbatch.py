"""Micro-batch planning for the policy worker: which rows of a right-padded [B, S] batch run
through the model together, and in which layout.

Planners (one per PolicyConfig choice, picked by `make_planner`):
- `padded`: a fixed number of rows per micro-batch (train_micro_batch_size /
  logprob_batch_size) in batch order, each slice trimmed to its longest row.
- `dynamic_batching`: rows sorted by length, filled into micro-batches while
  rows x padded width <= the token budget; the width is rounded up to sequence_length_round.
- `sequence_packing`: rows bin-packed by grpo_kernels.packing into streams of at most the token
  budget, laid end to end (the stream rounded up to sequence_length_round with a padding tail).

Then the layouts: `rows_of` slices a padded micro-batch (and the loss inputs of any micro-batch),
`pack_rows` builds a packed stream (flat ids, position ids restarting per sequence, cu_seqlens),
`unpack_rows` turns the stream's per-token values back into [rows, L]. Every per-token quantity
of the loss is computed per row, so a micro-batch's rows can be taken in any grouping; the
global normalisers of the loss keep the sum over micro-batches equal to the one-batch value.
Knows nothing of models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from grpo_train.batch import round_up
from grpo_train.config.schema import PolicyConfig

Purpose = Literal["train", "logprob"]
# Config spelling (NeMo RL's) -> grpo_kernels.packing.PACKERS key.
PACKING_ALGORITHMS = {
    "first_fit_decreasing": "ffd",
    "best_fit_decreasing": "bfd",
    "modified_first_fit_decreasing": "modified_ffd",
}
MIN_WIDTH = 2  # a padded slice needs two columns for one next-token logprob


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the batch that run together. Padded: a [len(rows), width] slice. Packed: one
    stream of `width` tokens (the rows end to end, then a padding tail)."""

    rows: tuple[int, ...]  # batch rows, in layout order
    lengths: tuple[int, ...]  # tokens of each row (attention_mask sum)
    width: int
    packed: bool = False

    @property
    def tokens(self) -> int:
        """Tokens the model runs on, padding included."""
        return self.width if self.packed else len(self.rows) * self.width


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Tokens per row of a right-padded [B, S] mask; refuses masks with holes or left padding."""
    lengths = attention_mask.sum(dim=1)
    right_padded = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :] < lengths[:, None]
    if not torch.equal(attention_mask.bool(), right_padded):
        bad = int((attention_mask.bool() != right_padded).any(dim=1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {bad} is not right-padded (1s then 0s); micro-batching needs right padding"
        )
    return lengths.tolist()


# ----------------------------------------------------------------------------- planners
class Planner(ABC):
    """Splits a batch (given its row lengths and width S) into micro-batches."""

    name: ClassVar[str]
    packed: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: PolicyConfig, purpose: Purpose) -> Planner: ...

    @abstractmethod
    def plan(self, lengths: Sequence[int], batch_width: int) -> list[MicroBatch]: ...

    def dummy(self, lengths: Sequence[int], batch_width: int) -> MicroBatch:
        """A micro-batch that keeps a rank in step with ranks that have more: the shortest row,
        alone, in this planner's layout (its result is thrown away)."""
        row = min(range(len(lengths)), key=lambda i: (lengths[i], i))
        n = int(lengths[row])
        width = max(1, n) if self.packed else max(min(MIN_WIDTH, batch_width), n)
        return MicroBatch((row,), (n,), width, self.packed)


class PaddedRows(Planner):
    """A fixed number of rows per micro-batch, in batch order."""

    name = "padded"

    def __init__(self, rows_per_microbatch: int):
        self.rows_per_microbatch = rows_per_microbatch

    @classmethod
    def from_config(cls, cfg: PolicyConfig, purpose: Purpose) -> PaddedRows:
        return cls(cfg.train_micro_batch_size if purpose == "train" else cfg.logprob_batch_size)

    def plan(self, lengths: Sequence[int], batch_width: int) -> list[MicroBatch]:
        out = []
        for start in range(0, len(lengths), self.rows_per_microbatch):
            rows = tuple(range(start, min(start + self.rows_per_microbatch, len(lengths))))
            lens = tuple(int(lengths[r]) for r in rows)
            out.append(MicroBatch(rows, lens, max(min(MIN_WIDTH, batch_width), max(lens))))
        return out


class _TokenBudget(Planner):
    """Shared by the token-budget planners: the budget, its config key and the oversize check."""

    section: ClassVar[str]  # PolicyConfig field of this planner's settings

    def __init__(self, budget: int, round_to: int, key: str):
        self.budget, self.round_to, self.key = budget, round_to, key

    @classmethod
    def _settings(cls, cfg: PolicyConfig, purpose: Purpose) -> tuple:
        section = getattr(cfg, cls.section)
        field = "train_mb_tokens" if purpose == "train" else "logprob_mb_tokens"
        return section, getattr(section, field), f"policy.{cls.section}.{field}"

    def check_fits(self, lengths: Sequence[int]) -> None:
        """A sequence is never split or truncated: one longer than the budget is an error."""
        longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
        if lengths[longest] > self.budget:
            over = sum(1 for n in lengths if n > self.budget)
            raise ValueError(
                f"{self.key}={self.budget}: row {longest} of the batch is {lengths[longest]} tokens long "
                f"({over} row(s) exceed the budget), and a sequence cannot be split across micro-batches; "
                f"set {self.key} to at least {lengths[longest]} (policy.max_total_sequence_length bounds every sequence)"
            )

    def rounded(self, tokens: int, cap: int) -> int:
        """`tokens` rounded up to sequence_length_round, but not past `cap` (nor below tokens)."""
        return max(tokens, min(round_up(tokens, self.round_to), cap))


class DynamicBatching(_TokenBudget):
    """Rows by decreasing length; a micro-batch grows while rows x padded width <= budget."""

    name = "dynamic_batching"
    section = "dynamic_batching"

    @classmethod
    def from_config(cls, cfg: PolicyConfig, purpose: Purpose) -> DynamicBatching:
        section, budget, key = cls._settings(cfg, purpose)
        return cls(budget, section.sequence_length_round, key)

    def plan(self, lengths: Sequence[int], batch_width: int) -> list[MicroBatch]:
        self.check_fits(lengths)
        groups: list[tuple[int, list[int]]] = []  # (padded width, rows); the first row is the longest
        for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            if not groups or (len(groups[-1][1]) + 1) * groups[-1][0] > self.budget:
                width = self.rounded(int(lengths[row]), min(self.budget, batch_width))
                groups.append((max(min(MIN_WIDTH, batch_width), width), []))
            groups[-1][1].append(row)
        return [
            MicroBatch(tuple(sorted(rows)), tuple(int(lengths[r]) for r in sorted(rows)), width)
            for width, rows in groups
        ]


class SequencePacking(_TokenBudget):
    """Rows bin-packed into streams of at most `budget` tokens (grpo_kernels.packing)."""

    name = "sequence_packing"
    section = "sequence_packing"
    packed = True

    def __init__(self, budget: int, round_to: int, key: str, algorithm: str = "modified_first_fit_decreasing"):
        super().__init__(budget, round_to, key)
        if algorithm not in PACKING_ALGORITHMS:
            raise ValueError(
                f"policy.sequence_packing.algorithm={algorithm!r}; expected one of {sorted(PACKING_ALGORITHMS)}"
            )
        self.algorithm = algorithm

    @classmethod
    def from_config(cls, cfg: PolicyConfig, purpose: Purpose) -> SequencePacking:
        section, budget, key = cls._settings(cfg, purpose)
        return cls(budget, section.sequence_length_round, key, section.algorithm)

    def plan(self, lengths: Sequence[int], batch_width: int) -> list[MicroBatch]:
        from grpo_kernels.packing import pack_lengths

        self.check_fits(lengths)
        bins = pack_lengths([int(n) for n in lengths], self.budget, PACKING_ALGORITHMS[self.algorithm])
        out = []
        for rows in bins:
            lens = tuple(int(lengths[r]) for r in rows)
            out.append(MicroBatch(tuple(rows), lens, self.rounded(max(1, sum(lens)), self.budget), packed=True))
        return out


PLANNERS: dict[str, type[Planner]] = {cls.name: cls for cls in (PaddedRows, DynamicBatching, SequencePacking)}


def planner_name(cfg: PolicyConfig) -> str:
    """The planner a policy config asks for (the config refuses both switches at once)."""
    if cfg.sequence_packing.enabled:
        return SequencePacking.name
    if cfg.dynamic_batching.enabled:
        return DynamicBatching.name
    return PaddedRows.name


def make_planner(cfg: PolicyConfig, purpose: Purpose) -> Planner:
    return PLANNERS[planner_name(cfg)].from_config(cfg, purpose)


# ------------------------------------------------------------------------------ layouts
def rows_of(
    batch: dict[str, torch.Tensor], rows: Sequence[int], width: int, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The micro-batch's rows of every tensor, on `device`: [B, S] -> [len(rows), width],
    [B] -> [len(rows)]."""
    out = {}
    for key, value in batch.items():
        picked = value.index_select(0, torch.tensor(rows, dtype=torch.long, device=value.device))
        out[key] = (picked[:, :width] if picked.dim() == 2 else picked).to(device or value.device, non_blocking=True)
    return out


@dataclass(frozen=True)
class PackedRows:
    """A packed micro-batch as model input."""

    input_ids: torch.Tensor  # [T] int64: the rows end to end, then a padding tail up to the width
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for every row (and for the tail)
    cu_seqlens: torch.Tensor  # [n + 1], or [n + 2] with a tail: boundaries of every segment, ending at T
    max_seqlen: int  # longest segment
    num_rows: int  # n: the first n segments are the rows


def pack_rows(
    input_ids: torch.Tensor, mb: MicroBatch, device: torch.device | None = None, pad_id: int = 0
) -> PackedRows:
    """input_ids [B, S] (right-padded) -> the packed stream of mb's rows, `mb.width` tokens, on `device`."""
    from grpo_kernels.pack_tensors import pack_padded

    index = torch.tensor(mb.rows, dtype=torch.long, device=input_ids.device)
    packed = pack_padded(input_ids.index_select(0, index).to(device or input_ids.device), mb.lengths)
    tail = mb.width - sum(mb.lengths)
    if tail < 0:
        raise ValueError(f"micro-batch width {mb.width} is below its {sum(mb.lengths)} tokens")
    if not tail:
        return PackedRows(packed.flat, packed.position_ids, packed.cu_seqlens, packed.max_seqlen, len(mb.rows))
    device = packed.flat.device
    return PackedRows(
        input_ids=torch.cat([packed.flat, torch.full((tail,), pad_id, dtype=packed.flat.dtype, device=device)]),
        position_ids=torch.cat([packed.position_ids, torch.arange(tail, device=device)]),
        cu_seqlens=torch.cat([packed.cu_seqlens, torch.tensor([mb.width], device=device)]),
        max_seqlen=max(packed.max_seqlen, tail),
        num_rows=len(mb.rows),
    )


def unpack_rows(flat: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Per-token values of a packed stream [T] -> [n, longest row], 0 past each row's end
    (differentiable; the padding tail is dropped)."""
    from grpo_kernels.pack_tensors import unpack_padded

    cu = packed.cu_seqlens[: packed.num_rows + 1]
    return unpack_padded(flat[: int(cu[-1])], cu)
