// Bin packing of sequence lengths into bins of a fixed token capacity.
// Pure C++ on int64 spans; no Python or torch types, so it is testable and reusable alone.
//
// Determinism contract (the pure-Python twins in grpo_kernels/packing.py follow it exactly):
// items are considered in "decreasing order" = decreasing length, ties by increasing input
// index. "Largest" means earliest in that order and "smallest" latest. Bins are numbered in
// the order they are opened, starting at 0, and the numbering has no gaps.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace grpo {

// Returns the bin index of every item (same order as `lengths`). Throws std::invalid_argument
// on capacity <= 0, a negative length or a length above `capacity`. Zero lengths are allowed.
//
// First fit decreasing: each item, in decreasing order, goes to the lowest-numbered bin with
// room, a new bin if none has.
std::vector<int64_t> pack_first_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity);
// Best fit decreasing: each item goes to the bin whose room is smallest but still enough
// (ties: lowest bin number), a new bin if none has room.
std::vector<int64_t> pack_best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity);
// Johnson & Garey's modified first fit decreasing (MFFD, 1985), as NeMo RL describes it.
// Classes: large (C/2, C], medium (C/3, C/2], small (C/6, C/3], tiny [0, C/6].
//  1. one bin per large item, in decreasing order;
//  2. forward over those bins: put in the largest remaining medium item that fits, if any;
//  3. backward over the bins that did NOT get a medium item: if the two smallest remaining
//     small items fit together, put in the smallest one and the largest one that still fits;
//  4. forward over all bins: while some remaining item fits, put in the largest that fits;
//  5. first fit decreasing of what is left into new bins.
// Phases 4 and 5 together are exactly first fit decreasing over (large bins, then new bins),
// which is how it is computed here.
std::vector<int64_t> pack_modified_ffd(const int64_t* lengths, int64_t n, int64_t capacity);

// Split bins over `world` ranks: equal bin counts per rank (n_bins must be a multiple of
// `world`; the caller pads with empty bins), token sums balanced greedily: bins in decreasing
// order of tokens (ties: lower bin first), each to the rank with the fewest tokens among those
// that still have room for a bin (ties: lower rank). Returns the rank of every bin. Bins are
// never merged, so no bin can exceed capacity. Throws on world <= 0 or negative tokens.
std::vector<int64_t> split_bins_across_ranks(const int64_t* bin_tokens, int64_t n_bins, int64_t world);

// Groups item indices by bin: returns offsets [n_bins + 1] followed by the n items, items of a
// bin in increasing index order (one O(n) counting pass). Throws if a bin index is outside
// [0, n_bins).
std::vector<int64_t> group_by_bin(const int64_t* bin_of, int64_t n, int64_t n_bins);

}  // namespace grpo
