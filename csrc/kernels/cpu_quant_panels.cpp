// Many input rows against quantized weights: panels of 8 weight rows (kernels/cpu_quant_blocks.h
// panel_products_avx2).
//
// For a prompt chunk or a large batch each weight block meets many input blocks, so the weight rows are laid out
// again, 8 rows at a time, as panels (once for the whole weight by pack_quant_panels, or a chunk's rows per call): per
// block, register g holds values 4g..4g+3 of each of the 8 rows
// (row r in int32 lane r), beside the rows' scales and offsets in float32. One input block's four values 4g..4g+3,
// broadcast to every lane, meet register g in one maddubs, whose sums already sit one row per lane: no horizontal
// sums, and 8 outputs stored together. The 4-bit formats hold their nibbles as unsigned bytes; the 8-bit formats'
// panels hold the int8 values themselves. A tile keeps 4 input rows' sums in registers (and, for the 4-bit formats,
// two panels' worth), so every register loaded meets several others before it is dropped.
#include "kernels/cpu_quant_blocks.h"
#include "kernels/parallel.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringserve::kernels::quant {

namespace {

// The 8 rows' half-precision field at byte `field` of each row's block at `at`, as 8 float32 lanes.
__attribute__((target("avx2,fma,f16c"))) inline __m256 halves8(const uint8_t* at, std::size_t row_bytes,
                                                              std::size_t field) {
  uint16_t h[kQuantPanelRows];
  for (std::size_t r = 0; r < kQuantPanelRows; ++r) h[r] = read_block_u16(at + r * row_bytes + field);
  return _mm256_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(h[0]), static_cast<int16_t>(h[1]),
                                        static_cast<int16_t>(h[2]), static_cast<int16_t>(h[3]),
                                        static_cast<int16_t>(h[4]), static_cast<int16_t>(h[5]),
                                        static_cast<int16_t>(h[6]), static_cast<int16_t>(h[7])));
}

// Weight rows [j0, j0 + 8) of an 8-bit format as a panel of `blocks` blocks: int8 values as they are, each row's
// 32 bytes one register, the 8 registers transposed as 8 x 8 int32s.
template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) void pack_8_bit_panel(const uint8_t* w, std::size_t blocks,
                                                               std::size_t block_bytes, std::size_t j0,
                                                               PanelBlock* panel) {
  const std::size_t row_bytes = blocks * block_bytes;
  for (std::size_t b = 0; b < blocks; ++b) {
    PanelBlock& out = panel[b];
    const uint8_t* at = w + j0 * row_bytes + b * block_bytes;
    if constexpr (kType == QuantType::kQ8_0) {
      const __m256 d = halves8(at, row_bytes, 0);
      _mm256_storeu_ps(out.d, d);
      _mm256_storeu_ps(out.m, d);
    } else {
      for (std::size_t r = 0; r < kQuantPanelRows; ++r) {
        const Q8Header h = read_q8_header_f16c<kType>(at + r * row_bytes);
        out.d[r] = h.d0;
        out.m[r] = h.d1;
      }
    }
    __m256i row[kQuantPanelRows];
    for (std::size_t r = 0; r < kQuantPanelRows; ++r) {
      row[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(read_q8_header_f16c<kType>(at + r * row_bytes).qs));
    }
    // t: rows 2i and 2i + 1 interleaved; u: 4 rows' int32 g (low lane) and g + 4 (high lane).
    __m256i t[kQuantPanelRows];
    for (std::size_t i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(row[2 * i], row[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(row[2 * i], row[2 * i + 1]);
    }
    const __m256i u[kQuantPanelRows] = {
        _mm256_unpacklo_epi64(t[0], t[2]), _mm256_unpackhi_epi64(t[0], t[2]), _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]), _mm256_unpacklo_epi64(t[4], t[6]), _mm256_unpackhi_epi64(t[4], t[6]),
        _mm256_unpacklo_epi64(t[5], t[7]), _mm256_unpackhi_epi64(t[5], t[7])};
    for (std::size_t g = 0; g < 4; ++g) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q[g]), _mm256_permute2x128_si256(u[g], u[g + 4], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q[g + 4]), _mm256_permute2x128_si256(u[g], u[g + 4], 0x31));
    }
  }
}

