#include "kernels/cpu_quant.h"

#include "kernels/cpu_quant_blocks.h"
#include "kernels/parallel.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace ringserve::kernels {

namespace {

using quant::ActBlock;
using quant::EpilogueOf;
using quant::is_signed;
using quant::kPanelMinInputs;

constexpr std::size_t kChunkRows = 16;  // weight rows per item handed to a thread
// A matrix-vector product (one input row) uses every weight byte once, and the hardware prefetchers alone left a core
// at a third of its streaming bandwidth: while a tile of kRows adjacent weight rows is computed, the next tile's bytes
// are prefetched, an equal share per block, so they arrive one tile ahead.
template <std::size_t kRows>
__attribute__((target("avx2,fma,f16c"))) inline void prefetch_next_tile(const uint8_t* w, std::size_t j0,
                                                                        std::size_t row_bytes,
                                                                        std::size_t block_bytes, std::size_t b) {
  const uint8_t* next = w + (j0 + kRows) * row_bytes + b * kRows * block_bytes;
  for (std::size_t at = 0; at < kRows * block_bytes + 64; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T0);
  }
}
// Products with at least this many weights are split over the caller's threads.
constexpr std::size_t kSplitWeights = std::size_t{1} << 16;

// ---- Activations: one block of 32 values to int8 ----

template <class T>
void quantize_block_portable(const T* x, ActBlock& out) {
  float amax = 0.0F;
  for (std::size_t p = 0; p < kQuantBlock; ++p) amax = std::max(amax, std::fabs(load_scalar(x[p])));
  const float d = amax / 127.0F;
  const float id = d > 0.0F ? 1.0F / d : 0.0F;
  int sum = 0;
  for (std::size_t p = 0; p < kQuantBlock; ++p) {
    const auto q = static_cast<int>(std::nearbyint(load_scalar(x[p]) * id));
    out.q[p] = static_cast<int8_t>(q);
    sum += q;
  }
  out.d = d;
  out.s = d * static_cast<float>(sum);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const bf16_bits* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The same values as quantize_block_portable: the same float32 operations, lane by lane.
template <class T>
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const T* x, ActBlock& out) {
  const __m256 sign = _mm256_set1_ps(-0.0F);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0F;
  const float id = d > 0.0F ? 1.0F / d : 0.0F;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permutation undoes it.
  const __m256i packed16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q), _mm256_permutevar8x32_epi32(packed16, order));
  out.d = d;
  out.s = d * static_cast<float>(_mm_cvtsi128_si32(t4));
}

// ---- Weight blocks, portable: the block's contribution to one output, given one input block ----

float block_dot_portable(QuantType type, const uint8_t* b, const ActBlock& a) {
  switch (type) {
    case QuantType::kQ8_0: {
      int sum = 0;
      for (std::size_t p = 0; p < kQuantBlock; ++p) sum += static_cast<int8_t>(b[2 + p]) * a.q[p];
      return half_to_float(read_block_u16(b)) * a.d * static_cast<float>(sum);
    }
    case QuantType::kQ8_2F: {
      int lo = 0;
      int hi = 0;
      for (std::size_t p = 0; p < 16; ++p) lo += static_cast<int8_t>(b[8 + p]) * a.q[p];
      for (std::size_t p = 16; p < kQuantBlock; ++p) hi += static_cast<int8_t>(b[8 + p]) * a.q[p];
      return a.d * (read_block_f32(b) * static_cast<float>(lo) + read_block_f32(b + 4) * static_cast<float>(hi));
    }
    default: break;
  }
  // The 4-bit formats: d * (sum of nibble * x) + m * (sum of x).
  const auto [d, m, qs] = read_q4_header(type, b);
  int sum = 0;
  for (std::size_t p = 0; p < 16; ++p) sum += (qs[p] & 0x0F) * a.q[p] + (qs[p] >> 4) * a.q[p + 16];
  return d * a.d * static_cast<float>(sum) + m * a.s;
}

