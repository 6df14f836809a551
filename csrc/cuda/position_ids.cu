// Position ids of a packed token stream: for token t in sequence s, t - cu_seqlens[s].
// Raw device pointers in, so the extension needs no libtorch.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace grpo::cuda {
namespace {
constexpr int kThreads = 256;

__global__ void position_ids_kernel(const int64_t* cu_seqlens, int64_t n_seqs, int64_t* out) {
  const int64_t s = blockIdx.x;
  if (s >= n_seqs) return;
  const int64_t start = cu_seqlens[s], end = cu_seqlens[s + 1];
  for (int64_t t = start + threadIdx.x; t < end; t += blockDim.x) out[t] = t - start;
}
}  // namespace

void position_ids_from_cu_seqlens(uintptr_t cu_seqlens, int64_t n_seqs, uintptr_t out, int64_t total, uintptr_t stream) {
  if (n_seqs <= 0 || total <= 0) return;
  position_ids_kernel<<<static_cast<unsigned>(n_seqs), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int64_t*>(cu_seqlens), n_seqs, reinterpret_cast<int64_t*>(out));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("position_ids kernel launch failed: ") + cudaGetErrorString(err));
}
}  // namespace grpo::cuda
