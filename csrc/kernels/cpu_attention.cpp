#include "kernels/cpu_attention.h"

#include "kernels/parallel.h"
#include "kernels/simd_avx2.h"
#include "kernels/simd_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringserve::kernels {

namespace {

// Below this much work (query heads x context positions) a call stays on the calling thread: waking a second one
// costs more than it saves.
constexpr std::size_t kParallelWork = 8192;
constexpr std::size_t kLanes = 16;  // float32 lanes of a 512-bit register

template <class T>
struct Job {
  const PagedDecodeShape& shape;
  const PagedDecodeIndex& index;
  const T* q;
  const T* k_cache;
  const T* v_cache;
  T* out;
  float scale;
};

// Per-thread working memory, grown on demand and kept: steady-state calls allocate nothing.
struct Scratch {
  std::vector<float> query;   // [heads, head_dim] (AVX-512 path)
  std::vector<float> scores;  // [heads or group, context]
  std::vector<float> acc;     // [heads or group, head_dim]
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Calls fn(pos, offset) for positions [0, len) of sequence `seq`'s context, where offset is where the position keeps
// KV head `kv_head` in either cache: block by block, so no position costs a division. With kPrefetch, each position
// also prefetches its whole token row (every KV head) in the sequence's next block of `prefetch_cache`: blocks are
// scattered, so the hardware prefetcher cannot see the jump coming.
template <bool kPrefetch, class T, class Fn>
[[gnu::always_inline]] inline void for_each_position(const Job<T>& job, std::size_t seq, std::size_t len,
                                                     std::size_t kv_head, const T* prefetch_cache, Fn&& fn) {
  const auto& s = job.shape;
  const int32_t* table = job.index.block_tables.data() + seq * s.table_stride;
  const std::size_t token_stride = s.num_kv_heads * s.head_dim;
  const std::size_t block_stride = s.block_size * token_stride;
  for (std::size_t start = 0, b = 0; start < len; start += s.block_size, ++b) {
    const std::size_t end = std::min(len, start + s.block_size);
    const bool next = end < len;
    const std::size_t next_base = next ? static_cast<std::size_t>(table[b + 1]) * block_stride : 0;
    std::size_t offset = static_cast<std::size_t>(table[b]) * block_stride + kv_head * s.head_dim;
    for (std::size_t pos = start; pos < end; ++pos, offset += token_stride) {
      if constexpr (kPrefetch) {
        if (next) {
          const char* row = reinterpret_cast<const char*>(prefetch_cache + next_base + (pos - start) * token_stride);
          for (std::size_t byte = 0; byte < token_stride * sizeof(T); byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
        }
      }
      fn(pos, offset);
    }
  }
}

// Portable path: any head_dim, any x86-64 CPU.
template <class T>
void attend_scalar(const Job<T>& job, std::size_t seq, std::size_t kv_head) {
  const auto& s = job.shape;
  const std::size_t group = s.num_heads / s.num_kv_heads, hd = s.head_dim;
  const auto len = static_cast<std::size_t>(job.index.seq_lens[seq]);
  const auto row = static_cast<std::size_t>(job.index.cu_seqlens_q[seq]);
  Scratch& w = scratch();
  w.scores.resize(group * len);
  w.acc.assign(group * hd, 0.0F);
  for (std::size_t h = 0; h < group; ++h) {
    const T* q = job.q + row * s.q_row_stride + (kv_head * group + h) * hd;
    float* scores = w.scores.data() + h * len;
    float max = -std::numeric_limits<float>::infinity();
    for_each_position<false>(job, seq, len, kv_head, job.k_cache, [&](std::size_t pos, std::size_t offset) {
      const T* k = job.k_cache + offset;
      float dot = 0.0F;
      for (std::size_t d = 0; d < hd; ++d) dot += load_scalar(q[d]) * load_scalar(k[d]);
      scores[pos] = dot * job.scale;
      max = std::max(max, scores[pos]);
    });
    float sum = 0.0F;
    for (std::size_t pos = 0; pos < len; ++pos) sum += (scores[pos] = std::exp(scores[pos] - max));
    float* acc = w.acc.data() + h * hd;
    for_each_position<false>(job, seq, len, kv_head, job.k_cache, [&](std::size_t pos, std::size_t offset) {
      const T* v = job.v_cache + offset;
      for (std::size_t d = 0; d < hd; ++d) acc[d] += scores[pos] * load_scalar(v[d]);
    });
    T* out = job.out + (row * s.num_heads + kv_head * group + h) * hd;
    for (std::size_t d = 0; d < hd; ++d) store_scalar(out + d, acc[d] / sum);
  }
}

// AVX-512 path (head_dim a multiple of 16), one whole sequence: each token row of K and V (every KV head, contiguous
// in the cache) is read once, in order, for all query heads.
template <class T>
__attribute__((target("avx512f"))) void attend_avx512(const Job<T>& job, std::size_t seq) {
  const auto& s = job.shape;
  const std::size_t heads = s.num_heads, group = s.num_heads / s.num_kv_heads, hd = s.head_dim;
  const auto len = static_cast<std::size_t>(job.index.seq_lens[seq]);
  const auto row = static_cast<std::size_t>(job.index.cu_seqlens_q[seq]);
  Scratch& w = scratch();
  w.query.resize(heads * hd);
  w.scores.resize(heads * len);
  w.acc.assign(heads * hd, 0.0F);
  const T* q = job.q + row * s.q_row_stride;
  for (std::size_t i = 0; i < heads * hd; i += kLanes) {
    _mm512_storeu_ps(w.query.data() + i, _mm512_mul_ps(load16(q + i), _mm512_set1_ps(job.scale)));
  }
  for_each_position<true>(job, seq, len, 0, job.k_cache,
                          [&](std::size_t pos, std::size_t offset) __attribute__((target("avx512f"))) {
    for (std::size_t h = 0; h < heads; ++h) {
      const T* k = job.k_cache + offset + (h / group) * hd;
      const float* qh = w.query.data() + h * hd;
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(k));
      for (std::size_t d = kLanes; d < hd; d += kLanes) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), load16(k + d), dot);
      w.scores[h * len + pos] = sum16(dot);
    }
  });
  std::vector<float>& sums = w.query;  // the scaled queries are no longer needed: reuse for the softmax sums
  for (std::size_t h = 0; h < heads; ++h) {
    float* scores = w.scores.data() + h * len;
    float max = -std::numeric_limits<float>::infinity();
    for (std::size_t pos = 0; pos < len; ++pos) max = std::max(max, scores[pos]);
    __m512 total = _mm512_setzero_ps();
    for (std::size_t pos = 0; pos < len; pos += kLanes) {
      const std::size_t left = len - pos;
      const __mmask16 mask = left >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1U << left) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + pos), _mm512_set1_ps(max)));
      _mm512_mask_storeu_ps(scores + pos, mask, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    sums[h] = sum16(total);
  }
  for_each_position<true>(job, seq, len, 0, job.v_cache,
                          [&](std::size_t pos, std::size_t offset) __attribute__((target("avx512f"))) {
    for (std::size_t h = 0; h < heads; ++h) {
      const T* v = job.v_cache + offset + (h / group) * hd;
      const __m512 p = _mm512_set1_ps(w.scores[h * len + pos]);
      float* acc = w.acc.data() + h * hd;
      for (std::size_t d = 0; d < hd; d += kLanes) {
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(p, load16(v + d), _mm512_loadu_ps(acc + d)));
      }
    }
  });
  T* out = job.out + row * heads * hd;
  for (std::size_t h = 0; h < heads; ++h) {
    const float inv = 1.0F / sums[h];
    for (std::size_t d = 0; d < hd; ++d) store_scalar(out + h * hd + d, w.acc[h * hd + d] * inv);
  }
}

