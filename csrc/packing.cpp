// O(n log n) bin packing. Items are ordered once (counting sort when lengths are small,
// which they are: they are bounded by the bin capacity). First fit uses a max segment tree
// over bin residuals to find the leftmost bin with room; best fit buckets bins by residual
// under a hierarchical bitset (an ordered set of (residual, bin) for huge capacities); MFFD's
// class phases use "next/previous remaining item" union-find arrays.
#include "packing.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

namespace grpo {
namespace {

// Throws on bad input; returns the longest length (the range the counting sort needs).
int64_t check_lengths(const int64_t* lengths, int64_t n, int64_t capacity) {
  if (capacity <= 0) throw std::invalid_argument("capacity must be positive, got " + std::to_string(capacity));
  if (n < 0) throw std::invalid_argument("number of items must be non-negative");
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0)
      throw std::invalid_argument("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) + " is negative");
    if (lengths[i] > capacity)
      throw std::invalid_argument("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) +
                                  " exceeds the bin capacity " + std::to_string(capacity));
    longest = std::max(longest, lengths[i]);
  }
  return longest;
}

int bit_width(uint64_t v) {
  int w = 0;
  while (v) {
    ++w;
    v >>= 1;
  }
  return w;
}

// Item indices by decreasing value, ties by increasing index. All values lie in [0, max_value].
std::vector<int64_t> order_decreasing(const int64_t* values, int64_t n, int64_t max_value) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (n == 0) return order;
  if (max_value <= 8 * n + 65536) {
    // Stable counting sort on key = max_value - value.
    std::vector<int64_t> start(static_cast<size_t>(max_value) + 2, 0);
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<size_t>(max_value - values[i]) + 1];
    for (size_t k = 1; k < start.size(); ++k) start[k] += start[k - 1];
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(start[static_cast<size_t>(max_value - values[i])]++)] = i;
    return order;
  }
  const int idx_bits = std::max(1, bit_width(static_cast<uint64_t>(n - 1)));
  if (bit_width(static_cast<uint64_t>(max_value)) + idx_bits <= 64) {
    // Unique packed keys (max_value - value, index): an unstable sort is deterministic.
    std::vector<uint64_t> keys(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      keys[static_cast<size_t>(i)] = (static_cast<uint64_t>(max_value - values[i]) << idx_bits) | static_cast<uint64_t>(i);
    std::sort(keys.begin(), keys.end());
    const uint64_t mask = (uint64_t{1} << idx_bits) - 1;
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int64_t>(keys[static_cast<size_t>(i)] & mask);
    return order;
  }
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return values[a] > values[b]; });
  return order;
}

// Upper bound on the bins any of the packers here opens. All of them are "any fit" in the
// sense that an item only starts a bin when it fits in no open one, and MFFD's large bins are
// more than half full; so at most one bin is at most half full and m <= max(1, ceil(2S/C)).
// One spare leaf is added; the first-fit tree throws rather than overflow if this is wrong.
int64_t bin_bound(const int64_t* lengths, int64_t n, int64_t capacity) {
  int64_t q = 0, acc = 0;  // S = q * capacity + acc, 0 <= acc < capacity, without overflow
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] >= capacity - acc) {
      ++q;
      acc = lengths[i] - (capacity - acc);
    } else {
      acc += lengths[i];
    }
  }
  const int64_t extra = acc == 0 ? 0 : (acc <= capacity - acc ? 1 : 2);
  return std::min(n, std::max<int64_t>(1, 2 * q + extra) + 1);
}

