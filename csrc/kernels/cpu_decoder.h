// A llama-family decoder's layers for a decode step, as one native call (bfloat16 weights, activations and KV cache).
//
// The Python model runs each layer as about a dozen operator calls; for a decode step of a few sequences the
// interpreter and dispatch around those calls cost as much as the kernels themselves. This runs the same kernels
// (RMSNorm, fused QKV projection with bias, RoPE, KV write, paged decode attention, O projection + residual, RMSNorm,
// fused gate/up projection, SiLU-and-multiply, down projection + residual) in the same order with the same roundings,
// so its output is bit-identical to the Python path's, then the final RMSNorm. Weights and caches are borrowed
// (the Python model owns them and keeps them alive); working memory is owned and kept between calls.
//
// A step may carry prefill chunks as well as decode rows: it is given by the step's own index (each sequence's query
// rows, length and block table), and each layer's attention runs the paged decode kernel for one-row sequences and
// the causal chunk kernel for the others (paged_attention_bf16). All rows' K and V are written before any row
// attends, so a chunk's rows see each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu_attention.h"
#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

struct DecoderDims {
  std::size_t hidden = 0;
  std::size_t num_heads = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t intermediate = 0;
  std::size_t num_blocks = 0;  // of each layer's K and V cache: [num_blocks, block_size, num_kv_heads, head_dim]
  std::size_t block_size = 0;
  std::size_t max_position = 0;  // rows of the RoPE table
  float rms_eps = 1e-5F;
  float attention_scale = 0.0F;

  std::size_t qkv_features() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
  std::size_t cache_values() const { return num_blocks * block_size * num_kv_heads * head_dim; }
};

// One layer's borrowed memory. qkv_bias may be empty (no bias).
struct DecoderLayerBf16 {
  std::span<const bf16_bits> input_norm;      // [hidden]
  std::span<const bf16_bits> qkv_weight;      // [qkv_features, hidden]: q rows, then k, then v
  std::span<const bf16_bits> qkv_bias;        // [qkv_features] or empty
  std::span<const bf16_bits> o_weight;        // [hidden, num_heads * head_dim]
  std::span<const bf16_bits> post_norm;       // [hidden]
  std::span<const bf16_bits> gate_up_weight;  // [2 * intermediate, hidden]: gate rows, then up
  std::span<const bf16_bits> down_weight;     // [hidden, intermediate]
  std::span<bf16_bits> k_cache;               // cache_values()
  std::span<bf16_bits> v_cache;
};

// One step: `rows` new tokens of `num_seqs` sequences; sequence i owns rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]).
struct DecodeStepBf16 {
  std::size_t rows = 0;
  std::size_t num_seqs = 0;
  std::span<bf16_bits> hidden;              // [rows, hidden]: the embeddings in, the last layer's output out
  std::span<bf16_bits> normed;              // [rows, hidden]: the final RMSNorm of `hidden`
  std::span<const int64_t> positions;       // [rows]
  std::span<const int64_t> slots;           // [rows]: flat cache slot of each new token
  std::span<const float> cos_sin;           // [2, max_position, head_dim]
  std::span<const int32_t> block_tables;    // [num_seqs, table_stride]
  std::span<const int32_t> seq_lens;        // [num_seqs]: context length including the new tokens
  std::span<const int32_t> cu_seqlens_q;    // [num_seqs + 1]: 0, ..., rows, non-decreasing
  std::size_t table_stride = 0;
};

// One call at a time: the working memory is the object's own (a worker runs its steps on one thread).
class DecoderBf16 {
 public:
  // Throws std::invalid_argument when a span's size does not match the dimensions.
  DecoderBf16(const DecoderDims& dims, std::vector<DecoderLayerBf16> layers, std::span<const bf16_bits> final_norm);

  // Runs every layer, then the final norm. Throws std::invalid_argument on a size, position, slot or block index out
  // of range; each is checked before anything is written.
  void decode(const DecodeStepBf16& step, int threads);

  const DecoderDims& dims() const { return dims_; }
  std::size_t num_layers() const { return layers_.size(); }

 private:
  void check_step(const DecodeStepBf16& step) const;
  void grow_scratch(std::size_t rows, std::size_t num_seqs);

  DecoderDims dims_;
  std::vector<DecoderLayerBf16> layers_;
  std::span<const bf16_bits> final_norm_;
  // Working memory, grown to the largest batch seen and kept.
  std::vector<bf16_bits> normed_;     // [rows, hidden]
  std::vector<bf16_bits> qkv_;        // [rows, qkv_features]
  std::vector<bf16_bits> attention_;  // [rows, num_heads * head_dim]
  std::vector<bf16_bits> gate_up_;    // [rows, 2 * intermediate]
  std::vector<bf16_bits> activated_;  // [rows, intermediate]
  std::vector<int32_t> sequence_ids_;  // [num_seqs]: 0, 1, ..., num_seqs - 1
};

}  // namespace ringserve::kernels
