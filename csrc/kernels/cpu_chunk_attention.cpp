// Causal attention of prefill chunks over the paged KV cache (see cpu_attention.h), flash-attention style: each work
// item is one sequence's KV head, a tile of its query rows and a range of context positions. It walks the range 64
// positions at a time; their keys are transposed (and widened to float32) once for every query vector of the tile (a
// query row times a query head of the KV head's group), so a score tile is plain FMAs with no horizontal sums, and
// the softmax is kept online (running max and sum per query vector), so the context is read once per item, not once
// per row. Deep contexts are split into ranges of kKeyRange positions whose partial results (unnormalized sums, max,
// denominator) are merged afterwards (flash-decoding), so two threads share even a single tile's work.
#include "kernels/cpu_attention.h"

#include "kernels/parallel.h"
#include "kernels/simd_avx2.h"
#include "kernels/simd_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace ringserve::kernels {

namespace {

constexpr std::size_t kLanes = 16;
// Query vectors one item keeps (their scaled queries and running outputs: 24 KB each at head_dim 64), and the fewest
// it takes when the rows are split for threads, so that a key tile's transpose is shared by enough of them.
constexpr std::size_t kMaxItemVectors = 96;
constexpr std::size_t kMinItemVectors = 16;
// Query vectors scored together (kScoreTile x kSub independent FMA chains over head_dim); the buffers are padded by
// this many.
constexpr std::size_t kScoreTile = 4;
// Context positions per key tile (both vector paths): four registers of 16, so a tile's online-softmax bookkeeping (maxima,
// sums, rescaling the running outputs) is shared by 64 positions, and each broadcast query value feeds four FMAs.
// Measured against 16- and 32-position tiles: 1.3x and ~1.05x faster deep into a context, ~10 us slower on tiny
// prompts (masked lanes).
constexpr std::size_t kSub = 4;
constexpr std::size_t kTile = kSub * kLanes;
// Below this many query-key products (over all heads) a call stays on the calling thread.
constexpr std::size_t kParallelWork = 8192;
// Context positions one work item covers at most (both vector paths). The ranges start at fixed multiples of this, so a
// row's result depends on its own length only, not on how the rows or the threads divide the work.
constexpr std::size_t kKeyRange = 512;
// Partial results kept allocated between calls (per calling thread). They take (head_dim + 2) floats per query vector
// per 512-position range it is split into: with SmolLM2's heads a 512-row chunk at depth 2,048 needs 4.6 MiB, a fresh
// 2,048-token prompt 10.4 MiB, 2,048 rows at depth 4,096 30 MiB. A buffer over this size is freed after its call
// instead of being held for the life of the thread.
constexpr std::size_t kKeptPartialBytes = std::size_t{16} << 20;
static_assert(kKeyRange % kTile == 0, "key ranges are whole tiles, so tiles sit at fixed positions");

std::size_t job_query_len(const PagedDecodeIndex& index, std::size_t seq) {
  return static_cast<std::size_t>(index.cu_seqlens_q[seq + 1] - index.cu_seqlens_q[seq]);
}

struct Item {
  std::size_t seq;
  std::size_t kv_head;
  std::size_t row_begin;  // query rows [row_begin, row_end) of the chunk
  std::size_t row_end;
  std::size_t key_begin;  // context positions [key_begin, key_end) (clipped to what the rows see)
  std::size_t key_end;
  std::ptrdiff_t partial;  // -1: the item covers all its rows see and writes `out`; else its slot of partial results
};

// A tile whose context was split: its items' partial results are slots [first, first + parts).
struct Merge {
  std::size_t seq;
  std::size_t kv_head;
  std::size_t row_begin;
  std::size_t row_end;
  std::size_t first;
  std::size_t parts;
};

template <class T>
struct Job {
  const PagedDecodeShape& shape;
  const PagedDecodeIndex& index;
  const T* q;
  const T* k_cache;
  const T* v_cache;
  T* out;
  float scale;
  // Partial results, slot_values apart: per query vector its unnormalized output [vectors, head_dim], then the
  // vectors' score maxima, then their softmax denominators (vectors = slot_vectors, the most an item has).
  float* partials;
  std::size_t slot_vectors;

