// The paged decode- and chunk-attention kernels against a float64 reference: float32 and bf16, grouped-query heads,
// head sizes on the AVX-512 path, on the AVX2 path and off both, shuffled block tables, a subset of the sequences,
// strided queries, causal chunks with and without cached context (and whole steps mixing them with decode rows), and
// refusal of out-of-range indices before anything is written.
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
  std::vector<int32_t> q_lens{};   // query rows of each sequence (the last of its positions); empty: one each
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
  d.cu.assign(seqs + 1, 0);
  for (std::size_t s = 0; s < seqs; ++s) d.cu[s + 1] = d.cu[s] + (c.q_lens.empty() ? 1 : c.q_lens[s]);
  const auto rows = static_cast<std::size_t>(d.cu[seqs]);
  d.shape = {rows, stride, c.heads, c.kv_heads, c.head_dim, blocks, c.block_size, seqs, table_stride};
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<float>& x, std::size_t n) {
    x.resize(n);
    for (auto& value : x) value = normal(gen);
  };
  fill(d.q, (rows - 1) * stride + c.heads * c.head_dim);
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
  return d;
}

// out[row, head, :] for query row `r` of a sequence (causal: it sees its own position and those before), in float64.
std::vector<double> reference(const Data& d, std::size_t seq, std::size_t head, float scale, std::size_t r = 0) {
  const auto& s = d.shape;
  const auto q_len = static_cast<std::size_t>(d.cu[seq + 1] - d.cu[seq]);
  const std::size_t kv_head = head / (s.num_heads / s.num_kv_heads);
  const std::size_t len = static_cast<std::size_t>(d.lens[seq]) - q_len + r + 1;
  const float* q = d.q.data() + (static_cast<std::size_t>(d.cu[seq]) + r) * s.q_row_stride + head * s.head_dim;
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

enum class Kernel { kDecode, kChunk, kStep };

// Runs `kernel` in float32 and bf16 on every other sequence (or all, for whole steps) and checks each listed row
// against the reference and each other row untouched.
void check_case(const Case& c, int threads, Kernel kernel = Kernel::kDecode) {
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
  // Every other sequence: the rest stand for sequences another kernel computes, whose rows must be left alone.
  const std::size_t every = kernel == Kernel::kStep ? 1 : 2;
  for (std::size_t s = 0; s < c.lens.size(); s += every) d.ids.push_back(static_cast<int32_t>(s));
  const PagedDecodeIndex index{d.tables, d.lens, d.cu, d.ids};
  const float scale = 1.0F / std::sqrt(static_cast<float>(c.head_dim));
  const std::size_t row = c.heads * c.head_dim;
  std::vector<float> out(d.shape.num_q_rows * row, NAN);
  std::vector<bf16_bits> outb(out.size(), 0xffff);
  if (kernel == Kernel::kDecode) {
    paged_decode_attention_f32(d.shape, index, d.q, d.k, d.v, out, scale, threads);
    paged_decode_attention_bf16(d.shape, index, qb, kb, vb, outb, scale, threads);
  } else if (kernel == Kernel::kChunk) {
    paged_chunk_attention_f32(d.shape, index, d.q, d.k, d.v, out, scale, threads);
    paged_chunk_attention_bf16(d.shape, index, qb, kb, vb, outb, scale, threads);
  } else {
    paged_attention_f32(d.shape, index, d.q, d.k, d.v, out, scale, threads);
    paged_attention_bf16(d.shape, index, qb, kb, vb, outb, scale, threads);
  }
  for (std::size_t s = 0; s < c.lens.size(); ++s) {
    for (auto r = static_cast<std::size_t>(d.cu[s]); r < static_cast<std::size_t>(d.cu[s + 1]); ++r) {
      for (std::size_t h = 0; h < c.heads; ++h) {
        const std::size_t at = r * row + h * c.head_dim;
        if (s % every != 0) {
          for (std::size_t i = 0; i < c.head_dim; ++i) CHECK(std::isnan(out[at + i]) && outb[at + i] == 0xffff);
          continue;
        }
        const auto ref = reference(d, s, h, scale, r - static_cast<std::size_t>(d.cu[s]));
        for (std::size_t i = 0; i < c.head_dim; ++i) {
          CHECK(std::abs(out[at + i] - ref[i]) < 2e-5);
          CHECK(std::abs(bf16_to_float(outb[at + i]) - ref[i]) <= std::abs(ref[i]) / 128.0 + 1e-5);  // output rounding
        }
      }
    }
  }
}

}  // namespace

