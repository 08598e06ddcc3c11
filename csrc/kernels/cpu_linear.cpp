#include "kernels/cpu_linear.h"

#include "kernels/parallel.h"
#include "kernels/simd_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace ringserve::kernels {

namespace {

// What is added to each product before its one rounding to T: bias[n] and residual[m, n], either may be null.
template <class T>
struct EpilogueOf {
  const T* bias;
  const T* residual;
};
using Epilogue = EpilogueOf<bf16_bits>;

constexpr std::size_t kRowTile = 4;    // weight rows sharing each load of x
constexpr std::size_t kInputTile = 4;  // input rows sharing each load of a weight row
constexpr std::size_t kLanes = 32;     // bf16 values per 512-bit register
constexpr std::size_t kPrefetchRows = 16;
// Products with at least this many weights (512 KiB of bf16) are split over two cores when the caller allows it.
constexpr std::size_t kSplitElements = std::size_t{1} << 18;
// With AVX512-BF16, from this many input rows (and an even K) the packed outer-product kernel below takes over.
constexpr std::size_t kPackedMinRows = 3;

template <class T>
void linear_portable(LinearShape s, const T* x, const T* w, const EpilogueOf<T>& epi, T* y) {
  for (std::size_t i = 0; i < s.m; ++i) {
    for (std::size_t j = 0; j < s.n; ++j) {
      float acc = 0.0F;
      for (std::size_t p = 0; p < s.k; ++p) acc += load_scalar(x[i * s.k + p]) * load_scalar(w[j * s.k + p]);
      if (epi.bias != nullptr) acc += load_scalar(epi.bias[j]);
      if (epi.residual != nullptr) acc += load_scalar(epi.residual[i * s.n + j]);
      store_scalar(&y[i * s.n + j], acc);
    }
  }
}

// Horizontal sum through memory: GCC 12's _mm512_reduce_add_ps trips -Werror=(maybe-)uninitialized inside its own
// header once inlined (a false positive no pragma here can silence), and this costs nothing measurable.
__attribute__((target("avx512f"))) inline float horizontal_sum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float sum = 0.0F;
  for (float lane : lanes) sum += lane;
  return sum;
}

// A tile's sums, each plus its bias and residual, rounded once into y[i0.., j0..].
template <std::size_t kInputs, std::size_t kRows>
__attribute__((target("avx512f"))) inline void store_tile(const __m512 (&acc)[kInputs][kRows], LinearShape s,
                                                          const Epilogue& epi, bf16_bits* y, std::size_t i0,
                                                          std::size_t j0) {
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) {
      float out = horizontal_sum(acc[i][r]);
      if (epi.bias != nullptr) out += bf16_to_float(epi.bias[j0 + r]);
      if (epi.residual != nullptr) out += bf16_to_float(epi.residual[(i0 + i) * s.n + j0 + r]);
      y[(i0 + i) * s.n + j0 + r] = float_to_bf16(out);
    }
  }
}

// A vector conversion (same bits, bf16 lanes); std::bit_cast is not compiled for AVX-512 and would change the ABI.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512bh reinterpret_bh(__m512i v) {
  return (__m512bh)v;  // NOLINT(google-readability-casting): vector casts have no named-cast form
}