// Max segment tree over `leaves` bins; unopened bins hold the full capacity, so the leftmost
// bin with residual >= need is either an open bin or the next new one.
class FirstFitTree {
 public:
  FirstFitTree(int64_t leaves, int64_t capacity) : size_(1) {
    while (size_ < std::max<int64_t>(leaves, 1)) size_ <<= 1;
    tree_.assign(static_cast<size_t>(2 * size_), capacity);
  }
  // Sets the residual of bin `bin` without updating parents; call build() afterwards.
  void set_leaf(int64_t bin, int64_t residual) { tree_[static_cast<size_t>(size_ + bin)] = residual; }
  void build() {
    for (int64_t node = size_ - 1; node >= 1; --node)
      tree_[static_cast<size_t>(node)] = std::max(tree_[static_cast<size_t>(2 * node)], tree_[static_cast<size_t>(2 * node + 1)]);
  }
  // Puts `need` into the leftmost bin with room and returns that bin.
  int64_t place(int64_t need) {
    if (tree_[1] < need) throw std::logic_error("grpo packing: first-fit tree ran out of bins (bin bound violated)");
    int64_t node = 1;
    while (node < size_) node = tree_[static_cast<size_t>(2 * node)] >= need ? 2 * node : 2 * node + 1;
    const int64_t bin = node - size_;
    tree_[static_cast<size_t>(node)] -= need;
    for (node >>= 1; node >= 1; node >>= 1) {
      const int64_t value = std::max(tree_[static_cast<size_t>(2 * node)], tree_[static_cast<size_t>(2 * node + 1)]);
      if (tree_[static_cast<size_t>(node)] == value) break;  // ancestors unchanged too
      tree_[static_cast<size_t>(node)] = value;
    }
    return bin;
  }

 private:
  int64_t size_;
  std::vector<int64_t> tree_;
};

// The remaining members of a range of positions [0, m): next remaining at or after i, previous
// remaining at or before i, with union-find path halving (amortised near O(1)).
class RemainingSet {
 public:
  explicit RemainingSet(int64_t m) : m_(m), next_(static_cast<size_t>(m + 1)), prev_(static_cast<size_t>(m + 1)) {
    std::iota(next_.begin(), next_.end(), int64_t{0});  // next_[m] = m: "none"
    std::iota(prev_.begin(), prev_.end(), int64_t{0});  // prev_[j] is about position j - 1; prev_[0]: "none"
  }
  int64_t next(int64_t i) { return find(next_, i); }         // m when none
  int64_t prev(int64_t i) { return find(prev_, i + 1) - 1; }  // -1 when none
  void remove(int64_t i) {
    next_[static_cast<size_t>(i)] = i + 1;
    prev_[static_cast<size_t>(i + 1)] = i;
  }
  int64_t size() const { return m_; }

 private:
  static int64_t find(std::vector<int64_t>& parent, int64_t x) {
    while (parent[static_cast<size_t>(x)] != x) {
      parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
      x = parent[static_cast<size_t>(x)];
    }
    return x;
  }
  int64_t m_;
  std::vector<int64_t> next_, prev_;
};

// Hierarchical bitset over [0, universe): insert, erase and "smallest member >= x" in
// O(log64 universe) word operations.
class SuccessorSet {
 public:
  explicit SuccessorSet(int64_t universe) {
    int64_t words = universe;
    do {
      words = (words + 63) / 64;
      levels_.emplace_back(static_cast<size_t>(words), 0);
    } while (words > 1);
  }
  void insert(int64_t x) {
    for (auto& level : levels_) {
      level[static_cast<size_t>(x >> 6)] |= uint64_t{1} << (x & 63);
      x >>= 6;
    }
  }
  void erase(int64_t x) {
    for (auto& level : levels_) {
      uint64_t& word = level[static_cast<size_t>(x >> 6)];
      word &= ~(uint64_t{1} << (x & 63));
      if (word) break;  // the parent bit stays set while this word has members
      x >>= 6;
    }
  }
  int64_t next(int64_t x) const {  // -1 when none
    size_t level = 0;
    for (;; ++level) {
      if (level == levels_.size()) return -1;
      const int64_t w = x >> 6;
      if (w >= static_cast<int64_t>(levels_[level].size())) return -1;
      const uint64_t bits = levels_[level][static_cast<size_t>(w)] & (~uint64_t{0} << (x & 63));
      if (bits) {
        x = (w << 6) | __builtin_ctzll(bits);
        break;
      }
      x = w + 1;  // first word after w, in the level above
    }
    while (level > 0) {
      --level;
      x = (x << 6) | __builtin_ctzll(levels_[level][static_cast<size_t>(x)]);
    }
    return x;
  }

