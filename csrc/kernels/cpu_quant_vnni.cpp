// The quantized products with AVX-512 VNNI (F, BW, VL and VNNI): the panels of 32 or more input rows below, and the
// tiles of fewer rows (kernels/cpu_quant_tiles.h, included here with vpdpbusd as their lane-sum step).
//
// Panels (kernels/cpu_quant_blocks.h PanelBlock, packed ones only). vpdpbusd multiplies 64 unsigned bytes by 64
// signed bytes and adds each run of 4 products into an int32 lane, so a panel register (4 values of each of 8 rows)
// against 4 broadcast input values is one instruction, with no int16 stage and no separate widening. A zmm register
// holds register g of two panels (16 weight rows); each input row's int32 sums for a block stay in one zmm. The
// 4-bit formats' nibbles are the unsigned side. The 8-bit formats' weights are signed, so the inputs become the
// unsigned side, offset by 128 (x ^ 0x80 is x + 128), and 128 times the weights' sums (one vpdpbusd per register,
// shared by every input row of the tile) comes off again. These int32 sums are exactly those of the AVX2 panels
// (kernels/cpu_quant_panels.cpp) and go through the same add_panel_block, so both paths give the same bits.
//
// The tests build this file a second time with RINGSERVE_EMULATE_AVX512 (csrc/tests/cpu_quant_vnni_emulated.cpp):
// SIMDe's portable AVX-512 on top of AVX2 stands in for the instructions, so both parts are checked bit for bit
// against the AVX2 ones on CPUs without AVX-512 as well (csrc/tests/cpu_quant_vnni_test.cpp).
#include "kernels/cpu_quant_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>

#if defined(RINGSERVE_EMULATE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define RINGSERVE_VNNI_TARGET "avx2,fma,f16c"
#define RINGSERVE_VNNI_ENTRY panel_products_avx512_vnni_emulated
#define RINGSERVE_TILE_ENTRY tile_products_avx512_vnni_emulated
#else
#define RINGSERVE_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define RINGSERVE_VNNI_ENTRY panel_products_avx512_vnni
#define RINGSERVE_TILE_ENTRY tile_products_avx512_vnni
#endif
#define RINGSERVE_TILE_TARGET RINGSERVE_VNNI_TARGET
#define RINGSERVE_TILE_VNNI 1
#include "kernels/cpu_quant_tiles.h"