// Weight rows [j0, j1) against every input row.
template <class T>
void rows_portable(LinearShape s, QuantType type, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                   const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  const std::size_t blocks = s.k / kQuantBlock;
  for (std::size_t i = 0; i < s.m; ++i) {
    for (std::size_t j = j0; j < j1; ++j) {
      float acc = 0.0F;
      for (std::size_t b = 0; b < blocks; ++b) {
        acc += block_dot_portable(type, w + (j * blocks + b) * block_bytes, act[i * blocks + b]);
      }
      if (epi.bias != nullptr) acc += load_scalar(epi.bias[j]);
      if (epi.residual != nullptr) acc += load_scalar(epi.residual[i * s.n + j]);
      store_scalar(&y[i * s.n + j], acc);
    }
  }
}

// ---- Weight blocks, AVX2 ----
//
// Each format gives, per block: its 32 values in a register (int8, or uint8 nibbles for the 4-bit formats), a vector
// of scales for the 8 int32 sums madd_epi16 leaves (lanes 0-3 sum values 0-15, lanes 4-7 values 16-31), and for the
// 4-bit formats its offset, which meets the input block's scaled sum.

struct WeightBlock {
  __m256i q;
  __m256 scale;
  float offset;
};

__attribute__((target("avx2,fma,f16c"))) inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) inline WeightBlock load_block(const uint8_t* b) {
  if constexpr (is_signed(kType)) {
    const quant::Q8Header h = quant::read_q8_header_f16c<kType>(b);
    const __m256 scale = _mm256_set_m128(_mm_set1_ps(h.d1), _mm_set1_ps(h.d0));
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.qs)), scale, 0.0F};
  } else {
    const Q4Header h = read_q4_header_f16c<kType>(b);
    return {nibbles(h.qs), _mm256_set1_ps(h.d), h.m};
  }
}

// The 8 int32 partial sums of w's 32 values times the input's, as float32.
template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) inline __m256 block_sums(__m256i w_abs_or_u, __m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i pairs;
  if constexpr (is_signed(kType)) {
    // maddubs takes unsigned x signed bytes: |w| against x carrying w's sign (pairs stay within int16).
    pairs = _mm256_maddubs_epi16(w_abs_or_u, _mm256_sign_epi8(x, w));
  } else {
    pairs = _mm256_maddubs_epi16(w_abs_or_u, x);
  }
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// kInputs input rows from i0 against kRows weight rows from j0, over all of K.
template <QuantType kType, std::size_t kInputs, std::size_t kRows, class T>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(LinearShape s, std::size_t block_bytes, const ActBlock* act,
                                                        const uint8_t* w, const EpilogueOf<T>& epi, T* y,
                                                        std::size_t i0, std::size_t j0) {
  const std::size_t blocks = s.k / kQuantBlock;
  __m256 acc[kInputs][kRows];
  float offsets[kInputs][kRows];
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      offsets[i][r] = 0.0F;
    }
  }
  for (std::size_t b = 0; b < blocks; ++b) {
    WeightBlock wb[kRows];
    __m256i wu[kRows];
    if constexpr (kInputs == 1) prefetch_next_tile<kRows>(w, j0, blocks * block_bytes, block_bytes, b);
    for (std::size_t r = 0; r < kRows; ++r) {
      wb[r] = load_block<kType>(w + ((j0 + r) * blocks + b) * block_bytes);
      wu[r] = is_signed(kType) ? _mm256_sign_epi8(wb[r].q, wb[r].q) : wb[r].q;
    }
    for (std::size_t i = 0; i < kInputs; ++i) {
      const ActBlock& a = act[(i0 + i) * blocks + b];
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q));
      const __m256 d = _mm256_set1_ps(a.d);
      for (std::size_t r = 0; r < kRows; ++r) {
        acc[i][r] = _mm256_fmadd_ps(block_sums<kType>(wu[r], wb[r].q, x), _mm256_mul_ps(wb[r].scale, d), acc[i][r]);
        if constexpr (!is_signed(kType)) offsets[i][r] += wb[r].offset * a.s;
      }
    }
  }
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) {
      float out = hsum(acc[i][r]) + offsets[i][r];
      const std::size_t j = j0 + r;
      if (epi.bias != nullptr) out += load_scalar(epi.bias[j]);
      if (epi.residual != nullptr) out += load_scalar(epi.residual[(i0 + i) * s.n + j]);
      store_scalar(&y[(i0 + i) * s.n + j], out);
    }
  }
}