// Weight rows [j0, j0 + 8) of a 4-bit format as a panel of `blocks` blocks: nibbles as unsigned bytes.
template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) void pack_4_bit_panel(const uint8_t* w, std::size_t blocks,
                                                               std::size_t block_bytes, std::size_t j0,
                                                               PanelBlock* panel) {
  const std::size_t row_bytes = blocks * block_bytes;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (std::size_t b = 0; b < blocks; ++b) {
    PanelBlock& out = panel[b];
    __m256i pair[4];  // rows r and r + 4: their 16 nibble bytes in the low and high 128-bit lanes
    const uint8_t* at = w + j0 * row_bytes + b * block_bytes;
    if constexpr (kType == QuantType::kQ4_1F) {
      for (std::size_t r = 0; r < kQuantPanelRows; ++r) {
        const Q4Header h = read_q4_header_f16c<kType>(at + r * row_bytes);
        out.d[r] = h.d;
        out.m[r] = h.m;
      }
    } else {  // half-precision fields, converted 8 at a time (Q4_0: no offset field, m = -8 d)
      const __m256 d = halves8(at, row_bytes, 0);
      _mm256_storeu_ps(out.d, d);
      _mm256_storeu_ps(out.m, kType == QuantType::kQ4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0F))
                                                        : halves8(at, row_bytes, 2));
    }
    for (std::size_t r = 0; r < kQuantPanelRows; ++r) {
      const Q4Header h = read_q4_header_f16c<kType>(at + r * row_bytes);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.qs));
      pair[r % 4] = r < 4 ? _mm256_castsi128_si256(q) : _mm256_inserti128_si256(pair[r % 4], q, 1);
    }
    // A 4 x 4 transpose of int32s in each lane: t[g] then holds bytes 4g..4g+3 of rows 0-3 (low lane), 4-7 (high).
    const __m256i lo01 = _mm256_unpacklo_epi32(pair[0], pair[1]);
    const __m256i lo23 = _mm256_unpacklo_epi32(pair[2], pair[3]);
    const __m256i hi01 = _mm256_unpackhi_epi32(pair[0], pair[1]);
    const __m256i hi23 = _mm256_unpackhi_epi32(pair[2], pair[3]);
    const __m256i t[4] = {_mm256_unpacklo_epi64(lo01, lo23), _mm256_unpackhi_epi64(lo01, lo23),
                          _mm256_unpacklo_epi64(hi01, hi23), _mm256_unpackhi_epi64(hi01, hi23)};
    for (std::size_t g = 0; g < 4; ++g) {  // low nibbles are values 0-15, high nibbles 16-31
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q[g]), _mm256_and_si256(t[g], mask));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q[g + 4]), _mm256_and_si256(_mm256_srli_epi16(t[g], 4), mask));
    }
  }
}

// How one input block's sums against a panel block are formed: the panel tile below is written once over this
// policy. Each gives weights(wq) (what a panel register becomes before it meets inputs), add(g, w, x4) (register g
// against 4 broadcast input values) and add_to(acc, w, a) (the block's exact int32 sums through add_panel_block).

// The 4-bit formats: nibbles (0-15) against int8 inputs; the 8 registers' int16 sums stay within int16
// (8 x 2 x 15 x 127 < 32768), so a block costs 8 maddubs, 8 int16 adds and one madd for 8 rows.
template <QuantType kType>
struct NibbleSums {
  __m256i sums{};

