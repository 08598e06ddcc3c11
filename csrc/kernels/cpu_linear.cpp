#include "kernels/cpu_linear.h"

#include <immintrin.h>

#include <bit>
#include <stdexcept>
#include <string>

namespace ringserve::kernels {

namespace {

constexpr std::size_t kRowTile = 4;    // weight rows sharing each load of x
constexpr std::size_t kInputTile = 4;  // input rows sharing each load of a weight row
constexpr std::size_t kLanes = 32;     // bf16 values per 512-bit register
constexpr std::size_t kPrefetchRows = 16;
// Products with at least this many weights (512 KiB of bf16) are split over two cores when the caller allows it.
constexpr std::size_t kSplitElements = std::size_t{1} << 18;

void linear_portable(LinearShape s, const bf16_bits* x, const bf16_bits* w, const bf16_bits* bias, bf16_bits* y) {
  for (std::size_t i = 0; i < s.m; ++i) {
    for (std::size_t j = 0; j < s.n; ++j) {
      float acc = 0.0F;
      for (std::size_t p = 0; p < s.k; ++p) acc += bf16_to_float(x[i * s.k + p]) * bf16_to_float(w[j * s.k + p]);
      if (bias != nullptr) acc += bf16_to_float(bias[j]);
      y[i * s.n + j] = float_to_bf16(acc);
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

// A vector conversion (same bits, bf16 lanes); std::bit_cast is not compiled for AVX-512 and would change the ABI.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512bh reinterpret_bh(__m512i v) {
  return (__m512bh)v;  // NOLINT(google-readability-casting): vector casts have no named-cast form
}

// One tile: kRows weight rows from j0 against kInputs input rows from i0. Both counts are compile-time so the
// accumulators stay in registers. Rows below `j_end` are this call's; prefetches stay inside them.
template <std::size_t kInputs, std::size_t kRows>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile_avx512(
    LinearShape s, const bf16_bits* x, const bf16_bits* w, const bf16_bits* bias, bf16_bits* y, std::size_t i0,
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
  for (std::size_t i = 0; i < kInputs; ++i) {
    for (std::size_t r = 0; r < kRows; ++r) {
      float out = horizontal_sum(acc[i][r]);
      if (bias != nullptr) out += bf16_to_float(bias[j0 + r]);
      y[(i0 + i) * s.n + j0 + r] = float_to_bf16(out);
    }
  }
}

// Input rows are the inner loop, so each weight tile is read from memory once (and reused from L1) whatever m is.
template <std::size_t kRows>
void column_avx512(LinearShape s, const bf16_bits* x, const bf16_bits* w, const bf16_bits* bias, bf16_bits* y,
                   std::size_t j0, std::size_t j_end) {
  std::size_t i0 = 0;
  for (; i0 + kInputTile <= s.m; i0 += kInputTile) tile_avx512<kInputTile, kRows>(s, x, w, bias, y, i0, j0, j_end);
  switch (s.m - i0) {
    case 3: tile_avx512<3, kRows>(s, x, w, bias, y, i0, j0, j_end); break;
    case 2: tile_avx512<2, kRows>(s, x, w, bias, y, i0, j0, j_end); break;
    case 1: tile_avx512<1, kRows>(s, x, w, bias, y, i0, j0, j_end); break;
    default: break;
  }
}

// Weight rows [j_begin, j_end) of the product.
struct RowRange {
  LinearShape s;
  const bf16_bits* x;
  const bf16_bits* w;
  const bf16_bits* bias;
  bf16_bits* y;
  std::size_t j_begin;
  std::size_t j_end;
};

void rows_avx512(const RowRange& job) {
  std::size_t j0 = job.j_begin;
  for (; j0 + kRowTile <= job.j_end; j0 += kRowTile) {
    column_avx512<kRowTile>(job.s, job.x, job.w, job.bias, job.y, j0, job.j_end);
  }
  for (; j0 < job.j_end; ++j0) column_avx512<1>(job.s, job.x, job.w, job.bias, job.y, j0, job.j_end);
}

void linear_avx512(LinearShape s, const bf16_bits* x, const bf16_bits* w, const bf16_bits* bias, bf16_bits* y,
                   [[maybe_unused]] bool two_cores) {
#ifdef _OPENMP
  // The two halves of the rows on two threads of the OpenMP pool. Imported after torch, this module shares torch's
  // libgomp (same soname), so these are torch's own intra-op threads, already awake between the step's operators.
  if (two_cores && s.n * s.k >= kSplitElements) {
    const std::size_t middle = s.n / 2 / kRowTile * kRowTile;
    const RowRange halves[2] = {{s, x, w, bias, y, 0, middle}, {s, x, w, bias, y, middle, s.n}};
#pragma omp parallel for num_threads(2) schedule(static)
    for (int half = 0; half < 2; ++half) rows_avx512(halves[half]);
    return;
  }
#endif
  const RowRange all{s, x, w, bias, y, 0, s.n};
  rows_avx512(all);
}

}  // namespace

bool has_avx512_bf16() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
}

void linear_bf16(LinearShape shape, std::span<const bf16_bits> x, std::span<const bf16_bits> w,
                 std::span<const bf16_bits> bias, std::span<bf16_bits> y, bool force_portable, int threads) {
  require_size("linear_bf16", "x", x.size(), shape.m * shape.k);
  require_size("linear_bf16", "w", w.size(), shape.n * shape.k);
  require_size("linear_bf16", "y", y.size(), shape.m * shape.n);
  if (!bias.empty()) require_size("linear_bf16", "bias", bias.size(), shape.n);
  const bf16_bits* b = bias.empty() ? nullptr : bias.data();
  if (!force_portable && has_avx512_bf16()) {
    linear_avx512(shape, x.data(), w.data(), b, y.data(), threads >= 2);
  } else {
    linear_portable(shape, x.data(), w.data(), b, y.data());
  }
}

}  // namespace ringserve::kernels