 private:
  std::vector<std::vector<uint64_t>> levels_;
};

// Best fit over integer residuals: bins bucketed by residual, a SuccessorSet of the non-empty
// buckets, and a min-heap of bin numbers per bucket for the "lowest bin" tie rule. Memory is
// O(capacity), so it is used when the capacity is not much larger than the item count.
class BestFitBuckets {
 public:
  explicit BestFitBuckets(int64_t capacity) : nonempty_(capacity + 1), slot_(static_cast<size_t>(capacity) + 1, -1) {}
  // Bin with the smallest residual >= need (lowest number among those), removed; -1 if none.
  std::pair<int64_t, int64_t> take(int64_t need) {
    const int64_t residual = nonempty_.next(need);
    if (residual < 0) return {-1, -1};
    std::vector<int64_t>& heap = heaps_[static_cast<size_t>(slot_[static_cast<size_t>(residual)])];
    std::pop_heap(heap.begin(), heap.end(), std::greater<int64_t>());
    const int64_t bin = heap.back();
    heap.pop_back();
    if (heap.empty()) {
      free_.push_back(slot_[static_cast<size_t>(residual)]);
      slot_[static_cast<size_t>(residual)] = -1;
      nonempty_.erase(residual);
    }
    return {bin, residual};
  }
  void put(int64_t bin, int64_t residual) {
    int32_t& s = slot_[static_cast<size_t>(residual)];
    if (s < 0) {
      if (free_.empty()) {
        s = static_cast<int32_t>(heaps_.size());
        heaps_.emplace_back();
      } else {
        s = free_.back();
        free_.pop_back();
      }
      nonempty_.insert(residual);
    }
    std::vector<int64_t>& heap = heaps_[static_cast<size_t>(s)];
    heap.push_back(bin);
    std::push_heap(heap.begin(), heap.end(), std::greater<int64_t>());
  }

 private:
  SuccessorSet nonempty_;
  std::vector<int32_t> slot_;  // residual -> heap index, -1 when no bin has that residual
  std::vector<std::vector<int64_t>> heaps_;
  std::vector<int32_t> free_;
};

}  // namespace

std::vector<int64_t> pack_first_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity) {
  const int64_t longest = check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(static_cast<size_t>(n), -1);
  if (n == 0) return bin_of;
  FirstFitTree tree(bin_bound(lengths, n, capacity), capacity);
  for (int64_t item : order_decreasing(lengths, n, longest)) bin_of[static_cast<size_t>(item)] = tree.place(lengths[item]);
  return bin_of;
}

std::vector<int64_t> pack_best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity) {
  const int64_t longest = check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(static_cast<size_t>(n), -1);
  if (n == 0) return bin_of;
  const std::vector<int64_t> order = order_decreasing(lengths, n, longest);
  int64_t n_bins = 0;
  if (capacity <= std::min<int64_t>(16 * n + 65536, int64_t{1} << 26)) {
    BestFitBuckets open(capacity);
    for (int64_t item : order) {
      const int64_t len = lengths[item];
      auto [bin, residual] = open.take(len);
      if (bin < 0) {
        bin = n_bins++;
        residual = capacity;
      }
      open.put(bin, residual - len);
      bin_of[static_cast<size_t>(item)] = bin;
    }
    return bin_of;
  }
  std::set<std::pair<int64_t, int64_t>> open;  // (residual, bin); (residual, bin) pairs are unique
  for (int64_t item : order) {
    const int64_t len = lengths[item];
    auto it = open.lower_bound({len, -1});  // smallest residual >= len, then lowest bin
    int64_t bin, residual;
    if (it == open.end()) {
      bin = n_bins++;
      residual = capacity;
    } else {
      bin = it->second;
      residual = it->first;
      it = open.erase(it);
    }
    // The new key is smaller than the erased one, so the erased position is a good hint.
    open.emplace_hint(it, residual - len, bin);
    bin_of[static_cast<size_t>(item)] = bin;
  }
  return bin_of;
}

