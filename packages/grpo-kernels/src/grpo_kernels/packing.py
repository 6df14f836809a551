"""Sequence packing: which sequences share a micro-batch of at most `capacity` tokens, and which
data-parallel rank gets which micro-batch.

Works on lengths only (numpy, no torch): the tensors themselves are packed by
`grpo_kernels.pack_tensors`. The fast path is the C++ in `grpo_kernels._C` (through `_ext`);
every algorithm has a pure-Python twin here that follows the same rules to the letter, and the
tests check that both give the same assignment, item for item.

Determinism rules shared with csrc/packing.h: items are taken in decreasing length, ties by
increasing index ("largest" = earliest in that order); bins are numbered in the order they are
opened. Bounds (C = capacity, S = total tokens, LB = ceil(S / C) <= OPT):
- all three algorithms leave at most one bin at most half full, so bins <= max(1, ceil(2S/C));
- more tightly, every bin but the last is fuller than C - (longest item), so with short items
  bins <= floor(S / (C - longest)) + 1;
- against the optimum: FFD and BFD <= 11/9 OPT + 6/9 (Dósa 2007), MFFD <= 71/60 OPT + 31/6
  (Yue & Zhang 1995). OPT is not computable here, so tests check LB and the bounds above.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from grpo_kernels import _ext

logger = logging.getLogger(__name__)

Algorithm = Literal["ffd", "bfd", "modified_ffd"]
Implementation = Literal["auto", "cpp", "python"]
OversizePolicy = Literal["error", "truncate"]
# Upper bound on refinement moves in split_bins_for_ranks, per item (it always terminates: each
# move lowers the sum of squared rank loads; the cap only bounds the time on odd inputs).
_MOVES_PER_ITEM = 4

__all__ = [
    "PACKERS",
    "Packer",
    "assign_bins",
    "pack_lengths",
    "lower_bound_bins",
    "split_bins_for_ranks",
    "first_fit_decreasing_py",
    "best_fit_decreasing_py",
    "modified_first_fit_decreasing_py",
    "split_bins_across_ranks_py",
]


# ------------------------------------------------------------------------------------------
# Pure-Python twins: simple O(n * bins) code, written to be obviously right, not fast.
# ------------------------------------------------------------------------------------------
def _decreasing_order(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def first_fit_decreasing_py(lengths: Sequence[int], capacity: int) -> list[int]:
    """Bin per item: each item, largest first, into the lowest-numbered bin with room."""
    bin_of = [-1] * len(lengths)
    residual: list[int] = []
    for item in _decreasing_order(lengths):
        size = lengths[item]
        bin_ = next((b for b, room in enumerate(residual) if room >= size), len(residual))
        if bin_ == len(residual):
            residual.append(capacity)
        residual[bin_] -= size
        bin_of[item] = bin_
    return bin_of


def best_fit_decreasing_py(lengths: Sequence[int], capacity: int) -> list[int]:
    """Bin per item: each item, largest first, into the bin with the least room that still
    suffices (ties: lowest bin number)."""
    bin_of = [-1] * len(lengths)
    residual: list[int] = []
    for item in _decreasing_order(lengths):
        size = lengths[item]
        fitting = [(room, b) for b, room in enumerate(residual) if room >= size]
        if fitting:
            bin_ = min(fitting)[1]
        else:
            bin_ = len(residual)
            residual.append(capacity)
        residual[bin_] -= size
        bin_of[item] = bin_
    return bin_of


def modified_first_fit_decreasing_py(lengths: Sequence[int], capacity: int) -> list[int]:
    """Bin per item: Johnson & Garey's MFFD, phase by phase as NeMo RL describes it."""
    order = _decreasing_order(lengths)  # every class list below keeps this order
    large = [i for i in order if 2 * lengths[i] > capacity]
    medium = [i for i in order if 3 * lengths[i] > capacity >= 2 * lengths[i]]
    small = [i for i in order if 6 * lengths[i] > capacity >= 3 * lengths[i]]
    tiny = [i for i in order if 6 * lengths[i] <= capacity]
    bin_of = [-1] * len(lengths)
    residual: list[int] = []

    def put(item: int, bin_: int) -> None:
        bin_of[item] = bin_
        residual[bin_] -= lengths[item]

    # 1. One bin per large item, largest first.
    for b, item in enumerate(large):
        residual.append(capacity)
        put(item, b)
    # 2. Forward: the largest remaining medium item that fits.
    got_medium = [False] * len(large)
    for b in range(len(large)):
        fitting = [i for i in medium if lengths[i] <= residual[b]]
        if fitting:
            medium.remove(fitting[0])
            put(fitting[0], b)
            got_medium[b] = True
    # 3. Backward over bins without a medium item: if the two smallest small items fit
    #    together, the smallest one plus the largest one that still fits.
    for b in reversed(range(len(large))):
        if got_medium[b]:
            continue
        if len(small) < 2:
            break
        smallest, second = small[-1], small[-2]
        if lengths[smallest] + lengths[second] > residual[b]:
            continue
        small.remove(smallest)
        put(smallest, b)
        partner = next(i for i in small if lengths[i] <= residual[b])
        small.remove(partner)
        put(partner, b)
    # 4. Forward over all bins: while something fits, the largest remaining item that fits.
    #    (One pass per bin suffices: an item skipped once never fits this bin later.)
    position = {item: p for p, item in enumerate(order)}
    rest = sorted(medium + small + tiny, key=position.__getitem__)
    for b in range(len(large)):
        left = []
        for item in rest:
            if lengths[item] <= residual[b]:
                put(item, b)
            else:
                left.append(item)
        rest = left
    # 5. First fit decreasing of the leftovers into new bins.
    n_large = len(large)
    for item in rest:
        bin_ = next((b for b in range(n_large, len(residual)) if residual[b] >= lengths[item]), len(residual))
        if bin_ == len(residual):
            residual.append(capacity)
        put(item, bin_)
    return bin_of