  __attribute__((target("avx2,fma,f16c"))) static __m256i weights(__m256i wq) { return wq; }
  __attribute__((target("avx2,fma,f16c"))) void add(std::size_t /*g*/, __m256i w, __m256i x4) {
    sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(w, x4));
    // Kept a running sum: left free, GCC re-associates a tile's 32 int16 adds into a tree and spills the maddubs
    // results to the stack (1.2x slower).
    asm("" : "+x"(sums));
  }
  __attribute__((target("avx2,fma,f16c"))) __m256 add_to(__m256 acc, const PanelBlock& w, const ActBlock& a) const {
    return add_panel_block<kType>(acc, _mm256_madd_epi16(sums, _mm256_set1_epi16(1)), __m256i{}, w, a);
  }
};

// The 8-bit formats: maddubs takes |w| against x carrying w's sign, and its int16 pair sums (up to 2 x 128 x 127)
// cannot be added in int16, so each goes to int32 at once; values 0-15 (registers 0-3) and 16-31 keep their own sums
// for their own scales.
template <QuantType kType>
struct SignedSums {
  struct Weights {
    __m256i abs;
    __m256i sign;
  };
  __m256i sums[2]{};

  __attribute__((target("avx2,fma,f16c"))) static Weights weights(__m256i wq) { return {_mm256_sign_epi8(wq, wq), wq}; }
  __attribute__((target("avx2,fma,f16c"))) void add(std::size_t g, Weights w, __m256i x4) {
    const __m256i pairs = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x4, w.sign));
    sums[g / 4] = _mm256_add_epi32(sums[g / 4], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  __attribute__((target("avx2,fma,f16c"))) __m256 add_to(__m256 acc, const PanelBlock& w, const ActBlock& a) const {
    if constexpr (kType == QuantType::kQ8_0) {
      return add_panel_block<kType>(acc, _mm256_add_epi32(sums[0], sums[1]), __m256i{}, w, a);
    } else {
      return add_panel_block<kType>(acc, sums[0], sums[1], w, a);
    }
  }
};

template <QuantType kType>
using PanelSums = std::conditional_t<is_signed(kType), SignedSums<kType>, NibbleSums<kType>>;

// kInputs input rows from i0 against kPanels panels (weight rows [j0, j0 + 8 kPanels)): each broadcast input group
// meets every panel's register before the next is loaded.
template <QuantType kType, std::size_t kInputs, std::size_t kPanels, class T>
__attribute__((target("avx2,fma,f16c"))) void panel_tile(LinearShape s, const PanelBlock* const* panels,
                                                         const ActBlock* act, const EpilogueOf<T>& epi, T* y,
                                                         std::size_t i0, std::size_t j0) {
  const std::size_t blocks = s.k / kQuantBlock;
  __m256 acc[kInputs][kPanels];
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t p = 0; p < kPanels; ++p) acc[i][p] = _mm256_setzero_ps();
  }
  for (std::size_t b = 0; b < blocks; ++b) {
    const ActBlock* a[kInputs];
    PanelSums<kType> sums[kInputs][kPanels];
    for (std::size_t i = 0; i < kInputs; ++i) a[i] = act + (i0 + i) * blocks + b;
    for (std::size_t g = 0; g < 8; ++g) {
      decltype(PanelSums<kType>::weights(__m256i{})) wg[kPanels];
      for (std::size_t p = 0; p < kPanels; ++p) {
        wg[p] = PanelSums<kType>::weights(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panels[p][b].q[g])));
      }
      for (std::size_t i = 0; i < kInputs; ++i) {
        int32_t four = 0;
        std::memcpy(&four, a[i]->q + 4 * g, sizeof four);
        const __m256i x4 = _mm256_set1_epi32(four);
        for (std::size_t p = 0; p < kPanels; ++p) sums[i][p].add(g, wg[p], x4);
      }
    }
    for (std::size_t p = 0; p < kPanels; ++p) {
      for (std::size_t i = 0; i < kInputs; ++i) acc[i][p] = sums[i][p].add_to(acc[i][p], panels[p][b], *a[i]);
    }
  }
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t p = 0; p < kPanels; ++p) store_panel_row(s, acc[i][p], epi, y, i0 + i, j0 + p * kQuantPanelRows);
  }
}

