// A llama-family decoder's layers for a decode step, as one native call: bfloat16 or float32 activations and KV
// cache, each projection's weight either dense in the same type or in quantized blocks (kernels/cpu_quant.h).
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
// the causal chunk kernel for the others (paged_attention_*). All rows' K and V are written before any row
// attends, so a chunk's rows see each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu_attention.h"
#include "kernels/cpu_linear.h"
#include "kernels/cpu_quant.h"

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

// A projection's weight [n, k]: n dense rows of T, or (when `blocks` is not empty) n rows of k / 32 blocks of
// `type`, multiplied by the int8 kernel (linear_quant_*), with their panels (pack_quant_panels) or none.
template <class T>
struct Projection {
  std::span<const T> dense;
  std::span<const uint8_t> blocks;
  QuantType type = QuantType::kQ8_0;
  std::span<const uint8_t> panels;

  static Projection of_dense(std::span<const T> w) { return {w, {}, QuantType::kQ8_0, {}}; }
  static Projection of_blocks(QuantType t, std::span<const uint8_t> b, std::span<const uint8_t> panels = {}) {
    return {{}, b, t, panels};
  }
  bool quantized() const { return !blocks.empty(); }
};

// One layer's borrowed memory. qkv_bias may be empty (no bias).
template <class T>
struct DecoderLayer {
  std::span<const T> input_norm;   // [hidden]
  Projection<T> qkv_weight;        // [qkv_features, hidden]: q rows, then k, then v
  std::span<const T> qkv_bias;     // [qkv_features] or empty
  Projection<T> o_weight;          // [hidden, num_heads * head_dim]
  std::span<const T> post_norm;    // [hidden]
  Projection<T> gate_up_weight;    // [2 * intermediate, hidden]: gate rows, then up
  Projection<T> down_weight;       // [hidden, intermediate]
  std::span<T> k_cache;            // cache_values()
  std::span<T> v_cache;
};

// One step: `rows` new tokens of `num_seqs` sequences; sequence i owns rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]).
template <class T>
struct DecodeStep {
  std::size_t rows = 0;
  std::size_t num_seqs = 0;
  std::span<T> hidden;                      // [rows, hidden]: the embeddings in, the last layer's output out
  std::span<T> normed;                      // [rows, hidden]: the final RMSNorm of `hidden`
  std::span<const int64_t> positions;       // [rows]
  std::span<const int64_t> slots;           // [rows]: flat cache slot of each new token
  std::span<const float> cos_sin;           // [2, max_position, head_dim]
  std::span<const int32_t> block_tables;    // [num_seqs, table_stride]
  std::span<const int32_t> seq_lens;        // [num_seqs]
  std::span<const int32_t> cu_seqlens_q;    // [num_seqs + 1]: 0, ..., rows, non-decreasing
  std::size_t table_stride = 0;
};

// One call at a time: the working memory is the object's own (a worker runs its steps on one thread). T is
// bf16_bits or float.
template <class T>
class Decoder {
 public:
  // Throws std::invalid_argument when a span's size does not match the dimensions.
  Decoder(const DecoderDims& dims, std::vector<DecoderLayer<T>> layers, std::span<const T> final_norm);

  // Runs every layer, then the final norm. Throws std::invalid_argument on a size, position, slot or block index out
  // of range; each is checked before anything is written.
  void decode(const DecodeStep<T>& step, int threads);

  const DecoderDims& dims() const { return dims_; }
  std::size_t num_layers() const { return layers_.size(); }

 private:
  void check_step(const DecodeStep<T>& step) const;
  void grow_scratch(std::size_t rows, std::size_t num_seqs);

  DecoderDims dims_;
  std::vector<DecoderLayer<T>> layers_;
  std::span<const T> final_norm_;
  // Working memory, grown to the largest batch seen and kept.
  std::vector<T> normed_;     // [rows, hidden]
  std::vector<T> qkv_;        // [rows, qkv_features]
  std::vector<T> attention_;  // [rows, num_heads * head_dim]
  std::vector<T> gate_up_;    // [rows, 2 * intermediate]
  std::vector<T> activated_;  // [rows, intermediate]
  std::vector<int32_t> sequence_ids_;  // [num_seqs]: 0, 1, ..., num_seqs - 1
};

extern template class Decoder<bf16_bits>;
extern template class Decoder<float>;
using DecoderBf16 = Decoder<bf16_bits>;
using DecoderF32 = Decoder<float>;
using DecoderLayerBf16 = DecoderLayer<bf16_bits>;
using DecodeStepBf16 = DecodeStep<bf16_bits>;

}  // namespace ringserve::kernels