def split_bins_across_ranks_py(bin_tokens: Sequence[int], world: int) -> list[int]:
    """Rank per bin (len(bin_tokens) a multiple of `world`): bins by decreasing tokens, each to
    the rank with the fewest tokens among those with room for a bin (ties: lowest rank)."""
    per_rank = len(bin_tokens) // world
    load, count = [0] * world, [0] * world
    rank_of = [-1] * len(bin_tokens)
    for b in _decreasing_order(bin_tokens):
        rank = min((r for r in range(world) if count[r] < per_rank), key=lambda r: (load[r], r))
        rank_of[b] = rank
        load[rank] += bin_tokens[b]
        count[rank] += 1
    return rank_of


# ------------------------------------------------------------------------------------------
# Registry: adding an algorithm is a C++ function, a Python twin and one line here.
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packer:
    """One packing algorithm: the C++ fast path and its pure-Python twin (same results)."""

    description: str
    cpp: Callable[[np.ndarray, int], np.ndarray]
    python: Callable[[Sequence[int], int], list[int]]


PACKERS: dict[str, Packer] = {
    "ffd": Packer("first fit decreasing", _ext.pack_first_fit_decreasing, first_fit_decreasing_py),
    "bfd": Packer("best fit decreasing", _ext.pack_best_fit_decreasing, best_fit_decreasing_py),
    "modified_ffd": Packer("Johnson & Garey modified FFD", _ext.pack_modified_ffd, modified_first_fit_decreasing_py),
}


# ------------------------------------------------------------------------------------------
# Input checks (errors name the item)
# ------------------------------------------------------------------------------------------
def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise ValueError(f"capacity must be an int, got {capacity!r}")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    return int(capacity)


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("empty batch: there are no sequence lengths to pack")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype} (first value {arr[0]!r})")
    arr = arr.astype(np.int64, copy=False)
    negative = np.flatnonzero(arr < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"lengths[{i}] = {int(arr[i])} is negative ({negative.size} negative length(s) in all)")
    return arr


def _apply_oversize(arr: np.ndarray, capacity: int, oversize: OversizePolicy) -> np.ndarray:
    if oversize not in ("error", "truncate"):
        raise ValueError(f"oversize must be 'error' or 'truncate', got {oversize!r}")
    over = np.flatnonzero(arr > capacity)
    if not over.size:
        return arr
    if oversize == "error":
        i = int(over[0])
        raise ValueError(
            f"lengths[{i}] = {int(arr[i])} exceeds the bin capacity {capacity} ({over.size} item(s) do). "
            "The oversize policy is 'error'; it can be 'error' or 'truncate' (oversize='truncate' packs "
            "such sequences as `capacity` tokens long, and the caller must truncate them to that)."
        )
    logger.debug("packing: %d item(s) longer than capacity %d packed truncated", over.size, capacity)
    return np.minimum(arr, capacity)


