// Matrix products with GGUF-quantized weights for CPU workers: y[M, N] = x[M, K] * w[N, K]^T (+ bias) (+ residual),
// where each weight row is a run of blocks of 32 values, as a GGUF file stores them.
//
// The input rows are first quantized per block of 32 values to int8 (scale = the block's largest magnitude / 127,
// rounded to nearest even), keeping each block's scale and, for weight formats with an offset, its scaled sum; each
// weight block then meets each input block in one integer dot product (int8 x int8, or uint8 nibbles x int8),
// scaled once in float32. On AVX2 CPUs these are _mm256_maddubs_epi16 / _mm256_madd_epi16 (vpdpbusd where AVX-512
// VNNI runs, the same integer sums); elsewhere portable loops compute the same sums (the reference the tests hold the
// AVX2 path to). The activations' quantization is the same
// code's result on both paths, bit for bit.
//
// Decode rows (a few inputs) read each weight block once for every input row; for a single input row the 4-bit
// formats put two weight rows' nibbles in one register, so each maddubs covers two rows, and the next tile of weight
// rows is prefetched while one is computed. Prompt chunks and large batches (32 input rows or more) read each 8 weight
// rows as a panel that holds 4 values of every row per register (laid out once by pack_quant_panels, or per call),
// so that one maddubs against 4 broadcast input values covers 8 rows and the int32 sums come out one row per lane (for
// the 4-bit formats 1.5-2x a float32 GEMM on dequantized weights). Threads take chunks of 16 weight rows as they free
// up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include <immintrin.h>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

// Weight block formats, each a block of 32 values (byte sizes in quant_block_bytes). The first three are GGUF's own
// layouts (ggml's block_q8_0, block_q4_0, block_q4_1, float16 scales); the last two hold a k-quant's 256-value
// super-blocks repacked without loss at load time (workers/model/quant_ops.py):
// - kQ4_1F: Q4_K's sub-blocks: float32 scale d, float32 offset m, 16 bytes of nibbles; value = d * q + m.
// - kQ8_2F: Q6_K's sub-blocks, two per block: float32 scales d0 (values 0-15) and d1 (16-31), 32 int8 values.
// In the 4-bit formats byte i holds value i in its low nibble and value i + 16 in its high one.
enum class QuantType : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_1F = 3, kQ8_2F = 4 };

constexpr std::size_t kQuantBlock = 32;  // values per block

// Bytes per block of `type`; std::invalid_argument for a value outside the enum.
std::size_t quant_block_bytes(QuantType type);

// True when this CPU runs the AVX2 path (AVX2, FMA and F16C).
bool has_avx2_quant();
// True when the AVX2 path's integer sums take AVX-512 VNNI here (AVX-512 F, BW, VL and VNNI): vpdpbusd in the tiles,
// and in the panels where packed ones are given (kernels/cpu_quant_vnni.cpp); the same bits as AVX2.
bool has_avx512_vnni_quant();

// kFastest: the fastest path this CPU has; kAvx2: the AVX2 path even where AVX-512 VNNI runs (to compare them);
// kPortable: the portable loops.
enum class QuantPath { kFastest, kAvx2, kPortable };

// x: m*k, w: n rows of k/32 blocks, y: m*n, bias: n or empty, residual: m*n or empty (may be y itself). K must be a
// multiple of 32. Throws std::invalid_argument on a size mismatch. Weight rows are split in chunks over `threads`
// threads when the product is large enough.
// panels: the weight's panels as pack_quant_panels lays them out, or empty (each product of many input rows then
// lays out the rows it needs itself).
void linear_quant_f32(LinearShape shape, QuantType type, std::span<const float> x, std::span<const uint8_t> w,
                      std::span<const float> bias, std::span<float> y, QuantPath path = QuantPath::kFastest,
                      int threads = 1, std::span<const float> residual = {}, std::span<const uint8_t> panels = {});
void linear_quant_bf16(LinearShape shape, QuantType type, std::span<const bf16_bits> x, std::span<const uint8_t> w,
                       std::span<const bf16_bits> bias, std::span<bf16_bits> y, QuantPath path = QuantPath::kFastest,
                       int threads = 1, std::span<const bf16_bits> residual = {},
                       std::span<const uint8_t> panels = {});

// The weight's panels, laid out once: products of many input rows on the AVX2 path read every weight row in 8-row
// panels (kernels/cpu_quant_panels.cpp), which they otherwise build again on every call (7% of a 64-row decode step
// on SmolLM2). quant_panel_bytes is their size for n rows of k / 32 blocks of `type` (the first n / 8 * 8 rows; the
// rest never take panels); pack_quant_panels writes them into out (exactly that size), over `threads` threads. Both
// throw std::invalid_argument on a size mismatch, pack_quant_panels also where the AVX2 path does not run.
constexpr std::size_t kQuantPanelRows = 8;  // weight rows per panel
std::size_t quant_panel_bytes(QuantType type, std::size_t n, std::size_t k);
void pack_quant_panels(QuantType type, std::size_t n, std::size_t k, std::span<const uint8_t> w,
                       std::span<uint8_t> out, int threads = 1);

// The float32 values of n weight rows of k / 32 blocks of `type` (w: exactly those rows' bytes), row-major into out
// (n * k): gguf's dequantization, bit for bit (kernels/cpu_dequant.cpp). For products with many input rows, where a
// float32 GEMM on dequantized rows beats the int8 kernel. Throws std::invalid_argument on a size mismatch; rows are
// split over `threads` threads when there are enough.
void dequantize_f32(QuantType type, std::size_t n, std::size_t k, std::span<const uint8_t> w, std::span<float> out,
                    QuantPath path = QuantPath::kFastest, int threads = 1);

// A block's float32 and float16 fields, read where they lie (blocks are packed, so unaligned).
inline float read_block_f32(const uint8_t* p) {
  float v = 0.0F;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint16_t read_block_u16(const uint8_t* p) {
  uint16_t v = 0;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE half precision to float32 (exact; subnormals, infinities and NaN kept).
float half_to_float(uint16_t h);

// A 4-bit block's header (kQ4_0, kQ4_1, kQ4_1F): nibble q stands for d * q + m (Q4_0 has no offset field: m = -8 d),
// and its 16 bytes of nibbles start at qs. read_q4_header is the portable reader; read_q4_header_f16c gives the same
// values with the CPU's half-precision conversion, for the AVX2 kernels.
struct Q4Header {
  float d;
  float m;
  const uint8_t* qs;
};

inline Q4Header read_q4_header(QuantType type, const uint8_t* b) {
  if (type == QuantType::kQ4_1F) return {read_block_f32(b), read_block_f32(b + 4), b + 8};
  const float d = half_to_float(read_block_u16(b));
  if (type == QuantType::kQ4_0) return {d, -8.0F * d, b + 2};
  return {d, half_to_float(read_block_u16(b + 2)), b + 4};
}

template <QuantType kType>
__attribute__((target("f16c"))) inline Q4Header read_q4_header_f16c(const uint8_t* b) {
  static_assert(kType == QuantType::kQ4_0 || kType == QuantType::kQ4_1 || kType == QuantType::kQ4_1F);
  if constexpr (kType == QuantType::kQ4_1F) {
    return {read_block_f32(b), read_block_f32(b + 4), b + 8};
  } else {
    const float d = _cvtsh_ss(read_block_u16(b));
    if constexpr (kType == QuantType::kQ4_0) return {d, -8.0F * d, b + 2};
    return {d, _cvtsh_ss(read_block_u16(b + 2)), b + 4};
  }
}

}  // namespace ringserve::kernels