  std::size_t slot_values() const { return slot_vectors * (shape.head_dim + 2); }
  std::size_t first_row(std::size_t seq) const { return static_cast<std::size_t>(index.cu_seqlens_q[seq]); }
  std::size_t query_len(std::size_t seq) const { return job_query_len(index, seq); }
  std::size_t context_len(std::size_t seq) const { return static_cast<std::size_t>(index.seq_lens[seq]); }
  // Where position `pos` of sequence `seq` keeps KV head `kv_head` in either cache.
  std::size_t offset(std::size_t seq, std::size_t pos, std::size_t kv_head) const {
    const auto block = static_cast<std::size_t>(index.block_tables[seq * shape.table_stride + pos / shape.block_size]);
    return ((block * shape.block_size + pos % shape.block_size) * shape.num_kv_heads + kv_head) * shape.head_dim;
  }
};

// Per-thread working memory, grown on demand and kept: steady-state calls allocate nothing.
struct Scratch {
  std::vector<float> query;   // [vectors + pad, head_dim]: scaled queries
  std::vector<float> output;  // [vectors + pad, head_dim]: running weighted sums of values
  std::vector<float> max;     // [vectors]: running score maxima
  std::vector<float> sum;     // [vectors]: running softmax denominators
  std::vector<float> rescale;  // [vectors + pad]: this tile's correction of the running sums
  std::vector<float> probs;   // [vectors + pad, kTile]: this tile's softmax numerators
  std::vector<float> keys;    // [head_dim, kTile]: the tile's keys, transposed
  std::vector<float> values;  // [kTile, head_dim]: the tile's values
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The calling thread's scratch, sized and cleared for an item of `vectors` query vectors (vector paths; the buffers
// are padded by kScoreTile vectors, which compute on zeros).
Scratch& start_item(std::size_t vectors, std::size_t hd) {
  const std::size_t padded = vectors + kScoreTile;
  Scratch& w = scratch();
  w.query.assign(padded * hd, 0.0F);
  w.output.assign(padded * hd, 0.0F);
  w.max.assign(vectors, -std::numeric_limits<float>::infinity());
  w.sum.assign(vectors, 0.0F);
  w.rescale.assign(padded, 0.0F);
  w.probs.assign(padded * kTile, 0.0F);
  w.keys.resize(hd * kTile);
  w.values.resize(kTile * hd);
  return w;
}

// An item of a split tile leaves its unnormalized sums, maxima and denominators in its slot for the merge (rows that
// saw none of the range keep max -inf, sum 0: the merge weighs them 0). False for an item that writes `out` itself.
template <class T>
bool kept_partial(const Job<T>& job, const Item& item, const Scratch& w, std::size_t vectors) {
  if (item.partial < 0) return false;
  const std::size_t hd = job.shape.head_dim;
  float* slot = job.partials + static_cast<std::size_t>(item.partial) * job.slot_values();
  std::copy_n(w.output.data(), vectors * hd, slot);
  std::copy_n(w.max.data(), vectors, slot + job.slot_vectors * hd);
  std::copy_n(w.sum.data(), vectors, slot + job.slot_vectors * (hd + 1));
  return true;
}

// Portable path: any head_dim, any x86-64 CPU. Two passes per query vector (scores, then weighted values).
template <class T>
void chunk_scalar(const Job<T>& job, const Item& item) {
  const auto& s = job.shape;
  const std::size_t group = s.num_heads / s.num_kv_heads, hd = s.head_dim;
  const std::size_t context = job.context_len(item.seq) - job.query_len(item.seq);
  Scratch& w = scratch();
  w.probs.resize(context + item.row_end);
  w.output.resize(hd);
  for (std::size_t r = item.row_begin; r < item.row_end; ++r) {
    const std::size_t row = job.first_row(item.seq) + r, visible = context + r + 1;
    for (std::size_t g = 0; g < group; ++g) {
      const std::size_t head = item.kv_head * group + g;
      const T* q = job.q + row * s.q_row_stride + head * hd;
      float max = -std::numeric_limits<float>::infinity();
      for (std::size_t pos = 0; pos < visible; ++pos) {
        const T* k = job.k_cache + job.offset(item.seq, pos, item.kv_head);
        float dot = 0.0F;
        for (std::size_t d = 0; d < hd; ++d) dot += load_scalar(q[d]) * load_scalar(k[d]);
        w.probs[pos] = dot * job.scale;
        max = std::max(max, w.probs[pos]);
      }
      float sum = 0.0F;
      for (std::size_t pos = 0; pos < visible; ++pos) sum += (w.probs[pos] = std::exp(w.probs[pos] - max));
      std::fill(w.output.begin(), w.output.end(), 0.0F);
      for (std::size_t pos = 0; pos < visible; ++pos) {
        const T* v = job.v_cache + job.offset(item.seq, pos, item.kv_head);
        for (std::size_t d = 0; d < hd; ++d) w.output[d] += w.probs[pos] * load_scalar(v[d]);
      }
      T* out = job.out + (row * s.num_heads + head) * hd;
      for (std::size_t d = 0; d < hd; ++d) store_scalar(out + d, w.output[d] / sum);
    }
  }
}

// AVX-512 path for head_dim = 16 * kVectors (64 or 128: every llama-family model). Query vector v of the item is
// row v / group of its tile, head v % group of the KV head's group: rows in order, so the rows that see none of a key
// tile (the causal mask) are a prefix, skipped.
template <class T, std::size_t kVectors>
__attribute__((target("avx512f"))) void chunk_avx512(const Job<T>& job, const Item& item) {
  constexpr std::size_t kHd = kLanes * kVectors;
  constexpr std::size_t kWeighTile = 16 / kVectors;  // query vectors whose outputs stay in registers over a tile
  const auto& s = job.shape;
  const std::size_t group = s.num_heads / s.num_kv_heads;
  const std::size_t rows = item.row_end - item.row_begin, vectors = rows * group;
  // Row r of the tile is at position first_pos + r and sees positions [0, first_pos + r].
  const std::size_t first_pos = job.context_len(item.seq) - job.query_len(item.seq) + item.row_begin;
  const std::size_t end = std::min(first_pos + rows, item.key_end);
  Scratch& w = start_item(vectors, kHd);
  const std::size_t first_row = job.first_row(item.seq) + item.row_begin;
  const __m512 scale = _mm512_set1_ps(job.scale);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* q = job.q + (first_row + r) * s.q_row_stride + item.kv_head * group * kHd;
    float* dst = w.query.data() + r * group * kHd;
    for (std::size_t i = 0; i < group * kHd; i += kLanes) _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16(q + i), scale));
  }
  for (std::size_t tile = item.key_begin; tile < end; tile += kTile) {
    const std::size_t n = std::min(kTile, end - tile);
    std::size_t offsets[kTile];
    for (std::size_t j = 0; j < n; ++j) offsets[j] = job.offset(item.seq, tile + j, item.kv_head);
    for (std::size_t u = 0; u < kSub; ++u) {
      for (std::size_t v = 0; v < kVectors; ++v) {
        __m512i r[kLanes];
        for (std::size_t j = 0; j < kLanes; ++j) {
          const std::size_t at = u * kLanes + j;
          r[j] = at < n ? _mm512_castps_si512(load16(job.k_cache + offsets[at] + v * kLanes)) : _mm512_setzero_si512();
        }
        transpose16x16(r);  // r[d]: dimension v * 16 + d of the 16 positions
        for (std::size_t d = 0; d < kLanes; ++d) {
          _mm512_storeu_si512(w.keys.data() + (v * kLanes + d) * kTile + u * kLanes, r[d]);
        }
      }
    }
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t v = 0; v < kVectors; ++v) {
        _mm512_storeu_ps(w.values.data() + j * kHd + v * kLanes, load16(job.v_cache + offsets[j] + v * kLanes));
      }
    }
    const std::size_t first = (tile > first_pos ? tile - first_pos : 0) * group;  // the first vector seeing the tile
    // Scores and the online softmax, kScoreTile query vectors at a time (the padding computes on zeros, unread).
    for (std::size_t i = first; i < vectors; i += kScoreTile) {
      __m512 acc[kScoreTile][kSub];
      for (auto& a : acc) {
        for (auto& b : a) b = _mm512_setzero_ps();
      }
      const float* q = w.query.data() + i * kHd;
      for (std::size_t d = 0; d < kHd; ++d) {
        __m512 k[kSub];
        for (std::size_t u = 0; u < kSub; ++u) k[u] = _mm512_loadu_ps(w.keys.data() + d * kTile + u * kLanes);
        for (std::size_t c = 0; c < kScoreTile; ++c) {
          const __m512 qd = _mm512_set1_ps(q[c * kHd + d]);
          for (std::size_t u = 0; u < kSub; ++u) acc[c][u] = _mm512_fmadd_ps(qd, k[u], acc[c][u]);
        }
      }
      const std::size_t count = std::min(kScoreTile, vectors - i);
      alignas(64) float old_max[kLanes] = {};
      alignas(64) float new_max[kLanes] = {};
      float tile_sum[kScoreTile];
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (std::size_t c = 0; c < count; ++c) {
        const std::size_t vec = i + c;
        const std::size_t visible = std::min(n, first_pos + vec / group + 1 - tile);  // at least 1 from `first` on
        __mmask16 mask[kSub];
        __m512 top = minus_inf;
        for (std::size_t u = 0; u < kSub; ++u) {
          const std::size_t lanes = visible > u * kLanes ? std::min(kLanes, visible - u * kLanes) : 0;
          mask[u] = static_cast<__mmask16>(lanes >= kLanes ? 0xffffU : (1U << lanes) - 1U);
          top = _mm512_mask_max_ps(top, mask[u], top, acc[c][u]);
        }
        old_max[c] = w.max[vec];
        new_max[c] = std::max(old_max[c], max16(top));
        w.max[vec] = new_max[c];
        const __m512 shift = _mm512_set1_ps(new_max[c]);
        __m512 total = _mm512_setzero_ps();
        for (std::size_t u = 0; u < kSub; ++u) {
          const __m512 p = _mm512_maskz_mov_ps(mask[u], exp16(_mm512_sub_ps(acc[c][u], shift)));
          _mm512_storeu_ps(w.probs.data() + vec * kTile + u * kLanes, p);
          total = _mm512_add_ps(total, p);
        }
        tile_sum[c] = sum16(total);
      }
      // e^(old max - new max) for the vectors at once; a first tile's -inf old max gives ~0 times a zero sum.
      alignas(64) float factor[kLanes];
      _mm512_store_ps(factor, exp16(_mm512_sub_ps(_mm512_load_ps(old_max), _mm512_load_ps(new_max))));
      for (std::size_t c = 0; c < count; ++c) {
        w.sum[i + c] = w.sum[i + c] * factor[c] + tile_sum[c];
        w.rescale[i + c] = factor[c];
      }
    }
    // Weighted values: rescale the running outputs, add this tile's (kWeighTile vectors in registers at a time).
    for (std::size_t i = first; i < vectors; i += kWeighTile) {
      __m512 acc[kWeighTile][kVectors];
      float* out = w.output.data() + i * kHd;
      for (std::size_t c = 0; c < kWeighTile; ++c) {
        const __m512 f = _mm512_set1_ps(w.rescale[i + c]);
        for (std::size_t v = 0; v < kVectors; ++v) acc[c][v] = _mm512_mul_ps(_mm512_loadu_ps(out + c * kHd + v * kLanes), f);
      }
      const float* probs = w.probs.data() + i * kTile;
      for (std::size_t j = 0; j < n; ++j) {
        __m512 val[kVectors];
        for (std::size_t v = 0; v < kVectors; ++v) val[v] = _mm512_loadu_ps(w.values.data() + j * kHd + v * kLanes);
        for (std::size_t c = 0; c < kWeighTile; ++c) {
          const __m512 p = _mm512_set1_ps(probs[c * kTile + j]);
          for (std::size_t v = 0; v < kVectors; ++v) acc[c][v] = _mm512_fmadd_ps(p, val[v], acc[c][v]);
        }
      }
      for (std::size_t c = 0; c < kWeighTile; ++c) {
        for (std::size_t v = 0; v < kVectors; ++v) _mm512_storeu_ps(out + c * kHd + v * kLanes, acc[c][v]);
      }
    }
  }
  if (kept_partial(job, item, w, vectors)) return;
  for (std::size_t vec = 0; vec < vectors; ++vec) {
    const std::size_t row = first_row + vec / group, head = item.kv_head * group + vec % group;
    const __m512 inv = _mm512_set1_ps(1.0F / w.sum[vec]);
    T* out = job.out + (row * s.num_heads + head) * kHd;
    for (std::size_t v = 0; v < kVectors; ++v) {
      store16(out + v * kLanes, _mm512_mul_ps(_mm512_loadu_ps(w.output.data() + vec * kHd + v * kLanes), inv));
    }
  }
}

