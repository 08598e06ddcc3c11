#include "kernels/cpu_norm.h"

#include "kernels/parallel.h"
#include "kernels/simd_avx512.h"

#include <cmath>

namespace ringserve::kernels {

namespace {

constexpr const char* kOp = "rms_norm";

// One row, portable: eight running sums (independent chains the compiler can keep in flight).
template <class T>
void row_scalar(const T* in, const T* weight, T* o, std::size_t dim, float eps) {
  float partial[8] = {};
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

// One row, 16 lanes at a time (dim a multiple of 16), with the same roundings.
template <class T>
__attribute__((target("avx512f"))) void row_avx512(const T* in, const T* weight, T* o, std::size_t dim, float eps) {
  __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  std::size_t i = 0;
  for (; i + 32 <= dim; i += 32) {
    const __m512 a = load16(in + i), b = load16(in + i + 16);
    sums[0] = _mm512_fmadd_ps(a, a, sums[0]);
    sums[1] = _mm512_fmadd_ps(b, b, sums[1]);
  }
  if (i < dim) {
    const __m512 a = load16(in + i);
    sums[0] = _mm512_fmadd_ps(a, a, sums[0]);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(sums[0], sums[1]));
  float sum = 0.0F;
  for (const float lane : lanes) sum += lane;
  const __m512 inv = _mm512_set1_ps(1.0F / std::sqrt(sum / static_cast<float>(dim) + eps));
  for (std::size_t d = 0; d < dim; d += 16) {
    const __m512 normed = round16(_mm512_mul_ps(load16(in + d), inv), T{});
    store16(o + d, _mm512_mul_ps(load16(weight + d), normed));
  }
}


template <class T>
void rms_norm_rows(std::size_t rows, std::size_t dim, std::span<const T> x, std::span<const T> weight, std::span<T> out,
                   float eps, int threads) {
  require_size(kOp, "x", x.size(), rows * dim);
  require_size(kOp, "out", out.size(), rows * dim);
  require_size(kOp, "weight", weight.size(), dim);
  require(dim > 0, kOp, "dim must be positive");
  const bool vector = has_avx512f() && dim % 16 == 0;
  const auto one = [&](std::size_t r) {
    const T* in = x.data() + r * dim;
    T* o = out.data() + r * dim;
    if (vector) {
      row_avx512(in, weight.data(), o, dim, eps);
    } else {
      row_scalar(in, weight.data(), o, dim, eps);
    }
  };
  for_each_item(rows, threads, rows * dim >= kParallelValues, one);
}

}  // namespace

void rms_norm_f32(std::size_t rows, std::size_t dim, std::span<const float> x, std::span<const float> weight,
                  std::span<float> out, float eps, int threads) {
  rms_norm_rows(rows, dim, x, weight, out, eps, threads);
}

void rms_norm_bf16(std::size_t rows, std::size_t dim, std::span<const bf16_bits> x,
                   std::span<const bf16_bits> weight, std::span<bf16_bits> out, float eps, int threads) {
  rms_norm_rows(rows, dim, x, weight, out, eps, threads);
}

}  // namespace ringserve::kernels
