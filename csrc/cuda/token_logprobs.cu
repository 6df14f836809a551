// Token logprobs (+ entropy) from materialised logits, forward and backward, as CUDA kernels of
// grpo_kernels._C. Raw device pointers in (no libtorch); grpo_kernels/_ext.py checks shapes,
// dtypes and devices and wraps these as the torch op grpo_kernels::token_logprobs.
//
// Forward: one block per row, rows walked with a grid-stride loop (any T on a capped grid). Each
// thread keeps an online logsumexp state over its columns (one pass over V, 16-byte loads when
// the row is aligned), the block merges the states, and thread 0 writes logprob, entropy and
// lse = log sum exp(logits / T) for the backward. Rows whose target is ignore_index are skipped
// (their logprob, entropy and lse are written as 0 without reading the row).
// Backward: d logits = (g_lp ([j = target] - p) - g_ent p (log p + H)) / T from the saved lse
// and entropy, written in the logits' dtype; rows with no upstream gradient are zero-filled
// without reading the logits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "online_lse.h"

namespace grpo::cuda {
namespace {

using grpo::lse::OnlineLse;

constexpr int64_t kMaxBlocks = 65536;  // grid cap: block b takes rows b, b + grid, ...
constexpr int kWarp = 32;
constexpr int kMaxWarps = 32;  // 1024 threads

// Row r of the logits sits at (r / n_inner) * stride_outer + (r % n_inner) * stride_inner, so a
// strided [B, S, V] view such as logits[:, :-1] is read in place; V itself is contiguous.
struct RowLayout {
  int64_t stride_outer;
  int64_t stride_inner;
  int64_t n_inner;
};

__device__ __forceinline__ int64_t row_offset(const RowLayout& layout, int64_t row) {
  return (row / layout.n_inner) * layout.stride_outer + (row % layout.n_inner) * layout.stride_inner;
}

template <typename Acc, typename In>
__device__ __forceinline__ Acc to_acc(In x) {
  return static_cast<Acc>(x);
}
template <>
__device__ __forceinline__ float to_acc<float, __half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_acc<float, __nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename In, typename Acc>
__device__ __forceinline__ In from_acc(Acc x) {
  return static_cast<In>(x);
}
template <>
__device__ __forceinline__ __half from_acc<__half, float>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of logits, loaded or stored as one vector instruction.
template <typename In>
struct alignas(16) Pack {
  static constexpr int kN = 16 / sizeof(In);
  In v[kN];
};

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Merges every thread's state; all threads get the block's state. `shared` is reused per row.
template <bool kEntropy, typename Acc>
__device__ OnlineLse<Acc> block_merge(OnlineLse<Acc> st, OnlineLse<Acc>* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    OnlineLse<Acc> other{__shfl_xor_sync(0xffffffffu, st.m, offset), __shfl_xor_sync(0xffffffffu, st.s, offset),
                         kEntropy ? __shfl_xor_sync(0xffffffffu, st.a, offset) : Acc(0)};
    grpo::lse::merge<kEntropy>(st, other);
  }
  if (lane == 0) shared[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < n_warps ? shared[lane] : grpo::lse::empty_state<Acc>();
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      OnlineLse<Acc> other{__shfl_xor_sync(0xffffffffu, st.m, offset), __shfl_xor_sync(0xffffffffu, st.s, offset),
                           kEntropy ? __shfl_xor_sync(0xffffffffu, st.a, offset) : Acc(0)};
      grpo::lse::merge<kEntropy>(st, other);
    }
    if (lane == 0) shared[0] = st;
  }
  __syncthreads();
  st = shared[0];
  __syncthreads();  // everyone has read shared[0] before the next row overwrites it
  return st;
}

template <typename In, typename Acc, bool kEntropy>
__global__ void token_logprobs_fwd_kernel(const In* __restrict__ logits, RowLayout layout,
                                          const int64_t* __restrict__ targets, int64_t n_rows, int64_t n_cols,
                                          Acc temperature, int64_t ignore_index, Acc* __restrict__ logprobs,
                                          Acc* __restrict__ entropy, Acc* __restrict__ lse) {
  __shared__ OnlineLse<Acc> shared[kMaxWarps];
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const int64_t target = targets[row];
    if (target == ignore_index) {  // uniform across the block: no thread reaches block_merge
      if (threadIdx.x == 0) {
        logprobs[row] = Acc(0);
        lse[row] = Acc(0);
        if (kEntropy) entropy[row] = Acc(0);
      }
      continue;
    }
    const In* row_ptr = logits + row_offset(layout, row);
    OnlineLse<Acc> st = grpo::lse::empty_state<Acc>();
    int64_t head = 0;
    if (aligned16(row_ptr)) {
      const auto* packs = reinterpret_cast<const Pack<In>*>(row_ptr);
      const int64_t n_packs = n_cols / Pack<In>::kN;
      for (int64_t i = threadIdx.x; i < n_packs; i += blockDim.x) {
        const Pack<In> pack = packs[i];
#pragma unroll
        for (int k = 0; k < Pack<In>::kN; ++k) grpo::lse::push<kEntropy>(st, to_acc<Acc>(pack.v[k]) / temperature);
      }
      head = n_packs * Pack<In>::kN;
    }
    for (int64_t col = head + threadIdx.x; col < n_cols; col += blockDim.x) {
      grpo::lse::push<kEntropy>(st, to_acc<Acc>(row_ptr[col]) / temperature);
    }
    st = block_merge<kEntropy>(st, shared);
    if (threadIdx.x == 0) {
      const Acc row_lse = grpo::lse::logsumexp(st);
      // Targets are range-checked on the host; an id outside [0, V) gives NaN, never a stray read.
      const bool inside = target >= 0 && target < n_cols;
      logprobs[row] = inside ? to_acc<Acc>(row_ptr[target]) / temperature - row_lse : Acc(NAN);
      lse[row] = row_lse;
      if (kEntropy) entropy[row] = grpo::lse::entropy(st);
    }
  }
}

