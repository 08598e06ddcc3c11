// ringserve._kernels: native CPU kernels for the workers, called on tensors' memory by address.
//
// The module does not link libtorch: the Python side (workers/model/cpu_ops.py) checks dtype, device, shape and
// contiguity and passes data_ptr() values; the tensors stay alive for the call, which releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/cpu_attention.h"
#include "kernels/cpu_decoder.h"
#include "kernels/cpu_elementwise.h"
#include "kernels/cpu_linear.h"
#include "kernels/cpu_norm.h"
#include "kernels/cpu_quant.h"
#include "kernels/cpu_sampling.h"

namespace py = pybind11;
using ringserve::kernels::bf16_bits;

namespace {

template <class T>
std::span<T> view(std::uintptr_t address, std::size_t count) {
  if (count == 0) return {};
  if (address == 0) throw py::value_error("null tensor address");
  return {reinterpret_cast<T*>(address), count};
}

void linear_bf16(std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t y, std::size_t m,
                 std::size_t n, std::size_t k, bool force_portable, int threads, std::uintptr_t residual,
                 bool avx512f_only) {
  const auto xs = view<const bf16_bits>(x, m * k);
  const auto ws = view<const bf16_bits>(w, n * k);
  const auto bs = bias == 0 ? std::span<const bf16_bits>{} : view<const bf16_bits>(bias, n);
  const auto rs = residual == 0 ? std::span<const bf16_bits>{} : view<const bf16_bits>(residual, m * n);
  const auto ys = view<bf16_bits>(y, m * n);
  py::gil_scoped_release release;
  using ringserve::kernels::LinearPath;
  const LinearPath path = force_portable ? LinearPath::kPortable
                          : avx512f_only ? LinearPath::kAvx512F
                                         : LinearPath::kFastest;
  ringserve::kernels::linear_bf16({m, n, k}, xs, ws, bs, ys, path, threads, rs);
}

void linear_f32(std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t y, std::size_t m,
                std::size_t n, std::size_t k, bool force_portable, int threads, std::uintptr_t residual) {
  const auto xs = view<const float>(x, m * k);
  const auto ws = view<const float>(w, n * k);
  const auto bs = bias == 0 ? std::span<const float>{} : view<const float>(bias, n);
  const auto rs = residual == 0 ? std::span<const float>{} : view<const float>(residual, m * n);
  const auto ys = view<float>(y, m * n);
  py::gil_scoped_release release;
  using ringserve::kernels::LinearPath;
  const LinearPath path = force_portable ? LinearPath::kPortable : LinearPath::kFastest;
  ringserve::kernels::linear_f32({m, n, k}, xs, ws, bs, ys, path, threads, rs);
}

// Which paged attention kernel a binding runs (kernels/cpu_attention.h).
enum class Attention { kDecode, kChunk, kStep };

// The tensors' layouts are described in kernels/cpu_attention.h; sizes are in values, not bytes.
template <Attention kKind>
void paged_attention(bool bf16, std::uintptr_t q, std::uintptr_t k_cache, std::uintptr_t v_cache,
                     std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t cu_seqlens_q,
                     std::uintptr_t seq_ids, std::uintptr_t out, std::size_t num_q_rows, std::size_t q_row_stride,
                     std::size_t num_heads, std::size_t num_kv_heads, std::size_t head_dim, std::size_t num_blocks,
                     std::size_t block_size, std::size_t num_seqs, std::size_t table_stride, std::size_t num_ids,
                     float scale, int threads) {
  namespace k = ringserve::kernels;
  const k::PagedDecodeShape shape{num_q_rows, q_row_stride, num_heads,  num_kv_heads,
                                  head_dim,   num_blocks,   block_size, num_seqs,     table_stride};
  const std::size_t q_size = num_q_rows == 0 ? 0 : (num_q_rows - 1) * q_row_stride + num_heads * head_dim;
  const std::size_t out_size = num_q_rows * num_heads * head_dim;
  const std::size_t cache_size = num_blocks * block_size * num_kv_heads * head_dim;
  const k::PagedDecodeIndex index{view<const int32_t>(block_tables, num_seqs * table_stride),
                                  view<const int32_t>(seq_lens, num_seqs),
                                  view<const int32_t>(cu_seqlens_q, num_seqs + 1),
                                  view<const int32_t>(seq_ids, num_ids)};
  const auto run = [&](auto tag, auto decode, auto chunk, auto step) {
    using T = decltype(tag);
    const auto fn = kKind == Attention::kDecode ? decode : kKind == Attention::kChunk ? chunk : step;
    fn(shape, index, view<const T>(q, q_size), view<const T>(k_cache, cache_size), view<const T>(v_cache, cache_size),
       view<T>(out, out_size), scale, threads);
  };
  py::gil_scoped_release release;
  if (bf16) {
    run(bf16_bits{}, k::paged_decode_attention_bf16, k::paged_chunk_attention_bf16, k::paged_attention_bf16);
  } else {
    run(float{}, k::paged_decode_attention_f32, k::paged_chunk_attention_f32, k::paged_attention_f32);
  }
}

void rms_norm(bool bf16, std::uintptr_t x, std::uintptr_t weight, std::uintptr_t out, std::size_t rows,
              std::size_t dim, float eps, int threads) {
  namespace k = ringserve::kernels;
  py::gil_scoped_release release;
  if (bf16) {
    k::rms_norm_bf16(rows, dim, view<const bf16_bits>(x, rows * dim), view<const bf16_bits>(weight, dim),
                     view<bf16_bits>(out, rows * dim), eps, threads);
  } else {
    k::rms_norm_f32(rows, dim, view<const float>(x, rows * dim), view<const float>(weight, dim),
                    view<float>(out, rows * dim), eps, threads);
  }
}

void rope(bool bf16, std::uintptr_t x, std::size_t rows, std::size_t row_stride, std::size_t heads,
          std::size_t head_dim, std::uintptr_t positions, std::uintptr_t cos_sin, std::size_t max_position,
          int threads) {
  namespace k = ringserve::kernels;
  const k::RopeShape shape{rows, row_stride, heads, head_dim, max_position};
  const std::size_t span = rows == 0 ? 0 : (rows - 1) * row_stride + heads * head_dim;
  const std::size_t table = max_position * head_dim;
  const auto cos = view<const float>(cos_sin, 2 * table);
  const auto pos = view<const int64_t>(positions, rows);
  py::gil_scoped_release release;
  if (bf16) {
    k::rope_bf16(shape, view<bf16_bits>(x, span), pos, cos.first(table), cos.subspan(table), threads);
  } else {
    k::rope_f32(shape, view<float>(x, span), pos, cos.first(table), cos.subspan(table), threads);
  }
}

void silu_mul(bool bf16, std::uintptr_t gate_up, std::uintptr_t out, std::size_t rows, std::size_t dim, int threads) {
  namespace k = ringserve::kernels;
  py::gil_scoped_release release;
  if (bf16) {
    k::silu_mul_bf16(rows, dim, view<const bf16_bits>(gate_up, rows * 2 * dim), view<bf16_bits>(out, rows * dim),
                     threads);
  } else {
    k::silu_mul_f32(rows, dim, view<const float>(gate_up, rows * 2 * dim), view<float>(out, rows * dim), threads);
  }
}

void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::size_t cache_bytes, std::uintptr_t k,
              std::uintptr_t v, std::uintptr_t slots, std::size_t rows, std::size_t row_bytes, std::size_t k_stride,
              std::size_t v_stride) {
  namespace kn = ringserve::kernels;
  const kn::KvWriteShape shape{rows, row_bytes, k_stride, v_stride};
  const auto span_of = [&](std::size_t stride) { return rows == 0 ? 0 : (rows - 1) * stride + row_bytes; };
  const auto slot_span = view<const int64_t>(slots, rows);
  py::gil_scoped_release release;
  kn::write_kv(shape, view<std::byte>(k_cache, cache_bytes), view<std::byte>(v_cache, cache_bytes),
               view<const std::byte>(k, span_of(k_stride)), view<const std::byte>(v, span_of(v_stride)), slot_span);
}

