// The paged decode-attention kernel against a float64 reference: float32 and bf16, grouped-query heads, head sizes
// on the AVX-512 path and off it, shuffled block tables, a subset of the sequences, strided queries, and refusal of
// out-of-range indices before anything is written.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_attention.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

struct Case {
  std::size_t heads, kv_heads, head_dim, block_size;
  std::vector<int32_t> lens;
  std::size_t q_row_stride = 0;  // 0: contiguous
};

struct Data {
  PagedDecodeShape shape{};
  std::vector<float> q, k, v;
  std::vector<int32_t> tables, lens, cu, ids;
};

Data make(const Case& c, std::mt19937& gen) {
  Data d;
  const std::size_t seqs = c.lens.size();
  std::size_t table_stride = 0, blocks = 0;
  for (const int32_t len : c.lens) {
    const std::size_t need = (static_cast<std::size_t>(len) + c.block_size - 1) / c.block_size;
    table_stride = std::max(table_stride, need);
    blocks += need;
  }
  blocks += 2;  // spare blocks nobody owns
  const std::size_t stride = c.q_row_stride ? c.q_row_stride : c.heads * c.head_dim;
  d.shape = {seqs, stride, c.heads, c.kv_heads, c.head_dim, blocks, c.block_size, seqs, table_stride};
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<float>& x, std::size_t n) {
    x.resize(n);
    for (auto& value : x) value = normal(gen);
  };
  fill(d.q, (seqs - 1) * stride + c.heads * c.head_dim);
  fill(d.k, blocks * c.block_size * c.kv_heads * c.head_dim);
  fill(d.v, blocks * c.block_size * c.kv_heads * c.head_dim);
  std::vector<int32_t> pool(blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), gen);
  d.tables.assign(seqs * table_stride, 0);
  std::size_t next = 0;
  for (std::size_t s = 0; s < seqs; ++s) {
    const std::size_t need = (static_cast<std::size_t>(c.lens[s]) + c.block_size - 1) / c.block_size;
    for (std::size_t b = 0; b < need; ++b) d.tables[s * table_stride + b] = pool[next++];
  }
  d.lens = c.lens;
  d.cu.resize(seqs + 1);
  std::iota(d.cu.begin(), d.cu.end(), 0);
  return d;
}

// out[row, head, :] for one sequence, in float64.
std::vector<double> reference(const Data& d, std::size_t seq, std::size_t head, float scale) {
  const auto& s = d.shape;
  const std::size_t kv_head = head / (s.num_heads / s.num_kv_heads), len = static_cast<std::size_t>(d.lens[seq]);
  const float* q = d.q.data() + static_cast<std::size_t>(d.cu[seq]) * s.q_row_stride + head * s.head_dim;
  std::vector<double> scores(len), out(s.head_dim, 0.0);
  auto at = [&](const std::vector<float>& cache, std::size_t pos) {
    const auto block = static_cast<std::size_t>(d.tables[seq * s.table_stride + pos / s.block_size]);
    return cache.data() + ((block * s.block_size + pos % s.block_size) * s.num_kv_heads + kv_head) * s.head_dim;
  };
  double max = -INFINITY, sum = 0.0;
  for (std::size_t pos = 0; pos < len; ++pos) {
    double dot = 0.0;
    for (std::size_t i = 0; i < s.head_dim; ++i) dot += double{q[i]} * at(d.k, pos)[i];
    max = std::max(max, scores[pos] = dot * scale);
  }
  for (auto& x : scores) sum += (x = std::exp(x - max));
  for (std::size_t pos = 0; pos < len; ++pos) {
    for (std::size_t i = 0; i < s.head_dim; ++i) out[i] += scores[pos] / sum * at(d.v, pos)[i];
  }
  return out;
}