template <typename In, typename Acc>
__global__ void token_logprobs_bwd_kernel(const In* __restrict__ logits, RowLayout layout,
                                          const int64_t* __restrict__ targets, const Acc* __restrict__ lse,
                                          const Acc* __restrict__ entropy, const Acc* __restrict__ grad_logprobs,
                                          const Acc* __restrict__ grad_entropy, In* __restrict__ grad_logits,
                                          int64_t n_rows, int64_t n_cols, Acc temperature, int64_t ignore_index) {
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const int64_t target = targets[row];
    const bool keep = target != ignore_index;
    const Acc g_lp = keep && grad_logprobs != nullptr ? grad_logprobs[row] : Acc(0);
    const Acc g_ent = keep && grad_entropy != nullptr ? grad_entropy[row] : Acc(0);
    In* out = grad_logits + row * n_cols;
    const In* in = logits + row_offset(layout, row);
    const bool zero = g_lp == Acc(0) && g_ent == Acc(0);  // masked-out token: d logits = 0
    const Acc row_lse = zero ? Acc(0) : lse[row];
    const Acc h = zero || grad_entropy == nullptr ? Acc(0) : entropy[row];
    auto grad_at = [&](int64_t col, In x) -> In {
      if (zero) return from_acc<In>(Acc(0));
      const Acc z = to_acc<Acc>(x) / temperature;
      return from_acc<In>(grpo::lse::dlogit(z, row_lse, h, g_lp, g_ent, col == target) / temperature);
    };
    int64_t head = 0;
    if (aligned16(in) && aligned16(out)) {
      const auto* in_packs = reinterpret_cast<const Pack<In>*>(in);
      auto* out_packs = reinterpret_cast<Pack<In>*>(out);
      const int64_t n_packs = n_cols / Pack<In>::kN;
      for (int64_t i = threadIdx.x; i < n_packs; i += blockDim.x) {
        Pack<In> pack{};  // zero rows never read it
        if (!zero) pack = in_packs[i];
#pragma unroll
        for (int k = 0; k < Pack<In>::kN; ++k) pack.v[k] = grad_at(i * Pack<In>::kN + k, pack.v[k]);
        out_packs[i] = pack;
      }
      head = n_packs * Pack<In>::kN;
    }
    for (int64_t col = head + threadIdx.x; col < n_cols; col += blockDim.x) {
      out[col] = grad_at(col, zero ? from_acc<In>(Acc(0)) : in[col]);
    }
  }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------
struct Launch {
  unsigned blocks;
  unsigned threads;
  cudaStream_t stream;
};

Launch launch_shape(int64_t n_rows, int64_t n_cols, uintptr_t stream) {
  // Wide rows get more threads; a 128-thread block still covers small vocabularies.
  const unsigned threads = n_cols >= 8192 ? 512 : n_cols >= 1024 ? 256 : 128;
  const int64_t blocks = n_rows < kMaxBlocks ? n_rows : kMaxBlocks;
  return {static_cast<unsigned>(blocks), threads, reinterpret_cast<cudaStream_t>(stream)};
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " kernel launch failed: " + cudaGetErrorString(err));
  }
}

void check_shape(int64_t n_rows, int64_t n_cols, int64_t n_inner, double temperature) {
  if (n_rows < 0 || n_cols < 1 || n_inner < 1) throw std::invalid_argument("token_logprobs: bad shape");
  if (!(temperature > 0)) throw std::invalid_argument("token_logprobs: temperature must be > 0");
}