// AVX2 + FMA path for the same head sizes (CPUs without AVX-512): the same items, 64-position key tiles and online
// softmax on 8 lanes. Each phase takes two query vectors at a time over 32 positions or 32 dimensions (8
// accumulators of the 16 registers): raw scores go to `probs`, then each vector's softmax rewrites its row there, then
// the weighted values. The tile's keys are transposed by plain stores, once for every query vector of the item.
template <class T, std::size_t kHd>
__attribute__((target("avx2,fma"))) void chunk_avx2(const Job<T>& job, const Item& item) {
  constexpr std::size_t kL = 8;      // float32 lanes
  constexpr std::size_t kSlab = 32;  // positions scored, or dimensions weighed, per pass: 4 registers
  constexpr std::size_t kRegs = kSlab / kL;
  static_assert(kTile % kSlab == 0 && kHd % kSlab == 0 && kScoreTile >= 2, "two vectors over whole slabs");
  const auto& s = job.shape;
  const std::size_t group = s.num_heads / s.num_kv_heads;
  const std::size_t rows = item.row_end - item.row_begin, vectors = rows * group;
  const std::size_t first_pos = job.context_len(item.seq) - job.query_len(item.seq) + item.row_begin;
  const std::size_t end = std::min(first_pos + rows, item.key_end);
  Scratch& w = start_item(vectors, kHd);
  float* const query = w.query.data();
  float* const output = w.output.data();
  float* const probs = w.probs.data();
  float* const keys = w.keys.data();
  float* const values = w.values.data();
  const std::size_t first_row = job.first_row(item.seq) + item.row_begin;
  const __m256 scale = _mm256_set1_ps(job.scale);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* q = job.q + (first_row + r) * s.q_row_stride + item.kv_head * group * kHd;
    for (std::size_t i = 0; i < group * kHd; i += kL) {
      _mm256_storeu_ps(query + r * group * kHd + i, _mm256_mul_ps(load8(q + i), scale));
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (std::size_t tile = item.key_begin; tile < end; tile += kTile) {
    const std::size_t n = std::min(kTile, end - tile);
    for (std::size_t j = 0; j < kTile; ++j) {
      if (j >= n) {
        for (std::size_t d = 0; d < kHd; ++d) keys[d * kTile + j] = 0.0F;
        continue;
      }
      const std::size_t at = job.offset(item.seq, tile + j, item.kv_head);
      for (std::size_t d = 0; d < kHd; ++d) keys[d * kTile + j] = load_scalar(job.k_cache[at + d]);
      for (std::size_t d = 0; d < kHd; d += kL) _mm256_storeu_ps(values + j * kHd + d, load8(job.v_cache + at + d));
    }
    const std::size_t first = (tile > first_pos ? tile - first_pos : 0) * group;  // the first vector seeing the tile
    // Raw scores, two vectors at a time (a padding vector's zero query scores zeros, never read).
    for (std::size_t i = first; i < vectors; i += 2) {
      const float* q0 = query + i * kHd;
      const float* q1 = q0 + kHd;
      for (std::size_t slab = 0; slab < kTile; slab += kSlab) {
        __m256 a0[kRegs], a1[kRegs];
        for (std::size_t u = 0; u < kRegs; ++u) a0[u] = a1[u] = _mm256_setzero_ps();
        for (std::size_t d = 0; d < kHd; ++d) {
          const __m256 b0 = _mm256_set1_ps(q0[d]), b1 = _mm256_set1_ps(q1[d]);
          for (std::size_t u = 0; u < kRegs; ++u) {
            const __m256 k = _mm256_loadu_ps(keys + d * kTile + slab + u * kL);
            a0[u] = _mm256_fmadd_ps(b0, k, a0[u]);
            a1[u] = _mm256_fmadd_ps(b1, k, a1[u]);
          }
        }
        for (std::size_t u = 0; u < kRegs; ++u) {
          _mm256_storeu_ps(probs + i * kTile + slab + u * kL, a0[u]);
          _mm256_storeu_ps(probs + (i + 1) * kTile + slab + u * kL, a1[u]);
        }
      }
    }
    // Each vector's online softmax over the positions it sees (at least one from `first` on).
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (std::size_t vec = first; vec < vectors; ++vec) {
      const auto visible = static_cast<int>(std::min(n, first_pos + vec / group + 1 - tile));
      float* p = probs + vec * kTile;
      __m256 top = minus_inf;
      for (std::size_t u = 0; u < kTile; u += kL) {
        const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(u)));
        const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(visible), index));
        top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(p + u), seen));
      }
      __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      half = _mm_max_ps(half, _mm_movehl_ps(half, half));
      half = _mm_max_ss(half, _mm_movehdup_ps(half));
      const float old_max = w.max[vec];
      const float new_max = std::max(old_max, _mm_cvtss_f32(half));
      w.max[vec] = new_max;
      const __m256 shift = _mm256_set1_ps(new_max);
      __m256 total = _mm256_setzero_ps();
      for (std::size_t u = 0; u < kTile; u += kL) {
        const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(u)));
        const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(visible), index));
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(p + u), shift)), seen);
        _mm256_storeu_ps(p + u, e);
        total = _mm256_add_ps(total, e);
      }
      const float factor = std::exp(old_max - new_max);  // a first tile's -inf old max gives 0 times a zero sum
      w.sum[vec] = w.sum[vec] * factor + sum8(total);
      w.rescale[vec] = factor;
    }
    // Weighted values: rescale the running outputs, add this tile's; two vectors, 32 dimensions at a time.
    for (std::size_t i = first; i < vectors; i += 2) {
      const __m256 f0 = _mm256_set1_ps(w.rescale[i]), f1 = _mm256_set1_ps(w.rescale[i + 1]);
      const float* p0 = probs + i * kTile;
      const float* p1 = p0 + kTile;
      for (std::size_t slab = 0; slab < kHd; slab += kSlab) {
        float* out0 = output + i * kHd + slab;
        float* out1 = out0 + kHd;
        __m256 a0[kRegs], a1[kRegs];
        for (std::size_t v = 0; v < kRegs; ++v) {
          a0[v] = _mm256_mul_ps(_mm256_loadu_ps(out0 + v * kL), f0);
          a1[v] = _mm256_mul_ps(_mm256_loadu_ps(out1 + v * kL), f1);
        }
        for (std::size_t j = 0; j < n; ++j) {
          const __m256 b0 = _mm256_set1_ps(p0[j]), b1 = _mm256_set1_ps(p1[j]);
          for (std::size_t v = 0; v < kRegs; ++v) {
            const __m256 val = _mm256_loadu_ps(values + j * kHd + slab + v * kL);
            a0[v] = _mm256_fmadd_ps(b0, val, a0[v]);
            a1[v] = _mm256_fmadd_ps(b1, val, a1[v]);
          }
        }
        for (std::size_t v = 0; v < kRegs; ++v) {
          _mm256_storeu_ps(out0 + v * kL, a0[v]);
          _mm256_storeu_ps(out1 + v * kL, a1[v]);
        }
      }
    }
  }
  if (kept_partial(job, item, w, vectors)) return;
  for (std::size_t vec = 0; vec < vectors; ++vec) {
    const std::size_t row = first_row + vec / group, head = item.kv_head * group + vec % group;
    const __m256 inv = _mm256_set1_ps(1.0F / w.sum[vec]);
    T* out = job.out + (row * s.num_heads + head) * kHd;
    for (std::size_t d = 0; d < kHd; d += kL) store8(out + d, _mm256_mul_ps(_mm256_loadu_ps(output + vec * kHd + d), inv));
  }
}