// kInputs input rows from i0 against kPairs pairs of weight rows from j0, for the 4-bit formats: a pair's two 16-byte
// nibble runs share one register, so each maddubs covers two weight rows, and the pair's scales and offsets come in
// one load and conversion. Lanes 0-3 of a pair's sums belong to its first row, lanes 4-7 to its second.
template <QuantType kType, std::size_t kInputs, std::size_t kPairs, class T>
__attribute__((target("avx2,fma,f16c"))) void pairs_avx2(LinearShape s, std::size_t block_bytes, const ActBlock* act,
                                                         const uint8_t* w, const EpilogueOf<T>& epi, T* y,
                                                         std::size_t i0, std::size_t j0) {
  constexpr std::size_t kNibbles = kType == QuantType::kQ4_0 ? 2 : kType == QuantType::kQ4_1 ? 4 : 8;
  const std::size_t blocks = s.k / kQuantBlock;
  const std::size_t row_bytes = blocks * block_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kInputs][kPairs];
  __m256 offsets[kInputs][kPairs];
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t p = 0; p < kPairs; ++p) acc[i][p] = offsets[i][p] = _mm256_setzero_ps();
  }
  for (std::size_t b = 0; b < blocks; ++b) {
    if constexpr (kInputs == 1) prefetch_next_tile<2 * kPairs>(w, j0, row_bytes, block_bytes, b);
    for (std::size_t p = 0; p < kPairs; ++p) {
      const uint8_t* b0 = w + (j0 + 2 * p) * row_bytes + b * block_bytes;
      const uint8_t* b1 = b0 + row_bytes;
      const __m256i q = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kNibbles))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kNibbles)), 1);
      const __m256i low = _mm256_and_si256(q, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
      // Each row's scale d and offset m in float32, spread to its four lanes.
      __m256 d;
      __m256 m;
      if constexpr (kType == QuantType::kQ4_0) {
        const int h = static_cast<int>(read_block_u16(b0)) | (static_cast<int>(read_block_u16(b1)) << 16);
        d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(h))),
                                     _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0F));
      } else {
        __m128 dm;  // d0, m0, d1, m1
        if constexpr (kType == QuantType::kQ4_1F) {
          uint64_t f0 = 0;
          uint64_t f1 = 0;
          std::memcpy(&f0, b0, sizeof f0);
          std::memcpy(&f1, b1, sizeof f1);
          dm = _mm_castsi128_ps(_mm_set_epi64x(static_cast<long long>(f1), static_cast<long long>(f0)));
        } else {
          uint32_t h0 = 0;
          uint32_t h1 = 0;
          std::memcpy(&h0, b0, sizeof h0);
          std::memcpy(&h1, b1, sizeof h1);
          dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(h1), static_cast<int>(h0)));
        }
        const __m256 wide = _mm256_castps128_ps256(dm);
        d = _mm256_permutevar8x32_ps(wide, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        m = _mm256_permutevar8x32_ps(wide, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
      }
      for (std::size_t i = 0; i < kInputs; ++i) {
        const ActBlock& a = act[(i0 + i) * blocks + b];
        const auto* x = reinterpret_cast<const __m128i*>(a.q);
        const __m256i pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(low, _mm256_broadcastsi128_si256(_mm_loadu_si128(x))),
            _mm256_maddubs_epi16(high, _mm256_broadcastsi128_si256(_mm_loadu_si128(x + 1))));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[i][p] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_set1_ps(a.d)), acc[i][p]);
        offsets[i][p] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s), offsets[i][p]);
      }
    }
  }
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t p = 0; p < kPairs; ++p) {
      const __m128 halves[2] = {_mm256_castps256_ps128(acc[i][p]), _mm256_extractf128_ps(acc[i][p], 1)};
      const float offset[2] = {_mm256_cvtss_f32(offsets[i][p]),
                               _mm_cvtss_f32(_mm256_extractf128_ps(offsets[i][p], 1))};
      for (std::size_t h = 0; h < 2; ++h) {
        __m128 v = _mm_add_ps(halves[h], _mm_movehl_ps(halves[h], halves[h]));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        float out = _mm_cvtss_f32(v) + offset[h];
        const std::size_t j = j0 + 2 * p + h;
        if (epi.bias != nullptr) out += load_scalar(epi.bias[j]);
        if (epi.residual != nullptr) out += load_scalar(epi.residual[(i0 + i) * s.n + j]);
        store_scalar(&y[(i0 + i) * s.n + j], out);
      }
    }
  }
}

