// Host harness for csrc/cuda/online_lse.h: replays the CUDA kernels' order of operations
// (per-thread strided push, warp butterfly merge, cross-warp merge) on the CPU.
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
void run_row(int threads, double temperature) {
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
  for (int t = 0; t < threads; ++t)
    for (long c = t; c < n_cols; c += threads) push<true>(states[t], z[c]);
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
  const double temperature = std::atof(argv[3]);
  long n_rows;
  if (std::scanf("%ld", &n_rows) != 1) return 2;
  for (long r = 0; r < n_rows; ++r) acc == "double" ? run_row<double>(threads, temperature) : run_row<float>(threads, temperature);
  return 0;
}