namespace ringserve::kernels::quant {

namespace {

constexpr std::size_t kTileInputs = 8;  // input rows per tile

// int32 sums kept per input row and block: kQ8_2F keeps values 0-15 and 16-31 apart (each half has its own scale).
template <QuantType kType>
constexpr std::size_t kParts = kType == QuantType::kQ8_2F ? 2 : 1;

// Register g of two panels' blocks: panel a's 8 rows in int32 lanes 0-7, panel b's in lanes 8-15.
__attribute__((target(RINGSERVE_VNNI_TARGET))) inline __m512i two_panels(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

// kRows input rows from i0 against panels p0 and p1 (weight rows [j0, j0 + 16)); p1's outputs are stored only when
// `second` (a lone last panel is passed as both).
template <QuantType kType, std::size_t kRows, class T>
__attribute__((target(RINGSERVE_VNNI_TARGET))) void vnni_tile(LinearShape s, const PanelBlock* p0,
                                                               const PanelBlock* p1, bool second, const ActBlock* act,
                                                               const EpilogueOf<T>& epi, T* y, std::size_t i0,
                                                               std::size_t j0) {
  constexpr std::size_t kP = kParts<kType>;
  const std::size_t blocks = s.k / kQuantBlock;
  __m256 acc[kRows][2];
  for (std::size_t i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (std::size_t b = 0; b < blocks; ++b) {
    const ActBlock* a[kRows];
    for (std::size_t i = 0; i < kRows; ++i) a[i] = act + (i0 + i) * blocks + b;
    __m512i sums[kRows][kP];
    __m512i offset[kP];  // 8-bit formats: 128 x the weights' sums
    for (std::size_t part = 0; part < kP; ++part) {
      offset[part] = _mm512_setzero_si512();
      for (std::size_t i = 0; i < kRows; ++i) sums[i][part] = _mm512_setzero_si512();
    }
    for (std::size_t g = 0; g < 8; ++g) {
      const std::size_t part = kP == 2 ? g / 4 : 0;
      const __m512i w = two_panels(p0[b].q[g], p1[b].q[g]);
      if constexpr (is_signed(kType)) {
        offset[part] = _mm512_dpbusd_epi32(offset[part], _mm512_set1_epi8(static_cast<char>(0x80)), w);
      }
      for (std::size_t i = 0; i < kRows; ++i) {
        uint32_t four = 0;
        std::memcpy(&four, a[i]->q + 4 * g, sizeof four);
        if constexpr (is_signed(kType)) {
          sums[i][part] =
              _mm512_dpbusd_epi32(sums[i][part], _mm512_set1_epi32(static_cast<int>(four ^ 0x80808080U)), w);
        } else {
          sums[i][part] = _mm512_dpbusd_epi32(sums[i][part], w, _mm512_set1_epi32(static_cast<int>(four)));
        }
      }
    }
    for (std::size_t i = 0; i < kRows; ++i) {
      __m512i t[kP];
      for (std::size_t part = 0; part < kP; ++part) {
        t[part] = is_signed(kType) ? _mm512_sub_epi32(sums[i][part], offset[part]) : sums[i][part];
      }
      acc[i][0] = add_panel_block<kType>(acc[i][0], _mm512_castsi512_si256(t[0]), _mm512_castsi512_si256(t[kP - 1]),
                                         p0[b], *a[i]);
      acc[i][1] = add_panel_block<kType>(acc[i][1], _mm512_extracti64x4_epi64(t[0], 1),
                                         _mm512_extracti64x4_epi64(t[kP - 1], 1), p1[b], *a[i]);
    }
  }
  for (std::size_t i = 0; i < kRows; ++i) {
    store_panel_row(s, acc[i][0], epi, y, i0 + i, j0);
    if (second) store_panel_row(s, acc[i][1], epi, y, i0 + i, j0 + kQuantPanelRows);
  }
}

// Every input row against panels p0 and p1, kTileInputs rows at a time, then the rest in one tile.
template <QuantType kType, class T>
void vnni_rows(LinearShape s, const PanelBlock* p0, const PanelBlock* p1, bool second, const ActBlock* act,
               const EpilogueOf<T>& epi, T* y, std::size_t j0) {
  std::size_t i0 = 0;
  for (; i0 + kTileInputs <= s.m; i0 += kTileInputs) {
    vnni_tile<kType, kTileInputs>(s, p0, p1, second, act, epi, y, i0, j0);
  }
  [&]<std::size_t... kRest>(std::index_sequence<kRest...>) {
    ((s.m - i0 == kRest + 1 ? vnni_tile<kType, kRest + 1>(s, p0, p1, second, act, epi, y, i0, j0) : void()), ...);
  }(std::make_index_sequence<kTileInputs - 1>{});
}

}  // namespace

template <class T>
void RINGSERVE_VNNI_ENTRY(QuantType type, LinearShape s, const ActBlock* act, const PanelBlock* panels,
                          const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  const std::size_t blocks = s.k / kQuantBlock;
  const std::size_t all_panels = s.n / kQuantPanelRows;
  with_block_type(type, [&](auto t) {
    for (std::size_t j = j0; j < j1; j += 2 * kQuantPanelRows) {
      const std::size_t first = j / kQuantPanelRows;
      const PanelBlock* p0 = panels + first * blocks;
      const bool second = j + 2 * kQuantPanelRows <= j1;
      // The next two panels (most often this thread's next rows) on their way into L2 while these are computed.
      const auto* from = reinterpret_cast<const char*>(panels + std::min(all_panels, first + 2) * blocks);
      const auto* to = reinterpret_cast<const char*>(panels + std::min(all_panels, first + 4) * blocks);
      for (const char* at = from; at < to; at += 64) _mm_prefetch(at, _MM_HINT_T1);
      vnni_rows<decltype(t)::value>(s, p0, second ? p0 + blocks : p0, second, act, epi, y, j);
    }
  });
}

template void RINGSERVE_VNNI_ENTRY<float>(QuantType, LinearShape, const ActBlock*, const PanelBlock*,
                                          const EpilogueOf<float>&, float*, std::size_t, std::size_t);
template void RINGSERVE_VNNI_ENTRY<bf16_bits>(QuantType, LinearShape, const ActBlock*, const PanelBlock*,
                                              const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t, std::size_t);

}  // namespace ringserve::kernels::quant
