// bf16 matrix products for CPU workers: y[M, N] = x[M, K] * w[N, K]^T (+ bias) (+ residual), float32 sums.
//
// Decoding a few sequences is a matrix-vector product that must stream every weight once per step, so its speed is
// the memory bandwidth the kernel reaches: dot-product tiles read each weight row once for up to four input rows,
// prefetching the rows ahead in address order, on up to two cores. Batches (decoding many sequences, prefill) are
// compute-bound: there an outer-product kernel packs panels of 48 weight rows and keeps an 8 x 48 tile of sums in
// registers over all of K. With AVX512-BF16 both use bf16 dot products; on AVX-512 CPUs without them the tiles widen
// bf16 to float32 in registers and the panels are packed as float32, feeding plain FMAs. PyTorch's bf16 F.linear
// (oneDNN) reaches about a quarter of the bandwidth of the first and, without AVX512-BF16, a third of the FLOP/s of
// the second on SmolLM2's shapes.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace ringserve::kernels {

// bfloat16 values travel as their raw 16-bit patterns.
using bf16_bits = uint16_t;

struct LinearShape {
  std::size_t m;  // input rows
  std::size_t n;  // output features (weight rows)
  std::size_t k;  // input features
};

// True when this CPU (and OS) runs the AVX512-BF16 path.
bool has_avx512_bf16();
// True when it runs the AVX-512F dot-product tiles (bf16 widened to float32 in registers, then FMAs): the path for
// AVX-512 CPUs without BF16 dot products (Skylake-X, Cascade Lake, Ice Lake). Else linear_bf16 uses portable code.
bool has_avx512f_linear();

// Which code computes a product: the fastest this CPU has, or (for tests) the AVX-512F tiles or the portable loops.
// A path this CPU lacks falls back to the portable one.
enum class LinearPath { kFastest, kAvx512F, kPortable };

// x: m*k, w: n*k, y: m*n, bias: n or empty, residual: m*n or empty (may be y itself); all row-major and
// contiguous. y = x w^T + bias + residual, summed in float32 and rounded once. Throws std::invalid_argument on a size
// mismatch. With `threads` of 2 or more, a large product is split over that many threads of the kernels'
// worker pool (kernels/parallel.h).
void linear_bf16(LinearShape shape, std::span<const bf16_bits> x, std::span<const bf16_bits> w,
                 std::span<const bf16_bits> bias, std::span<bf16_bits> y, LinearPath path = LinearPath::kFastest,
                 int threads = 1, std::span<const bf16_bits> residual = {});

// The same for float32 x, w, bias, residual and y: float32 weight panels for any m (AVX-512F/BW; no rounding but
// float32's own), else portable loops. For prefill and batched decoding of float32 models, where PyTorch's GEMM
// reaches a fraction of these panels' FLOP/s at tens of rows.
void linear_f32(LinearShape shape, std::span<const float> x, std::span<const float> w, std::span<const float> bias,
                std::span<float> y, LinearPath path = LinearPath::kFastest, int threads = 1,
                std::span<const float> residual = {});

inline float bf16_to_float(bf16_bits v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }

// Round to nearest even, NaN kept NaN (quieted).
inline bf16_bits float_to_bf16(float v) {
  const auto u = std::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffU) > 0x7f800000U) return static_cast<bf16_bits>((u >> 16) | 0x40U);
  const uint32_t rounding = 0x7fffU + ((u >> 16) & 1U);
  return static_cast<bf16_bits>((u + rounding) >> 16);
}

// Element access for kernels templated on the storage type (float or bf16), computing in float32.
inline float load_scalar(float v) { return v; }
inline float load_scalar(bf16_bits v) { return bf16_to_float(v); }
inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(bf16_bits* p, float v) { *p = float_to_bf16(v); }

// Rounds a float32 to what the storage type keeps (float32: itself).
inline float round_to(float v, float /*type tag*/) { return v; }
inline float round_to(float v, bf16_bits /*type tag*/) { return bf16_to_float(float_to_bf16(v)); }

// The kernels' argument checks: std::invalid_argument "<op>: <what>", sizes counted in values.
inline void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(op) + ": " + what);
}
inline void require_size(const char* op, const char* what, std::size_t got, std::size_t want) {
  require(got == want, op, std::string(what) + " holds " + std::to_string(got) + " values, expected " +
                               std::to_string(want));
}

}  // namespace ringserve::kernels