void argmax_logprob(bool bf16, std::uintptr_t logits, std::uintptr_t ids, std::uintptr_t logprobs, std::size_t rows,
                    std::size_t vocab, int threads) {
  namespace k = ringserve::kernels;
  const auto id_span = view<int64_t>(ids, rows);
  const auto lp_span = view<float>(logprobs, rows);
  py::gil_scoped_release release;
  if (bf16) {
    k::argmax_logprob_bf16(rows, vocab, view<const bf16_bits>(logits, rows * vocab), id_span, lp_span, threads);
  } else {
    k::argmax_logprob_f32(rows, vocab, view<const float>(logits, rows * vocab), id_span, lp_span, threads);
  }
}

// A decoder's borrowed memory by address: per layer [input_norm, qkv_weight, qkv_bias (0 = none), o_weight,
// post_norm, gate_up_weight, down_weight, k_cache, v_cache]; the Python side keeps the tensors alive. quant_types, when
// given, has per layer the block type (kernels/cpu_quant.h QuantType) of [qkv, o, gate_up, down], -1 for a dense one;
// quant_panels, when given, the address of each of those projections' panels (pack_quant_panels), 0 for none.
template <class T>
std::unique_ptr<ringserve::kernels::Decoder<T>> make_decoder(
    std::size_t hidden, std::size_t num_heads, std::size_t num_kv_heads, std::size_t head_dim,
    std::size_t intermediate, std::size_t num_blocks, std::size_t block_size, std::size_t max_position, float rms_eps,
    float attention_scale, const std::vector<std::vector<std::uintptr_t>>& layers, std::uintptr_t final_norm,
    const std::vector<std::vector<int>>& quant_types, const std::vector<std::vector<std::uintptr_t>>& quant_panels) {
  namespace k = ringserve::kernels;
  const k::DecoderDims d{hidden,     num_heads,    num_kv_heads, head_dim, intermediate,
                         num_blocks, block_size,   max_position, rms_eps,  attention_scale};
  const std::size_t qkv = d.qkv_features();
  if (!quant_types.empty() && quant_types.size() != layers.size()) {
    throw py::value_error("quant_types needs one entry per decoder layer");
  }
  if (!quant_panels.empty() && quant_panels.size() != layers.size()) {
    throw py::value_error("quant_panels needs one entry per decoder layer");
  }
  // A projection [n, k] at `address`: dense values, or n rows of k / 32 blocks of the layer's type for it (with the
  // panels at `panels`, 0 for none).
  const auto projection = [](std::uintptr_t address, int type, std::uintptr_t panels, std::size_t n, std::size_t k) {
    if (type < 0) return k::Projection<T>::of_dense(view<const T>(address, n * k));
    if (type > static_cast<int>(k::QuantType::kQ8_2F)) throw py::value_error("unknown weight block type");
    if (k % k::kQuantBlock != 0) throw py::value_error("quantized projections need widths that are multiples of 32");
    const auto qtype = static_cast<k::QuantType>(type);
    const std::size_t bytes = n * (k / k::kQuantBlock) * k::quant_block_bytes(qtype);
    const auto panel_span = panels == 0 ? std::span<const uint8_t>{}
                                        : view<const uint8_t>(panels, k::quant_panel_bytes(qtype, n, k));
    return k::Projection<T>::of_blocks(qtype, view<const uint8_t>(address, bytes), panel_span);
  };
  std::vector<k::DecoderLayer<T>> spans;
  spans.reserve(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& a = layers[i];
    if (a.size() != 9) throw py::value_error("each decoder layer needs 9 addresses");
    const std::vector<int> dense(4, -1);
    const std::vector<std::uintptr_t> no_panels(4, 0);
    const std::vector<int>& types = quant_types.empty() ? dense : quant_types[i];
    const std::vector<std::uintptr_t>& panels = quant_panels.empty() ? no_panels : quant_panels[i];
    if (types.size() != 4) throw py::value_error("each layer's quant_types needs 4 entries");
    if (panels.size() != 4) throw py::value_error("each layer's quant_panels needs 4 entries");
    spans.push_back({view<const T>(a[0], hidden), projection(a[1], types[0], panels[0], qkv, hidden),
                     a[2] == 0 ? std::span<const T>{} : view<const T>(a[2], qkv),
                     projection(a[3], types[1], panels[1], hidden, num_heads * head_dim), view<const T>(a[4], hidden),
                     projection(a[5], types[2], panels[2], 2 * intermediate, hidden),
                     projection(a[6], types[3], panels[3], hidden, intermediate), view<T>(a[7], d.cache_values()),
                     view<T>(a[8], d.cache_values())});
  }
  return std::make_unique<k::Decoder<T>>(d, std::move(spans), view<const T>(final_norm, hidden));
}

