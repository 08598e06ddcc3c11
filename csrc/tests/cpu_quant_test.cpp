// The quantized-weight products against a float64 product of the dequantized weights, for every block type, input
// row tile and tail, thread count and output type; the AVX2 path (where this CPU has it) against the portable one;
// and the weights' dequantization to float32 on both paths.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_quant.h"
#include "tests/check.h"
#include "tests/quant_blocks.h"

using namespace ringserve::kernels;
using ringserve::testing::from_float;
using ringserve::testing::kTypes;
using ringserve::testing::random_block;

namespace {

// y of the kernel against sum(w * x) in float64, within the error the inputs' int8 rounding allows (half a step of
// each block's scale, times the weights' magnitudes) plus float32 summation; returns y for comparing paths.
template <class T>
std::vector<T> check_type(QuantType type, std::size_t m, std::size_t n, std::size_t k, QuantPath path, int threads,
                          bool with_bias, bool with_residual) {
  std::mt19937 gen(static_cast<unsigned>(static_cast<int>(type) * 7919 + m * 1000003 + n * 1009 + k));
  std::vector<uint8_t> w;
  std::vector<double> wv;
  for (std::size_t b = 0; b < n * k / 32; ++b) random_block(type, gen, w, wv);
  std::normal_distribution<float> normal;
  std::vector<T> x(m * k);
  for (auto& v : x) v = from_float<T>(normal(gen));
  std::vector<T> bias(with_bias ? n : 0);
  for (auto& v : bias) v = from_float<T>(normal(gen));
  std::vector<T> residual(with_residual ? m * n : 0);
  for (auto& v : residual) v = from_float<T>(normal(gen));
  std::vector<T> y(m * n, from_float<T>(12345.0F));
  if constexpr (std::is_same_v<T, float>) {
    linear_quant_f32({m, n, k}, type, x, w, bias, y, path, threads, residual);
  } else {
    linear_quant_bf16({m, n, k}, type, x, w, bias, y, path, threads, residual);
  }
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double ref = (with_bias ? load_scalar(bias[j]) : 0.0) + (with_residual ? load_scalar(residual[i * n + j]) : 0.0);
      double bound = 0.0;
      double magnitude = std::abs(ref);
      for (std::size_t b = 0; b < k / 32; ++b) {
        double amax = 0.0;
        for (std::size_t p = 0; p < 32; ++p) amax = std::max(amax, double{std::abs(load_scalar(x[i * k + b * 32 + p]))});
        for (std::size_t p = 0; p < 32; ++p) {
          const double wp = wv[j * k + b * 32 + p];
          const double term = wp * load_scalar(x[i * k + b * 32 + p]);
          ref += term;
          magnitude += std::abs(term);
          bound += std::abs(wp) * amax / 127.0 * 0.5;
        }
      }
      const double tolerance = bound * 1.001 + magnitude * (std::is_same_v<T, float> ? 1e-5 : 8e-3) + 1e-6;
      const double got = load_scalar(y[i * n + j]);
      if (!(std::abs(got - ref) <= tolerance)) {
        std::fprintf(stderr, "  type %d m=%zu n=%zu k=%zu threads %d: y[%zu,%zu] = %g, expected %g +- %g\n",
                     static_cast<int>(type), m, n, k, threads, i, j, got, ref, tolerance);
        CHECK(false);
        return y;
      }
    }
  }
  return y;
}

}  // namespace

TEST(half_to_float_exact) {
  CHECK(half_to_float(0x3C00) == 1.0F);
  CHECK(half_to_float(0xC000) == -2.0F);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0F, -24));
  CHECK(half_to_float(0x8000) == 0.0F && std::signbit(half_to_float(0x8000)));
  CHECK(std::isinf(half_to_float(0x7C00)));
  CHECK(std::isnan(half_to_float(0x7E00)));
  CHECK(half_to_float(0x7BFF) == 65504.0F);
}