// One tile: kRows weight rows from j0 against kInputs input rows from i0. Both counts are compile-time so the
// accumulators stay in registers. Rows below `j_end` are this call's; prefetches stay inside them.
template <std::size_t kInputs, std::size_t kRows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile_avx512(
    LinearShape s, const bf16_bits* x, const bf16_bits* w, const Epilogue& epi, bf16_bits* y, std::size_t i0,
    std::size_t j0, std::size_t j_end) {
  __m512 acc[kInputs][kRows];
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
  }
  // The weights stream from DRAM once per step, and a tile's rows are one contiguous run of memory. Each iteration
  // prefetches kRows cache lines, in address order, of the run kPrefetchRows rows further on: one tile's worth of
  // lines per tile, so the tile kPrefetchRows rows ahead is in cache by the time it is read.
  const std::size_t prefetch_from = (j0 + kPrefetchRows) * s.k;  // in elements of w
  const std::size_t prefetch_end = j_end * s.k;
  for (std::size_t p = 0, it = 0; p < s.k; p += kLanes, ++it) {
    const std::size_t left = s.k - p;
    const __mmask32 mask = left >= kLanes ? ~__mmask32{0} : static_cast<__mmask32>((1ULL << left) - 1);
    __m512bh wv[kRows];
    for (std::size_t r = 0; r < kRows; ++r) {
      const std::size_t line = prefetch_from + (it * kRows + r) * kLanes;  // kLanes bf16 values = one 64-byte line
      if (line < prefetch_end) _mm_prefetch(reinterpret_cast<const char*>(w + line), _MM_HINT_T0);
      wv[r] = reinterpret_bh(_mm512_maskz_loadu_epi16(mask, w + (j0 + r) * s.k + p));
    }
    for (std::size_t i = 0; i < kInputs; ++i) {
      const auto xv = reinterpret_bh(_mm512_maskz_loadu_epi16(mask, x + (i0 + i) * s.k + p));
      for (std::size_t r = 0; r < kRows; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[r], xv);
    }
  }
  store_tile<kInputs, kRows>(acc, s, epi, y, i0, j0);
}

// The even (low-half) and odd (high-half) bf16 values of each 32-bit lane, as float32.
__attribute__((target("avx512f"))) inline __m512 even_bf16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
__attribute__((target("avx512f"))) inline __m512 odd_bf16(__m512i v, __m512i high) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, high));
}

// The same tile for AVX-512 CPUs without BF16 dot products. A 32-bit lane holding two bf16 values (even element in
// the low half) yields both as float32 with one shift (even) and one mask (odd), for x and w alike; two FMAs then
// do what one dpbf16 does. Weights still stream from memory once, at half the bytes of float32 ones.
template <std::size_t kInputs, std::size_t kRows>
__attribute__((target("avx512f,avx512bw"))) void tile_fma(LinearShape s, const bf16_bits* x, const bf16_bits* w,
                                                           const Epilogue& epi, bf16_bits* y, std::size_t i0,
                                                           std::size_t j0, std::size_t j_end) {
  __m512 acc[kInputs][kRows];
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000U));
  const std::size_t prefetch_from = (j0 + kPrefetchRows) * s.k;  // as in tile_avx512
  const std::size_t prefetch_end = j_end * s.k;
  for (std::size_t p = 0, it = 0; p < s.k; p += kLanes, ++it) {
    const std::size_t left = s.k - p;
    const __mmask32 mask = left >= kLanes ? ~__mmask32{0} : static_cast<__mmask32>((1ULL << left) - 1);
    __m512 w_even[kRows];
    __m512 w_odd[kRows];
    for (std::size_t r = 0; r < kRows; ++r) {
      const std::size_t line = prefetch_from + (it * kRows + r) * kLanes;
      if (line < prefetch_end) _mm_prefetch(reinterpret_cast<const char*>(w + line), _MM_HINT_T0);
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + (j0 + r) * s.k + p);
      w_even[r] = even_bf16(wv);
      w_odd[r] = odd_bf16(wv, high);
    }
    for (std::size_t i = 0; i < kInputs; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + (i0 + i) * s.k + p);
      const __m512 x_even = even_bf16(xv);
      const __m512 x_odd = odd_bf16(xv, high);
      for (std::size_t r = 0; r < kRows; ++r) {
        acc[i][r] = _mm512_fmadd_ps(x_odd, w_odd[r], _mm512_fmadd_ps(x_even, w_even[r], acc[i][r]));
      }
    }
  }
  store_tile<kInputs, kRows>(acc, s, epi, y, i0, j0);
}

// Which tile the dot-product walk below runs.
enum class Dot { kBf16, kFma };

template <Dot kDot, std::size_t kInputs, std::size_t kRows>
void tile(LinearShape s, const bf16_bits* x, const bf16_bits* w, const Epilogue& epi, bf16_bits* y, std::size_t i0,
          std::size_t j0, std::size_t j_end) {
  if constexpr (kDot == Dot::kBf16) {
    tile_avx512<kInputs, kRows>(s, x, w, epi, y, i0, j0, j_end);
  } else {
    tile_fma<kInputs, kRows>(s, x, w, epi, y, i0, j0, j_end);
  }
}