template <class T>
void decoder_decode(ringserve::kernels::Decoder<T>& decoder, std::uintptr_t hidden, std::uintptr_t normed,
                    std::uintptr_t positions, std::uintptr_t slots, std::uintptr_t cos_sin,
                    std::uintptr_t block_tables, std::uintptr_t seq_lens, std::uintptr_t cu_seqlens_q,
                    std::size_t rows, std::size_t num_seqs, std::size_t table_stride, int threads) {
  const auto& d = decoder.dims();
  const ringserve::kernels::DecodeStep<T> step{
      rows,
      num_seqs,
      view<T>(hidden, rows * d.hidden),
      view<T>(normed, rows * d.hidden),
      view<const int64_t>(positions, rows),
      view<const int64_t>(slots, rows),
      view<const float>(cos_sin, 2 * d.max_position * d.head_dim),
      view<const int32_t>(block_tables, num_seqs * table_stride),
      view<const int32_t>(seq_lens, num_seqs),
      view<const int32_t>(cu_seqlens_q, num_seqs + 1),
      table_stride};
  py::gil_scoped_release release;
  decoder.decode(step, threads);
}

// DecoderBf16 and DecoderF32: one Python class per storage type.
template <class T>
void bind_decoder(py::module_& m, const char* name, const char* doc) {
  using D = ringserve::kernels::Decoder<T>;
  py::class_<D>(m, name, py::module_local(), doc)
      .def(py::init(&make_decoder<T>), py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("max_position"), py::arg("rms_eps"), py::arg("attention_scale"), py::arg("layers"),
           py::arg("final_norm"), py::arg("quant_types") = std::vector<std::vector<int>>{},
           py::arg("quant_panels") = std::vector<std::vector<std::uintptr_t>>{})
      .def_property_readonly("num_layers", &D::num_layers)
      .def("decode", &decoder_decode<T>, py::arg("hidden"), py::arg("normed"), py::arg("positions"), py::arg("slots"),
           py::arg("cos_sin"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("rows"),
           py::arg("num_seqs"), py::arg("table_stride"), py::arg("threads") = 1,
           "One step of `rows` new tokens of `num_seqs` sequences (decode rows and prefill chunks): hidden "
           "[rows, hidden] holds the embeddings in and the last layer's output out, normed gets its final "
           "RMSNorm; positions and slots are int64 [rows], cos_sin the float32 RoPE table, block_tables int32 "
           "[num_seqs, table_stride], seq_lens int32 [num_seqs], cu_seqlens_q int32 [num_seqs + 1]. Raises "
           "ValueError on anything out of range, before writing.");
}

// The weight blocks' byte count is checked against m, n, k and the type by the kernel.
void linear_quant(bool bf16, int type, std::uintptr_t x, std::uintptr_t w, std::size_t w_bytes, std::uintptr_t bias,
                  std::uintptr_t y, std::size_t m, std::size_t n, std::size_t k, bool force_portable, int threads,
                  std::uintptr_t residual, std::uintptr_t panels, std::size_t panel_bytes, bool avx2_only) {
  namespace k_ = ringserve::kernels;
  const auto qtype = static_cast<k_::QuantType>(type);
  if (type < 0 || type > static_cast<int>(k_::QuantType::kQ8_2F)) throw py::value_error("unknown weight block type");
  const auto ws = view<const uint8_t>(w, w_bytes);
  const auto ps = panels == 0 ? std::span<const uint8_t>{} : view<const uint8_t>(panels, panel_bytes);
  const k_::QuantPath path = force_portable ? k_::QuantPath::kPortable
                             : avx2_only    ? k_::QuantPath::kAvx2
                                            : k_::QuantPath::kFastest;
  const auto run = [&](auto tag, auto fn) {
    using T = decltype(tag);
    const auto bs = bias == 0 ? std::span<const T>{} : view<const T>(bias, n);
    const auto rs = residual == 0 ? std::span<const T>{} : view<const T>(residual, m * n);
    const auto xs = view<const T>(x, m * k);
    const auto ys = view<T>(y, m * n);
    py::gil_scoped_release release;
    fn({m, n, k}, qtype, xs, ws, bs, ys, path, threads, rs, ps);
  };
  if (bf16) {
    run(bf16_bits{}, k_::linear_quant_bf16);
  } else {
    run(float{}, k_::linear_quant_f32);
  }
}

void pack_quant_panels(int type, std::uintptr_t w, std::size_t w_bytes, std::uintptr_t out, std::size_t out_bytes,
                       std::size_t n, std::size_t k, int threads) {
  namespace k_ = ringserve::kernels;
  if (type < 0 || type > static_cast<int>(k_::QuantType::kQ8_2F)) throw py::value_error("unknown weight block type");
  const auto ws = view<const uint8_t>(w, w_bytes);
  const auto outs = view<uint8_t>(out, out_bytes);
  py::gil_scoped_release release;
  k_::pack_quant_panels(static_cast<k_::QuantType>(type), n, k, ws, outs, threads);
}

void dequantize(int type, std::uintptr_t w, std::size_t w_bytes, std::uintptr_t out, std::size_t n, std::size_t k,
                bool force_portable, int threads) {
  namespace k_ = ringserve::kernels;
  if (type < 0 || type > static_cast<int>(k_::QuantType::kQ8_2F)) throw py::value_error("unknown weight block type");
  const auto ws = view<const uint8_t>(w, w_bytes);
  const auto outs = view<float>(out, n * k);
  py::gil_scoped_release release;
  k_::dequantize_f32(static_cast<k_::QuantType>(type), n, k, ws, outs,
                     force_portable ? k_::QuantPath::kPortable : k_::QuantPath::kFastest, threads);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "Native CPU kernels for RingServe workers (see csrc/kernels).";
  m.def("has_avx512_bf16", &ringserve::kernels::has_avx512_bf16,
        "True when this CPU runs the AVX512-BF16 kernels.");
  m.def("has_avx512f_linear", &ringserve::kernels::has_avx512f_linear,
        "True when linear_bf16 has its AVX-512F path here (bf16 widened in registers; for CPUs without AVX512-BF16).");
  m.def("linear_bf16", &linear_bf16, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("force_portable") = false, py::arg("threads") = 1,
        py::arg("residual") = 0, py::arg("avx512f_only") = false,
        "y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) (+ residual[m, n]) on contiguous bfloat16 memory given by address "
        "(bias / residual 0 = none), rounded once; threads >= 2 lets a large product use a second core. force_portable "
        "/ avx512f_only pick a path for tests.");
  m.def("has_avx2_quant", &ringserve::kernels::has_avx2_quant,
        "True when linear_quant has its AVX2 path here (AVX2, FMA, F16C).");
  m.def("has_avx512_vnni_quant", &ringserve::kernels::has_avx512_vnni_quant,
        "True when linear_quant's AVX2 path takes AVX-512 VNNI here (its tiles, and its panels with packed ones).");
  m.def("quant_block_bytes", [](int type) {
    return ringserve::kernels::quant_block_bytes(static_cast<ringserve::kernels::QuantType>(type));
  }, py::arg("type"), "Bytes per 32-value weight block of a QuantType value.");
  m.def("linear_quant", &linear_quant, py::arg("bf16"), py::arg("type"), py::arg("x"), py::arg("w"),
        py::arg("w_bytes"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("force_portable") = false, py::arg("threads") = 1, py::arg("residual") = 0, py::arg("panels") = 0,
        py::arg("panel_bytes") = 0, py::arg("avx2_only") = false,
        "y[m, n] = x[m, k] @ W^T (+ bias) (+ residual), W being n rows of quantized weight blocks (kernels/cpu_quant.h; "
        "type: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_1F, 4 Q8_2F), on contiguous float32 or bfloat16 memory given by address; "
        "the input rows are quantized per 32 values to int8. panels: W's panels (pack_quant_panels), 0 for none. "
        "force_portable picks the portable loops, avx2_only the AVX2 path where AVX-512 VNNI runs (tests, "
        "benchmarks).");
  m.def("quant_panel_bytes", [](int type, std::size_t n, std::size_t k) {
    if (type < 0 || type > static_cast<int>(ringserve::kernels::QuantType::kQ8_2F)) {
      throw py::value_error("unknown weight block type");
    }
    return ringserve::kernels::quant_panel_bytes(static_cast<ringserve::kernels::QuantType>(type), n, k);
  }, py::arg("type"), py::arg("n"), py::arg("k"), "Bytes of pack_quant_panels' output for n rows [n, k] of `type`.");
  m.attr("quant_panel_rows") = ringserve::kernels::kQuantPanelRows;
  m.def("pack_quant_panels", &pack_quant_panels, py::arg("type"), py::arg("w"), py::arg("w_bytes"), py::arg("out"),
        py::arg("out_bytes"), py::arg("n"), py::arg("k"), py::arg("threads") = 1,
        "Lays out n rows of quantized weight blocks (w) once as the 8-row panels that linear_quant reads for products "
        "of many input rows (out: quant_panel_bytes(type, n, k) bytes; the AVX2 path only).");
  m.def("dequantize", &dequantize, py::arg("type"), py::arg("w"), py::arg("w_bytes"), py::arg("out"), py::arg("n"),
        py::arg("k"), py::arg("force_portable") = false, py::arg("threads") = 1,
        "out[n, k] (float32) = the values of n rows of quantized weight blocks of `type` (as linear_quant), given by "
        "address: gguf's dequantization, bit for bit. force_portable picks the portable loops for tests.");
  m.def("linear_f32", &linear_f32, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("force_portable") = false, py::arg("threads") = 1,
        py::arg("residual") = 0,
        "linear_bf16 for contiguous float32 memory: float32 weight panels (AVX-512F/BW CPUs; see has_avx512f_linear), "
        "else portable loops (force_portable picks those for tests).");
  const auto attention_args = [](py::module_& mod, const char* name, auto fn, const char* doc) {
    mod.def(name, fn, py::arg("bf16"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
            py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("seq_ids"), py::arg("out"), py::arg("num_q_rows"),
            py::arg("q_row_stride"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
            py::arg("num_blocks"), py::arg("block_size"), py::arg("num_seqs"), py::arg("table_stride"),
            py::arg("num_ids"), py::arg("scale"), py::arg("threads") = 1, doc);
  };
  attention_args(m, "paged_decode_attention", &paged_attention<Attention::kDecode>,
                 "Decode attention (one query per listed sequence, at row cu_seqlens_q[seq]) over the paged KV cache, "
                 "read through the block tables; float32 or bfloat16 (bf16=True) memory given by address. Raises "
                 "ValueError on an out-of-range index or size.");
  attention_args(m, "paged_chunk_attention", &paged_attention<Attention::kChunk>,
                 "Causal attention of prefill chunks (rows cu_seqlens_q[seq] .. cu_seqlens_q[seq + 1] of each listed "
                 "sequence, the last of its seq_lens[seq] positions) over the paged KV cache; as paged_decode_attention.");
  attention_args(m, "paged_attention", &paged_attention<Attention::kStep>,
                 "A step's causal attention by its own index: listed sequences with one query row take the decode "
                 "kernel, those with more the chunk kernel.");
  m.def("chunk_attention_vectorized", &ringserve::kernels::paged_chunk_attention_is_vectorized, py::arg("head_dim"),
        "True when chunks of this head size run the AVX-512 or AVX2 tiles here (else portable loops, slower than SDPA).");
  m.def("rms_norm", &rms_norm, py::arg("bf16"), py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("rows"),
        py::arg("dim"), py::arg("eps"), py::arg("threads") = 1,
        "out[rows, dim] = weight * (x * rsqrt(mean(x^2) + eps)) as Hugging Face's LlamaRMSNorm computes it, on "
        "contiguous float32 or bfloat16 memory given by address; threads >= 2 splits a large call's rows.");
  m.def("rope", &rope, py::arg("bf16"), py::arg("x"), py::arg("rows"), py::arg("row_stride"), py::arg("heads"),
        py::arg("head_dim"), py::arg("positions"), py::arg("cos_sin"), py::arg("max_position"), py::arg("threads") = 1,
        "Hugging Face rotate_half RoPE in place on x [rows (row_stride apart), heads, head_dim] (float32 or bfloat16) "
        "by int64 positions and a float32 [2, max_position, head_dim] cos/sin table; threads >= 2 splits a large "
        "call's rows. Raises ValueError on a position outside the table, writing nothing.");
  m.def("silu_mul", &silu_mul, py::arg("bf16"), py::arg("gate_up"), py::arg("out"), py::arg("rows"), py::arg("dim"),
        py::arg("threads") = 1,
        "out[rows, dim] = silu(gate) * up for gate_up [rows, 2 * dim] (gate then up), contiguous float32 or bfloat16 "
        "memory given by address; threads >= 2 splits a large call's rows.");
  m.def("write_kv", &write_kv, py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_bytes"), py::arg("k"),
        py::arg("v"), py::arg("slots"), py::arg("rows"), py::arg("row_bytes"), py::arg("k_stride"), py::arg("v_stride"),
        "Copies row r of k and v (row_bytes each, rows k_stride / v_stride bytes apart) into slot slots[r] (int64) of "
        "the caches (cache_bytes each, row_bytes per slot). Raises ValueError on a slot outside them, writing "
        "nothing.");
  m.def("argmax_logprob", &argmax_logprob, py::arg("bf16"), py::arg("logits"), py::arg("ids"), py::arg("logprobs"),
        py::arg("rows"), py::arg("vocab"), py::arg("threads") = 1,
        "Greedy tokens of logits [rows, vocab] (contiguous float32 or bfloat16 memory given by address): writes the "
        "first index of each row's maximum to ids (int64 [rows]) and its log-softmax value to logprobs (float32).");
  bind_decoder<bf16_bits>(m, "DecoderBf16",
                          "A llama decoder's layers and final norm for decode steps, as one call (bfloat16 activations "
                          "and KV caches; dense bfloat16 or quantized projections; weights and caches borrowed by "
                          "address).");
  bind_decoder<float>(m, "DecoderF32",
                      "DecoderBf16 for float32 activations and KV caches (dense float32 or quantized projections).");
}