// Combines a split tile's partial results: each range's sums weighed by e^(its max - the overall max), divided by the
// weighed denominators, rounded once (a row that only one range saw gets exactly the unsplit result).
template <class T>
void merge(const Job<T>& job, const Merge& m) {
  const auto& s = job.shape;
  const std::size_t group = s.num_heads / s.num_kv_heads, hd = s.head_dim;
  const std::size_t vectors = (m.row_end - m.row_begin) * group;
  const float* first = job.partials + m.first * job.slot_values();
  thread_local std::vector<float> weights, acc;
  weights.resize(m.parts);
  acc.resize(hd);
  for (std::size_t vec = 0; vec < vectors; ++vec) {
    float top = -std::numeric_limits<float>::infinity();
    for (std::size_t p = 0; p < m.parts; ++p) {
      top = std::max(top, first[p * job.slot_values() + job.slot_vectors * hd + vec]);
    }
    float sum = 0.0F;
    for (std::size_t p = 0; p < m.parts; ++p) {
      const float* slot = first + p * job.slot_values();
      weights[p] = std::exp(slot[job.slot_vectors * hd + vec] - top);  // e^-inf = 0: a range the row did not see
      sum += slot[job.slot_vectors * (hd + 1) + vec] * weights[p];
    }
    std::fill(acc.begin(), acc.end(), 0.0F);
    for (std::size_t p = 0; p < m.parts; ++p) {
      const float* out = first + p * job.slot_values() + vec * hd;
      for (std::size_t d = 0; d < hd; ++d) acc[d] += out[d] * weights[p];
    }
    const float inv = 1.0F / sum;
    const std::size_t row = job.first_row(m.seq) + m.row_begin + vec / group;
    T* out = job.out + (row * s.num_heads + m.kv_head * group + vec % group) * hd;
    for (std::size_t d = 0; d < hd; ++d) store_scalar(out + d, acc[d] * inv);
  }
}