def _pick_implementation(implementation: Implementation) -> str:
    if implementation == "auto":
        if _ext.has_extension():
            return "cpp"
        warnings.warn(
            "grpo_kernels._C is not available; packing falls back to the slow pure-Python twins "
            "(see grpo_kernels._ext for how to rebuild the extension)",
            RuntimeWarning,
            stacklevel=3,
        )
        return "python"
    if implementation not in ("cpp", "python"):
        raise ValueError(f"implementation must be 'auto', 'cpp' or 'python', got {implementation!r}")
    return implementation


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def lower_bound_bins(lengths: Sequence[int] | np.ndarray, capacity: int) -> int:
    """ceil(total tokens / capacity), at least 1 for a non-empty batch: no packing does better."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return max(1, -(-total // capacity)) if len(lengths) else 0


def assign_bins(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    algorithm: Algorithm = "ffd",
    implementation: Implementation = "auto",
    oversize: OversizePolicy = "error",
) -> np.ndarray:
    """Bin index per item ([n] int64, bins numbered 0.. in opening order). See `pack_lengths`."""
    capacity = _check_capacity(capacity)
    if algorithm not in PACKERS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; known: {', '.join(sorted(PACKERS))}")
    arr = _apply_oversize(_as_lengths(lengths), capacity, oversize)
    impl = _pick_implementation(implementation)
    logger.debug("packing %d items with %s (%s)", arr.size, algorithm, impl)
    packer = PACKERS[algorithm]
    if impl == "cpp":
        return packer.cpp(arr, capacity)
    return np.asarray(packer.python(arr.tolist(), capacity), dtype=np.int64)


def _group(bin_of: np.ndarray) -> list[list[int]]:
    n_bins = int(bin_of.max()) + 1 if bin_of.size else 0
    if _ext.has_extension():
        offsets, items = _ext.group_by_bin(bin_of, n_bins)
    else:
        items = np.argsort(bin_of, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=n_bins))])
    flat, bounds = items.tolist(), offsets.tolist()
    return [flat[bounds[b] : bounds[b + 1]] for b in range(n_bins)]


def pack_lengths(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    algorithm: Algorithm = "ffd",
    implementation: Implementation = "auto",
    oversize: OversizePolicy = "error",
) -> list[list[int]]:
    """Packs sequences of the given token lengths into bins of at most `capacity` tokens.

    Returns the bins in opening order, each a list of item indices in increasing order.
    algorithm: a key of PACKERS ("ffd", "bfd", "modified_ffd").
    implementation: "cpp" (C++, GIL released), "python" (the twin), "auto" (C++ when built).
    oversize: "error" (ValueError naming the item) or "truncate" (the item is packed as
    `capacity` tokens long, alone in its bin; the caller truncates the sequence).
    Raises ValueError on an empty batch, a negative length, capacity <= 0 or an unknown name.
    """
    return _group(assign_bins(lengths, capacity, algorithm, implementation, oversize))


# ------------------------------------------------------------------------------------------
# Data-parallel split
# ------------------------------------------------------------------------------------------
def _lpt_split(items: list[int], lengths: list[int], capacity: int, world: int, impl: str) -> list[list[list[int]]]:
    """Fallback: items (largest first) to the lightest rank, then FFD within each rank."""
    loads = [0] * world
    per_rank: list[list[int]] = [[] for _ in range(world)]
    for item in sorted(items, key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        per_rank[rank].append(item)
        loads[rank] += lengths[item]
    ranks = []
    for members in per_rank:
        if not members:
            ranks.append([])
            continue
        local = pack_lengths([lengths[i] for i in members], capacity, "ffd", impl)
        ranks.append([sorted(members[j] for j in bin_) for bin_ in local])
    k = max(len(r) for r in ranks)
    return [r + [[] for _ in range(k - len(r))] for r in ranks]


def _refine(ranks: list[list[list[int]]], lengths: list[int], capacity: int, tolerance: int, max_moves: int) -> None:
    """Moves single items from the heaviest rank into bins of the lightest one while their gap
    exceeds `tolerance`. Each move of x (0 < x < gap) lowers the sum of squared loads."""
    fills = [[sum(lengths[i] for i in bin_) for bin_ in rank] for rank in ranks]
    loads = [sum(f) for f in fills]
    world = len(ranks)
    for _ in range(max_moves):
        heavy = max(range(world), key=lambda r: (loads[r], -r))
        light = min(range(world), key=lambda r: (loads[r], r))
        gap = loads[heavy] - loads[light]
        if gap <= tolerance or not ranks[light]:
            return
        room = max(capacity - f for f in fills[light])
        best = None  # (|gap - 2x|, bin, position)
        for b, bin_ in enumerate(ranks[heavy]):
            for pos, item in enumerate(bin_):
                x = lengths[item]
                if 0 < x < gap and x <= room and (best is None or abs(gap - 2 * x) < best[0]):
                    best = (abs(gap - 2 * x), b, pos)
        if best is None:
            return
        _, b, pos = best
        item = ranks[heavy][b].pop(pos)
        x = lengths[item]
        dest = min((capacity - f, d) for d, f in enumerate(fills[light]) if capacity - f >= x)[1]
        ranks[light][dest].append(item)
        ranks[light][dest].sort()
        fills[heavy][b] -= x
        fills[light][dest] += x
        loads[heavy] -= x
        loads[light] += x


def _gap(ranks: list[list[list[int]]], lengths: list[int]) -> int:
    loads = [sum(lengths[i] for bin_ in rank for i in bin_) for rank in ranks]
    return max(loads) - min(loads)


def split_bins_for_ranks(
    bins: Sequence[Sequence[int]],
    lengths: Sequence[int] | np.ndarray,
    world_size: int,
    *,
    capacity: int | None = None,
    tolerance: int | None = None,
    implementation: Implementation = "auto",
) -> list[list[list[int]]]:
    """Splits packed bins over `world_size` data-parallel ranks: result[rank] is that rank's list
    of bins (lists of item indices).

    Every rank gets the same number of bins, ceil(len(bins) / world_size), padded with empty
    bins; no bin exceeds `capacity` (default: the fullest input bin, so nothing gets fuller than
    the input allowed). Token sums are balanced in three steps:
    1. bins, heaviest first, to the lightest rank with room for a bin (C++ when built);
    2. while the heaviest and lightest ranks differ by more than `tolerance` (default: the
       longest sequence), move one sequence from the heaviest rank into a bin of the lightest
       that has room, the one that best halves their gap;
    3. if that still leaves a gap above `tolerance` (rare: no bin of the light rank had room),
       re-split sequence by sequence (largest to the lightest rank, then FFD within each rank),
       which always ends within the longest sequence but may need more bins per rank.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    world = int(world_size)
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and (lens.dtype == np.bool_ or not np.issubdtype(lens.dtype, np.integer))):
        raise ValueError(f"lengths must be a 1-D sequence of ints, got {lens.dtype} shape {lens.shape}")
    lens_list: list[int] = lens.astype(np.int64).tolist()
    seen: dict[int, int] = {}
    for b, bin_ in enumerate(bins):
        for item in bin_:
            if isinstance(item, bool) or not isinstance(item, (int, np.integer)) or not 0 <= item < len(lens_list):
                raise ValueError(
                    f"bins[{b}] holds {item!r}, which is not an index into lengths (0..{len(lens_list) - 1})"
                )
            if item in seen:
                raise ValueError(f"item {item} appears in bins[{seen[item]}] and bins[{b}]")
            if lens_list[item] < 0:
                raise ValueError(f"lengths[{item}] = {lens_list[item]} is negative")
            seen[int(item)] = b
    tokens = [sum(lens_list[i] for i in bin_) for bin_ in bins]
    if capacity is None:
        capacity = max(tokens, default=0)
    elif isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    for b, t in enumerate(tokens):
        if t > capacity:
            raise ValueError(f"bins[{b}] holds {t} tokens, more than the capacity {capacity}")
    if not bins:
        return [[] for _ in range(world)]
    longest = max((lens_list[i] for i in seen), default=0)
    tolerance = longest if tolerance is None else int(tolerance)
    impl = _pick_implementation(implementation)

    # 1. Bin-level greedy over padded bins.
    per_rank = -(-len(bins) // world)
    padded = tokens + [0] * (per_rank * world - len(bins))
    if impl == "cpp":
        rank_of = _ext.split_bins_across_ranks(np.asarray(padded, dtype=np.int64), world).tolist()
    else:
        rank_of = split_bins_across_ranks_py(padded, world)
    ranks: list[list[list[int]]] = [[] for _ in range(world)]
    for b, rank in enumerate(rank_of):
        ranks[rank].append(sorted(int(i) for i in bins[b]) if b < len(bins) else [])
    # 2. Item moves.
    _refine(ranks, lens_list, capacity, tolerance, max_moves=_MOVES_PER_ITEM * (len(seen) + world))
    if _gap(ranks, lens_list) <= tolerance:
        return ranks
    # 3. Sequence-level fallback.
    fallback = _lpt_split(sorted(seen), lens_list, capacity, world, impl)
    chosen = fallback if _gap(fallback, lens_list) < _gap(ranks, lens_list) else ranks
    logger.debug(
        "split_bins_for_ranks: bin-level split left a gap above %d; using the %s split",
        tolerance,
        "sequence-level" if chosen is fallback else "bin-level",
    )
    return chosen