// Input rows are the inner loop, so each weight tile is read from memory once (and reused from L1) whatever m is.
template <Dot kDot, std::size_t kRows>
void column_avx512(LinearShape s, const bf16_bits* x, const bf16_bits* w, const Epilogue& epi, bf16_bits* y,
                   std::size_t j0, std::size_t j_end) {
  std::size_t i0 = 0;
  for (; i0 + kInputTile <= s.m; i0 += kInputTile) tile<kDot, kInputTile, kRows>(s, x, w, epi, y, i0, j0, j_end);
  switch (s.m - i0) {
    case 3: tile<kDot, 3, kRows>(s, x, w, epi, y, i0, j0, j_end); break;
    case 2: tile<kDot, 2, kRows>(s, x, w, epi, y, i0, j0, j_end); break;
    case 1: tile<kDot, 1, kRows>(s, x, w, epi, y, i0, j0, j_end); break;
    default: break;
  }
}

// Weight rows [j_begin, j_end) of the product.
struct RowRange {
  LinearShape s;
  const bf16_bits* x;
  const bf16_bits* w;
  Epilogue epi;
  bf16_bits* y;
  std::size_t j_begin;
  std::size_t j_end;
};

template <Dot kDot>
void rows_avx512(const RowRange& job) {
  std::size_t j0 = job.j_begin;
  for (; j0 + kRowTile <= job.j_end; j0 += kRowTile) {
    column_avx512<kDot, kRowTile>(job.s, job.x, job.w, job.epi, job.y, j0, job.j_end);
  }
  for (; j0 < job.j_end; ++j0) column_avx512<kDot, 1>(job.s, job.x, job.w, job.epi, job.y, j0, job.j_end);
}

template <Dot kDot>
void linear_avx512(LinearShape s, const bf16_bits* x, const bf16_bits* w, const Epilogue& epi, bf16_bits* y,
                   bool two_cores) {
  // Blocks of row tiles claimed by two threads of the kernels' pool (kernels/parallel.h), so a descheduled thread
  // holds up at most one block.
  constexpr std::size_t kBlockRows = 8 * kRowTile;
  const std::size_t blocks = (s.n + kBlockRows - 1) / kBlockRows;
  for_each_item(blocks, 2, two_cores && s.n * s.k >= kSplitElements, [&](std::size_t b) {
    const RowRange rows{s, x, w, epi, y, b * kBlockRows, std::min(s.n, (b + 1) * kBlockRows)};
    rows_avx512<kDot>(rows);
  });
}

// ---- Batches: an outer-product kernel on weight panels packed per call ----
//
// With more than a couple of input rows the product is compute-bound, and the dot-product tiles above spend too
// much on their horizontal sums (K is a few hundred), on reloading x and (without BF16 dot products) on widening
// both operands for every use. Here each panel of kPanel weight rows is first packed so that one 512-bit load holds
// 16 output columns' values at one k; a micro-tile of kTileRows input rows x kPanel columns then keeps its 24
// float32 accumulators in registers for the whole of K, each step broadcasting one input value against three such
// loads. Panels of 48 split llama widths (576, 960, 1536, 3072, 4096, ...) into even panel counts, so two threads
// get equal shares, and tiles of 8 rows divide the usual batch sizes. Packing reads the weights once per call, as the
// product has to anyway, and writes an L2-resident buffer per thread.
//
// Two flavours share the walk over panels and tiles:
// - Bf16Panels (AVX512-BF16): the panel keeps bf16 "k-pairs", P[k/2][c] = (w[c][k], w[c][k+1]), and each step
//   broadcasts one k-pair of an input row (read in place) into dot products. Needs an even K.
// - FmaPanels (AVX-512F): the panel is widened to float32 once, P[k][c] = w[c][k], and x is widened once per call
//   into a per-thread buffer, so the inner loop is nothing but loads, broadcasts and FMAs (the dot-product tiles'
//   widening of every value at every use cost about half their arithmetic). Any K.

