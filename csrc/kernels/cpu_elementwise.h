// Small per-layer operations of a llama decoder on CPU, one pass each, replacing the chains of tensor operations of
// the PyTorch formulation (which cost more in dispatch than in arithmetic when decoding a few rows). Both round
// exactly as that formulation does in the storage type, so results equal it (bit for bit where the same elementary
// functions are used).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

// Where the rows to rotate sit: `rows` tokens, each `heads` heads of `head_dim` values, heads contiguous within a
// token, tokens `row_stride` values apart (a view of the queries and keys inside a fused QKV projection).
struct RopeShape {
  std::size_t rows = 0;
  std::size_t row_stride = 0;
  std::size_t heads = 0;
  std::size_t head_dim = 0;  // even
  std::size_t max_position = 0;
};

// Hugging Face's "rotate_half" RoPE, in place: x = x * cos + rotate_half(x) * sin, where rotate_half(x) =
// (-x[half:], x[:half]) and cos / sin are float32 tables [max_position, head_dim] rounded to the storage type first;
// each product and the sum are rounded to the storage type, as the tensor formulation does. `positions` [rows] index
// the tables. Every position is checked before anything is written (std::invalid_argument). With `threads` >= 2, a
// large call splits its rows over that many threads of the kernels' pool.
void rope_f32(const RopeShape& shape, std::span<float> x, std::span<const int64_t> positions,
              std::span<const float> cos, std::span<const float> sin, int threads = 1);
void rope_bf16(const RopeShape& shape, std::span<bf16_bits> x, std::span<const int64_t> positions,
               std::span<const float> cos, std::span<const float> sin, int threads = 1);

// The gated MLP's activation: out[r, j] = silu(gate[r, j]) * up[r, j] with gate_up [rows, 2 * dim] holding gate then
// up in each row and out [rows, dim]; silu(g) = g / (1 + exp(-g)) in float32, rounded to the storage type before the
// product (as F.silu(gate) * up rounds). With `threads` >= 2, a large call splits its rows over that many pool
// threads.
void silu_mul_f32(std::size_t rows, std::size_t dim, std::span<const float> gate_up, std::span<float> out,
                  int threads = 1);
void silu_mul_bf16(std::size_t rows, std::size_t dim, std::span<const bf16_bits> gate_up, std::span<bf16_bits> out,
                   int threads = 1);

// Where a step's new keys and values go: `rows` tokens, each one cache slot of `row_bytes` (every KV head of one
// position), read from rows `k_stride` / `v_stride` bytes apart (views inside a fused QKV output).
struct KvWriteShape {
  std::size_t rows = 0;
  std::size_t row_bytes = 0;
  std::size_t k_stride = 0;
  std::size_t v_stride = 0;
};

// Copies row r of k and v into slot slots[r] of the caches ([num_slots, row_bytes] each, any element type). Every
// slot is checked before anything is written (std::invalid_argument).
void write_kv(const KvWriteShape& shape, std::span<std::byte> k_cache, std::span<std::byte> v_cache,
              std::span<const std::byte> k, std::span<const std::byte> v, std::span<const int64_t> slots);

}  // namespace ringserve::kernels
