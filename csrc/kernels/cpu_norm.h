// RMSNorm on CPU in one pass per row, replacing the eight tensor operations of the PyTorch formulation (which cost
// more in dispatch than in arithmetic when decoding a few rows).
#pragma once

#include <cstddef>
#include <span>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

// RMSNorm over rows of `dim` values, as Hugging Face's LlamaRMSNorm computes it: in float32,
// y = x * rsqrt(mean(x^2) + eps), rounded to the storage type, then out = weight * y rounded again. x, out:
// [rows, dim]; weight: [dim]. Throws std::invalid_argument on a size mismatch. AVX-512 where dim is a multiple of 16;
// with `threads` >= 2 a large call splits its rows over that many threads of the kernels' pool.
void rms_norm_f32(std::size_t rows, std::size_t dim, std::span<const float> x, std::span<const float> weight,
                  std::span<float> out, float eps, int threads = 1);
void rms_norm_bf16(std::size_t rows, std::size_t dim, std::span<const bf16_bits> x,
                   std::span<const bf16_bits> weight, std::span<bf16_bits> out, float eps, int threads = 1);

}  // namespace ringserve::kernels