constexpr std::size_t kVectors = 3;              // 16-column vectors per panel
constexpr std::size_t kPanel = 16 * kVectors;    // weight rows (output columns) per packed panel
constexpr std::size_t kTileRows = 8;             // input rows per micro-tile (8 x 3 accumulators + 3 weights + 1)
constexpr std::size_t kPairsPerBlock = 16;  // the packing transposes 16 x 16 blocks of 32-bit values
// Without BF16 dot products, from this many input rows the float32 panels take over from the dot-product tiles.
constexpr std::size_t kFmaPackedMinRows = 10;

// Up to 16 values at p (the lanes in `mask`), as float32; the rest zero.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_masked(const bf16_bits* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
__attribute__((target("avx512f"))) inline __m512 load_masked(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
// Stores the lanes in `mask`, rounded to bf16 as float_to_bf16 does (float32: as they are).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_masked(bf16_bits* p, __mmask16 mask,
                                                                             __m512 v) {
  const __m512i high_halves = _mm512_castps_si512(round16(v, bf16_bits{}));  // bf16 in each lane's top half
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(high_halves, 16)));
}
__attribute__((target("avx512f"))) inline void store_masked(float* p, __mmask16 mask, __m512 v) {
  _mm512_mask_storeu_ps(p, mask, v);
}

// y[i0 .. i0 + kRows, j0 .. j0 + cols) = acc (+ bias, + residual), rounded once to T.
template <class T, std::size_t kRows>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_panel_tile(
    const __m512 (&acc)[kRows][kVectors], LinearShape s, const EpilogueOf<T>& epi, T* y, std::size_t i0,
    std::size_t j0, std::size_t cols) {
  for (std::size_t v = 0; v < kVectors; ++v) {
    const std::size_t c0 = v * 16;
    if (c0 >= cols) break;
    const std::size_t live = std::min<std::size_t>(16, cols - c0);
    const auto mask = static_cast<__mmask16>((1U << live) - 1U);
    const __m512 b = epi.bias != nullptr ? load_masked(epi.bias + j0 + c0, mask) : _mm512_setzero_ps();
    for (std::size_t i = 0; i < kRows; ++i) {
      __m512 out = _mm512_add_ps(acc[i][v], b);
      if (epi.residual != nullptr) out = _mm512_add_ps(out, load_masked(epi.residual + (i0 + i) * s.n + j0 + c0, mask));
      store_masked(y + (i0 + i) * s.n + j0 + c0, mask, out);
    }
  }
}

// Spreads a tile's share of the next panel's prefetches (`lines` cache lines from `ahead`) over its `steps` steps.
struct Prefetch {
  const char* ahead;
  std::size_t lines;
  std::size_t per_step;
  Prefetch(const char* from, std::size_t count, std::size_t steps)
      : ahead(from), lines(count), per_step(count == 0 ? 0 : count / steps + 1) {}
  void step(std::size_t p) const {
    for (std::size_t l = p * per_step; l < std::min(lines, (p + 1) * per_step); ++l) {
      _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
    }
  }
};

