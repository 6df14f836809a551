// Python bindings of grpo_kernels._C. Inputs are numpy int64 arrays; they are copied while the
// GIL is held (so another thread mutating the array cannot corrupt a running sort), then the
// GIL is released while C++ runs. Wrapped exactly once, in grpo_kernels/_ext.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "packing.h"

namespace py = pybind11;
using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

#ifdef GRPO_WITH_CUDA
namespace grpo::cuda {
void position_ids_from_cu_seqlens(uintptr_t cu_seqlens, int64_t n_seqs, uintptr_t out, int64_t total, uintptr_t stream);
void token_logprobs_fwd(const std::string& dtype, uintptr_t logits, int64_t stride_outer, int64_t stride_inner,
                        int64_t n_inner, uintptr_t targets, int64_t n_rows, int64_t n_cols, double temperature,
                        int64_t ignore_index, uintptr_t logprobs, uintptr_t entropy, uintptr_t lse, uintptr_t stream);
void token_logprobs_bwd(const std::string& dtype, uintptr_t logits, int64_t stride_outer, int64_t stride_inner,
                        int64_t n_inner, uintptr_t targets, uintptr_t lse, uintptr_t entropy, uintptr_t grad_logprobs,
                        uintptr_t grad_entropy, uintptr_t grad_logits, int64_t n_rows, int64_t n_cols,
                        double temperature, int64_t ignore_index, uintptr_t stream);
}
#endif

namespace {

using PackFn = std::vector<int64_t> (*)(const int64_t*, int64_t, int64_t);

// Hands the vector's buffer to numpy without another copy.
py::array_t<int64_t> to_array(std::vector<int64_t>&& v) {
  auto* owned = new std::vector<int64_t>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  return py::array_t<int64_t>({static_cast<py::ssize_t>(owned->size())}, {static_cast<py::ssize_t>(sizeof(int64_t))},
                              owned->data(), free_when_done);
}

std::vector<int64_t> copy_1d(const IntArray& a, const char* name) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) + "-D");
  return std::vector<int64_t>(a.data(), a.data() + a.shape(0));
}

py::array_t<int64_t> run_pack(PackFn fn, const IntArray& lengths, int64_t capacity) {
  const std::vector<int64_t> values = copy_1d(lengths, "lengths");
  std::vector<int64_t> result;
  {
    py::gil_scoped_release release;
    result = fn(values.data(), static_cast<int64_t>(values.size()), capacity);
  }
  return to_array(std::move(result));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "grpo-kernels compiled extension (C++ packing; CUDA kernels when built with CUDA)";
  m.def("pack_first_fit_decreasing",
        [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_first_fit_decreasing, l, c); },
        py::arg("lengths"), py::arg("capacity"), "Bin index per item, first fit decreasing (GIL released).");
  m.def("pack_best_fit_decreasing",
        [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_best_fit_decreasing, l, c); },
        py::arg("lengths"), py::arg("capacity"), "Bin index per item, best fit decreasing (GIL released).");
  m.def("pack_modified_ffd", [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_modified_ffd, l, c); },
        py::arg("lengths"), py::arg("capacity"),
        "Bin index per item, Johnson & Garey modified first fit decreasing (GIL released).");
  m.def(
      "split_bins_across_ranks",
      [](const IntArray& bin_tokens, int64_t world) {
        const std::vector<int64_t> tokens = copy_1d(bin_tokens, "bin_tokens");
        std::vector<int64_t> result;
        {
          py::gil_scoped_release release;
          result = grpo::split_bins_across_ranks(tokens.data(), static_cast<int64_t>(tokens.size()), world);
        }
        return to_array(std::move(result));
      },
      py::arg("bin_tokens"), py::arg("world"), "Rank per bin: equal bin counts, greedy token balance (GIL released).");
  m.def(
      "group_by_bin",
      [](const IntArray& bin_of, int64_t n_bins) {
        const std::vector<int64_t> bins = copy_1d(bin_of, "bin_of");
        std::vector<int64_t> result;
        {
          py::gil_scoped_release release;
          result = grpo::group_by_bin(bins.data(), static_cast<int64_t>(bins.size()), n_bins);
        }
        py::array_t<int64_t> flat = to_array(std::move(result));
        // (offsets [n_bins + 1], items [n]) as two views of one buffer.
        py::slice head(0, n_bins + 1, 1), tail(n_bins + 1, static_cast<py::ssize_t>(flat.size()), 1);
        return py::make_tuple(flat[head], flat[tail]);
      },
      py::arg("bin_of"), py::arg("n_bins"), "(offsets, items): item indices grouped by bin, CSR layout.");
#ifdef GRPO_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("position_ids_from_cu_seqlens_cuda", &grpo::cuda::position_ids_from_cu_seqlens, py::arg("cu_seqlens_ptr"),
        py::arg("n_seqs"), py::arg("out_ptr"), py::arg("total"), py::arg("stream"),
        "Writes per-sequence position ids of a packed stream (int64 device pointers).");
  m.def("token_logprobs_fwd_cuda", &grpo::cuda::token_logprobs_fwd, py::arg("dtype"), py::arg("logits_ptr"),
        py::arg("stride_outer"), py::arg("stride_inner"), py::arg("n_inner"), py::arg("targets_ptr"),
        py::arg("n_rows"), py::arg("n_cols"), py::arg("temperature"), py::arg("ignore_index"),
        py::arg("logprobs_ptr"), py::arg("entropy_ptr"), py::arg("lse_ptr"), py::arg("stream"),
        "Per-row logprob, entropy (entropy_ptr 0: skipped) and logsumexp of logits / temperature "
        "(device pointers; outputs float32, float64 for float64 logits).");
  m.def("token_logprobs_bwd_cuda", &grpo::cuda::token_logprobs_bwd, py::arg("dtype"), py::arg("logits_ptr"),
        py::arg("stride_outer"), py::arg("stride_inner"), py::arg("n_inner"), py::arg("targets_ptr"),
        py::arg("lse_ptr"), py::arg("entropy_ptr"), py::arg("grad_logprobs_ptr"), py::arg("grad_entropy_ptr"),
        py::arg("grad_logits_ptr"), py::arg("n_rows"), py::arg("n_cols"), py::arg("temperature"),
        py::arg("ignore_index"), py::arg("stream"),
        "Writes d(loss)/d(logits) [n_rows, n_cols] in the logits' dtype (device pointers; 0 = no gradient).");
#else
  m.attr("with_cuda") = false;
#endif
}
