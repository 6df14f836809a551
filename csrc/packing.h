// Bin packing of sequence lengths into bins of a fixed token capacity.
// Pure C++ on int64 spans; no Python or torch types, so it is testable and reusable alone.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace grpo {

// Returns bin index per item (same order as `lengths`). Throws std::invalid_argument on a
// negative length or a length above `capacity`.
std::vector<int64_t> pack_first_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity);
std::vector<int64_t> pack_best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity);
// NeMo RL's "modified first-fit-decreasing": items above half the capacity each open a bin,
// then medium items, then the small ones fill first-fit (see packing.cpp for the exact rule).
std::vector<int64_t> pack_modified_ffd(const int64_t* lengths, int64_t n, int64_t capacity);

// Split bins over `world` ranks: equal bin counts per rank (the caller pads with empty bins),
// token sums balanced greedily (largest bin to the lightest rank with room for a bin).
// Returns the rank per bin. Bins are never merged, so no bin can exceed capacity.
std::vector<int64_t> split_bins_across_ranks(const int64_t* bin_tokens, int64_t n_bins, int64_t world);

}  // namespace grpo