template <typename In, typename Acc>
void launch_fwd(uintptr_t logits, RowLayout layout, uintptr_t targets, int64_t n_rows, int64_t n_cols,
                double temperature, int64_t ignore_index, uintptr_t logprobs, uintptr_t entropy, uintptr_t lse,
                uintptr_t stream) {
  const Launch l = launch_shape(n_rows, n_cols, stream);
  const auto* x = reinterpret_cast<const In*>(logits);
  const auto* t = reinterpret_cast<const int64_t*>(targets);
  auto* lp = reinterpret_cast<Acc*>(logprobs);
  auto* ent = reinterpret_cast<Acc*>(entropy);
  auto* out_lse = reinterpret_cast<Acc*>(lse);
  const Acc temp = static_cast<Acc>(temperature);
  if (entropy != 0) {
    token_logprobs_fwd_kernel<In, Acc, true>
        <<<l.blocks, l.threads, 0, l.stream>>>(x, layout, t, n_rows, n_cols, temp, ignore_index, lp, ent, out_lse);
  } else {
    token_logprobs_fwd_kernel<In, Acc, false>
        <<<l.blocks, l.threads, 0, l.stream>>>(x, layout, t, n_rows, n_cols, temp, ignore_index, lp, ent, out_lse);
  }
  check_launch("token_logprobs forward");
}

template <typename In, typename Acc>
void launch_bwd(uintptr_t logits, RowLayout layout, uintptr_t targets, uintptr_t lse, uintptr_t entropy,
                uintptr_t grad_logprobs, uintptr_t grad_entropy, uintptr_t grad_logits, int64_t n_rows,
                int64_t n_cols, double temperature, int64_t ignore_index, uintptr_t stream) {
  const Launch l = launch_shape(n_rows, n_cols, stream);
  token_logprobs_bwd_kernel<In, Acc><<<l.blocks, l.threads, 0, l.stream>>>(
      reinterpret_cast<const In*>(logits), layout, reinterpret_cast<const int64_t*>(targets),
      reinterpret_cast<const Acc*>(lse), reinterpret_cast<const Acc*>(entropy),
      reinterpret_cast<const Acc*>(grad_logprobs), reinterpret_cast<const Acc*>(grad_entropy),
      reinterpret_cast<In*>(grad_logits), n_rows, n_cols, static_cast<Acc>(temperature), ignore_index);
  check_launch("token_logprobs backward");
}

template <typename T>
struct Type {
  using type = T;
};

// Calls f(Type<logits type>, Type<accumulation type>) for a dtype name.
template <typename F>
void with_logits_type(const std::string& dtype, F&& f) {
  if (dtype == "float32") {
    f(Type<float>{}, Type<float>{});
  } else if (dtype == "bfloat16") {
    f(Type<__nv_bfloat16>{}, Type<float>{});
  } else if (dtype == "float16") {
    f(Type<__half>{}, Type<float>{});
  } else if (dtype == "float64") {
    f(Type<double>{}, Type<double>{});
  } else {
    throw std::invalid_argument("token_logprobs: logits dtype " + dtype +
                                " is not supported (float32, float16, bfloat16, float64)");
  }
}
}  // namespace

// The caller (grpo_kernels/_ext.py) passes: logits of `dtype` with V contiguous and the row
// layout above; int64 targets [n_rows]; outputs [n_rows] in the accumulation dtype (float64 for
// float64 logits, float32 otherwise), entropy = 0 when not wanted. All on the current device.
void token_logprobs_fwd(const std::string& dtype, uintptr_t logits, int64_t stride_outer, int64_t stride_inner,
                        int64_t n_inner, uintptr_t targets, int64_t n_rows, int64_t n_cols, double temperature,
                        int64_t ignore_index, uintptr_t logprobs, uintptr_t entropy, uintptr_t lse,
                        uintptr_t stream) {
  check_shape(n_rows, n_cols, n_inner, temperature);
  if (n_rows == 0) return;
  const RowLayout layout{stride_outer, stride_inner, n_inner};
  with_logits_type(dtype, [&](auto in, auto acc) {
    using In = typename decltype(in)::type;
    using Acc = typename decltype(acc)::type;
    launch_fwd<In, Acc>(logits, layout, targets, n_rows, n_cols, temperature, ignore_index, logprobs, entropy, lse,
                        stream);
  });
}

// grad_logits: contiguous [n_rows, n_cols] of `dtype`. grad_logprobs / grad_entropy may be 0
// (no gradient); entropy must be given when grad_entropy is.
void token_logprobs_bwd(const std::string& dtype, uintptr_t logits, int64_t stride_outer, int64_t stride_inner,
                        int64_t n_inner, uintptr_t targets, uintptr_t lse, uintptr_t entropy, uintptr_t grad_logprobs,
                        uintptr_t grad_entropy, uintptr_t grad_logits, int64_t n_rows, int64_t n_cols,
                        double temperature, int64_t ignore_index, uintptr_t stream) {
  check_shape(n_rows, n_cols, n_inner, temperature);
  if (grad_entropy != 0 && entropy == 0) {
    throw std::invalid_argument("token_logprobs: the entropy gradient needs entropy");
  }
  if (n_rows == 0) return;
  const RowLayout layout{stride_outer, stride_inner, n_inner};
  with_logits_type(dtype, [&](auto in, auto acc) {
    using In = typename decltype(in)::type;
    using Acc = typename decltype(acc)::type;
    launch_bwd<In, Acc>(logits, layout, targets, lse, entropy, grad_logprobs, grad_entropy, grad_logits, n_rows,
                        n_cols, temperature, ignore_index, stream);
  });
}
}  // namespace grpo::cuda
