// Internal to the quantized products (kernels/cpu_quant.cpp, kernels/cpu_quant_panels.cpp; the public interface is
// kernels/cpu_quant.h): the quantized input blocks both read, the epilogue both apply, the AVX2 readers of the 8-bit
// weight blocks' headers, and the entry point of the 8-row weight panels.
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

}  // namespace ringserve::kernels::quant