// kVecs x 8 dimensions from d0 of query head h's output: its context's values weighed by the softmaxed scores,
// summed in registers over every position, then divided by the scores' sum.
template <std::size_t kVecs, class T>
__attribute__((target("avx2,fma"))) void weigh_values_avx2(const Job<T>& job, std::size_t seq, std::size_t len,
                                                           std::size_t h, std::size_t d0, const float* scores,
                                                           float sum, bool prefetch) {
  const auto& s = job.shape;
  const std::size_t kv = h / (s.num_heads / s.num_kv_heads);
  __m256 acc[kVecs];
  for (std::size_t c = 0; c < kVecs; ++c) acc[c] = _mm256_setzero_ps();
  auto weigh = [&](std::size_t pos, std::size_t offset) __attribute__((target("avx2,fma"))) {
    const __m256 p = _mm256_set1_ps(scores[pos]);
    const T* v = job.v_cache + offset + d0;
    for (std::size_t c = 0; c < kVecs; ++c) acc[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), acc[c]);
  };
  if (prefetch) {  // the first pass over the values brings the next block's rows in
    for_each_position<true>(job, seq, len, kv, job.v_cache, weigh);
  } else {
    for_each_position<false>(job, seq, len, kv, job.v_cache, weigh);
  }
  const auto row = static_cast<std::size_t>(job.index.cu_seqlens_q[seq]);
  T* out = job.out + row * s.num_heads * s.head_dim + h * s.head_dim + d0;
  const __m256 inv = _mm256_set1_ps(1.0F / sum);
  for (std::size_t c = 0; c < kVecs; ++c) store8(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

// AVX2 + FMA path (head_dim a multiple of 8), one whole sequence. Scores: each token row of K (every KV head,
// contiguous in the cache) is read once, in order, for all query heads; within a block, 8 positions at a time meet a
// query head (the 8 dot products reduced together), the rest one by one. Then the softmax; then each head's output
// summed in registers, 64 dimensions at a time (weigh_values_avx2). The passes reach the scratch memory through plain
// pointers taken once: inside them, the thread-local itself would cost a TLS lookup per position and head.
template <class T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Job<T>& job, std::size_t seq) {
  constexpr std::size_t kLanes8 = 8;
  const auto& s = job.shape;
  const std::size_t heads = s.num_heads, group = s.num_heads / s.num_kv_heads, hd = s.head_dim;
  const std::size_t token_stride = s.num_kv_heads * hd;
  const auto len = static_cast<std::size_t>(job.index.seq_lens[seq]);
  const auto row = static_cast<std::size_t>(job.index.cu_seqlens_q[seq]);
  Scratch& w = scratch();
  w.query.resize(heads * hd);
  w.scores.resize(heads * len);
  float* const query = w.query.data();
  float* const all_scores = w.scores.data();
  const T* q = job.q + row * s.q_row_stride;
  for (std::size_t i = 0; i < heads * hd; i += kLanes8) {
    _mm256_storeu_ps(query + i, _mm256_mul_ps(load8(q + i), _mm256_set1_ps(job.scale)));
  }
  const T* const k_cache = job.k_cache;
  std::size_t run_end = 0;  // positions before it were scored 8 at a time
  for_each_position<true>(job, seq, len, 0, k_cache,
                          [&](std::size_t pos, std::size_t offset) __attribute__((target("avx2,fma"))) {
    if (pos < run_end) return;
    const bool eight = pos % s.block_size + kLanes8 <= s.block_size && pos + kLanes8 <= len;
    for (std::size_t kv = 0, h = 0; h < heads; ++kv) {
      const T* k = k_cache + offset + kv * hd;
      for (std::size_t g = 0; g < group; ++g, ++h) {
        const float* qh = query + h * hd;
        if (eight) {
          __m256 dot[kLanes8];
          for (std::size_t p = 0; p < kLanes8; ++p) dot[p] = _mm256_setzero_ps();
          for (std::size_t d = 0; d < hd; d += kLanes8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            for (std::size_t p = 0; p < kLanes8; ++p) {
              dot[p] = _mm256_fmadd_ps(qv, load8(k + p * token_stride + d), dot[p]);
            }
          }
          _mm256_storeu_ps(all_scores + h * len + pos, sum8x8(dot));
        } else {
          __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k));
          for (std::size_t d = kLanes8; d < hd; d += kLanes8) {
            dot = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k + d), dot);
          }
          all_scores[h * len + pos] = sum8(dot);
        }
      }
    }
    if (eight) run_end = pos + kLanes8;
  });
  float* const sums = query;  // the scaled queries are no longer needed: reuse for the softmax sums
  for (std::size_t h = 0; h < heads; ++h) {
    float* scores = all_scores + h * len;
    float max = -std::numeric_limits<float>::infinity();
    for (std::size_t pos = 0; pos < len; ++pos) max = std::max(max, scores[pos]);
    __m256 total = _mm256_setzero_ps();
    std::size_t pos = 0;
    for (; pos + kLanes8 <= len; pos += kLanes8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + pos), _mm256_set1_ps(max)));
      _mm256_storeu_ps(scores + pos, e);
      total = _mm256_add_ps(total, e);
    }
    float tail = 0.0F;
    for (; pos < len; ++pos) tail += (scores[pos] = std::exp(scores[pos] - max));
    sums[h] = sum8(total) + tail;
  }
  for (std::size_t h = 0; h < heads; ++h) {
    for (std::size_t d0 = 0; d0 < hd; d0 += 8 * kLanes8) {
      const float* scores = all_scores + h * len;
      const bool first = h == 0 && d0 == 0;
      const std::size_t vecs = std::min<std::size_t>(hd - d0, 8 * kLanes8) / kLanes8;  // 1..8
      [&]<std::size_t... kV>(std::index_sequence<kV...>) {
        ((vecs == kV + 1 ? weigh_values_avx2<kV + 1>(job, seq, len, h, d0, scores, sums[h], first) : void()), ...);
      }(std::make_index_sequence<kLanes8>{});
    }
  }
}

