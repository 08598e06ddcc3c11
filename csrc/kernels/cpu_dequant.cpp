// Quantized weight rows back to float32 (kernels/cpu_quant.h dequantize_f32): for products with many input rows,
// where a float32 GEMM on the dequantized rows beats the int8 kernel. Each value takes the float32 operations gguf's
// dequantization takes, in its order (no fused multiply-add), so both paths give gguf's values bit for bit.
#include "kernels/cpu_quant.h"

#include "kernels/parallel.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace ringserve::kernels {

namespace {

// Weight rows per item handed to a thread.
constexpr std::size_t kRowsPerItem = 16;

// The 4-bit formats' nibble p (low nibbles are values 0-15, high ones 16-31).
unsigned nibble(const uint8_t* qs, std::size_t p) { return p < 16 ? qs[p] & 0x0FU : qs[p - 16] >> 4U; }

void block_portable(QuantType type, const uint8_t* b, float* out) {
  switch (type) {
    case QuantType::kQ8_0: {
      const float d = half_to_float(read_block_u16(b));
      for (std::size_t p = 0; p < kQuantBlock; ++p) out[p] = static_cast<float>(static_cast<int8_t>(b[2 + p])) * d;
      return;
    }
    case QuantType::kQ8_2F: {
      const float d[2] = {read_block_f32(b), read_block_f32(b + 4)};
      for (std::size_t p = 0; p < kQuantBlock; ++p) out[p] = d[p / 16] * static_cast<float>(static_cast<int8_t>(b[8 + p]));
      return;
    }
    case QuantType::kQ4_0: {
      const Q4Header h = read_q4_header(type, b);
      for (std::size_t p = 0; p < kQuantBlock; ++p) out[p] = h.d * static_cast<float>(static_cast<int>(nibble(h.qs, p)) - 8);
      return;
    }
    case QuantType::kQ4_1:
    case QuantType::kQ4_1F: {
      const auto [d, m, qs] = read_q4_header(type, b);
      for (std::size_t p = 0; p < kQuantBlock; ++p) {
        const float scaled = d * static_cast<float>(nibble(qs, p));  // rounded on its own, as gguf does
        out[p] = scaled + m;
      }
      return;
    }
  }
}

// 8 int32 lanes to float32, times `scale`, then plus `offset` for the formats that have one (gguf adds nothing to the
// others, and adding 0 would turn a -0 product into +0).
__attribute__((target("avx2,fma,f16c"))) inline void store8(float* out, __m256i q, __m256 scale, __m256 offset,
                                                           bool with_offset) {
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale);
  _mm256_storeu_ps(out, with_offset ? _mm256_add_ps(v, offset) : v);
}

template <QuantType kType>
__attribute__((target("avx2,fma,f16c"))) void block_avx2(const uint8_t* b, float* out) {
  if constexpr (kType == QuantType::kQ8_0 || kType == QuantType::kQ8_2F) {
    const uint8_t* qs = b + (kType == QuantType::kQ8_0 ? 2 : 8);
    const __m256 lo = _mm256_set1_ps(kType == QuantType::kQ8_0 ? _cvtsh_ss(read_block_u16(b)) : read_block_f32(b));
    const __m256 hi = kType == QuantType::kQ8_0 ? lo : _mm256_set1_ps(read_block_f32(b + 4));
    for (std::size_t g = 0; g < 4; ++g) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g)));
      store8(out + 8 * g, q, g < 2 ? lo : hi, _mm256_setzero_ps(), false);
    }
  } else {
    const auto [d, m, qs] = read_q4_header_f16c<kType>(b);
    const __m256 scale = _mm256_set1_ps(d);
    const __m256 offset = _mm256_set1_ps(m);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    // Q4_0 is d * (q - 8) in gguf: the integer shifted first, then one rounding.
    const __m256i shift = _mm256_set1_epi32(kType == QuantType::kQ4_0 ? 8 : 0);
    for (std::size_t g = 0; g < 2; ++g) {
      const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * g)));
      const __m256i low = _mm256_sub_epi32(_mm256_and_si256(raw, mask), shift);
      const __m256i high = _mm256_sub_epi32(_mm256_srli_epi32(raw, 4), shift);
      store8(out + 8 * g, low, scale, offset, kType != QuantType::kQ4_0);
      store8(out + 16 + 8 * g, high, scale, offset, kType != QuantType::kQ4_0);
    }
  }
}

template <QuantType kType>
void rows_avx2(const uint8_t* w, std::size_t blocks, std::size_t block_bytes, float* out, std::size_t j0,
               std::size_t j1) {
  for (std::size_t b = j0 * blocks; b < j1 * blocks; ++b) block_avx2<kType>(w + b * block_bytes, out + b * kQuantBlock);
}

void rows_avx2_any(QuantType type, const uint8_t* w, std::size_t blocks, std::size_t block_bytes, float* out,
                   std::size_t j0, std::size_t j1) {
  switch (type) {
    case QuantType::kQ8_0: rows_avx2<QuantType::kQ8_0>(w, blocks, block_bytes, out, j0, j1); break;
    case QuantType::kQ4_0: rows_avx2<QuantType::kQ4_0>(w, blocks, block_bytes, out, j0, j1); break;
    case QuantType::kQ4_1: rows_avx2<QuantType::kQ4_1>(w, blocks, block_bytes, out, j0, j1); break;
    case QuantType::kQ4_1F: rows_avx2<QuantType::kQ4_1F>(w, blocks, block_bytes, out, j0, j1); break;
    case QuantType::kQ8_2F: rows_avx2<QuantType::kQ8_2F>(w, blocks, block_bytes, out, j0, j1); break;
  }
}

}  // namespace

void dequantize_f32(QuantType type, std::size_t n, std::size_t k, std::span<const uint8_t> w, std::span<float> out,
                    QuantPath path, int threads) {
  static constexpr const char* kOp = "dequantize_f32";
  const std::size_t block_bytes = quant_block_bytes(type);
  require(k % kQuantBlock == 0, kOp, "k (" + std::to_string(k) + ") is not a multiple of 32");
  const std::size_t blocks = k / kQuantBlock;
  require(w.size() == n * blocks * block_bytes, kOp,
          "w holds " + std::to_string(w.size()) + " bytes, expected " + std::to_string(n * blocks * block_bytes));
  require_size(kOp, "out", out.size(), n * k);
  const bool avx2 = path == QuantPath::kFastest && has_avx2_quant();
  const std::size_t items = (n + kRowsPerItem - 1) / kRowsPerItem;
  for_each_item(items, threads, n * k >= kParallelValues, [&](std::size_t item) {
    const std::size_t j0 = item * kRowsPerItem;
    const std::size_t j1 = std::min(n, j0 + kRowsPerItem);
    if (avx2) {
      rows_avx2_any(type, w.data(), blocks, block_bytes, out.data(), j0, j1);
      return;
    }
    for (std::size_t b = j0 * blocks; b < j1 * blocks; ++b) {
      block_portable(type, w.data() + b * block_bytes, out.data() + b * kQuantBlock);
    }
  });
}

}  // namespace ringserve::kernels