// The calling thread's panel buffer (kept between calls).
PanelBlock* panel_buffer(std::size_t blocks) {
  thread_local std::vector<PanelBlock> buffer;
  if (buffer.size() < blocks) buffer.resize(blocks);
  return buffer.data();
}

// Every input row against the kPanels panels at weight row j, kInputs rows at a time, then the rest in one tile.
template <QuantType kType, std::size_t kInputs, std::size_t kPanels, class T>
void panel_rows(LinearShape s, const PanelBlock* const* panels, const ActBlock* act, const EpilogueOf<T>& epi, T* y,
                std::size_t j) {
  std::size_t i0 = 0;
  for (; i0 + kInputs <= s.m; i0 += kInputs) panel_tile<kType, kInputs, kPanels>(s, panels, act, epi, y, i0, j);
  [&]<std::size_t... kRest>(std::index_sequence<kRest...>) {
    ((s.m - i0 == kRest + 1 ? panel_tile<kType, kRest + 1, kPanels>(s, panels, act, epi, y, i0, j) : void()), ...);
  }(std::make_index_sequence<kInputs - 1>{});
}

// Weight rows [j0, j0 + 8) as a panel of `blocks` blocks.
template <QuantType kType>
void pack_panel(const uint8_t* w, std::size_t blocks, std::size_t block_bytes, std::size_t j0, PanelBlock* out) {
  if constexpr (is_signed(kType)) {
    pack_8_bit_panel<kType>(w, blocks, block_bytes, j0, out);
  } else {
    pack_4_bit_panel<kType>(w, blocks, block_bytes, j0, out);
  }
}

// The memory from `from` to `to` on its way into the cache level `kHint` names (a hint: the hardware may drop it).
template <_mm_hint kHint>
__attribute__((target("avx2,fma,f16c"))) inline void prefetch_range(const uint8_t* from, const uint8_t* to) {
  for (const uint8_t* at = from; at < to; at += 64) _mm_prefetch(reinterpret_cast<const char*>(at), kHint);
}

// A tile holds 4 input rows; the 4-bit formats' tiles span two panels (16 weight rows), so each broadcast input group
// meets two weight registers (20% faster on SmolLM2's shapes), while the 8-bit formats' sums (two registers per
// input row and panel) leave room for one.
template <QuantType kType, class T>
void panels_avx2(LinearShape s, std::size_t block_bytes, const ActBlock* act, const uint8_t* w,
                 const PanelBlock* packed, const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1) {
  constexpr std::size_t kInputs = 4;
  constexpr std::size_t kPanels = is_signed(kType) ? 1 : 2;
  constexpr std::size_t kTileRows = kPanels * kQuantPanelRows;
  const std::size_t blocks = s.k / kQuantBlock;
  const std::size_t row_bytes = blocks * block_bytes;
  PanelBlock* buffer = packed == nullptr ? panel_buffer(kPanels * blocks) : nullptr;
  const PanelBlock* panels[kPanels];
  // The panels of weight rows [j, j + 8 count): the packed ones, or laid out into the buffer now. Meanwhile the next
  // tile's bytes (contiguous; past j1 they are most often this thread's next chunk) are prefetched: the rows to pack
  // into L1 (a layer's projections 1.05-1.1x faster), packed panels into L2 (the tile's own panels, read again for
  // every 4 input rows, keep L1).
  auto take = [&](std::size_t j, std::size_t count) {
    const std::size_t end = packed != nullptr ? s.n / kQuantPanelRows * kQuantPanelRows : s.n;
    const std::size_t next = std::min(end, j + count * kQuantPanelRows + kTileRows);
    for (std::size_t p = 0; p < count; ++p) {
      if (packed != nullptr) {
        panels[p] = packed + (j / kQuantPanelRows + p) * blocks;
      } else {
        pack_panel<kType>(w, blocks, block_bytes, j + p * kQuantPanelRows, buffer + p * blocks);
        panels[p] = buffer + p * blocks;
      }
    }
    const std::size_t after = j + count * kQuantPanelRows;
    if (packed != nullptr) {
      const PanelBlock* from = packed + after / kQuantPanelRows * blocks;
      const PanelBlock* to = packed + std::max(next, after) / kQuantPanelRows * blocks;
      prefetch_range<_MM_HINT_T1>(reinterpret_cast<const uint8_t*>(from), reinterpret_cast<const uint8_t*>(to));
    } else {
      prefetch_range<_MM_HINT_T0>(w + after * row_bytes, w + std::max(next, after) * row_bytes);
    }
  };
  std::size_t j = j0;
  for (; j + kTileRows <= j1; j += kTileRows) {
    take(j, kPanels);
    panel_rows<kType, kInputs, kPanels>(s, panels, act, epi, y, j);
  }
  if constexpr (kPanels > 1) {
    for (; j < j1; j += kQuantPanelRows) {  // the rows short of a whole tile, one panel at a time
      take(j, 1);
      panel_rows<kType, kInputs, 1>(s, panels, act, epi, y, j);
    }
  }
}

}  // namespace