// Streams the K and V token rows of the sequence a thread attends to next into L2, a few cache lines per call, while
// the current sequence's later passes run from cache: its memory then overlaps this one's arithmetic.
template <class T>
class NextSequenceFeeder {
 public:
  NextSequenceFeeder(const Job<T>& job, std::ptrdiff_t seq) : job_(job) {
    if (seq < 0) return;
    const auto& s = job.shape;
    seq_ = static_cast<std::size_t>(seq);
    len_ = static_cast<std::size_t>(job.index.seq_lens[seq_]);
    row_bytes_ = s.num_kv_heads * s.head_dim * sizeof(T);
    block_bytes_ = s.block_size * row_bytes_;
    total_ = 2 * ((len_ + s.block_size - 1) / s.block_size);  // K blocks, then V blocks
  }

  // Issues up to `lines` prefetches, continuing where the last call stopped.
  void feed(std::size_t lines) {
    const auto& s = job_.shape;
    while (lines > 0 && block_ < total_) {
      const std::size_t b = block_ % (total_ / 2);
      const T* cache = block_ < total_ / 2 ? job_.k_cache : job_.v_cache;
      const std::size_t bytes = std::min(s.block_size, len_ - b * s.block_size) * row_bytes_;
      const auto id = static_cast<std::size_t>(job_.index.block_tables[seq_ * s.table_stride + b]);
      const char* base = reinterpret_cast<const char*>(cache) + id * block_bytes_;
      for (; byte_ < bytes && lines > 0; byte_ += 64, --lines) _mm_prefetch(base + byte_, _MM_HINT_T1);
      if (byte_ >= bytes) byte_ = 0, ++block_;
    }
  }

