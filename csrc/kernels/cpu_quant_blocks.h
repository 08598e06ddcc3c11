// Internal to the quantized products (kernels/cpu_quant.cpp, kernels/cpu_quant_tiles.h, kernels/cpu_quant_panels.cpp,
// kernels/cpu_quant_vnni.cpp; the public interface is kernels/cpu_quant.h): the quantized input blocks they read, the
// epilogue they apply, the AVX2 readers of the 8-bit weight blocks' headers, the 8-row weight panels' layout and
// per-block scaling, and the entry points of the tiles and the panels on each instruction set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

#include "kernels/cpu_quant.h"

namespace ringserve::kernels::quant {

// One input block: its scale, its scale times the sum of its values (for formats with an offset), its int8 values.
struct ActBlock {
  float d;
  float s;
  int8_t q[kQuantBlock];
};

// What is added to each product before its one rounding to T: bias[n] and residual[m, n], either may be null.
template <class T>
struct EpilogueOf {
  const T* bias;
  const T* residual;
};

constexpr bool is_signed(QuantType t) { return t == QuantType::kQ8_0 || t == QuantType::kQ8_2F; }

// Calls fn(std::integral_constant<QuantType, type>{}): a run-time block type to the kernel templated on it.
template <class Fn>
void with_block_type(QuantType type, Fn&& fn) {
  using enum QuantType;
  switch (type) {
    case kQ8_0: return fn(std::integral_constant<QuantType, kQ8_0>{});
    case kQ8_2F: return fn(std::integral_constant<QuantType, kQ8_2F>{});
    case kQ4_0: return fn(std::integral_constant<QuantType, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<QuantType, kQ4_1>{});
    case kQ4_1F: return fn(std::integral_constant<QuantType, kQ4_1F>{});
  }
}

// An 8-bit block's header (kQ8_0, kQ8_2F): values 0-15 are d0 * q, values 16-31 d1 * q (Q8_0: d0 = d1), and its 32
// int8 values start at qs. The AVX2 kernels' counterpart of read_q4_header_f16c (kernels/cpu_quant.h).
struct Q8Header {
  float d0;
  float d1;
  const uint8_t* qs;
};

template <QuantType kType>
__attribute__((target("f16c"))) inline Q8Header read_q8_header_f16c(const uint8_t* b) {
  static_assert(is_signed(kType));
  if constexpr (kType == QuantType::kQ8_0) {
    const float d = _cvtsh_ss(read_block_u16(b));
    return {d, d, b + 2};
  } else {
    return {read_block_f32(b), read_block_f32(b + 4), b + 8};
  }
}

// One panel block: 8 weight rows' 32 values of one block, laid out so that register g (32 bytes) holds values
// 4g..4g+3 of each row (row r in int32 lane r), then the rows' scales and offsets in float32. The 4-bit formats hold
// their nibbles as unsigned bytes, the 8-bit formats their int8 values.
struct PanelBlock {
  uint8_t q[8][32];
  float d[kQuantPanelRows];  // 8-bit formats: the scale of values 0-15
  float m[kQuantPanelRows];  // 8-bit formats: the scale of values 16-31
};

// acc (8 rows' running sums for one input row) plus one panel block's products with one input block, from their
// exact int32 sums: s0 (kQ8_2F: values 0-15 in s0, 16-31 in s1; other formats: all 32 in s0). Every panel path
// scales through this one function, so they round alike: the 4-bit formats' scaled dot product and offset term
// (often of opposite signs and larger than their sum) meet before the running sum, which then rounds only what the
// block adds; the 8-bit formats' last product is fused with the running sum.
template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) inline __m256 add_panel_block(__m256 acc, __m256i s0, __m256i s1,
                                                                        const PanelBlock& w, const ActBlock& a) {
  const __m256 d = _mm256_loadu_ps(w.d);
  const __m256 dx = _mm256_set1_ps(a.d);
  if constexpr (kType == QuantType::kQ8_0) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, dx), acc);
  } else if constexpr (kType == QuantType::kQ8_2F) {
    const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), d,
                                        _mm256_mul_ps(_mm256_cvtepi32_ps(s1), _mm256_loadu_ps(w.m)));
    return _mm256_fmadd_ps(both, dx, acc);
  } else {
    const __m256 m = _mm256_loadu_ps(w.m);
    return _mm256_add_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, dx),
                                              _mm256_mul_ps(m, _mm256_set1_ps(a.s))));
  }
}

