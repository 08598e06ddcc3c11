// The bf16 and float32 matrix-product kernels against a float64 reference, for every tile shape and K tail they have.
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_linear.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

std::vector<bf16_bits> random_bf16(std::size_t count, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  std::vector<bf16_bits> values(count);
  for (auto& v : values) v = float_to_bf16(normal(gen));
  return values;
}

// Relative error of y against a float64 product of the same bf16 inputs, within bf16 rounding of the output.
void check_against_reference(std::size_t m, std::size_t n, std::size_t k, bool with_bias, LinearPath path,
                             int threads = 1, bool with_residual = false) {
  std::mt19937 gen(static_cast<unsigned>(m * 1000003 + n * 1009 + k));
  const auto x = random_bf16(m * k, gen);
  const auto w = random_bf16(n * k, gen);
  const auto bias = with_bias ? random_bf16(n, gen) : std::vector<bf16_bits>{};
  const auto residual = with_residual ? random_bf16(m * n, gen) : std::vector<bf16_bits>{};
  std::vector<bf16_bits> y(m * n, 0xffff);
  linear_bf16({m, n, k}, x, w, bias, y, path, threads, residual);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double ref = with_bias ? bf16_to_float(bias[j]) : 0.0;
      if (with_residual) ref += bf16_to_float(residual[i * n + j]);
      double magnitude = std::abs(ref);
      for (std::size_t p = 0; p < k; ++p) {
        const double term = double{bf16_to_float(x[i * k + p])} * bf16_to_float(w[j * k + p]);
        ref += term;
        magnitude += std::abs(term);
      }
      const double got = bf16_to_float(y[i * n + j]);
      // bf16 keeps 8 significant bits: half an ulp of the result plus float32 accumulation error.
      const double tolerance = std::abs(ref) / 256.0 + magnitude * 1e-6 + 1e-6;
      if (std::abs(got - ref) > tolerance) {
        std::fprintf(stderr, "  m=%zu n=%zu k=%zu bias=%d path=%d: y[%zu,%zu]=%g, reference %g\n", m, n, k,
                     with_bias, static_cast<int>(path), i, j, got, ref);
        CHECK(false);
        return;
      }
    }
  }
}

// float32: the weight panels (any m, any K) and the portable loops, with bias and residual, split or not, against
// float64: within float32 accumulation error of the terms' magnitude.
void check_f32_against_reference(std::size_t m, std::size_t n, std::size_t k, LinearPath path, int threads) {
  std::mt19937 gen(static_cast<unsigned>(m * 7919 + n * 104729 + k));
  std::normal_distribution<float> normal;
  const auto random = [&](std::size_t count) {
    std::vector<float> values(count);
    for (auto& v : values) v = normal(gen);
    return values;
  };
  const auto x = random(m * k), w = random(n * k), bias = random(n), residual = random(m * n);
  std::vector<float> y(m * n, NAN);
  linear_f32({m, n, k}, x, w, bias, y, path, threads, residual);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double ref = double{bias[j]} + residual[i * n + j];
      double magnitude = std::abs(ref);
      for (std::size_t p = 0; p < k; ++p) {
        ref += double{x[i * k + p]} * w[j * k + p];
        magnitude += std::abs(double{x[i * k + p]} * w[j * k + p]);
      }
      if (!(std::abs(y[i * n + j] - ref) <= magnitude * 1e-6 + 1e-6)) {
        std::fprintf(stderr, "  f32 m=%zu n=%zu k=%zu path=%d: y[%zu,%zu]=%g, reference %g\n", m, n, k,
                     static_cast<int>(path), i, j, static_cast<double>(y[i * n + j]), ref);
        CHECK(false);
        return;
      }
    }
  }
}

constexpr LinearPath kFastest = LinearPath::kFastest;
// Every path: where this CPU lacks one, linear_bf16 falls back to the portable loops (still checked).
constexpr LinearPath kAllPaths[] = {LinearPath::kFastest, LinearPath::kAvx512F, LinearPath::kPortable};

}  // namespace

TEST(bf16_rounding_is_to_nearest_even_and_keeps_nan) {
  CHECK(float_to_bf16(1.0F) == 0x3f80);
  CHECK(bf16_to_float(float_to_bf16(1.00390625F)) == 1.0F);        // exactly halfway: to the even neighbour
  CHECK(bf16_to_float(float_to_bf16(1.01171875F)) == 1.015625F);   // halfway: to the even neighbour, up
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  CHECK(std::isinf(bf16_to_float(float_to_bf16(INFINITY))));
}

TEST(every_tile_shape_and_k_tail_matches_the_reference) {
  for (const LinearPath path : kAllPaths) {
    for (std::size_t m : {1, 2, 3, 4, 5, 9}) {
      for (std::size_t n : {1, 3, 4, 7, 33}) {
        for (std::size_t k : {1, 31, 32, 33, 64, 100}) check_against_reference(m, n, k, (m + n) % 2 == 0, path);
      }
    }
  }
}

TEST(model_shapes_match_the_reference) {
  for (const LinearPath path : kAllPaths) {
    check_against_reference(1, 960, 576, false, path);
    check_against_reference(4, 576, 1536, true, path);
  }
}

