// O(n log n) bin packing. First fit uses a max segment tree over bin residuals to find the
// leftmost bin with room; best fit uses an ordered multiset of (residual, bin).
#include "packing.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

namespace grpo {
namespace {

void check_lengths(const int64_t* lengths, int64_t n, int64_t capacity) {
  if (capacity <= 0) throw std::invalid_argument("capacity must be positive, got " + std::to_string(capacity));
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0)
      throw std::invalid_argument("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) + " is negative");
    if (lengths[i] > capacity)
      throw std::invalid_argument("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) +
                                  " exceeds the bin capacity " + std::to_string(capacity));
  }
}

// Items sorted by decreasing length; ties keep input order so results are deterministic.
std::vector<int64_t> order_decreasing(const int64_t* lengths, int64_t n) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  return order;
}

// Max segment tree over at most `n` bins; unopened bins hold the full capacity, so the
// leftmost bin with residual >= size is either an open bin or the next new one.
class FirstFitTree {
 public:
  FirstFitTree(int64_t n, int64_t capacity) : size_(1) {
    while (size_ < std::max<int64_t>(n, 1)) size_ <<= 1;
    tree_.assign(2 * size_, capacity);
  }
  int64_t find_leftmost(int64_t need) const {
    if (tree_[1] < need) return -1;
    int64_t node = 1;
    while (node < size_) node = tree_[2 * node] >= need ? 2 * node : 2 * node + 1;
    return node - size_;
  }
  void subtract(int64_t bin, int64_t amount) {
    int64_t node = bin + size_;
    tree_[node] -= amount;
    for (node >>= 1; node >= 1; node >>= 1) tree_[node] = std::max(tree_[2 * node], tree_[2 * node + 1]);
  }

 private:
  int64_t size_;
  std::vector<int64_t> tree_;
};

}  // namespace

std::vector<int64_t> pack_first_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity) {
  check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(n, -1);
  FirstFitTree tree(n, capacity);
  for (int64_t item : order_decreasing(lengths, n)) {
    const int64_t bin = tree.find_leftmost(lengths[item]);
    tree.subtract(bin, lengths[item]);
    bin_of[item] = bin;
  }
  return bin_of;
}

std::vector<int64_t> pack_best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t capacity) {
  check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(n, -1);
  std::multiset<std::pair<int64_t, int64_t>> open;  // (residual, bin)
  int64_t n_bins = 0;
  for (int64_t item : order_decreasing(lengths, n)) {
    const int64_t len = lengths[item];
    auto it = open.lower_bound({len, -1});
    int64_t bin, residual;
    if (it == open.end()) {
      bin = n_bins++;
      residual = capacity;
    } else {
      bin = it->second;
      residual = it->first;
      open.erase(it);
    }
    open.insert({residual - len, bin});
    bin_of[item] = bin;
  }
  return bin_of;
}

// Johnson & Garey's modified first-fit-decreasing, the variant NeMo RL ships:
// large items (> C/2) open one bin each; medium items (C/3, C/2] are placed forward, the
// largest that fits into each large bin; small items (C/6, C/3] are placed backward in pairs
// (the smallest plus the largest that still fits); everything left goes first-fit
// decreasing over all bins.
std::vector<int64_t> pack_modified_ffd(const int64_t* lengths, int64_t n, int64_t capacity) {
  check_lengths(lengths, n, capacity);
  std::vector<int64_t> bin_of(n, -1);
  std::vector<int64_t> residual;
  std::multiset<std::pair<int64_t, int64_t>> medium, small;  // (length, item)
  std::vector<int64_t> rest;
  for (int64_t item : order_decreasing(lengths, n)) {
    const int64_t len = lengths[item];
    if (2 * len > capacity) {
      bin_of[item] = static_cast<int64_t>(residual.size());
      residual.push_back(capacity - len);
    } else if (3 * len > capacity) {
      medium.insert({len, item});
    } else if (6 * len > capacity) {
      small.insert({len, item});
    } else {
      rest.push_back(item);
    }
  }
  const int64_t n_large = static_cast<int64_t>(residual.size());
  for (int64_t b = 0; b < n_large && !medium.empty(); ++b) {
    auto it = medium.upper_bound({residual[b], n});
    if (it == medium.begin()) continue;
    --it;
    bin_of[it->second] = b;
    residual[b] -= it->first;
    medium.erase(it);
  }
  for (int64_t b = n_large - 1; b >= 0 && small.size() >= 2; --b) {
    auto first = small.begin();
    auto second = std::next(first);
    if (first->first + second->first > residual[b]) continue;
    const auto smallest = *first;
    small.erase(first);
    auto partner = small.upper_bound({residual[b] - smallest.first, n});
    --partner;  // exists: the old second-smallest fits
    bin_of[smallest.second] = b;
    bin_of[partner->second] = b;
    residual[b] -= smallest.first + partner->first;
    small.erase(partner);
  }
  for (const auto& m : medium) rest.push_back(m.second);
  for (const auto& s : small) rest.push_back(s.second);
  std::stable_sort(rest.begin(), rest.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  FirstFitTree tree(n, capacity);
  for (int64_t b = 0; b < n_large; ++b) tree.subtract(b, capacity - residual[b]);
  for (int64_t item : rest) {
    const int64_t bin = tree.find_leftmost(lengths[item]);
    tree.subtract(bin, lengths[item]);
    bin_of[item] = bin;
  }
  return bin_of;
}

std::vector<int64_t> split_bins_across_ranks(const int64_t* bin_tokens, int64_t n_bins, int64_t world) {
  if (world <= 0) throw std::invalid_argument("world size must be positive, got " + std::to_string(world));
  if (n_bins % world != 0)
    throw std::invalid_argument("number of bins (" + std::to_string(n_bins) + ") must be a multiple of the world size (" +
                                std::to_string(world) + "); pad with empty bins first");
  const int64_t per_rank = n_bins / world;
  std::vector<int64_t> rank_of(n_bins, -1);
  std::set<std::pair<int64_t, int64_t>> load;  // (tokens, rank) of ranks with room for a bin
  std::vector<int64_t> count(world, 0);
  for (int64_t r = 0; r < world; ++r) load.insert({0, r});
  for (int64_t b : order_decreasing(bin_tokens, n_bins)) {
    auto lightest = *load.begin();
    load.erase(load.begin());
    rank_of[b] = lightest.second;
    if (++count[lightest.second] < per_rank) load.insert({lightest.first + bin_tokens[b], lightest.second});
  }
  return rank_of;
}

}  // namespace grpo