TEST(float32_and_bf16_match_the_reference) {
  for (int threads : {1, 2, 3}) {
    check_case({9, 3, 64, 16, {1, 5, 17, 40, 100, 3, 33}}, threads);  // SmolLM2's heads, AVX-512 path
    check_case({4, 4, 32, 8, {16, 2, 31, 9}}, threads);                 // no grouping
    check_case({6, 2, 24, 16, {50, 7, 18}}, threads);                   // head_dim off AVX-512's path: AVX2's
    check_case({6, 2, 20, 16, {50, 7, 18}}, threads);                   // head_dim off every vector path
    check_case({8, 2, 64, 16, std::vector<int32_t>(12, 300)}, threads); // enough work for two threads
    check_case({9, 3, 64, 16, {20, 44, 61}, 15 * 64}, threads);         // queries strided in a fused QKV row
    check_case({8, 1, 64, 16, {16, 17, 47}}, threads);                   // a group of 8: two chunks of 4 heads
    check_case({6, 2, 128, 16, {1, 15, 16, 33, 70}}, threads);           // head_dim 128: chunks of 2 heads, one short
    check_case({4, 4, 128, 4, {5, 64}}, threads);                        // head_dim 128 without grouping
    // Split by context positions, not sequence count: the long first sequence is one part of its own.
    check_case({9, 3, 64, 16, {2000, 3, 5, 900, 1, 1, 1, 40}}, threads);
  }
}

TEST(chunks_attend_causally_as_the_reference) {
  for (int threads : {1, 2, 3}) {
    // Fresh prompts (q_len = len), chunks deep into cached context, a one-row "chunk", tails not a multiple of 16.
    check_case({9, 3, 64, 16, {5, 40, 17, 100, 300, 33}, 0, {5, 1, 17, 33, 64, 20}}, threads, Kernel::kChunk);
    check_case({4, 4, 128, 8, {30, 300, 7}, 0, {7, 20, 7}}, threads, Kernel::kChunk);     // head_dim 128
    check_case({8, 1, 64, 16, {700, 90}, 0, {40, 90}}, threads, Kernel::kChunk);           // a group of 8
    check_case({6, 2, 24, 16, {50, 70, 18}, 0, {9, 70, 3}}, threads, Kernel::kChunk);       // off the vector path
    check_case({9, 3, 64, 16, {20, 44, 61}, 15 * 64, {20, 4, 11}}, threads, Kernel::kChunk);  // strided queries
    check_case({9, 3, 64, 4, {2040, 130}, 0, {16, 130}}, threads, Kernel::kChunk);         // deep, small blocks
  }
}

// A chunk row's result depends on its own length only: the same bits whether its sequence's rows come as one prompt
// or in chunks (tiled and split over context ranges differently) and whatever the thread count.
TEST(chunk_rows_give_the_same_bits_however_the_prompt_is_chunked) {
  std::mt19937 gen(9);
  const std::vector<int32_t> lens{1300};
  Data whole = make({9, 3, 64, 16, lens, 0, {1300}}, gen);
  whole.ids = {0};
  std::vector<float> all(whole.shape.num_q_rows * 9 * 64, NAN);
  paged_chunk_attention_f32(whole.shape, {whole.tables, whole.lens, whole.cu, whole.ids}, whole.q, whole.k, whole.v,
                            all, 0.125F, 1);
  for (int threads : {1, 2, 3}) {
    for (const auto& [begin, end] : {std::pair{0, 37}, {37, 600}, {600, 1290}, {1290, 1300}}) {
      // The sequence's first `end` positions, of which rows [begin, end) are the chunk: its queries, same cache.
      Data part = whole;
      part.lens = {end};
      part.cu = {0, end - begin};
      part.shape.num_q_rows = static_cast<std::size_t>(end - begin);
      part.q.assign(whole.q.begin() + begin * 9 * 64, whole.q.begin() + end * 9 * 64);
      std::vector<float> out(part.q.size(), NAN);
      paged_chunk_attention_f32(part.shape, {part.tables, part.lens, part.cu, part.ids}, part.q, part.k, part.v, out,
                                0.125F, threads);
      CHECK(std::equal(out.begin(), out.end(), all.begin() + begin * 9 * 64));
    }
  }
}

TEST(whole_steps_mix_decode_rows_and_chunks) {
  for (int threads : {1, 2}) {
    check_case({9, 3, 64, 16, {40, 7, 300, 1, 33, 600}, 0, {1, 7, 1, 1, 20, 256}}, threads, Kernel::kStep);
    check_case({6, 2, 24, 16, {50, 8}, 0, {1, 8}}, threads, Kernel::kStep);
  }
}

TEST(chunk_rows_out_of_range_are_refused_before_anything_is_written) {
  std::mt19937 gen(5);
  Data d = make({4, 2, 64, 4, {10, 6}, 0, {3, 6}}, gen);
  d.ids = {0, 1};
  std::vector<float> out(d.shape.num_q_rows * 4 * 64, NAN);
  auto refused = [&] {
    bool threw = false;
    try {
      paged_attention_f32(d.shape, {d.tables, d.lens, d.cu, d.ids}, d.q, d.k, d.v, out, 0.25F);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw && std::all_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }));
  };
  d.lens[1] = 5;  // six query rows, five positions
  refused();
  d.lens[1] = 6;
  d.cu[2] = 10;  // rows past q
  refused();
  d.cu[2] = 9;
  const int32_t saved = d.tables[0];
  d.tables[0] = -1;  // the decode-free step still checks the chunk's blocks
  refused();
  d.tables[0] = saved;
  paged_attention_f32(d.shape, {d.tables, d.lens, d.cu, d.ids}, d.q, d.k, d.v, out, 0.25F);
  CHECK(std::none_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }));
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