void check_case(const Case& c, int threads) {
  std::mt19937 gen(static_cast<unsigned>(c.heads * 131 + c.head_dim * 7 + c.lens.size()));
  Data d = make(c, gen);
  // Inputs rounded to bf16 values, so the float32 and bf16 runs and the reference all see the same numbers.
  std::vector<bf16_bits> qb(d.q.size()), kb(d.k.size()), vb(d.v.size());
  auto round = [](std::vector<float>& x, std::vector<bf16_bits>& b) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(b[i] = float_to_bf16(x[i]));
  };
  round(d.q, qb);
  round(d.k, kb);
  round(d.v, vb);
  // Every other sequence: the rest stand for prefill chunks, whose rows the kernel must leave alone.
  for (std::size_t s = 0; s < c.lens.size(); s += 2) d.ids.push_back(static_cast<int32_t>(s));
  const PagedDecodeIndex index{d.tables, d.lens, d.cu, d.ids};
  const float scale = 1.0F / std::sqrt(static_cast<float>(c.head_dim));
  const std::size_t row = c.heads * c.head_dim;
  std::vector<float> out(c.lens.size() * row, NAN);
  std::vector<bf16_bits> outb(out.size(), 0xffff);
  paged_decode_attention_f32(d.shape, index, d.q, d.k, d.v, out, scale, threads);
  paged_decode_attention_bf16(d.shape, index, qb, kb, vb, outb, scale, threads);
  for (std::size_t s = 0; s < c.lens.size(); ++s) {
    for (std::size_t h = 0; h < c.heads; ++h) {
      const std::size_t at = s * row + h * c.head_dim;
      if (s % 2 != 0) {
        for (std::size_t i = 0; i < c.head_dim; ++i) CHECK(std::isnan(out[at + i]) && outb[at + i] == 0xffff);
        continue;
      }
      const auto ref = reference(d, s, h, scale);
      for (std::size_t i = 0; i < c.head_dim; ++i) {
        CHECK(std::abs(out[at + i] - ref[i]) < 2e-5);
        CHECK(std::abs(bf16_to_float(outb[at + i]) - ref[i]) <= std::abs(ref[i]) / 128.0 + 1e-5);  // output rounding
      }
    }
  }
}

}  // namespace

TEST(float32_and_bf16_match_the_reference) {
  for (int threads : {1, 2, 3}) {
    check_case({9, 3, 64, 16, {1, 5, 17, 40, 100, 3, 33}}, threads);  // SmolLM2's heads, AVX-512 path
    check_case({4, 4, 32, 8, {16, 2, 31, 9}}, threads);                 // no grouping
    check_case({6, 2, 24, 16, {50, 7, 18}}, threads);                   // head_dim off the vector path
    check_case({8, 2, 64, 16, std::vector<int32_t>(12, 300)}, threads); // enough work for two threads
    check_case({9, 3, 64, 16, {20, 44, 61}, 15 * 64}, threads);         // queries strided in a fused QKV row
    check_case({8, 1, 64, 16, {16, 17, 47}}, threads);                   // a group of 8: two chunks of 4 heads
    check_case({6, 2, 128, 16, {1, 15, 16, 33, 70}}, threads);           // head_dim 128: chunks of 2 heads, one short
    check_case({4, 4, 128, 4, {5, 64}}, threads);                        // head_dim 128 without grouping
    // Split by context positions, not sequence count: the long first sequence is one part of its own.
    check_case({9, 3, 64, 16, {2000, 3, 5, 900, 1, 1, 1, 40}}, threads);
  }
}

TEST(out_of_range_indices_are_refused_before_anything_is_written) {
  std::mt19937 gen(3);
  Data d = make({4, 2, 16, 4, {10, 6}}, gen);
  d.ids = {0, 1};
  std::vector<float> out(2 * 4 * 16, NAN);
  auto call = [&] {
    paged_decode_attention_f32(d.shape, {d.tables, d.lens, d.cu, d.ids}, d.q, d.k, d.v, out, 0.25F);
  };
  auto refused = [&] {
    bool threw = false;
    try {
      call();
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw && std::all_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }));
  };
  const int32_t saved_block = d.tables[d.shape.table_stride];
  d.tables[d.shape.table_stride] = static_cast<int32_t>(d.shape.num_blocks);  // sequence 1's first block
  refused();
  d.tables[d.shape.table_stride] = saved_block;
  d.lens[1] = static_cast<int32_t>(d.shape.table_stride * d.shape.block_size + 1);  // longer than its table
  refused();
  d.lens[1] = 0;  // nothing to attend to
  refused();
  d.lens[1] = 6;
  d.ids = {0, 2};  // no such sequence
  refused();
  d.ids = {0, 1};
  d.cu[1] = 2;  // query row past q
  refused();
  d.cu[1] = 1;
  call();
  CHECK(std::none_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }));
}

TEST_MAIN()