std::vector<int64_t> pack_modified_ffd(const int64_t* lengths, int64_t n, int64_t capacity) {
  const int64_t longest = check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(static_cast<size_t>(n), -1);
  if (n == 0) return bin_of;
  const std::vector<int64_t> order = order_decreasing(lengths, n, longest);
  std::vector<int64_t> sorted_len(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) sorted_len[static_cast<size_t>(p)] = lengths[order[static_cast<size_t>(p)]];
  // Classes are contiguous ranges of positions in decreasing order. For integers,
  // k * len > C  <=>  len > floor(C / k), which cannot overflow.
  auto end_of_class = [&](int64_t from, int64_t threshold) {  // first position with len <= threshold
    return static_cast<int64_t>(std::partition_point(sorted_len.begin() + from, sorted_len.end(),
                                                     [&](int64_t v) { return v > threshold; }) -
                                sorted_len.begin());
  };
  const int64_t n_large = end_of_class(0, capacity / 2);
  const int64_t medium_end = end_of_class(n_large, capacity / 3);
  const int64_t small_end = end_of_class(medium_end, capacity / 6);
  // First position in [from, to) whose length is <= budget (to if none).
  auto first_fitting = [&](int64_t from, int64_t to, int64_t budget) {
    return static_cast<int64_t>(std::partition_point(sorted_len.begin() + from, sorted_len.begin() + to,
                                                     [&](int64_t v) { return v > budget; }) -
                                sorted_len.begin());
  };

  // Phase 1: one bin per large item; bin b holds the item at position b.
  std::vector<int64_t> residual(static_cast<size_t>(n_large));
  std::vector<char> has_medium(static_cast<size_t>(n_large), 0);
  for (int64_t b = 0; b < n_large; ++b) {
    bin_of[static_cast<size_t>(order[static_cast<size_t>(b)])] = b;
    residual[static_cast<size_t>(b)] = capacity - sorted_len[static_cast<size_t>(b)];
  }

  // Phase 2: forward, the largest remaining medium item that fits.
  RemainingSet medium(medium_end - n_large);
  int64_t medium_left = medium.size();
  for (int64_t b = 0; b < n_large && medium_left > 0; ++b) {
    const int64_t p0 = first_fitting(n_large, medium_end, residual[static_cast<size_t>(b)]);
    const int64_t i = medium.next(p0 - n_large);
    if (i == medium.size()) continue;
    const int64_t p = n_large + i;
    bin_of[static_cast<size_t>(order[static_cast<size_t>(p)])] = b;
    residual[static_cast<size_t>(b)] -= sorted_len[static_cast<size_t>(p)];
    has_medium[static_cast<size_t>(b)] = 1;
    medium.remove(i);
    --medium_left;
  }

  // Phase 3: backward over bins without a medium item, the smallest small item plus the
  // largest remaining one that fits with it, when the two smallest fit together. (A bin with a
  // large and a medium item has less than C/6 left, so it could never take two small items;
  // the has_medium test only keeps the code word for word with the paper.)
  RemainingSet small(small_end - medium_end);
  int64_t small_left = small.size();
  for (int64_t b = n_large - 1; b >= 0 && small_left >= 2; --b) {
    if (has_medium[static_cast<size_t>(b)]) continue;
    const int64_t s1 = small.prev(small.size() - 1);
    const int64_t s2 = small.prev(s1 - 1);
    const int64_t len1 = sorted_len[static_cast<size_t>(medium_end + s1)];
    const int64_t len2 = sorted_len[static_cast<size_t>(medium_end + s2)];
    if (len1 + len2 > residual[static_cast<size_t>(b)]) continue;  // both <= C/3: no overflow
    bin_of[static_cast<size_t>(order[static_cast<size_t>(medium_end + s1)])] = b;
    residual[static_cast<size_t>(b)] -= len1;
    small.remove(s1);
    const int64_t p0 = first_fitting(medium_end, small_end, residual[static_cast<size_t>(b)]);
    const int64_t i = small.next(p0 - medium_end);  // exists: s2 fits and is still there
    bin_of[static_cast<size_t>(order[static_cast<size_t>(medium_end + i)])] = b;
    residual[static_cast<size_t>(b)] -= sorted_len[static_cast<size_t>(medium_end + i)];
    small.remove(i);
    small_left -= 2;
  }

  // Phases 4 + 5: first fit decreasing of everything left over (large bins first, then new).
  FirstFitTree tree(bin_bound(lengths, n, capacity), capacity);
  for (int64_t b = 0; b < n_large; ++b) tree.set_leaf(b, residual[static_cast<size_t>(b)]);
  tree.build();
  for (int64_t p = n_large; p < n; ++p) {
    const int64_t item = order[static_cast<size_t>(p)];
    if (bin_of[static_cast<size_t>(item)] < 0) bin_of[static_cast<size_t>(item)] = tree.place(sorted_len[static_cast<size_t>(p)]);
  }
  return bin_of;
}

