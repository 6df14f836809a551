// Online logsumexp (and entropy) state over a stream of scaled logits z, one value at a time,
// and the merge of two such states. Plain host/device code with no CUDA types, so the same
// math is compiled into the kernels and, on machines without nvcc, into a host test program
// (packages/grpo-kernels/tests/test_online_lse.py).
//
// State after z_1..z_n:  m = max z_i,  s = sum e^(z_i - m),  a = sum e^(z_i - m) (z_i - m).
// Then lse = m + log s and the entropy of softmax(z) is H = lse - E[z] = log s - a / s.
// a is kept relative to m (not as sum p z) so that H does not cancel at large |z|.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define GRPO_HD __host__ __device__ __forceinline__
#else
#define GRPO_HD inline
#endif

namespace grpo::lse {

// exp / log by overload, identical on host and device (expf, not a fast-math intrinsic).
GRPO_HD float exp_acc(float x) { return expf(x); }
GRPO_HD double exp_acc(double x) { return ::exp(x); }
GRPO_HD float log_acc(float x) { return logf(x); }
GRPO_HD double log_acc(double x) { return ::log(x); }

template <typename Acc>
struct OnlineLse {
  Acc m;  // running max (-inf while empty)
  Acc s;  // sum of e^(z - m) (0 while empty)
  Acc a;  // sum of e^(z - m) (z - m); only kept when entropy is wanted
};

template <typename Acc>
GRPO_HD OnlineLse<Acc> empty_state() {
  return {-static_cast<Acc>(INFINITY), Acc(0), Acc(0)};
}

// Adds one value. -inf (a masked vocabulary entry) contributes nothing; one exp per value.
template <bool kEntropy, typename Acc>
GRPO_HD void push(OnlineLse<Acc>& st, Acc z) {
  if (z <= st.m) {
    if (z == -static_cast<Acc>(INFINITY)) return;
    const Acc d = z - st.m;
    const Acc e = exp_acc(d);
    st.s += e;
    if (kEntropy) st.a += e * d;
    return;
  }
  // z > m (or z is NaN, which then propagates through m like it does in the reference).
  if (st.s > Acc(0)) {
    const Acc d = st.m - z;  // < 0: re-base the old terms on the new max
    const Acc r = exp_acc(d);
    if (kEntropy) st.a = r * (st.a + st.s * d);
    st.s = st.s * r + Acc(1);
  } else {
    st.s = Acc(1);
    if (kEntropy) st.a = Acc(0);
  }
  st.m = z;
}

// Folds `other` into `st`; either may be empty.
template <bool kEntropy, typename Acc>
GRPO_HD void merge(OnlineLse<Acc>& st, const OnlineLse<Acc>& other) {
  if (!(other.s > Acc(0))) return;
  if (!(st.s > Acc(0))) {
    st = other;
    return;
  }
  const Acc m = st.m > other.m ? st.m : other.m;
  const Acc d1 = st.m - m, d2 = other.m - m;
  const Acc r1 = exp_acc(d1), r2 = exp_acc(d2);
  if (kEntropy) st.a = r1 * (st.a + st.s * d1) + r2 * (other.a + other.s * d2);
  st.s = st.s * r1 + other.s * r2;
  st.m = m;
}

// log sum e^z; -inf for a row of only -inf logits.
template <typename Acc>
GRPO_HD Acc logsumexp(const OnlineLse<Acc>& st) {
  return st.m + log_acc(st.s);
}

// Entropy of softmax(z) (NaN for a row of only -inf logits, as in the reference).
template <typename Acc>
GRPO_HD Acc entropy(const OnlineLse<Acc>& st) {
  return log_acc(st.s) - st.a / st.s;
}

// d(loss)/dz_j for one logit: g_lp ([j = target] - p_j) + g_ent (-p_j (log p_j + H)).
// log p_j = z_j - lse; -inf logits have p_j = 0 and give 0 (no 0 * -inf).
template <typename Acc>
GRPO_HD Acc dlogit(Acc z, Acc lse, Acc h, Acc g_lp, Acc g_ent, bool is_target) {
  Acc logp = z - lse;
  const Acc p = exp_acc(logp);
  if (!(p > Acc(0))) logp = Acc(0);
  Acc grad = -p * (g_lp + g_ent * (logp + h));
  if (is_target) grad += g_lp;
  return grad;
}

}  // namespace grpo::lse
