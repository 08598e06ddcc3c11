// The quantized products' tiles: input rows (1 to 31, and those past the panels' rows) against weight rows read from
// their blocks as a GGUF file stores them (kernels/cpu_quant.h). Written once over lane_sums, the one step that
// differs by instruction set: included by kernels/cpu_quant.cpp for AVX2 (maddubs + madd) and by
// kernels/cpu_quant_vnni.cpp for AVX-512 VNNI (vpdpbusd on 256-bit registers), which give the same int32 sums, so
// the same bits. The includer defines RINGSERVE_TILE_TARGET (the functions' target attribute), RINGSERVE_TILE_VNNI
// (0 or 1) and RINGSERVE_TILE_ENTRY (the name of the exported entry point, declared in kernels/cpu_quant_blocks.h).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu_quant_blocks.h"

namespace ringserve::kernels::quant {

namespace {

// A matrix-vector product (one input row) uses every weight byte once, and the hardware prefetchers alone left a core
// at a third of its streaming bandwidth: while a tile of kRows adjacent weight rows is computed, the next tile's bytes
// are prefetched, an equal share per block, so they arrive one tile ahead.
template <std::size_t kRows>
__attribute__((target(RINGSERVE_TILE_TARGET))) inline void prefetch_next_tile(const uint8_t* w, std::size_t j0,
                                                                              std::size_t row_bytes,
                                                                              std::size_t block_bytes, std::size_t b) {
  const uint8_t* next = w + (j0 + kRows) * row_bytes + b * kRows * block_bytes;
  for (std::size_t at = 0; at < kRows * block_bytes + 64; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T0);
  }
}

// Each format gives, per block: its 32 values in a register (int8, or uint8 nibbles for the 4-bit formats), a vector
// of scales for the 8 int32 lane sums (lanes 0-3 sum values 0-15, lanes 4-7 values 16-31), and for the 4-bit formats
// its offset, which meets the input block's scaled sum.

struct WeightBlock {
  __m256i q;
  __m256 scale;
  float offset;
};

__attribute__((target(RINGSERVE_TILE_TARGET))) inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

template <QuantType kType>
__attribute__((target(RINGSERVE_TILE_TARGET))) inline WeightBlock load_block(const uint8_t* b) {
  if constexpr (is_signed(kType)) {
    const Q8Header h = read_q8_header_f16c<kType>(b);
    const __m256 scale = _mm256_set_m128(_mm_set1_ps(h.d1), _mm_set1_ps(h.d0));
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.qs)), scale, 0.0F};
  } else {
    const Q4Header h = read_q4_header_f16c<kType>(b);
    return {nibbles(h.qs), _mm256_set1_ps(h.d), h.m};
  }
}

// The 8 int32 sums of 4 adjacent byte products each (lane l: bytes 4l..4l+3), u unsigned and s signed; with u2 and s2,
// plus theirs. AVX2: maddubs's int16 pair sums (within int16 for every use here) widened by madd; VNNI: vpdpbusd.
// The same integers either way.
__attribute__((target(RINGSERVE_TILE_TARGET))) inline __m256i lane_sums(__m256i u, __m256i s) {
#if RINGSERVE_TILE_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
__attribute__((target(RINGSERVE_TILE_TARGET))) inline __m256i lane_sums(__m256i u, __m256i s, __m256i u2, __m256i s2) {
#if RINGSERVE_TILE_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), u2, s2);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2)),
                           _mm256_set1_epi16(1));
#endif
}

// The 8 int32 partial sums of w's 32 values times the input's, as float32. The unsigned side is the 4-bit formats'
// nibbles, or |w| for the 8-bit formats against x carrying w's sign (their int16 pair sums stay within int16).
template <QuantType kType>
__attribute__((target(RINGSERVE_TILE_TARGET))) inline __m256 block_sums(__m256i w_abs_or_u, __m256i w, __m256i x) {
  if constexpr (is_signed(kType)) {
    return _mm256_cvtepi32_ps(lane_sums(w_abs_or_u, _mm256_sign_epi8(x, w)));
  } else {
    return _mm256_cvtepi32_ps(lane_sums(w_abs_or_u, x));
  }
}