TEST(every_type_against_the_dequantized_product) {
  const QuantPath paths[] = {QuantPath::kPortable, QuantPath::kFastest};
  if (!has_avx2_quant()) std::fprintf(stderr, "  (no AVX2 here: the fastest path is the portable one)\n");
  for (const QuantType type : kTypes) {
    for (const QuantPath path : paths) {
      for (const std::size_t m : {1, 2, 3, 5, 64}) {
        check_type<float>(type, m, 37, 96, path, 1, m % 2 == 1, m == 3);
      }
      check_type<float>(type, 4, 33, 256, path, 3, true, true);
      check_type<bf16_bits>(type, 5, 19, 64, path, 2, true, true);
      check_type<bf16_bits>(type, 1, 19, 64, path, 1, true, true);  // a matrix-vector product's own tiles
    }
  }
}

TEST(avx2_matches_portable_for_every_tile_and_thread_split) {
  if (!has_avx2_quant()) {
    std::fprintf(stderr, "  skipped: this CPU has no AVX2 (the portable path is tested above)\n");
    return;
  }
  // From 32 input rows the 4-bit formats take 8-row weight panels: 32, 33, 34 and 67 inputs leave every tail of input
  // tiles; 35 and 45 rows leave a chunk of 16 with 3 rows past its panels, and one with a panel and 5 more.
  for (const QuantType type : kTypes) {
    for (const std::size_t m : {1, 2, 3, 4, 5, 7, 32, 33, 34, 67}) {
      for (const int threads : {1, 2, 4}) {
        const std::size_t n = m % 2 == 0 ? 35 : 45;
        const auto fast = check_type<float>(type, m, n, 160, QuantPath::kFastest, threads, true, false);
        const auto slow = check_type<float>(type, m, n, 160, QuantPath::kPortable, 1, true, false);
        for (std::size_t e = 0; e < fast.size(); ++e) {
          // Same integer sums and scales; only the order of the float32 additions differs.
          if (!(std::abs(fast[e] - slow[e]) <= 1e-4F * (1.0F + std::abs(slow[e])))) {
            std::fprintf(stderr, "  type %d m=%zu threads %d: %g vs %g at %zu\n", static_cast<int>(type), m, threads,
                         fast[e], slow[e], e);
            CHECK(false);
            break;
          }
        }
      }
    }
  }
}

TEST(packed_panels_give_the_same_bits_as_panels_laid_out_per_call) {
  if (!has_avx2_quant()) {
    std::fprintf(stderr, "  skipped: the panels are read by the AVX2 path only\n");
    return;
  }
  // n = 7 has no whole panel, 45 leaves a chunk of 16 with a panel and 5 rows more, 61 a lone panel past the
  // 4-bit formats' 16-row tiles; 32 and 67 inputs reach every input tail of the panel tiles.
  for (const QuantType type : kTypes) {
    for (const std::size_t n : {7, 45, 61}) {
      const std::size_t k = 160;
      std::mt19937 gen(static_cast<unsigned>(static_cast<int>(type) * 7 + n));
      std::vector<uint8_t> w;
      std::vector<double> values;
      for (std::size_t b = 0; b < n * k / 32; ++b) random_block(type, gen, w, values);
      std::vector<uint8_t> panels(quant_panel_bytes(type, n, k));
      CHECK(panels.size() == n / 8 * 5 * (8 * 32 + 2 * 8 * sizeof(float)));
      for (const int threads : {1, 3}) {
        std::fill(panels.begin(), panels.end(), uint8_t{0xA5});
        pack_quant_panels(type, n, k, w, panels, threads);
        for (const std::size_t m : {32, 67}) {
          std::normal_distribution<float> normal;
          std::vector<float> x(m * k), bias(n), residual(m * n);
          for (auto& v : x) v = normal(gen);
          for (auto& v : bias) v = normal(gen);
          for (auto& v : residual) v = normal(gen);
          std::vector<float> laid_out(m * n), packed(m * n);
          linear_quant_f32({m, n, k}, type, x, w, bias, laid_out, QuantPath::kFastest, threads, residual);
          linear_quant_f32({m, n, k}, type, x, w, bias, packed, QuantPath::kFastest, threads, residual, panels);
          CHECK(std::memcmp(laid_out.data(), packed.data(), packed.size() * sizeof(float)) == 0);
          std::vector<bf16_bits> xb(m * k), yb(m * n), yb_packed(m * n);
          for (std::size_t e = 0; e < x.size(); ++e) xb[e] = from_float<bf16_bits>(x[e]);
          linear_quant_bf16({m, n, k}, type, xb, w, {}, yb, QuantPath::kFastest, threads);
          linear_quant_bf16({m, n, k}, type, xb, w, {}, yb_packed, QuantPath::kFastest, threads, {}, panels);
          CHECK(std::memcmp(yb.data(), yb_packed.data(), yb.size() * sizeof(bf16_bits)) == 0);
        }
      }
      // Panels of another size are refused, and so is a destination of the wrong size.
      std::vector<uint8_t> short_panels(panels.size() + 1);
      std::vector<float> x(32 * k), y(32 * n);
      CHECK_THROWS(std::invalid_argument, linear_quant_f32({32, n, k}, type, x, w, {}, y, QuantPath::kFastest, 1, {},
                                                           short_panels));
      CHECK_THROWS(std::invalid_argument, pack_quant_panels(type, n, k, w, short_panels));
    }
  }
}