  std::size_t lines() const { return total_ * block_bytes_ / 64; }

 private:
  const Job<T>& job_;
  std::size_t seq_ = 0, len_ = 0, row_bytes_ = 0, block_bytes_ = 0;
  std::size_t total_ = 0, block_ = 0, byte_ = 0;
};

// bf16 scores with AVX512-BF16, for up to 16 positions at once: their key rows (at k_cache + offsets[i], i < rows)
// are transposed 16 k-pairs at a time so that each lane holds one position, and each of the `count` (at most 4)
// query heads at q (kPairs * 2 values apart, unscaled) is broadcast one k-pair at a time into dot products: no
// horizontal sums. scores[c * stride + i] = scale * q_c . k_i.
template <std::size_t kPairs>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void score_block_bf16(
    const bf16_bits* k_cache, const std::size_t* offsets, std::size_t rows, const bf16_bits* q, std::size_t count,
    float scale, float* scores, std::size_t stride) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (std::size_t half = 0; half < kPairs; half += 16) {
    __m512i r[16];
    for (std::size_t p = 0; p < 16; ++p) {
      r[p] = p < rows ? _mm512_loadu_si512(k_cache + offsets[p] + 2 * half) : _mm512_setzero_si512();
    }
    transpose16x16(r);  // r[j]: k-pair half + j of the 16 positions
    for (std::size_t c = 0; c < 4; ++c) {
      if (c >= count) break;
      const bf16_bits* qc = q + c * 2 * kPairs + 2 * half;
      for (std::size_t j = 0; j < 16; ++j) {
        uint32_t pair = 0;
        std::memcpy(&pair, qc + 2 * j, sizeof pair);
        acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)r[j],
                                  (__m512bh)_mm512_maskz_set1_epi32(0xffff, static_cast<int>(pair)));
      }
    }
  }
  for (std::size_t c = 0; c < count; ++c) {
    _mm512_storeu_ps(scores + c * stride, _mm512_mul_ps(acc[c], _mm512_set1_ps(scale)));
  }
}

