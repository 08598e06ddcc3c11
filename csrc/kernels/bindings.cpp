// ringserve._kernels: native CPU kernels for the workers, called on tensors' memory by address.
//
// The module does not link libtorch: the Python side (workers/model/cpu_ops.py) checks dtype, device, shape and
// contiguity and passes data_ptr() values; the tensors stay alive for the call, which releases the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <span>

#include "kernels/cpu_linear.h"

namespace py = pybind11;
using ringserve::kernels::bf16_bits;

namespace {

template <class T>
std::span<T> view(std::uintptr_t address, std::size_t count) {
  if (count == 0) return {};
  if (address == 0) throw py::value_error("null tensor address");
  return {reinterpret_cast<T*>(address), count};
}

void linear_bf16(std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t y, std::size_t m,
                 std::size_t n, std::size_t k, bool force_portable, int threads) {
  const auto xs = view<const bf16_bits>(x, m * k);
  const auto ws = view<const bf16_bits>(w, n * k);
  const auto bs = bias == 0 ? std::span<const bf16_bits>{} : view<const bf16_bits>(bias, n);
  const auto ys = view<bf16_bits>(y, m * n);
  py::gil_scoped_release release;
  ringserve::kernels::linear_bf16({m, n, k}, xs, ws, bs, ys, force_portable, threads);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "Native CPU kernels for RingServe workers (see csrc/kernels).";
  m.def("has_avx512_bf16", &ringserve::kernels::has_avx512_bf16,
        "True when this CPU runs the AVX512-BF16 kernels (else they use portable code).");
  m.def("linear_bf16", &linear_bf16, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("force_portable") = false, py::arg("threads") = 1,
        "y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) on contiguous bfloat16 memory given by address (bias 0 = none); "
        "threads >= 2 lets a large product use a second core.");
}
