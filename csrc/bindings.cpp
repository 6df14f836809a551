// Python bindings of grpo_kernels._C. Inputs are numpy int64 arrays; the GIL is released
// while C++ runs. Wrapped exactly once, in grpo_kernels/_ext.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <functional>
#include <stdexcept>

#include "packing.h"

namespace py = pybind11;
using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

#ifdef GRPO_WITH_CUDA
namespace grpo::cuda {
void position_ids_from_cu_seqlens(uintptr_t cu_seqlens, int64_t n_seqs, uintptr_t out, int64_t total, uintptr_t stream);
}
#endif

namespace {

using PackFn = std::vector<int64_t> (*)(const int64_t*, int64_t, int64_t);

py::array_t<int64_t> to_array(std::vector<int64_t>&& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

py::array_t<int64_t> run_pack(PackFn fn, const IntArray& lengths, int64_t capacity) {
  if (lengths.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
  std::vector<int64_t> result;
  {
    py::gil_scoped_release release;
    result = fn(lengths.data(), lengths.shape(0), capacity);
  }
  return to_array(std::move(result));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "grpo-kernels compiled extension (C++ packing; CUDA kernels when built with CUDA)";
  m.def("pack_first_fit_decreasing",
        [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_first_fit_decreasing, l, c); },
        py::arg("lengths"), py::arg("capacity"));
  m.def("pack_best_fit_decreasing",
        [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_best_fit_decreasing, l, c); },
        py::arg("lengths"), py::arg("capacity"));
  m.def("pack_modified_ffd", [](const IntArray& l, int64_t c) { return run_pack(grpo::pack_modified_ffd, l, c); },
        py::arg("lengths"), py::arg("capacity"));
  m.def(
      "split_bins_across_ranks",
      [](const IntArray& bin_tokens, int64_t world) {
        if (bin_tokens.ndim() != 1) throw std::invalid_argument("bin_tokens must be 1-D");
        std::vector<int64_t> result;
        {
          py::gil_scoped_release release;
          result = grpo::split_bins_across_ranks(bin_tokens.data(), bin_tokens.shape(0), world);
        }
        return to_array(std::move(result));
      },
      py::arg("bin_tokens"), py::arg("world"));
#ifdef GRPO_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("position_ids_from_cu_seqlens_cuda", &grpo::cuda::position_ids_from_cu_seqlens, py::arg("cu_seqlens_ptr"),
        py::arg("n_seqs"), py::arg("out_ptr"), py::arg("total"), py::arg("stream"),
        "Writes per-sequence position ids of a packed stream (int64 device pointers).");
#else
  m.attr("with_cuda") = false;
#endif
}