// AVX-512 path for head_dim = 16 * kVectors (64 or 128: every llama-family model), one whole sequence, a chunk of
// the query heads sharing one KV head at a time, so that each K or V row is converted once for the chunk and the
// output accumulators stay in registers (kChunk * kVectors = 16 of them). A query-key score is a dot product over
// head_dim; rather than summing each product vector's 16 lanes apart, 16 positions' vectors are transposed and
// added, which leaves the 16 scores in one register.
template <class T, std::size_t kVectors>
__attribute__((target("avx512f"))) void attend_avx512_fixed(const Job<T>& job, std::size_t seq,
                                                             std::ptrdiff_t next_seq, bool fed) {
  constexpr std::size_t kHd = kLanes * kVectors;
  constexpr std::size_t kChunk = 16 / kVectors;
  const auto& s = job.shape;
  const std::size_t heads = s.num_heads, group = s.num_heads / s.num_kv_heads;
  const auto len = static_cast<std::size_t>(job.index.seq_lens[seq]);
  const std::size_t stride = (len + kLanes - 1) / kLanes * kLanes;  // a head's row of scores, padded to vectors
  const auto row = static_cast<std::size_t>(job.index.cu_seqlens_q[seq]);
  Scratch& w = scratch();
  w.query.resize(heads * kHd);
  w.scores.resize(heads * stride);
  w.acc.resize(kChunk * kLanes * kLanes);  // the chunk's product vectors for 16 positions, before the transpose
  const T* q = job.q + row * s.q_row_stride;
  for (std::size_t i = 0; i < heads * kHd; i += kLanes) {
    _mm512_storeu_ps(w.query.data() + i, _mm512_mul_ps(load16(q + i), _mm512_set1_ps(job.scale)));
  }
  T* out = job.out + row * heads * kHd;
  const bool dot_bf16 = has_avx512_bf16();
  NextSequenceFeeder<T> feeder(job, next_seq);
  // Every pass after the first (which brings this sequence's own rows in) feeds a share of the next sequence's.
  const std::size_t later_passes = s.num_kv_heads * ((group + kChunk - 1) / kChunk) * 2 - 1;
  const std::size_t per_position = later_passes == 0 ? 0 : feeder.lines() / (later_passes * len) + 1;
  for (std::size_t kv = 0; kv < s.num_kv_heads; ++kv) {
    for (std::size_t h0 = 0; h0 < group; h0 += kChunk) {
      const std::size_t first = kv * group + h0;  // the chunk's first query head
      const std::size_t count = std::min(kChunk, group - h0);
      float* products = w.acc.data();
      // Scores: each position's product vectors go to `products`; every 16 positions they become 16 scores. bf16 keys
      // on CPUs with AVX512-BF16 take score_block_bf16 instead, on each 16 positions' offsets.
      std::size_t offsets[kLanes];
      const auto score = [&](std::size_t pos, std::size_t offset) __attribute__((target("avx512f"))) {
        if constexpr (std::is_same_v<T, bf16_bits>) {
          if (dot_bf16) {
            const std::size_t slot = pos % kLanes;
            offsets[slot] = offset;
            if (slot + 1 == kLanes || pos + 1 == len) {
              score_block_bf16<kHd / 2>(job.k_cache, offsets, slot + 1, q + first * kHd, count, job.scale,
                                        w.scores.data() + first * stride + (pos - slot), stride);
            }
            return;
          }
        }
        const T* k = job.k_cache + offset;
        __m512 kvec[kVectors];
        for (std::size_t v = 0; v < kVectors; ++v) kvec[v] = load16(k + v * kLanes);
        const std::size_t slot = pos % kLanes;
        for (std::size_t c = 0; c < kChunk; ++c) {
          if (c >= count) break;
          const float* qh = w.query.data() + (first + c) * kHd;
          __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), kvec[0]);
          for (std::size_t v = 1; v < kVectors; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + v * kLanes), kvec[v], dot);
          _mm512_storeu_ps(products + (c * kLanes + slot) * kLanes, dot);
        }
        if (slot + 1 == kLanes || pos + 1 == len) {
          const std::size_t base = pos - slot;
          for (std::size_t c = 0; c < count; ++c) {
            __m512i r[16];
            for (std::size_t p = 0; p < kLanes; ++p) {
              r[p] = p <= slot ? _mm512_loadu_si512(products + (c * kLanes + p) * kLanes) : _mm512_setzero_si512();
            }
            transpose16x16(r);
            __m512 sum = _mm512_castsi512_ps(r[0]);
            for (std::size_t l = 1; l < kLanes; ++l) sum = _mm512_add_ps(sum, _mm512_castsi512_ps(r[l]));
            _mm512_storeu_ps(w.scores.data() + (first + c) * stride + base, sum);
          }
        }
      };
      if (kv == 0 && h0 == 0 && !fed) {
        // The first pass over K also fetches each position's V row (every KV head), which the first pass over V
        // reads next: both streams are then in flight together. A sequence the previous one's feeder brought in
        // skips this and the next-block prefetch: its rows are in cache already.
        const std::size_t row_bytes = s.num_kv_heads * kHd * sizeof(T);
        for_each_position<true>(job, seq, len, kv, job.k_cache,
                                [&](std::size_t pos, std::size_t offset) __attribute__((target("avx512f"))) {
          const char* vrow = reinterpret_cast<const char*>(job.v_cache + offset);
          for (std::size_t byte = 0; byte < row_bytes; byte += 64) _mm_prefetch(vrow + byte, _MM_HINT_T1);
          score(pos, offset);
        });
      } else {
        for_each_position<false>(job, seq, len, kv, job.k_cache, [&](std::size_t pos, std::size_t offset) {
          feeder.feed(per_position);
          score(pos, offset);
        });
      }
      // Softmax numerators in place, and their sums.
      float sums[kChunk];
      for (std::size_t c = 0; c < count; ++c) {
        float* scores = w.scores.data() + (first + c) * stride;
        __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (std::size_t pos = 0; pos < len; pos += kLanes) {
          const std::size_t left = len - pos;
          const __mmask16 mask = left >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1U << left) - 1);
          top = _mm512_mask_max_ps(top, mask, top, _mm512_loadu_ps(scores + pos));
        }
        alignas(64) float lanes[kLanes];
        _mm512_store_ps(lanes, top);
        float max = lanes[0];
        for (const float lane : lanes) max = std::max(max, lane);
        __m512 total = _mm512_setzero_ps();
        for (std::size_t pos = 0; pos < len; pos += kLanes) {
          const std::size_t left = len - pos;
          const __mmask16 mask = left >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1U << left) - 1);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + pos), _mm512_set1_ps(max)));
          _mm512_mask_storeu_ps(scores + pos, mask, e);
          total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
        }
        sums[c] = sum16(total);
      }
      // Weighted values, accumulated in registers.
      __m512 acc[kChunk][kVectors];
      for (std::size_t c = 0; c < kChunk; ++c) {
        for (std::size_t v = 0; v < kVectors; ++v) acc[c][v] = _mm512_setzero_ps();
      }
      const float* scores = w.scores.data() + first * stride;
      const auto weigh = [&](std::size_t pos, std::size_t offset) __attribute__((target("avx512f"))) {
        const T* vrow = job.v_cache + offset;
        __m512 vvec[kVectors];
        for (std::size_t v = 0; v < kVectors; ++v) vvec[v] = load16(vrow + v * kLanes);
        for (std::size_t c = 0; c < kChunk; ++c) {
          if (c >= count) break;
          const __m512 p = _mm512_set1_ps(scores[c * stride + pos]);
          for (std::size_t v = 0; v < kVectors; ++v) acc[c][v] = _mm512_fmadd_ps(p, vvec[v], acc[c][v]);
        }
      };
      const auto weigh_and_feed = [&](std::size_t pos, std::size_t offset) {
        feeder.feed(per_position);
        weigh(pos, offset);
      };
      if (kv == 0 && h0 == 0 && !fed) {
        for_each_position<true>(job, seq, len, kv, job.v_cache, weigh_and_feed);
      } else {
        for_each_position<false>(job, seq, len, kv, job.v_cache, weigh_and_feed);
      }
      for (std::size_t c = 0; c < count; ++c) {
        const __m512 inv = _mm512_set1_ps(1.0F / sums[c]);
        for (std::size_t v = 0; v < kVectors; ++v) {
          store16(out + (first + c) * kHd + v * kLanes, _mm512_mul_ps(acc[c][v], inv));
        }
      }
    }
  }
}