template <class T>
void panel_products_avx2(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act,
                         const uint8_t* w, const uint8_t* panels, const EpilogueOf<T>& epi, T* y, std::size_t j0,
                         std::size_t j1) {
  const auto* packed = reinterpret_cast<const PanelBlock*>(panels);
  with_block_type(type, [&](auto t) {
    panels_avx2<decltype(t)::value>(s, block_bytes, act, w, packed, epi, y, j0, j1);
  });
}

template void panel_products_avx2<float>(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                                         const uint8_t*, const EpilogueOf<float>&, float*, std::size_t, std::size_t);
template void panel_products_avx2<bf16_bits>(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                                             const uint8_t*, const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t,
                                             std::size_t);

}  // namespace ringserve::kernels::quant

namespace ringserve::kernels {

std::size_t quant_panel_bytes(QuantType type, std::size_t n, std::size_t k) {
  quant_block_bytes(type);  // throws for a value outside the enum
  if (k % kQuantBlock != 0) {
    throw std::invalid_argument("quant_panel_bytes: k (" + std::to_string(k) + ") is not a multiple of 32");
  }
  return n / kQuantPanelRows * (k / kQuantBlock) * sizeof(quant::PanelBlock);
}

void pack_quant_panels(QuantType type, std::size_t n, std::size_t k, std::span<const uint8_t> w,
                       std::span<uint8_t> out, int threads) {
  const std::size_t bytes = quant_panel_bytes(type, n, k);
  const std::size_t blocks = k / kQuantBlock;
  const std::size_t block_bytes = quant_block_bytes(type);
  if (w.size() != n * blocks * block_bytes || out.size() != bytes) {
    throw std::invalid_argument("pack_quant_panels: w holds " + std::to_string(w.size()) + " bytes (expected " +
                                std::to_string(n * blocks * block_bytes) + "), out " + std::to_string(out.size()) +
                                " (expected " + std::to_string(bytes) + ")");
  }
  if (!has_avx2_quant()) throw std::invalid_argument("pack_quant_panels: the panels are read by the AVX2 path only");
  auto* panels = reinterpret_cast<quant::PanelBlock*>(out.data());
  quant::with_block_type(type, [&](auto t) {
    constexpr QuantType kType = decltype(t)::value;
    for_each_item(n / kQuantPanelRows, threads, bytes >= kParallelValues, [&](std::size_t p) {
      quant::pack_panel<kType>(w.data(), blocks, block_bytes, p * kQuantPanelRows, panels + p * blocks);
    });
  });
}

}  // namespace ringserve::kernels
