// RMSNorm against a float64 reference (float32) and against the two-roundings bf16 definition.
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_norm.h"
#include "tests/check.h"

using namespace ringserve::kernels;

TEST(float32_rows_match_the_reference) {
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (std::size_t dim : {1, 7, 8, 16, 48, 576, 1001}) {  // 16, 48, 576: the AVX-512 rows (48: an odd vector)
    const std::size_t rows = 3;
    std::vector<float> x(rows * dim), w(dim), out(rows * dim);
    for (auto& v : x) v = 3.0F * normal(gen);
    for (auto& v : w) v = normal(gen);
    rms_norm_f32(rows, dim, x, w, out, 1e-5F);
    for (std::size_t r = 0; r < rows; ++r) {
      double sq = 0.0;
      for (std::size_t d = 0; d < dim; ++d) sq += double{x[r * dim + d]} * x[r * dim + d];
      const double inv = 1.0 / std::sqrt(sq / static_cast<double>(dim) + 1e-5);
      for (std::size_t d = 0; d < dim; ++d) {
        const double ref = w[d] * x[r * dim + d] * inv;
        CHECK(std::abs(out[r * dim + d] - ref) <= 1e-5 * (1.0 + std::abs(ref)));
      }
    }
  }
}

TEST(bf16_rounds_the_normalised_value_then_the_product) {
  std::mt19937 gen(2);
  std::normal_distribution<float> normal;
  const std::size_t dim = 64;
  std::vector<bf16_bits> x(dim), w(dim), out(dim);
  for (auto& v : x) v = float_to_bf16(normal(gen));
  for (auto& v : w) v = float_to_bf16(normal(gen));
  rms_norm_bf16(1, dim, x, w, out, 1e-6F);
  double sq = 0.0;
  for (auto v : x) sq += double{bf16_to_float(v)} * bf16_to_float(v);
  const float inv = static_cast<float>(1.0 / std::sqrt(sq / dim + 1e-6));
  std::size_t differing = 0;
  for (std::size_t d = 0; d < dim; ++d) {
    const float normed = bf16_to_float(float_to_bf16(bf16_to_float(x[d]) * inv));
    differing += out[d] != float_to_bf16(bf16_to_float(w[d]) * normed);
  }
  CHECK(differing <= 1);  // the float32 sum may round the scale one ulp apart, moving at most a tie
}

TEST(a_batch_split_over_two_threads_equals_one_thread) {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  const std::size_t rows = 64, dim = 576;
  std::vector<bf16_bits> x(rows * dim), w(dim), one(rows * dim), two(rows * dim, 0xffff);
  for (auto& v : x) v = float_to_bf16(2.0F * normal(gen));
  for (auto& v : w) v = float_to_bf16(normal(gen));
  rms_norm_bf16(rows, dim, x, w, one, 1e-5F, 1);
  rms_norm_bf16(rows, dim, x, w, two, 1e-5F, 2);
  CHECK(one == two);
}

TEST(mismatched_sizes_are_refused) {
  std::vector<float> x(10), w(5), out(10);
  CHECK_THROWS(std::invalid_argument, rms_norm_f32(2, 5, x, std::span<const float>(w.data(), 4), out, 1e-5F));
  CHECK_THROWS(std::invalid_argument, rms_norm_f32(3, 5, x, w, out, 1e-5F));
  CHECK_THROWS(std::invalid_argument, rms_norm_f32(0, 0, {}, {}, {}, 1e-5F));
}

TEST_MAIN()