constexpr const char* kOp = "paged_decode_attention";

void check(bool ok, const std::string& what) { require(ok, kOp, what); }

}  // namespace

namespace {

// The lengths and block ids of the sequences in `index` (what every kernel here reads through the block tables).
void check_sequences(const char* op, const PagedDecodeShape& s, const PagedDecodeIndex& index) {
  require(s.block_size > 0, op, "block_size must be positive");
  require_size(op, "block_tables", index.block_tables.size(), s.num_seqs * s.table_stride);
  require_size(op, "seq_lens", index.seq_lens.size(), s.num_seqs);
  require_size(op, "cu_seqlens_q", index.cu_seqlens_q.size(), s.num_seqs + 1);
  for (const int32_t seq : index.seq_ids) {
    require(seq >= 0 && static_cast<std::size_t>(seq) < s.num_seqs, op,
            "sequence id " + std::to_string(seq) + " out of range");
    const auto i = static_cast<std::size_t>(seq);
    const int32_t len = index.seq_lens[i];
    require(len >= 1 && static_cast<std::size_t>(len) <= s.table_stride * s.block_size, op,
            "sequence length " + std::to_string(len) + " does not fit its block table");
    const std::size_t blocks = (static_cast<std::size_t>(len) + s.block_size - 1) / s.block_size;
    for (std::size_t b = 0; b < blocks; ++b) {
      const int32_t block = index.block_tables[i * s.table_stride + b];
      require(block >= 0 && static_cast<std::size_t>(block) < s.num_blocks, op,
              "block id " + std::to_string(block) + " out of range");
    }
  }
}

}  // namespace