TEST(dequantize_gives_every_types_values_on_both_paths) {
  if (!has_avx2_quant()) std::fprintf(stderr, "  (no AVX2 here: only the portable dequantization runs)\n");
  for (const QuantType type : kTypes) {
    for (const std::size_t n : {1, 17, 37}) {
      for (const std::size_t k : {32, 96, 256}) {
        std::mt19937 gen(static_cast<unsigned>(static_cast<int>(type) * 131 + n * 17 + k));
        std::vector<uint8_t> w;
        std::vector<double> want;
        for (std::size_t b = 0; b < n * k / 32; ++b) random_block(type, gen, w, want);
        std::vector<float> slow(n * k, 12345.0F);
        dequantize_f32(type, n, k, w, slow, QuantPath::kPortable);
        for (std::size_t e = 0; e < slow.size(); ++e) {
          // float32's rounding of a product and a sum, each within 2^-24 of the larger of the block's values (the
          // product, d * q = value - offset, is at most twice that): 3 * 2^-24 of the block's largest value.
          double largest = 0.0;
          for (std::size_t p = e / 32 * 32; p < e / 32 * 32 + 32; ++p) largest = std::max(largest, std::abs(want[p]));
          if (!(std::abs(slow[e] - want[e]) <= 1.8e-7 * largest)) {
            std::fprintf(stderr, "  type %d n=%zu k=%zu: value %zu is %g, expected %g\n", static_cast<int>(type), n, k,
                         e, static_cast<double>(slow[e]), want[e]);
            CHECK(false);
            break;
          }
        }
        for (const int threads : {1, 2, 3}) {
          std::vector<float> fast(n * k, 12345.0F);
          dequantize_f32(type, n, k, w, fast, QuantPath::kFastest, threads);
          // The same float32 operations in the same order: the same bits.
          CHECK(std::memcmp(fast.data(), slow.data(), fast.size() * sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST(bad_sizes_are_refused) {
  std::vector<float> x(40), x32(32), y(1);
  std::vector<uint8_t> w(34);
  CHECK_THROWS(std::invalid_argument, linear_quant_f32({1, 1, 40}, QuantType::kQ8_0, x, w, {}, y));  // k % 32
  CHECK_THROWS(std::invalid_argument, linear_quant_f32({1, 1, 32}, QuantType::kQ4_0, x32, w, {}, y));  // 18 bytes
  CHECK_THROWS(std::invalid_argument, linear_quant_f32({1, 1, 32}, static_cast<QuantType>(9), x32, w, {}, y));
  CHECK_THROWS(std::invalid_argument, dequantize_f32(QuantType::kQ8_0, 1, 32, w, y));  // out holds 1, not 32
  CHECK_THROWS(std::invalid_argument, dequantize_f32(QuantType::kQ8_0, 1, 40, w, x));  // k % 32
  CHECK_THROWS(std::invalid_argument, dequantize_f32(QuantType::kQ4_1, 1, 32, w, x32));  // 20 bytes, not 34
}

TEST_MAIN()