template <class T>
void run(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const T> q,
         std::span<const T> k_cache, std::span<const T> v_cache, std::span<T> out, float scale, int threads) {
  check_paged_attention_sizes("paged_chunk_attention", shape, q.size(), k_cache.size(), v_cache.size(), out.size());
  check_paged_chunk_index(shape, index);
  const std::size_t group = shape.num_heads / shape.num_kv_heads;
  std::size_t rows = 0, work = 0;
  for (const int32_t seq : index.seq_ids) {
    const std::size_t q_len = job_query_len(index, static_cast<std::size_t>(seq));
    rows += q_len;
    work += q_len * static_cast<std::size_t>(index.seq_lens[static_cast<std::size_t>(seq)]);
  }
  if (rows == 0) return;
  const bool split = threads >= 2 && work * shape.num_heads >= kParallelWork;
  // Rows per item: at most kMaxItemVectors query vectors; with threads, small enough for about four items per thread
  // (items differ in cost: a fresh prompt's later rows see more), but no fewer than kMinItemVectors vectors.
  const std::size_t most = std::max<std::size_t>(1, kMaxItemVectors / group);
  const std::size_t fewest = std::max<std::size_t>(1, (kMinItemVectors + group - 1) / group);
  std::size_t per_item = most;
  if (split) {
    const std::size_t wanted = 4 * static_cast<std::size_t>(threads);
    per_item = std::clamp((rows * shape.num_kv_heads + wanted - 1) / wanted, std::min(fewest, most), most);
  }
  const bool vector = paged_chunk_attention_is_vectorized(shape.head_dim);
  const bool wide = has_avx512f();  // else the AVX2 path
  thread_local std::vector<Item> items;
  thread_local std::vector<Merge> merges;
  thread_local std::vector<float> partials;
  items.clear();
  merges.clear();
  std::size_t slots = 0;
  for (const int32_t seq : index.seq_ids) {
    const auto s = static_cast<std::size_t>(seq);
    const std::size_t q_len = job_query_len(index, s), context = static_cast<std::size_t>(index.seq_lens[s]) - q_len;
    // The costliest (last) rows first, so that the dynamic schedule ends on cheap items.
    for (std::size_t end = q_len; end > 0;) {
      const std::size_t begin = end > per_item ? end - per_item : 0;
      const std::size_t seen = context + end;  // positions the tile's last row sees
      const std::size_t parts = vector ? (seen + kKeyRange - 1) / kKeyRange : 1;
      for (std::size_t kv = 0; kv < shape.num_kv_heads; ++kv) {
        if (parts == 1) {
          items.push_back({s, kv, begin, end, 0, seen, -1});
          continue;
        }
        merges.push_back({s, kv, begin, end, slots, parts});
        for (std::size_t p = 0; p < parts; ++p, ++slots) {
          items.push_back({s, kv, begin, end, p * kKeyRange, std::min(seen, (p + 1) * kKeyRange),
                           static_cast<std::ptrdiff_t>(slots)});
        }
      }
      end = begin;
    }
  }
  const std::size_t slot_vectors = per_item * group;
  partials.resize(slots * slot_vectors * (shape.head_dim + 2));
  const Job<T> job{shape, index, q.data(), k_cache.data(), v_cache.data(), out.data(), scale, partials.data(),
                   slot_vectors};
  const Item* const all = items.data();  // the caller's: in the parallel region the thread_locals are each thread's
  for_each_item_dynamic(items.size(), threads, split, [&](std::size_t i) {
    const Item& item = all[i];
    if (vector && wide && shape.head_dim == 64) {
      chunk_avx512<T, 4>(job, item);
    } else if (vector && wide && shape.head_dim == 128) {
      chunk_avx512<T, 8>(job, item);
    } else if (vector && shape.head_dim == 64) {
      chunk_avx2<T, 64>(job, item);
    } else if (vector && shape.head_dim == 128) {
      chunk_avx2<T, 128>(job, item);
    } else {
      chunk_scalar(job, item);
    }
  });
  const Merge* const tiles = merges.data();
  for_each_item(merges.size(), threads, split, [&](std::size_t i) { merge(job, tiles[i]); });
  if (partials.capacity() * sizeof(float) > kKeptPartialBytes) std::vector<float>().swap(partials);
}

}  // namespace

bool paged_chunk_attention_is_vectorized(std::size_t head_dim) {
  return (has_avx512f() || has_avx2_fma()) && (head_dim == 64 || head_dim == 128);
}

void paged_chunk_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                               std::span<const float> q, std::span<const float> k_cache,
                               std::span<const float> v_cache, std::span<float> out, float scale, int threads) {
  run(shape, index, q, k_cache, v_cache, out, scale, threads);
}

void paged_chunk_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                std::span<const bf16_bits> q, std::span<const bf16_bits> k_cache,
                                std::span<const bf16_bits> v_cache, std::span<bf16_bits> out, float scale,
                                int threads) {
  run(shape, index, q, k_cache, v_cache, out, scale, threads);
}

}  // namespace ringserve::kernels