__attribute__((target(RINGSERVE_TILE_TARGET))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// kInputs input rows from i0 against kRows weight rows from j0, over all of K.
template <QuantType kType, std::size_t kInputs, std::size_t kRows, class T>
__attribute__((target(RINGSERVE_TILE_TARGET))) void tile(LinearShape s, std::size_t block_bytes, const ActBlock* act,
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
__attribute__((target(RINGSERVE_TILE_TARGET))) void pairs(LinearShape s, std::size_t block_bytes,
                                                          const ActBlock* act, const uint8_t* w,
                                                          const EpilogueOf<T>& epi, T* y, std::size_t i0,
                                                          std::size_t j0) {
  constexpr std::size_t kNibbles = kType == QuantType::kQ4_0 ? 2 : kType == QuantType::kQ4_1 ? 4 : 8;
  const std::size_t blocks = s.k / kQuantBlock;
  const std::size_t row_bytes = blocks * block_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F);
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
        const __m256 sums = _mm256_cvtepi32_ps(lane_sums(low, _mm256_broadcastsi128_si256(_mm_loadu_si128(x)), high,
                                                         _mm256_broadcastsi128_si256(_mm_loadu_si128(x + 1))));
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
void column(LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w, const EpilogueOf<T>& epi,
            T* y, std::size_t j0) {
  std::size_t i0 = 0;
  for (; i0 + 4 <= s.m; i0 += 4) tile<kType, 4, kRows>(s, block_bytes, act, w, epi, y, i0, j0);
  switch (s.m - i0) {
    case 3: tile<kType, 3, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    case 2: tile<kType, 2, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    case 1: tile<kType, 1, kRows>(s, block_bytes, act, w, epi, y, i0, j0); break;
    default: break;
  }
}

// Weight rows [j0, j1): pairs of rows against tiles of inputs (for a single input row, where the product is a
// matrix-vector one, four rows at a time, so that more independent sums hide the loads' latency); a last odd row
// alone.
template <QuantType kType, class T>
void rows_tiles(LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  std::size_t j = j0;
  if constexpr (is_signed(kType)) {
    if (s.m == 1) {
      for (; j + 4 <= j1; j += 4) tile<kType, 1, 4>(s, block_bytes, act, w, epi, y, 0, j);
    }
    for (; j + 2 <= j1; j += 2) column<kType, 2>(s, block_bytes, act, w, epi, y, j);
  } else {
    if (s.m == 1) {
      for (; j + 4 <= j1; j += 4) pairs<kType, 1, 2>(s, block_bytes, act, w, epi, y, 0, j);
      for (; j + 2 <= j1; j += 2) pairs<kType, 1, 1>(s, block_bytes, act, w, epi, y, 0, j);
    }
    for (; j + 2 <= j1; j += 2) column<kType, 2>(s, block_bytes, act, w, epi, y, j);
  }
  for (; j < j1; ++j) column<kType, 1>(s, block_bytes, act, w, epi, y, j);
}

}  // namespace

// Weight rows [j0, j1) of `type` against every input row, in the tiles above.
template <class T>
void RINGSERVE_TILE_ENTRY(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act,
                          const uint8_t* w, const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  with_block_type(type, [&](auto t) { rows_tiles<decltype(t)::value>(s, block_bytes, act, w, epi, y, j0, j1); });
}

template void RINGSERVE_TILE_ENTRY<float>(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                                          const EpilogueOf<float>&, float*, std::size_t, std::size_t);
template void RINGSERVE_TILE_ENTRY<bf16_bits>(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                                              const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t, std::size_t);

}  // namespace ringserve::kernels::quant