void check_paged_decode_index(const PagedDecodeShape& s, const PagedDecodeIndex& index) {
  check_sequences(kOp, s, index);
  for (const int32_t seq : index.seq_ids) {
    const int32_t row = index.cu_seqlens_q[static_cast<std::size_t>(seq)];
    check(row >= 0 && static_cast<std::size_t>(row) < s.num_q_rows, "query row out of range");
  }
}

void check_paged_chunk_index(const PagedDecodeShape& s, const PagedDecodeIndex& index) {
  constexpr const char* op = "paged_chunk_attention";
  check_sequences(op, s, index);
  for (const int32_t seq : index.seq_ids) {
    const auto i = static_cast<std::size_t>(seq);
    const int32_t begin = index.cu_seqlens_q[i], end = index.cu_seqlens_q[i + 1];
    require(begin >= 0 && end > begin && static_cast<std::size_t>(end) <= s.num_q_rows, op,
            "query rows of sequence " + std::to_string(seq) + " out of range");
    require(end - begin <= index.seq_lens[i], op,
            "sequence " + std::to_string(seq) + " has more query rows than positions");
  }
}

// Everything a call will read is checked before anything is computed, so a bad table never reads out of bounds.
void check_paged_attention_sizes(const char* op, const PagedDecodeShape& s, std::size_t q_size, std::size_t k_size,
                                 std::size_t v_size, std::size_t out_size) {
  require(s.num_heads > 0 && s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, op,
          "num_heads must be a positive multiple of num_kv_heads");
  require(s.head_dim > 0 && s.block_size > 0, op, "head_dim and block_size must be positive");
  require(s.q_row_stride >= s.num_heads * s.head_dim, op, "q_row_stride is shorter than a row");
  require_size(op, "q", q_size, s.num_q_rows == 0 ? 0 : (s.num_q_rows - 1) * s.q_row_stride + s.num_heads * s.head_dim);
  require_size(op, "out", out_size, s.num_q_rows * s.num_heads * s.head_dim);
  require_size(op, "k_cache", k_size, s.num_blocks * s.block_size * s.num_kv_heads * s.head_dim);
  require_size(op, "v_cache", v_size, s.num_blocks * s.block_size * s.num_kv_heads * s.head_dim);
}

namespace {

template <class T>
void run(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const T> q,
         std::span<const T> k_cache, std::span<const T> v_cache, std::span<T> out, float scale,
         int threads) {
  check_paged_attention_sizes(kOp, shape, q.size(), k_cache.size(), v_cache.size(), out.size());
  check_paged_decode_index(shape, index);
  const Job<T> job{shape, index, q.data(), k_cache.data(), v_cache.data(), out.data(), scale};
  const bool vector = has_avx512f() && shape.head_dim % kLanes == 0;
  const bool vector8 = !vector && has_avx2_fma() && shape.head_dim % 8 == 0;
  const std::size_t items = index.seq_ids.size();
  // `fed`: the previous sequence's feeder already brought this one's rows in; `next`: the sequence to feed.
  auto attend = [&](std::size_t item, bool fed, std::ptrdiff_t next) {
    const auto seq = static_cast<std::size_t>(index.seq_ids[item]);
    if (vector && shape.head_dim == 64) {
      attend_avx512_fixed<T, 4>(job, seq, next, fed);
    } else if (vector && shape.head_dim == 128) {
      attend_avx512_fixed<T, 8>(job, seq, next, fed);
    } else if (vector) {
      attend_avx512(job, seq);
    } else if (vector8) {
      attend_avx2(job, seq);
    } else {
      for (std::size_t kv_head = 0; kv_head < shape.num_kv_heads; ++kv_head) attend_scalar(job, seq, kv_head);
    }
  };
  std::size_t work = 0;
  for (const int32_t seq : index.seq_ids) work += static_cast<std::size_t>(index.seq_lens[seq]);
  const bool split = threads >= 2 && work * shape.num_heads >= kParallelWork;
  const std::size_t parts = split ? std::min(static_cast<std::size_t>(threads), items) : 1;
  // Each part is one contiguous run of sequences with about the same number of context positions, walked in order,
  // so each sequence feeds the next one of the same thread.
  thread_local std::vector<std::size_t> bounds;
  bounds.assign(parts + 1, items);
  bounds[0] = 0;
  for (std::size_t item = 0, part = 1, seen = 0; item < items && part < parts; ++item) {
    seen += static_cast<std::size_t>(index.seq_lens[index.seq_ids[item]]);
    while (part < parts && seen * parts >= work * part) bounds[part++] = item + 1;
  }
  const std::size_t* const cut = bounds.data();  // the caller's: in the parallel region `bounds` is each thread's own
  for_each_item(parts, threads, split, [&](std::size_t part) {
    const std::size_t begin = cut[part], end = cut[part + 1];
    for (std::size_t item = begin; item < end; ++item) {
      attend(item, item != begin, item + 1 < end ? index.seq_ids[item + 1] : -1);
    }
  });
}

}  // namespace