// Input row i's 8 outputs (weight rows j0..j0+7) from the lanes of acc, with bias and residual, rounded once to T.
template <class T>
__attribute__((target("avx2,fma,f16c"))) inline void store_panel_row(LinearShape s, __m256 acc,
                                                                     const EpilogueOf<T>& epi, T* y, std::size_t i,
                                                                     std::size_t j0) {
  float out[kQuantPanelRows];
  _mm256_storeu_ps(out, acc);
  for (std::size_t r = 0; r < kQuantPanelRows; ++r) {
    float v = out[r];
    if (epi.bias != nullptr) v += load_scalar(epi.bias[j0 + r]);
    if (epi.residual != nullptr) v += load_scalar(epi.residual[i * s.n + j0 + r]);
    store_scalar(&y[i * s.n + j0 + r], v);
  }
}

// From this many input rows every format takes panels. The 4-bit ones beat the tiles from 8 rows on SmolLM2's shapes
// (1.7-2x), but they sum in another order, and the embedded model's greedy tokens with int8 inputs sit at the edge
// of their accuracy bar (tests/workers/test_quant_ops.py): decode batches of fewer rows keep the tiles they had.
constexpr std::size_t kPanelMinInputs = 32;

// Weight rows [j0, j1) of `type` (j0 and j1 - j0 multiples of kQuantPanelRows) against every input row of s.m, in
// panels of 8 rows (kernels/cpu_quant_panels.cpp): read from `panels` (pack_quant_panels' layout of all of w) when it
// is not null, else laid out here. act: s.m rows of s.k / 32 blocks; y: s.m * s.n.
template <class T>
void panel_products_avx2(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act,
                         const uint8_t* w, const uint8_t* panels, const EpilogueOf<T>& epi, T* y, std::size_t j0,
                         std::size_t j1);

extern template void panel_products_avx2<float>(QuantType, LinearShape, std::size_t, const ActBlock*,
                                                const uint8_t*, const uint8_t*, const EpilogueOf<float>&, float*,
                                                std::size_t, std::size_t);
extern template void panel_products_avx2<bf16_bits>(QuantType, LinearShape, std::size_t, const ActBlock*,
                                                    const uint8_t*, const uint8_t*, const EpilogueOf<bf16_bits>&,
                                                    bf16_bits*, std::size_t, std::size_t);

// The same products with AVX-512 VNNI (kernels/cpu_quant_vnni.cpp), from the panels alone (`panels`: all of
// w's, as pack_quant_panels lays them out; j1 at most n / 8 * 8), bit for bit panel_products_avx2's outputs. Only
// where has_avx512_vnni_quant().
template <class T>
void panel_products_avx512_vnni(QuantType type, LinearShape s, const ActBlock* act, const PanelBlock* panels,
                                const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1);

extern template void panel_products_avx512_vnni<float>(QuantType, LinearShape, const ActBlock*, const PanelBlock*,
                                                       const EpilogueOf<float>&, float*, std::size_t, std::size_t);
extern template void panel_products_avx512_vnni<bf16_bits>(QuantType, LinearShape, const ActBlock*,
                                                           const PanelBlock*, const EpilogueOf<bf16_bits>&,
                                                           bf16_bits*, std::size_t, std::size_t);

// Weight rows [j0, j1) against every input row in tiles that read the weight blocks themselves
// (kernels/cpu_quant_tiles.h): AVX2, and AVX-512 VNNI (only where has_avx512_vnni_quant()), the same bits.
template <class T>
void tile_products_avx2(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                        const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1);
template <class T>
void tile_products_avx512_vnni(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act,
                               const uint8_t* w, const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1);

}  // namespace ringserve::kernels::quant
