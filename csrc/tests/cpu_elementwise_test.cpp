// RoPE and SiLU-and-multiply against float64 references, their bf16 roundings, strided rows and bad input.
#include <cmath>
#include <random>
#include <stdexcept>
#include <span>
#include <vector>

#include "kernels/cpu_elementwise.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

constexpr std::size_t kDim = 8;
constexpr std::size_t kMaxPos = 32;

// cos / sin tables as the model builds them: angle = position * inv_freq[i % half].
void tables(std::vector<float>& cos, std::vector<float>& sin, std::size_t dim = kDim) {
  cos.assign(kMaxPos * dim, 0.0F);
  sin.assign(kMaxPos * dim, 0.0F);
  for (std::size_t p = 0; p < kMaxPos; ++p) {
    for (std::size_t i = 0; i < dim; ++i) {
      const double inv_freq = std::pow(10000.0, -2.0 * static_cast<double>(i % (dim / 2)) / static_cast<double>(dim));
      cos[p * dim + i] = static_cast<float>(std::cos(static_cast<double>(p) * inv_freq));
      sin[p * dim + i] = static_cast<float>(std::sin(static_cast<double>(p) * inv_freq));
    }
  }
}

}  // namespace

TEST(rope_rotates_each_pair_by_its_angle_and_skips_the_gaps_between_rows) {
  std::vector<float> cos, sin;
  tables(cos, sin);
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  const RopeShape shape{.rows = 3, .row_stride = 3 * kDim, .heads = 2, .head_dim = kDim, .max_position = kMaxPos};
  std::vector<float> x(3 * 3 * kDim);
  for (auto& v : x) v = normal(gen);
  const std::vector<float> before = x;
  const std::vector<int64_t> positions{0, 5, 31};
  rope_f32(shape, x, positions, cos, sin);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t h = 0; h < 3; ++h) {
      for (std::size_t i = 0; i < kDim / 2; ++i) {
        const std::size_t at = r * 3 * kDim + h * kDim + i;
        if (h == 2) {  // the third head of each row is outside the view: untouched
          CHECK(x[at] == before[at] && x[at + kDim / 2] == before[at + kDim / 2]);
          continue;
        }
        const double angle = static_cast<double>(positions[r]) * std::pow(10000.0, -2.0 * static_cast<double>(i) / kDim);
        const double a = before[at];
        const double b = before[at + kDim / 2];
        CHECK(std::abs(x[at] - (a * std::cos(angle) - b * std::sin(angle))) < 1e-5);
        CHECK(std::abs(x[at + kDim / 2] - (b * std::cos(angle) + a * std::sin(angle))) < 1e-5);
      }
    }
  }
  for (std::size_t i = 0; i < 2 * kDim; ++i) CHECK(x[i] == before[i]);  // position 0: cos 1, sin 0
}

TEST(rope_in_bf16_rounds_each_product_and_the_sum) {
  for (const std::size_t dim : {kDim, 4 * kDim}) {  // 32: the AVX-512 path (16 pairs at a time) where present
    std::vector<float> cos, sin;
    tables(cos, sin, dim);
    const RopeShape shape{.rows = 1, .row_stride = dim, .heads = 1, .head_dim = dim, .max_position = kMaxPos};
    std::vector<bf16_bits> x(dim);
    for (std::size_t i = 0; i < dim; ++i) x[i] = float_to_bf16(0.37F * static_cast<float>(i + 1));
    const std::vector<bf16_bits> before = x;
    const std::vector<int64_t> positions{7};
    rope_bf16(shape, x, positions, cos, sin);
    auto r = [](float v) { return bf16_to_float(float_to_bf16(v)); };
    const std::size_t half = dim / 2;
    for (std::size_t i = 0; i < half; ++i) {
      const float a = bf16_to_float(before[i]);
      const float b = bf16_to_float(before[i + half]);
      const std::size_t t = 7 * dim + i;
      const float c1 = r(cos[t]), s1 = r(sin[t]), c2 = r(cos[t + half]), s2 = r(sin[t + half]);
      CHECK(x[i] == float_to_bf16(r(a * c1) + r(-b * s1)));
      CHECK(x[i + half] == float_to_bf16(r(b * c2) + r(a * s2)));
    }
  }
}

