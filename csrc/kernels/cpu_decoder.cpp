#include "kernels/cpu_decoder.h"

#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cpu_elementwise.h"
#include "kernels/cpu_norm.h"

namespace ringserve::kernels {

namespace {

constexpr const char* kOp = "decoder";

void check(bool ok, const std::string& what) { require(ok, kOp, what); }

void check_size(const std::string& layer, const char* what, std::size_t got, std::size_t want) {
  require(got == want, kOp, layer + what + " holds " + std::to_string(got) + " values, expected " +
                                std::to_string(want));
}

template <class T>
std::span<T> first(std::vector<T>& v, std::size_t n) {
  return std::span<T>(v).first(n);
}

void check_projection(const std::string& layer, const char* what, bool dense, std::size_t values, std::size_t bytes,
                      QuantType type, std::size_t n, std::size_t k) {
  if (dense) {
    check_size(layer, what, values, n * k);
    return;
  }
  check(k % kQuantBlock == 0, layer + what + ": quantized blocks need a width that is a multiple of 32");
  const std::size_t want = n * (k / kQuantBlock) * quant_block_bytes(type);
  check(bytes == want, layer + what + " holds " + std::to_string(bytes) + " bytes of blocks, expected " +
                           std::to_string(want));
}

template <class T>
void check_projection(const std::string& layer, const char* what, const Projection<T>& w, std::size_t n,
                      std::size_t k) {
  check_projection(layer, what, !w.quantized(), w.dense.size(), w.blocks.size(), w.type, n, k);
  if (!w.panels.empty()) {
    const std::size_t want = quant_panel_bytes(w.type, n, k);
    check(w.panels.size() == want, layer + what + " has " + std::to_string(w.panels.size()) +
                                       " bytes of panels, expected " + std::to_string(want));
  }
}

// The kernels for one storage type: y = x @ w^T (+ bias) (+ residual), and the small per-layer operations.
template <class T>
void project(LinearShape s, std::span<const T> x, const Projection<T>& w, std::span<const T> bias, std::span<T> y,
             int threads, std::span<const T> residual = {}) {
  constexpr bool kBf16 = std::is_same_v<T, bf16_bits>;
  if (w.quantized()) {
    if constexpr (kBf16) {
      linear_quant_bf16(s, w.type, x, w.blocks, bias, y, QuantPath::kFastest, threads, residual, w.panels);
    } else {
      linear_quant_f32(s, w.type, x, w.blocks, bias, y, QuantPath::kFastest, threads, residual, w.panels);
    }
  } else if constexpr (kBf16) {
    linear_bf16(s, x, w.dense, bias, y, LinearPath::kFastest, threads, residual);
  } else {
    linear_f32(s, x, w.dense, bias, y, LinearPath::kFastest, threads, residual);
  }
}

template <class T>
void rms_norm(std::size_t rows, std::size_t dim, std::span<const T> x, std::span<const T> w, std::span<T> out,
              float eps, int threads) {
  if constexpr (std::is_same_v<T, bf16_bits>) {
    rms_norm_bf16(rows, dim, x, w, out, eps, threads);
  } else {
    rms_norm_f32(rows, dim, x, w, out, eps, threads);
  }
}

template <class T>
void rotate(const RopeShape& shape, std::span<T> x, std::span<const int64_t> positions, std::span<const float> cos,
            std::span<const float> sin, int threads) {
  if constexpr (std::is_same_v<T, bf16_bits>) {
    rope_bf16(shape, x, positions, cos, sin, threads);
  } else {
    rope_f32(shape, x, positions, cos, sin, threads);
  }
}

template <class T>
void silu_mul(std::size_t rows, std::size_t dim, std::span<const T> gate_up, std::span<T> out, int threads) {
  if constexpr (std::is_same_v<T, bf16_bits>) {
    silu_mul_bf16(rows, dim, gate_up, out, threads);
  } else {
    silu_mul_f32(rows, dim, gate_up, out, threads);
  }
}

template <class T>
void paged_attention(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const T> q,
                     std::span<const T> k, std::span<const T> v, std::span<T> out, float scale, int threads) {
  if constexpr (std::is_same_v<T, bf16_bits>) {
    paged_attention_bf16(shape, index, q, k, v, out, scale, threads);
  } else {
    paged_attention_f32(shape, index, q, k, v, out, scale, threads);
  }
}

}  // namespace

template <class T>
Decoder<T>::Decoder(const DecoderDims& dims, std::vector<DecoderLayer<T>> layers, std::span<const T> final_norm)
    : dims_(dims), layers_(std::move(layers)), final_norm_(final_norm) {
  const DecoderDims& d = dims_;
  check(d.hidden > 0 && d.num_heads > 0 && d.num_kv_heads > 0 && d.head_dim > 0 && d.intermediate > 0,
        "every dimension must be positive");
  check(d.num_heads % d.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  check(d.head_dim % 2 == 0, "head_dim must be even (RoPE pairs)");
  check(d.block_size > 0 && d.num_blocks > 0 && d.max_position > 0, "the cache and RoPE table must not be empty");
  const std::size_t qkv = d.qkv_features();
  const std::size_t attention = d.num_heads * d.head_dim;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayer<T>& l = layers_[i];
    const std::string name = "layer " + std::to_string(i) + " ";
    check_size(name, "input_norm", l.input_norm.size(), d.hidden);
    check_projection(name, "qkv_weight", l.qkv_weight, qkv, d.hidden);
    if (!l.qkv_bias.empty()) check_size(name, "qkv_bias", l.qkv_bias.size(), qkv);
    check_projection(name, "o_weight", l.o_weight, d.hidden, attention);
    check_size(name, "post_norm", l.post_norm.size(), d.hidden);
    check_projection(name, "gate_up_weight", l.gate_up_weight, 2 * d.intermediate, d.hidden);
    check_projection(name, "down_weight", l.down_weight, d.hidden, d.intermediate);
    check_size(name, "k_cache", l.k_cache.size(), d.cache_values());
    check_size(name, "v_cache", l.v_cache.size(), d.cache_values());
  }
  check_size("", "final_norm", final_norm_.size(), d.hidden);
}

template <class T>
void Decoder<T>::check_step(const DecodeStep<T>& step) const {
  const DecoderDims& d = dims_;
  const std::size_t rows = step.rows;
  check_size("", "hidden", step.hidden.size(), rows * d.hidden);
  check_size("", "normed", step.normed.size(), rows * d.hidden);
  check_size("", "positions", step.positions.size(), rows);
  check_size("", "slots", step.slots.size(), rows);
  check_size("", "cos_sin", step.cos_sin.size(), 2 * d.max_position * d.head_dim);
  check_size("", "cu_seqlens_q", step.cu_seqlens_q.size(), step.num_seqs + 1);
  check(step.cu_seqlens_q[0] == 0 && static_cast<std::size_t>(step.cu_seqlens_q[step.num_seqs]) == rows,
        "cu_seqlens_q must run from 0 to rows");
  for (std::size_t i = 0; i < step.num_seqs; ++i) {
    check(step.cu_seqlens_q[i + 1] >= step.cu_seqlens_q[i], "cu_seqlens_q must not decrease");
  }
  const std::size_t cache_slots = d.num_blocks * d.block_size;
  for (std::size_t r = 0; r < rows; ++r) {
    const int64_t position = step.positions[r];
    check(position >= 0 && static_cast<std::size_t>(position) < d.max_position,
          "position " + std::to_string(position) + " outside the RoPE table");
    const int64_t slot = step.slots[r];
    check(slot >= 0 && static_cast<std::size_t>(slot) < cache_slots,
          "slot " + std::to_string(slot) + " outside the cache");
  }
}

template <class T>
void Decoder<T>::grow_scratch(std::size_t rows, std::size_t num_seqs) {
  const DecoderDims& d = dims_;
  if (sequence_ids_.size() < num_seqs) {
    sequence_ids_.resize(num_seqs);
    for (std::size_t i = 0; i < num_seqs; ++i) sequence_ids_[i] = static_cast<int32_t>(i);
  }
  if (normed_.size() >= rows * d.hidden) return;
  normed_.resize(rows * d.hidden);
  qkv_.resize(rows * d.qkv_features());
  attention_.resize(rows * d.num_heads * d.head_dim);
  gate_up_.resize(rows * 2 * d.intermediate);
  activated_.resize(rows * d.intermediate);
}

template <class T>
void Decoder<T>::decode(const DecodeStep<T>& step, int threads) {
  check_step(step);
  const std::size_t rows = step.rows;
  if (rows == 0) return;
  grow_scratch(rows, step.num_seqs);
  const DecoderDims& d = dims_;
  const std::size_t qkv_n = d.qkv_features();
  const std::size_t attention_n = d.num_heads * d.head_dim;
  const std::size_t kv_n = d.num_kv_heads * d.head_dim;
  const std::size_t table = d.max_position * d.head_dim;

  const std::span<T> x = step.hidden;
  const std::span<T> normed = first(normed_, rows * d.hidden);
  const std::span<T> qkv = first(qkv_, rows * qkv_n);
  const std::span<T> attention = first(attention_, rows * attention_n);
  const std::span<T> gate_up = first(gate_up_, rows * 2 * d.intermediate);
  const std::span<T> activated = first(activated_, rows * d.intermediate);

  const RopeShape rope{rows, qkv_n, d.num_heads + d.num_kv_heads, d.head_dim, d.max_position};
  const std::span<const T> all_qkv = qkv;
  // Keys and values sit inside each fused QKV row: after the query heads, then after the key heads.
  const KvWriteShape kv_write{rows, kv_n * sizeof(T), qkv_n * sizeof(T), qkv_n * sizeof(T)};
  const std::size_t kv_span = (rows - 1) * qkv_n + kv_n;
  const auto keys = std::as_bytes(all_qkv.subspan(attention_n, kv_span));
  const auto values = std::as_bytes(all_qkv.subspan(attention_n + kv_n, kv_span));
  const PagedDecodeShape attend{rows, qkv_n, d.num_heads, d.num_kv_heads, d.head_dim, d.num_blocks, d.block_size,
                                step.num_seqs, step.table_stride};
  const PagedDecodeIndex index{step.block_tables, step.seq_lens, step.cu_seqlens_q, first(sequence_ids_, step.num_seqs)};
  const std::span<const T> queries = all_qkv.first((rows - 1) * qkv_n + attention_n);
  // Lengths, rows and block ids, before the first layer writes its KV (each layer's call checks them again: cheap).
  check_paged_step_index(attend, index);

  for (const DecoderLayer<T>& layer : layers_) {
    rms_norm<T>(rows, d.hidden, x, layer.input_norm, normed, d.rms_eps, threads);
    project<T>({rows, qkv_n, d.hidden}, normed, layer.qkv_weight, layer.qkv_bias, qkv, threads);
    rotate<T>(rope, qkv.first((rows - 1) * qkv_n + (d.num_heads + d.num_kv_heads) * d.head_dim), step.positions,
              step.cos_sin.first(table), step.cos_sin.subspan(table), threads);
    write_kv(kv_write, std::as_writable_bytes(layer.k_cache), std::as_writable_bytes(layer.v_cache), keys, values,
             step.slots);
    paged_attention<T>(attend, index, queries, layer.k_cache, layer.v_cache, attention, d.attention_scale, threads);
    // The residual add is folded into the projection (y may alias the residual).
    project<T>({rows, d.hidden, attention_n}, attention, layer.o_weight, {}, x, threads, x);
    rms_norm<T>(rows, d.hidden, x, layer.post_norm, normed, d.rms_eps, threads);
    project<T>({rows, 2 * d.intermediate, d.hidden}, normed, layer.gate_up_weight, {}, gate_up, threads);
    silu_mul<T>(rows, d.intermediate, gate_up, activated, threads);
    project<T>({rows, d.hidden, d.intermediate}, activated, layer.down_weight, {}, x, threads, x);
  }
  rms_norm<T>(rows, d.hidden, x, final_norm_, step.normed, d.rms_eps, threads);
}

template class Decoder<bf16_bits>;
template class Decoder<float>;

}  // namespace ringserve::kernels