// All input rows (tiles of 4, then the rest) against weight rows [j0, j0 + kRows).
template <QuantType kType, std::size_t kRows, class T>
void column_avx2(LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                 const EpilogueOf<T>& epi, T* y, std::size_t j0) {
  std::size_t i0 = 0;
  for (; i0 + 4 <= s.m; i0 += 4) tile_avx2<kType, 4, kRows>(s, block_bytes, act, w, epi, y, i0, j0);
  switch (s.m - i0) {
    case 3: tile_avx2<kType, 3, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    case 2: tile_avx2<kType, 2, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    case 1: tile_avx2<kType, 1, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    default: break;
  }
}

// Weight rows [j0, j1): pairs of rows against tiles of inputs (for a single input row, where the product is a
// matrix-vector one, four rows at a time, so that more independent sums hide the loads' latency); a last odd row
// alone.
template <QuantType kType, class T>
void rows_avx2(LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
               const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  std::size_t j = j0;
  if constexpr (is_signed(kType)) {
    if (s.m == 1) {
      for (; j + 4 <= j1; j += 4) tile_avx2<kType, 1, 4>(s, block_bytes, act, w, epi, y, 0, j);
    }
    for (; j + 2 <= j1; j += 2) column_avx2<kType, 2>(s, block_bytes, act, w, epi, y, j);
  } else {
    if (s.m == 1) {
      for (; j + 4 <= j1; j += 4) pairs_avx2<kType, 1, 2>(s, block_bytes, act, w, epi, y, 0, j);
      for (; j + 2 <= j1; j += 2) pairs_avx2<kType, 1, 1>(s, block_bytes, act, w, epi, y, 0, j);
    }
    for (; j + 2 <= j1; j += 2) column_avx2<kType, 2>(s, block_bytes, act, w, epi, y, j);
  }
  for (; j < j1; ++j) column_avx2<kType, 1>(s, block_bytes, act, w, epi, y, j);
}

// Weight rows [j0, j1) against every input row: from kPanelMinInputs input rows in 8-row panels as far as they go
// (packed panels with AVX-512 VNNI where `vnni`, kernels/cpu_quant_panels_vnni.cpp; else kernels/cpu_quant_panels.cpp),
// the rest in rows_avx2's tiles.
template <class T>
void products_avx2(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                   const uint8_t* panels, bool vnni, const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  if (s.m >= kPanelMinInputs) {
    const std::size_t panels_end = j0 + (j1 - j0) / kQuantPanelRows * kQuantPanelRows;
    if (vnni && panels != nullptr) {
      quant::panel_products_avx512_vnni<T>(type, s, act, reinterpret_cast<const quant::PanelBlock*>(panels), epi, y,
                                           j0, panels_end);
    } else {
      quant::panel_products_avx2<T>(type, s, block_bytes, act, w, panels, epi, y, j0, panels_end);
    }
    j0 = panels_end;
  }
  if (j0 == j1) return;
  quant::with_block_type(type, [&](auto t) { rows_avx2<decltype(t)::value>(s, block_bytes, act, w, epi, y, j0, j1); });
}