// Packs weight rows [j0, j0 + kPanel) (rows past n are zeros) as P[p][c] = k-pair p of row j0 + c, p < k / 2.
__attribute__((target("avx512f"))) void pack_panel_pairs(LinearShape s, const bf16_bits* w, std::size_t j0,
                                                         uint32_t* packed) {
  const std::size_t pairs = s.k / 2;
  for (std::size_t g = 0; g < kPanel; g += 16) {
    for (std::size_t p0 = 0; p0 < pairs; p0 += kPairsPerBlock) {
      const std::size_t count = std::min(kPairsPerBlock, pairs - p0);
      const auto mask = static_cast<__mmask16>((1U << count) - 1U);
      __m512i r[16];
      for (std::size_t c = 0; c < 16; ++c) {
        const std::size_t row = j0 + g + c;
        r[c] = row < s.n ? _mm512_maskz_loadu_epi32(mask, w + row * s.k + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (std::size_t p = 0; p < count; ++p) _mm512_storeu_si512(packed + (p0 + p) * kPanel + g, r[p]);
    }
  }
}

// Packs weight rows [j0, j0 + kPanel) (rows past n are zeros) as float32, P[p][c] = w[j0 + c][p], p < k.
template <class T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void pack_panel_f32(LinearShape s, const T* w, std::size_t j0,
                                                                         float* packed) {
  for (std::size_t g = 0; g < kPanel; g += 16) {
    for (std::size_t p0 = 0; p0 < s.k; p0 += 16) {
      const std::size_t count = std::min<std::size_t>(16, s.k - p0);
      const auto mask = static_cast<__mmask16>((1U << count) - 1U);
      __m512i r[16];
      for (std::size_t c = 0; c < 16; ++c) {
        const std::size_t row = j0 + g + c;
        r[c] = row < s.n ? _mm512_castps_si512(load_masked(w + row * s.k + p0, mask)) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (std::size_t p = 0; p < count; ++p) _mm512_storeu_si512(packed + (p0 + p) * kPanel + g, r[p]);
    }
  }
}

// The tiles: y[i0 .. i0 + kRows, j0 .. j0 + cols) from x's rows and the packed panel, over all of K.
// While a panel's tiles run, each prefetches its share of the next panel's weight rows into L2 (one contiguous run
// of memory), spread over its steps, so packing that panel does not wait on DRAM.
template <std::size_t kRows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void panel_tile_pairs(
    LinearShape s, const bf16_bits* x, const uint32_t* packed, const Epilogue& epi, bf16_bits* y, std::size_t i0,
    std::size_t j0, std::size_t cols, const Prefetch& next) {
  __m512 acc[kRows][kVectors];
  for (std::size_t i = 0; i < kRows; ++i) {
    for (std::size_t v = 0; v < kVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (std::size_t p = 0; p < s.k / 2; ++p) {
    next.step(p);
    const uint32_t* wp = packed + p * kPanel;
    __m512bh wv[kVectors];
    for (std::size_t v = 0; v < kVectors; ++v) wv[v] = reinterpret_bh(_mm512_loadu_si512(wp + 16 * v));
    for (std::size_t i = 0; i < kRows; ++i) {
      uint32_t pair = 0;
      std::memcpy(&pair, x + (i0 + i) * s.k + 2 * p, sizeof pair);
      const __m512bh xv = reinterpret_bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (std::size_t v = 0; v < kVectors; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xv);
    }
  }
  store_panel_tile<bf16_bits, kRows>(acc, s, epi, y, i0, j0, cols);
}

template <class T, std::size_t kRows>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void panel_tile_f32(
    LinearShape s, const float* x, const float* packed, const EpilogueOf<T>& epi, T* y, std::size_t i0,
    std::size_t j0, std::size_t cols, const Prefetch& next) {
  __m512 acc[kRows][kVectors];
  for (std::size_t i = 0; i < kRows; ++i) {
    for (std::size_t v = 0; v < kVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (std::size_t p = 0; p < s.k; ++p) {
    next.step(p);
    const float* wp = packed + p * kPanel;
    __m512 wv[kVectors];
    for (std::size_t v = 0; v < kVectors; ++v) wv[v] = _mm512_loadu_ps(wp + 16 * v);
    for (std::size_t i = 0; i < kRows; ++i) {
      const __m512 xv = _mm512_set1_ps(x[(i0 + i) * s.k + p]);
      for (std::size_t v = 0; v < kVectors; ++v) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
    }
  }
  store_panel_tile<T, kRows>(acc, s, epi, y, i0, j0, cols);
}

struct Bf16Panels {
  using Weight = bf16_bits;
  using Input = bf16_bits;  // x as given
  using Packed = uint32_t;
  static std::size_t steps(std::size_t k) { return k / 2; }
  static std::size_t packed_size(std::size_t k) { return kPanel * (k / 2); }
  static void pack(LinearShape s, const bf16_bits* w, std::size_t j0, Packed* packed) {
    pack_panel_pairs(s, w, j0, packed);
  }
  template <std::size_t kRows>
  static void tile(LinearShape s, const Input* x, const Packed* packed, const Epilogue& epi, bf16_bits* y,
                   std::size_t i0, std::size_t j0, std::size_t cols, const Prefetch& next) {
    panel_tile_pairs<kRows>(s, x, packed, epi, y, i0, j0, cols, next);
  }
};

// T: the weights' and outputs' type (bf16 or float32).
template <class T>
struct FmaPanels {
  using Weight = T;
  using Input = float;  // x as given (float32) or widened once per call (bf16)
  using Packed = float;
  static std::size_t steps(std::size_t k) { return k; }
  static std::size_t packed_size(std::size_t k) { return kPanel * k; }
  static void pack(LinearShape s, const T* w, std::size_t j0, Packed* packed) { pack_panel_f32(s, w, j0, packed); }
  template <std::size_t kRows>
  static void tile(LinearShape s, const Input* x, const Packed* packed, const EpilogueOf<T>& epi, T* y,
                   std::size_t i0, std::size_t j0, std::size_t cols, const Prefetch& next) {
    panel_tile_f32<T, kRows>(s, x, packed, epi, y, i0, j0, cols, next);
  }
};

// Panels [first, last) of the product, packing each into `packed` (Kernel::packed_size(k) values).
template <class Kernel, class T = typename Kernel::Weight>
void panels(LinearShape s, const typename Kernel::Input* x, const T* w, const EpilogueOf<T>& epi, T* y,
            std::size_t first, std::size_t last, typename Kernel::Packed* packed) {
  const std::size_t steps = Kernel::steps(s.k);
  for (std::size_t panel = first; panel < last; ++panel) {
    const std::size_t j0 = panel * kPanel;
    const std::size_t cols = std::min(kPanel, s.n - j0);
    Kernel::pack(s, w, j0, packed);
    // The next panel of this call's range, prefetched while this one's tiles run.
    const std::size_t ahead_rows = panel + 1 < last ? std::min(kPanel, s.n - j0 - kPanel) : 0;
    const char* ahead = reinterpret_cast<const char*>(w + (ahead_rows > 0 ? (j0 + kPanel) * s.k : 0));
    const std::size_t all_lines = ahead_rows * s.k * sizeof(T) / 64;
    // Spread over the panel's tiles (a burst in one tile would overrun the outstanding-miss queue).
    const std::size_t tiles = (s.m + kTileRows - 1) / kTileRows;
    const std::size_t lines_per_tile = (all_lines + tiles - 1) / tiles;
    const auto share = [&](std::size_t i0) {
      const std::size_t first_line = std::min(all_lines, i0 / kTileRows * lines_per_tile);
      return Prefetch(ahead + first_line * 64, std::min(lines_per_tile, all_lines - first_line), steps);
    };
    std::size_t i0 = 0;
    for (; i0 + kTileRows <= s.m; i0 += kTileRows) {
      Kernel::template tile<kTileRows>(s, x, packed, epi, y, i0, j0, cols, share(i0));
    }
    const Prefetch next = share(i0);
    switch (s.m - i0) {
      case 7: Kernel::template tile<7>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 6: Kernel::template tile<6>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 5: Kernel::template tile<5>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 4: Kernel::template tile<4>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 3: Kernel::template tile<3>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 2: Kernel::template tile<2>(s, x, packed, epi, y, i0, j0, cols, next); break;
      case 1: Kernel::template tile<1>(s, x, packed, epi, y, i0, j0, cols, next); break;
      default: break;
    }
  }
}

// Each thread keeps its buffers between calls (no allocation per step once the largest product has been seen).
template <class T, int kTag>
T* thread_buffer(std::size_t size) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

template <class Kernel, class T = typename Kernel::Weight>
void gemm(LinearShape s, const typename Kernel::Input* x, const T* w, const EpilogueOf<T>& epi, T* y,
          int threads) {
  using Packed = typename Kernel::Packed;
  const std::size_t panel_count = (s.n + kPanel - 1) / kPanel;
  // Runs of panels claimed by the kernels' pool threads (several per thread, so the others can take a late
  // thread's share), each packing into its own buffer; a run prefetches its next panel as it goes.
  const std::size_t run = std::max<std::size_t>(1, panel_count / (static_cast<std::size_t>(std::max(threads, 1)) * kChunksPerThread / 2));
  for_each_item((panel_count + run - 1) / run, threads, true, [&](std::size_t r) {
    panels<Kernel>(s, x, w, epi, y, r * run, std::min(panel_count, (r + 1) * run),
                   thread_buffer<Packed, 0>(Kernel::packed_size(s.k)));
  });
}

__attribute__((target("avx512f"))) void widen_bf16(const bf16_bits* in, float* out, std::size_t count) {
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) _mm512_storeu_ps(out + i, load16(in + i));
  for (; i < count; ++i) out[i] = bf16_to_float(in[i]);
}

// x widened to float32 (the calling thread's buffer, read by every thread of the product), then the float32 panels.
void gemm_fma(LinearShape s, const bf16_bits* x, const bf16_bits* w, const Epilogue& epi, bf16_bits* y,
              int threads) {
  float* wide = thread_buffer<float, 1>(s.m * s.k);
  constexpr std::size_t kChunk = 4096;  // values per item
  const std::size_t total = s.m * s.k;
  for_each_item((total + kChunk - 1) / kChunk, threads, total >= kParallelValues, [&](std::size_t c) {
    const std::size_t begin = c * kChunk;
    widen_bf16(x + begin, wide + begin, std::min(kChunk, total - begin));
  });
  gemm<FmaPanels<bf16_bits>>(s, wide, w, epi, y, threads);
}

}  // namespace

bool has_avx512_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

bool has_avx512f_linear() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return supported;
}

void linear_bf16(LinearShape shape, std::span<const bf16_bits> x, std::span<const bf16_bits> w,
                 std::span<const bf16_bits> bias, std::span<bf16_bits> y, LinearPath path, int threads,
                 std::span<const bf16_bits> residual) {
  require_size("linear_bf16", "x", x.size(), shape.m * shape.k);
  require_size("linear_bf16", "w", w.size(), shape.n * shape.k);
  require_size("linear_bf16", "y", y.size(), shape.m * shape.n);
  if (!bias.empty()) require_size("linear_bf16", "bias", bias.size(), shape.n);
  if (!residual.empty()) require_size("linear_bf16", "residual", residual.size(), shape.m * shape.n);
  const Epilogue epi{bias.empty() ? nullptr : bias.data(), residual.empty() ? nullptr : residual.data()};
  const bool bf16_dot = path == LinearPath::kFastest && has_avx512_bf16();
  const bool fma = !bf16_dot && path != LinearPath::kPortable && has_avx512f_linear();
  if (bf16_dot && shape.m >= kPackedMinRows && shape.k % 2 == 0) {
    gemm<Bf16Panels>(shape, x.data(), w.data(), epi, y.data(), threads);
  } else if (bf16_dot) {
    linear_avx512<Dot::kBf16>(shape, x.data(), w.data(), epi, y.data(), threads >= 2);
  } else if (fma && shape.m >= kFmaPackedMinRows) {
    gemm_fma(shape, x.data(), w.data(), epi, y.data(), threads);
  } else if (fma) {
    linear_avx512<Dot::kFma>(shape, x.data(), w.data(), epi, y.data(), threads >= 2);
  } else {
    linear_portable(shape, x.data(), w.data(), epi, y.data());
  }
}

void linear_f32(LinearShape shape, std::span<const float> x, std::span<const float> w, std::span<const float> bias,
                std::span<float> y, LinearPath path, int threads, std::span<const float> residual) {
  require_size("linear_f32", "x", x.size(), shape.m * shape.k);
  require_size("linear_f32", "w", w.size(), shape.n * shape.k);
  require_size("linear_f32", "y", y.size(), shape.m * shape.n);
  if (!bias.empty()) require_size("linear_f32", "bias", bias.size(), shape.n);
  if (!residual.empty()) require_size("linear_f32", "residual", residual.size(), shape.m * shape.n);
  const EpilogueOf<float> epi{bias.empty() ? nullptr : bias.data(), residual.empty() ? nullptr : residual.data()};
  if (path != LinearPath::kPortable && has_avx512f_linear()) {
    gemm<FmaPanels<float>>(shape, x.data(), w.data(), epi, y.data(), threads);
  } else {
    linear_portable(shape, x.data(), w.data(), epi, y.data());
  }
}

}  // namespace ringserve::kernels