std::vector<int64_t> split_bins_across_ranks(const int64_t* bin_tokens, int64_t n_bins, int64_t world) {
  if (world <= 0) throw std::invalid_argument("world size must be positive, got " + std::to_string(world));
  if (n_bins < 0) throw std::invalid_argument("number of bins must be non-negative");
  if (n_bins % world != 0)
    throw std::invalid_argument("number of bins (" + std::to_string(n_bins) + ") must be a multiple of the world size (" +
                                std::to_string(world) + "); pad with empty bins first");
  int64_t max_tokens = 0;
  for (int64_t b = 0; b < n_bins; ++b) {
    if (bin_tokens[b] < 0)
      throw std::invalid_argument("bin_tokens[" + std::to_string(b) + "] = " + std::to_string(bin_tokens[b]) + " is negative");
    max_tokens = std::max(max_tokens, bin_tokens[b]);
  }
  const int64_t per_rank = n_bins / world;
  std::vector<int64_t> rank_of(static_cast<size_t>(n_bins), -1);
  std::set<std::pair<int64_t, int64_t>> load;  // (tokens, rank) of ranks with room for a bin
  std::vector<int64_t> count(static_cast<size_t>(world), 0);
  if (per_rank > 0)
    for (int64_t r = 0; r < world; ++r) load.insert({0, r});
  for (int64_t b : order_decreasing(bin_tokens, n_bins, max_tokens)) {
    const auto lightest = *load.begin();
    load.erase(load.begin());
    rank_of[static_cast<size_t>(b)] = lightest.second;
    if (++count[static_cast<size_t>(lightest.second)] < per_rank) load.insert({lightest.first + bin_tokens[b], lightest.second});
  }
  return rank_of;
}

std::vector<int64_t> group_by_bin(const int64_t* bin_of, int64_t n, int64_t n_bins) {
  if (n < 0 || n_bins < 0) throw std::invalid_argument("sizes must be non-negative");
  std::vector<int64_t> out(static_cast<size_t>(n_bins + 1 + n), 0);
  int64_t* offsets = out.data();
  int64_t* items = out.data() + n_bins + 1;
  for (int64_t i = 0; i < n; ++i) {
    if (bin_of[i] < 0 || bin_of[i] >= n_bins)
      throw std::invalid_argument("bin_of[" + std::to_string(i) + "] = " + std::to_string(bin_of[i]) + " is outside [0, " +
                                  std::to_string(n_bins) + ")");
    ++offsets[bin_of[i] + 1];
  }
  for (int64_t b = 0; b < n_bins; ++b) offsets[b + 1] += offsets[b];
  std::vector<int64_t> cursor(offsets, offsets + n_bins);
  for (int64_t i = 0; i < n; ++i) items[cursor[static_cast<size_t>(bin_of[i])]++] = i;
  return out;
}

}  // namespace grpo
