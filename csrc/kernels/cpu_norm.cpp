#include "kernels/cpu_norm.h"

#include <cmath>

namespace ringserve::kernels {

namespace {

constexpr const char* kOp = "rms_norm";

template <class T>
void rms_norm_rows(std::size_t rows, std::size_t dim, std::span<const T> x, std::span<const T> weight, std::span<T> out,
              float eps) {
  require_size(kOp, "x", x.size(), rows * dim);
  require_size(kOp, "out", out.size(), rows * dim);
  require_size(kOp, "weight", weight.size(), dim);
  require(dim > 0, kOp, "dim must be positive");
  for (std::size_t r = 0; r < rows; ++r) {
    const T* in = x.data() + r * dim;
    T* o = out.data() + r * dim;
    float partial[8] = {};  // eight running sums: independent chains the compiler can keep in flight
    std::size_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      for (std::size_t j = 0; j < 8; ++j) {
        const float v = load_scalar(in[i + j]);
        partial[j] += v * v;
      }
    }
    for (; i < dim; ++i) partial[0] += load_scalar(in[i]) * load_scalar(in[i]);
    float sum = 0.0F;
    for (const float p : partial) sum += p;
    const float inv = 1.0F / std::sqrt(sum / static_cast<float>(dim) + eps);
    for (std::size_t d = 0; d < dim; ++d) {
      const float normed = round_to(load_scalar(in[d]) * inv, T{});
      store_scalar(o + d, load_scalar(weight[d]) * normed);
    }
  }
}

}  // namespace

void rms_norm_f32(std::size_t rows, std::size_t dim, std::span<const float> x, std::span<const float> weight,
                  std::span<float> out, float eps) {
  rms_norm_rows(rows, dim, x, weight, out, eps);
}

void rms_norm_bf16(std::size_t rows, std::size_t dim, std::span<const bf16_bits> x,
                   std::span<const bf16_bits> weight, std::span<bf16_bits> out, float eps) {
  rms_norm_rows(rows, dim, x, weight, out, eps);
}

}  // namespace ringserve::kernels