// The packed outer-product kernels: AVX512-BF16 panels from three input rows (even K), float32 FMA panels from ten
// (any K; the kAvx512F path, and the fastest one on AVX-512 CPUs without BF16 dot products). Several panels of 48
// weight rows with a partial last one, every micro-tile height (1..7 rows left over), K off the 16-value packing
// blocks, bias, and the panels split over two threads.
TEST(packed_panels_every_tile_height_and_k_tail_match_the_reference) {
  for (const LinearPath path : {LinearPath::kFastest, LinearPath::kAvx512F}) {
    for (std::size_t m : {3, 6, 7, 8, 11, 13, 14, 15, 17, 18, 20, 64}) {
      for (std::size_t n : {64, 65, 130, 200}) {
        for (std::size_t k : {2, 17, 34, 64, 98}) check_against_reference(m, n, k, (m + n + k) % 3 == 0, path);
      }
    }
    for (std::size_t n : {129, 960}) check_against_reference(9, n, 576, true, path, 2);
    check_against_reference(12, 960, 576, true, path, 2);
    check_against_reference(70, 576, 1536, false, path, 2);
    check_against_reference(33, 49, 577, true, path, 2);
  }
}

// A residual (the decoder's skip connection) is added before the one rounding, on every path.
TEST(a_residual_is_added_on_every_path) {
  for (const LinearPath path : kAllPaths) {
    for (std::size_t m : {1, 2, 3, 9, 64}) check_against_reference(m, 100, 64, m % 2 == 1, path, 1, true);
    check_against_reference(2, 1538, 576, false, path, 2, true);  // the dot-product tiles, split
  }
  for (const LinearPath path : {LinearPath::kFastest, LinearPath::kAvx512F}) {
    check_against_reference(64, 576, 1536, true, path, 2, true);  // the packed panels, split
  }
  // In place: the residual is y itself (dot-product tiles and packed panels).
  std::mt19937 gen(11);
  const std::size_t n = 50, k = 32;
  for (const LinearPath path : kAllPaths) {
    for (const std::size_t m : {std::size_t{5}, std::size_t{24}}) {
      const auto x = random_bf16(m * k, gen);
      const auto w = random_bf16(n * k, gen);
      auto y = random_bf16(m * n, gen);
      const auto before = y;
      std::vector<bf16_bits> separate(m * n);
      linear_bf16({m, n, k}, x, w, {}, separate, path, 1, before);
      linear_bf16({m, n, k}, x, w, {}, y, path, 1, y);
      CHECK(y == separate);
    }
  }
  const std::size_t m = 5;
  const auto x = random_bf16(m * k, gen);
  const auto w = random_bf16(n * k, gen);
  std::vector<bf16_bits> separate(m * n);
  std::vector<bf16_bits> short_residual(m * n - 1);
  CHECK_THROWS(std::invalid_argument, linear_bf16({m, n, k}, x, w, {}, separate, kFastest, 1, short_residual));
}

// Products this large are split over two threads in blocks of row tiles: every block, and the row tile that
// straddles an odd block end, must be computed.
TEST(products_split_over_two_threads_match_the_reference) {
  for (const LinearPath path : kAllPaths) {
    for (std::size_t n : {1536, 1538, 1541}) check_against_reference(1, n, 576, n % 2 == 0, path, 2);
    check_against_reference(5, 600, 1000, true, path, 2);
  }
}

TEST(portable_and_vector_paths_agree) {
  std::mt19937 gen(7);
  const std::size_t m = 3, n = 37, k = 200;
  const auto x = random_bf16(m * k, gen);
  const auto w = random_bf16(n * k, gen);
  std::vector<bf16_bits> portable(m * n);
  linear_bf16({m, n, k}, x, w, {}, portable, LinearPath::kPortable);
  for (const LinearPath path : {LinearPath::kFastest, LinearPath::kAvx512F}) {
    std::vector<bf16_bits> fast(m * n);
    linear_bf16({m, n, k}, x, w, {}, fast, path);
    std::size_t differing = 0;
    for (std::size_t i = 0; i < fast.size(); ++i) {
      const float a = bf16_to_float(fast[i]), b = bf16_to_float(portable[i]);
      if (std::abs(a - b) > std::abs(b) / 128.0F + 1e-5F) ++differing;  // at most one bf16 ulp apart
    }
    CHECK(differing == 0);
  }
}

TEST(float32_panels_every_tile_height_and_k_tail_match_the_reference) {
  for (const LinearPath path : {LinearPath::kFastest, LinearPath::kPortable}) {
    for (std::size_t m : {1, 4, 7, 8, 9, 15, 17, 64}) {
      for (std::size_t n : {1, 47, 49, 130}) {
        for (std::size_t k : {1, 15, 16, 17, 100}) check_f32_against_reference(m, n, k, path, 1);
      }
    }
    check_f32_against_reference(24, 960, 577, path, 2);
  }
  std::vector<float> x(6), w(6), y(4), bias(3);
  CHECK_THROWS(std::invalid_argument, linear_f32({2, 2, 3}, x, w, {}, std::span<float>(y.data(), 3)));
  CHECK_THROWS(std::invalid_argument, linear_f32({2, 2, 3}, x, w, bias, y));
}

TEST(mismatched_sizes_are_refused) {
  std::vector<bf16_bits> x(6), w(6), y(4);
  CHECK_THROWS(std::invalid_argument, linear_bf16({2, 2, 3}, x, w, {}, std::span<bf16_bits>(y.data(), 3)));
  CHECK_THROWS(std::invalid_argument, linear_bf16({2, 2, 4}, x, w, {}, y));
  std::vector<bf16_bits> bias(3);
  CHECK_THROWS(std::invalid_argument, linear_bf16({2, 2, 3}, x, w, bias, y));
}

TEST_MAIN()