TEST(rope_in_bf16_on_many_heads_and_rows_rounds_like_one_head_at_a_time_on_any_thread_count) {
  // Every head of a token shares its cos / sin row (rounded once per token on the AVX-512 path, in groups of four
  // vectors: head_dim 256 takes two). 40 rows x 12 heads x 64 values is enough work to split over threads.
  for (const std::size_t dim : {32UL, 64UL, 128UL, 256UL}) {
    for (const int threads : {1, 2, 3}) {
      std::vector<float> cos, sin;
      tables(cos, sin, dim);
      const std::size_t rows = 40, heads = 12, stride = heads * dim + 8;  // a gap after each row stays untouched
      const RopeShape shape{.rows = rows, .row_stride = stride, .heads = heads, .head_dim = dim, .max_position = kMaxPos};
      std::vector<bf16_bits> x(rows * stride);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(0.01F * static_cast<float>(i % 997) - 4.0F);
      const std::vector<bf16_bits> before = x;
      std::vector<int64_t> positions(rows);
      for (std::size_t r = 0; r < rows; ++r) positions[r] = static_cast<int64_t>((r * 7) % kMaxPos);
      rope_bf16(shape, x, positions, cos, sin, threads);
      auto rd = [](float v) { return bf16_to_float(float_to_bf16(v)); };
      const std::size_t half = dim / 2;
      for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t h = 0; h < heads; ++h) {
          const std::size_t base = r * stride + h * dim;
          for (std::size_t i = 0; i < half; ++i) {
            const float a = bf16_to_float(before[base + i]);
            const float b = bf16_to_float(before[base + i + half]);
            const std::size_t t = static_cast<std::size_t>(positions[r]) * dim + i;
            const float c1 = rd(cos[t]), s1 = rd(sin[t]), c2 = rd(cos[t + half]), s2 = rd(sin[t + half]);
            CHECK(x[base + i] == float_to_bf16(rd(a * c1) + rd(-b * s1)));
            CHECK(x[base + i + half] == float_to_bf16(rd(b * c2) + rd(a * s2)));
          }
        }
        for (std::size_t g = heads * dim; g < stride; ++g) CHECK(x[r * stride + g] == before[r * stride + g]);
      }
    }
  }
}

TEST(rope_refuses_a_bad_position_or_shape_before_writing) {
  std::vector<float> cos, sin;
  tables(cos, sin);
  const RopeShape shape{.rows = 2, .row_stride = kDim, .heads = 1, .head_dim = kDim, .max_position = kMaxPos};
  std::vector<float> x(2 * kDim, 1.0F);
  for (const int64_t bad : {int64_t{-1}, static_cast<int64_t>(kMaxPos)}) {
    const std::vector<int64_t> positions{3, bad};
    CHECK_THROWS(std::invalid_argument, rope_f32(shape, x, positions, cos, sin));
    for (const float v : x) CHECK(v == 1.0F);  // the valid first row was not rotated either
  }
  const std::vector<int64_t> positions{1, 2};
  RopeShape odd = shape;
  odd.head_dim = 7;
  CHECK_THROWS(std::invalid_argument, rope_f32(odd, x, positions, cos, sin));
  RopeShape overlapping = shape;
  overlapping.row_stride = kDim - 1;
  CHECK_THROWS(std::invalid_argument, rope_f32(overlapping, x, positions, cos, sin));
  std::vector<float> short_x(kDim + 1);
  CHECK_THROWS(std::invalid_argument, rope_f32(shape, short_x, positions, cos, sin));
}

