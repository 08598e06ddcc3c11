#include "kernels/cpu_norm.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace ringserve::kernels {

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("rms_norm: " + what);
}

void check_size(const char* what, std::size_t got, std::size_t want) {
  check(got == want, std::string(what) + " holds " + std::to_string(got) + " values, expected " +
                         std::to_string(want));
}

// Rounds a float32 to what the storage type keeps (float32: itself).
float round_to(float v, float /*type tag*/) { return v; }
float round_to(float v, bf16_bits /*type tag*/) { return bf16_to_float(float_to_bf16(v)); }

template <class T>
void rms_norm_rows(std::size_t rows, std::size_t dim, std::span<const T> x, std::span<const T> weight, std::span<T> out,
              float eps) {
  check_size("x", x.size(), rows * dim);
  check_size("out", out.size(), rows * dim);
  check_size("weight", weight.size(), dim);
  check(dim > 0, "dim must be positive");
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
