#include "kernels/cpu_quant.h"

#include "kernels/cpu_quant_blocks.h"
#include "kernels/parallel.h"

#define RINGSERVE_TILE_TARGET "avx2,fma,f16c"
#define RINGSERVE_TILE_VNNI 0
#define RINGSERVE_TILE_ENTRY tile_products_avx2
#include "kernels/cpu_quant_tiles.h"

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

// Weight rows [j0, j1) against every input row: from kPanelMinInputs input rows in 8-row panels as far as they go
// (kernels/cpu_quant_panels.cpp; packed panels with AVX-512 VNNI where `vnni`, kernels/cpu_quant_vnni.cpp), the rest
// in the tiles (kernels/cpu_quant_tiles.h; with VNNI where `vnni`).
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
  if (vnni) {
    quant::tile_products_avx512_vnni<T>(type, s, block_bytes, act, w, epi, y, j0, j1);
  } else {
    quant::tile_products_avx2<T>(type, s, block_bytes, act, w, epi, y, j0, j1);
  }
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
