// Host harness for csrc/cuda/online_lse.h: replays token_logprobs.cu's forward order of
// operations on the CPU: thread t pushes the 16-byte packs t, t + threads, ... (`vec` values
// each; vec = 0 is an unaligned row, no packs), then the tail columns head + t, ...; warps
// merge by xor butterfly, then warp 0 merges the warps' states the same way.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "online_lse.h"

using namespace grpo::lse;

template <typename Acc>
OnlineLse<Acc> butterfly(std::vector<OnlineLse<Acc>> lanes) {  // 32 lanes -> lane 0's state
  for (int offset = 16; offset > 0; offset /= 2) {
    std::vector<OnlineLse<Acc>> next = lanes;
    for (int i = 0; i < 32; ++i) merge<true>(next[i], lanes[i ^ offset]);
    lanes = next;
  }
  return lanes[0];
}

template <typename Acc>
void run_row(int threads, long vec, double temperature) {
  long n_cols, target;
  double g_lp, g_ent;
  if (std::scanf("%ld %ld %lf %lf", &n_cols, &target, &g_lp, &g_ent) != 4) std::exit(2);
  std::vector<Acc> z(n_cols);
  char buf[64];
  for (long c = 0; c < n_cols; ++c) {
    if (std::scanf("%63s", buf) != 1) std::exit(2);
    z[c] = static_cast<Acc>(std::strtod(buf, nullptr)) / static_cast<Acc>(temperature);
  }
  std::vector<OnlineLse<Acc>> states(threads, empty_state<Acc>());
  const long n_packs = vec > 0 ? n_cols / vec : 0, head = n_packs * vec;
  for (int t = 0; t < threads; ++t) {
    for (long i = t; i < n_packs; i += threads)
      for (long k = 0; k < vec; ++k) push<true>(states[t], z[i * vec + k]);
    for (long c = head + t; c < n_cols; c += threads) push<true>(states[t], z[c]);
  }
  std::vector<OnlineLse<Acc>> warps(32, empty_state<Acc>());
  for (int w = 0; w < threads / 32; ++w)
    warps[w] = butterfly<Acc>(std::vector<OnlineLse<Acc>>(states.begin() + 32 * w, states.begin() + 32 * (w + 1)));
  const OnlineLse<Acc> row = butterfly<Acc>(warps);
  const Acc lse = logsumexp(row), h = entropy(row);
  std::printf("%.17g %.17g", static_cast<double>(lse), static_cast<double>(h));
  for (long c = 0; c < n_cols; ++c) {
    const Acc g = dlogit<Acc>(z[c], lse, h, static_cast<Acc>(g_lp), static_cast<Acc>(g_ent), c == target);
    std::printf(" %.17g", static_cast<double>(g / static_cast<Acc>(temperature)));
  }
  std::printf("\n");
}

int main(int, char** argv) {
  const std::string acc = argv[1];
  const int threads = std::atoi(argv[2]);
  const long vec = std::atol(argv[3]);
  const double temperature = std::atof(argv[4]);
  long n_rows;
  if (std::scanf("%ld", &n_rows) != 1) return 2;
  for (long r = 0; r < n_rows; ++r) acc == "double" ? run_row<double>(threads, vec, temperature) : run_row<float>(threads, vec, temperature);
  return 0;
}