void paged_decode_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                std::span<const float> q, std::span<const float> k_cache,
                                std::span<const float> v_cache, std::span<float> out, float scale, int threads) {
  run(shape, index, q, k_cache, v_cache, out, scale, threads);
}

void paged_decode_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                 std::span<const bf16_bits> q, std::span<const bf16_bits> k_cache,
                                 std::span<const bf16_bits> v_cache, std::span<bf16_bits> out, float scale,
                                 int threads) {
  run(shape, index, q, k_cache, v_cache, out, scale, threads);
}

namespace {

// The step's sequences split by query rows (one: decode; more: chunk), each list checked; the lists are the calling
// thread's own, valid until its next call.
std::pair<PagedDecodeIndex, PagedDecodeIndex> split_step(const PagedDecodeShape& shape, const PagedDecodeIndex& index) {
  constexpr const char* op = "paged_attention";
  require_size(op, "cu_seqlens_q", index.cu_seqlens_q.size(), shape.num_seqs + 1);
  thread_local std::vector<int32_t> decodes, chunks;
  decodes.clear();
  chunks.clear();
  for (const int32_t seq : index.seq_ids) {
    require(seq >= 0 && static_cast<std::size_t>(seq) < shape.num_seqs, op,
            "sequence id " + std::to_string(seq) + " out of range");
    const auto i = static_cast<std::size_t>(seq);
    (index.cu_seqlens_q[i + 1] - index.cu_seqlens_q[i] == 1 ? decodes : chunks).push_back(seq);
  }
  const PagedDecodeIndex decode_index{index.block_tables, index.seq_lens, index.cu_seqlens_q, decodes};
  const PagedDecodeIndex chunk_index{index.block_tables, index.seq_lens, index.cu_seqlens_q, chunks};
  check_paged_decode_index(shape, decode_index);
  check_paged_chunk_index(shape, chunk_index);
  return {decode_index, chunk_index};
}

template <class T, class Decode, class Chunk>
void attend_step(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const T> q,
                 std::span<const T> k_cache, std::span<const T> v_cache, std::span<T> out, float scale, int threads,
                 Decode&& decode, Chunk&& chunk) {
  check_paged_attention_sizes("paged_attention", shape, q.size(), k_cache.size(), v_cache.size(), out.size());
  const auto [decodes, chunks] = split_step(shape, index);
  if (!decodes.seq_ids.empty()) decode(shape, decodes, q, k_cache, v_cache, out, scale, threads);
  if (!chunks.seq_ids.empty()) chunk(shape, chunks, q, k_cache, v_cache, out, scale, threads);
}

}  // namespace

void check_paged_step_index(const PagedDecodeShape& shape, const PagedDecodeIndex& index) { split_step(shape, index); }

void paged_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const float> q,
                         std::span<const float> k_cache, std::span<const float> v_cache, std::span<float> out,
                         float scale, int threads) {
  attend_step(shape, index, q, k_cache, v_cache, out, scale, threads, paged_decode_attention_f32,
              paged_chunk_attention_f32);
}

void paged_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const bf16_bits> q,
                          std::span<const bf16_bits> k_cache, std::span<const bf16_bits> v_cache,
                          std::span<bf16_bits> out, float scale, int threads) {
  attend_step(shape, index, q, k_cache, v_cache, out, scale, threads, paged_decode_attention_bf16,
              paged_chunk_attention_bf16);
}

}  // namespace ringserve::kernels