// The calling thread's activation buffer (kept between calls; every thread of the product reads it).
ActBlock* activation_buffer(std::size_t count) {
  thread_local std::vector<ActBlock> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

template <class T>
void linear_quant(const char* op, LinearShape s, QuantType type, std::span<const T> x, std::span<const uint8_t> w,
                  std::span<const T> bias, std::span<T> y, QuantPath path, int threads, std::span<const T> residual,
                  std::span<const uint8_t> panels) {
  const std::size_t block_bytes = quant_block_bytes(type);
  require(s.k % kQuantBlock == 0, op, "k (" + std::to_string(s.k) + ") is not a multiple of 32");
  const std::size_t blocks = s.k / kQuantBlock;
  require_size(op, "x", x.size(), s.m * s.k);
  require(w.size() == s.n * blocks * block_bytes, op,
          "w holds " + std::to_string(w.size()) + " bytes, expected " + std::to_string(s.n * blocks * block_bytes));
  require_size(op, "y", y.size(), s.m * s.n);
  if (!bias.empty()) require_size(op, "bias", bias.size(), s.n);
  if (!residual.empty()) require_size(op, "residual", residual.size(), s.m * s.n);
  if (!panels.empty()) require_size(op, "panels", panels.size(), quant_panel_bytes(type, s.n, s.k));
  if (s.m == 0 || s.n == 0) return;
  const bool avx2 = path != QuantPath::kPortable && has_avx2_quant();
  const bool vnni = path == QuantPath::kFastest && has_avx512_vnni_quant();
  ActBlock* act = activation_buffer(s.m * blocks);
  const T* xs = x.data();
  for_each_item(s.m, threads, s.m * s.k >= kParallelValues, [&](std::size_t i) {
    for (std::size_t b = 0; b < blocks; ++b) {
      const T* from = xs + i * s.k + b * kQuantBlock;
      if (avx2) {
        quantize_block_avx2(from, act[i * blocks + b]);
      } else {
        quantize_block_portable(from, act[i * blocks + b]);
      }
    }
  });
  const EpilogueOf<T> epi{bias.empty() ? nullptr : bias.data(), residual.empty() ? nullptr : residual.data()};
  const std::size_t chunks = (s.n + kChunkRows - 1) / kChunkRows;
  for_each_item_dynamic(chunks, threads, s.n * s.k >= kSplitWeights, [&](std::size_t c) {
    const std::size_t j0 = c * kChunkRows;
    const std::size_t j1 = std::min(s.n, j0 + kChunkRows);
    if (avx2) {
      products_avx2<T>(type, s, block_bytes, act, w.data(), panels.empty() ? nullptr : panels.data(), vnni, epi,
                       y.data(), j0, j1);
    } else {
      rows_portable<T>(s, type, block_bytes, act, w.data(), epi, y.data(), j0, j1);
    }
  });
}

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000U) << 16;
  const uint32_t exponent = (h >> 10) & 0x1FU;
  const uint32_t mantissa = h & 0x3FFU;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1F ? sign | 0x7F800000U | (mantissa << 13)
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float v = 0.0F;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

std::size_t quant_block_bytes(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0: return 34;
    case QuantType::kQ4_0: return 18;
    case QuantType::kQ4_1: return 20;
    case QuantType::kQ4_1F: return 24;
    case QuantType::kQ8_2F: return 40;
  }
  throw std::invalid_argument("linear_quant: unknown weight block type " + std::to_string(static_cast<int>(type)));
}

bool has_avx2_quant() {
  static const bool supported =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return supported;
}

bool has_avx512_vnni_quant() {
  static const bool supported = has_avx2_quant() && __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512vnni");
  return supported;
}

void linear_quant_f32(LinearShape shape, QuantType type, std::span<const float> x, std::span<const uint8_t> w,
                      std::span<const float> bias, std::span<float> y, QuantPath path, int threads,
                      std::span<const float> residual, std::span<const uint8_t> panels) {
  linear_quant<float>("linear_quant_f32", shape, type, x, w, bias, y, path, threads, residual, panels);
}

void linear_quant_bf16(LinearShape shape, QuantType type, std::span<const bf16_bits> x, std::span<const uint8_t> w,
                       std::span<const bf16_bits> bias, std::span<bf16_bits> y, QuantPath path, int threads,
                       std::span<const bf16_bits> residual, std::span<const uint8_t> panels) {
  linear_quant<bf16_bits>("linear_quant_bf16", shape, type, x, w, bias, y, path, threads, residual, panels);
}

}  // namespace ringserve::kernels