TEST(silu_mul_matches_the_reference_and_rounds_like_the_tensor_formulation) {
  std::mt19937 gen(4);
  std::normal_distribution<float> normal;
  const std::size_t rows = 3, dim = 37;
  std::vector<float> gate_up(rows * 2 * dim), out(rows * dim);
  for (auto& v : gate_up) v = 4.0F * normal(gen);
  silu_mul_f32(rows, dim, gate_up, out);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t j = 0; j < dim; ++j) {
      const double g = gate_up[r * 2 * dim + j];
      const double ref = g / (1.0 + std::exp(-g)) * gate_up[r * 2 * dim + dim + j];
      CHECK(std::abs(out[r * dim + j] - ref) <= 1e-6 * (1.0 + std::abs(ref)));
    }
  }
  std::vector<bf16_bits> gu16(2 * dim), out16(dim);
  for (auto& v : gu16) v = float_to_bf16(4.0F * normal(gen));
  silu_mul_bf16(1, dim, gu16, out16);
  for (std::size_t j = 0; j < dim; ++j) {
    // The activation rounded to bf16, then the product: within one bf16 step of that (the vectorised exp may round
    // the last float bit the other way).
    const float g = bf16_to_float(gu16[j]);
    const float activated = bf16_to_float(float_to_bf16(g / (1.0F + std::exp(-g))));
    const float ref = bf16_to_float(float_to_bf16(activated * bf16_to_float(gu16[dim + j])));
    CHECK(std::abs(bf16_to_float(out16[j]) - ref) <= std::abs(ref) * 0x1p-7F + 1e-30F);
  }
  // Large arguments: silu(g) -> g for g >> 0 and -> -0 for g << 0, no NaN from the exp's range.
  std::vector<float> extreme{-200.0F, -90.0F, 90.0F, 200.0F, -200.0F, -90.0F, 90.0F, 200.0F, 1, 1, 1, 1, 1, 1, 1, 1,
                             1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  std::vector<float> extreme_out(16);
  silu_mul_f32(1, 16, extreme, extreme_out);
  const float want[] = {-0.0F, -0.0F, 90.0F, 200.0F};
  for (std::size_t j = 0; j < 8; ++j) CHECK(std::abs(extreme_out[j] - want[j % 4]) < 1e-30F + 1e-6F * std::abs(want[j % 4]));
  CHECK_THROWS(std::invalid_argument, silu_mul_f32(rows, dim + 1, gate_up, out));
  std::vector<float> small(dim);
  CHECK_THROWS(std::invalid_argument, silu_mul_f32(rows, dim, gate_up, small));
}

TEST(silu_mul_split_over_two_threads_equals_one_thread) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  const std::size_t rows = 64, dim = 1536;  // a batch large enough to split
  std::vector<bf16_bits> gate_up(rows * 2 * dim), one(rows * dim), two(rows * dim, 0xffff);
  for (auto& v : gate_up) v = float_to_bf16(3.0F * normal(gen));
  silu_mul_bf16(rows, dim, gate_up, one, 1);
  silu_mul_bf16(rows, dim, gate_up, two, 2);
  CHECK(one == two);
}

TEST(write_kv_copies_each_row_to_its_slot_and_checks_every_slot_first) {
  // Two caches of 6 slots of 4 values; 3 rows taken from strided views (stride 10 values for k, 7 for v).
  const std::size_t slots = 6, row = 4;
  std::vector<float> k_cache(slots * row, -1.0F), v_cache(slots * row, -1.0F);
  std::vector<float> k(2 * 10 + row), v(2 * 7 + row);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 100.0F + static_cast<float>(i);
  const std::vector<int64_t> where{4, 0, 2};
  const KvWriteShape shape{3, row * sizeof(float), 10 * sizeof(float), 7 * sizeof(float)};
  const auto bytes = [](auto& vec) { return std::as_writable_bytes(std::span(vec)); };
  const auto cbytes = [](const auto& vec) { return std::as_bytes(std::span(vec)); };
  write_kv(shape, bytes(k_cache), bytes(v_cache), cbytes(k), cbytes(v), where);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t j = 0; j < row; ++j) {
      CHECK(k_cache[static_cast<std::size_t>(where[r]) * row + j] == k[r * 10 + j]);
      CHECK(v_cache[static_cast<std::size_t>(where[r]) * row + j] == v[r * 7 + j]);
    }
  }
  for (std::size_t j = 0; j < row; ++j) CHECK(k_cache[1 * row + j] == -1.0F && v_cache[5 * row + j] == -1.0F);
  // A slot past the end: refused, and the first (valid) row is not written either.
  std::vector<float> fresh(slots * row, -1.0F), fresh_v(slots * row, -1.0F);
  const std::vector<int64_t> bad{1, 6, 0};
  CHECK_THROWS(std::invalid_argument, write_kv(shape, bytes(fresh), bytes(fresh_v), cbytes(k), cbytes(v), bad));
  const std::vector<int64_t> negative{1, -1, 0};
  CHECK_THROWS(std::invalid_argument, write_kv(shape, bytes(fresh), bytes(fresh_v), cbytes(k), cbytes(v), negative));
  CHECK(fresh == std::vector<float>(slots * row, -1.0F));
  CHECK_THROWS(std::invalid_argument, write_kv(shape, bytes(fresh), bytes(fresh_v), cbytes(k), cbytes(v),
                                               std::span<const int64_t>(where.data(), 2)));
}

TEST_MAIN()
