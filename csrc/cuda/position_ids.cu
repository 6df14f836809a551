// Position ids of a packed token stream: for token t in sequence s, t - cu_seqlens[s].
// Raw device pointers in, so the extension needs no libtorch.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace grpo::cuda {
namespace {
constexpr int kThreads = 256;

// One block per sequence. Writes are clamped to [0, total), so a cu_seqlens that disagrees with
// `total` gives wrong ids, never an out-of-bounds write.
__global__ void position_ids_kernel(const int64_t* cu_seqlens, int64_t n_seqs, int64_t* out, int64_t total) {
  const int64_t s = blockIdx.x;
  if (s >= n_seqs) return;
  const int64_t start = max(cu_seqlens[s], int64_t{0}), end = min(cu_seqlens[s + 1], total);
  for (int64_t t = start + threadIdx.x; t < end; t += blockDim.x) out[t] = t - cu_seqlens[s];
}
}  // namespace

void position_ids_from_cu_seqlens(uintptr_t cu_seqlens, int64_t n_seqs, uintptr_t out, int64_t total, uintptr_t stream) {
  // The caller (grpo_kernels/_ext.py) checks that cu_seqlens is int64, contiguous and on the
  // current device, and that `out` holds `total` int64. Its values are not checked (that would
  // synchronise the stream); the kernel clamps its writes instead.
  if (n_seqs <= 0 || total <= 0) return;
  if (n_seqs > INT_MAX) throw std::invalid_argument("position_ids: too many sequences for one launch");
  position_ids_kernel<<<static_cast<unsigned>(n_seqs), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int64_t*>(cu_seqlens), n_seqs, reinterpret_cast<int64_t*>(out), total);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("position_ids kernel launch failed: ") + cudaGetErrorString(err));
}
}  // namespace grpo::cuda
