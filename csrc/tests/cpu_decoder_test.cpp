// The native decode step against a scalar llama reference written here (float math, bf16 storage at the same
// points), the KV it writes, and its refusal of out-of-range input before anything is written.
#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_decoder.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

using Bf16 = std::vector<bf16_bits>;

float bf(float v) { return bf16_to_float(float_to_bf16(v)); }

struct TinyModel {
  DecoderDims d;
  std::size_t layers = 2;
  std::vector<Bf16> input_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w, k_cache, v_cache;
  Bf16 final_norm;
  std::vector<float> cos_sin;

  explicit TinyModel(bool bias) {
    d.hidden = 64;
    d.num_heads = 4;
    d.num_kv_heads = 2;
    d.head_dim = 16;
    d.intermediate = 96;
    d.num_blocks = 12;
    d.block_size = 4;
    d.max_position = 64;
    d.rms_eps = 1e-5F;
    d.attention_scale = 0.25F;
    std::mt19937 gen(7);
    std::normal_distribution<float> normal;
    auto random = [&](std::size_t n, float scale, float offset = 0.0F) {
      Bf16 v(n);
      for (auto& x : v) x = float_to_bf16(offset + scale * normal(gen));
      return v;
    };
    for (std::size_t l = 0; l < layers; ++l) {
      input_norm.push_back(random(d.hidden, 0.1F, 1.0F));
      qkv_w.push_back(random(d.qkv_features() * d.hidden, 0.15F));
      qkv_b.push_back(bias ? random(d.qkv_features(), 0.1F) : Bf16{});
      o_w.push_back(random(d.hidden * d.num_heads * d.head_dim, 0.1F));
      post_norm.push_back(random(d.hidden, 0.1F, 1.0F));
      gate_up_w.push_back(random(2 * d.intermediate * d.hidden, 0.1F));
      down_w.push_back(random(d.hidden * d.intermediate, 0.1F));
      k_cache.push_back(random(d.cache_values(), 1.0F));
      v_cache.push_back(random(d.cache_values(), 1.0F));
    }
    final_norm = random(d.hidden, 0.1F, 1.0F);
    const std::size_t half = d.head_dim / 2;
    cos_sin.resize(2 * d.max_position * d.head_dim);
    for (std::size_t p = 0; p < d.max_position; ++p) {
      for (std::size_t i = 0; i < d.head_dim; ++i) {
        const double freq = std::pow(10000.0, -static_cast<double>(2 * (i % half)) / static_cast<double>(d.head_dim));
        cos_sin[p * d.head_dim + i] = static_cast<float>(std::cos(static_cast<double>(p) * freq));
        cos_sin[(d.max_position + p) * d.head_dim + i] = static_cast<float>(std::sin(static_cast<double>(p) * freq));
      }
    }
  }

  DecoderBf16 decoder() {
    using P = Projection<bf16_bits>;
    std::vector<DecoderLayerBf16> spans;
    for (std::size_t l = 0; l < layers; ++l) {
      spans.push_back({input_norm[l], P::of_dense(qkv_w[l]), qkv_b[l], P::of_dense(o_w[l]), post_norm[l],
                       P::of_dense(gate_up_w[l]), P::of_dense(down_w[l]), k_cache[l], v_cache[l]});
    }
    return DecoderBf16(d, std::move(spans), final_norm);
  }
};

// y[n] = bf(sum_k x[k] w[n, k] (+ bias) (+ residual))
std::vector<float> project(const std::vector<float>& x, const Bf16& w, std::size_t n, const Bf16* bias,
                           const std::vector<float>* residual) {
  const std::size_t k = x.size();
  std::vector<float> y(n);
  for (std::size_t j = 0; j < n; ++j) {
    double acc = 0.0;
    for (std::size_t p = 0; p < k; ++p) acc += double{x[p]} * bf16_to_float(w[j * k + p]);
    if (bias != nullptr && !bias->empty()) acc += bf16_to_float((*bias)[j]);
    if (residual != nullptr) acc += (*residual)[j];
    y[j] = bf(static_cast<float>(acc));
  }
  return y;
}

std::vector<float> rms(const std::vector<float>& x, const Bf16& w, float eps) {
  double sq = 0.0;
  for (float v : x) sq += double{v} * v;
  const auto inv = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(x.size()) + eps));
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = bf(bf16_to_float(w[i]) * bf(x[i] * inv));
  return y;
}

// One sequence's token through every layer of the reference; writes its K/V into the model's caches.
std::vector<float> reference_token(TinyModel& m, std::vector<float> x, int64_t position, int64_t slot,
                                   const std::vector<int32_t>& blocks, int32_t seq_len) {
  const DecoderDims& d = m.d;
  const std::size_t hd = d.head_dim, half = hd / 2, kv_n = d.num_kv_heads * hd;
  for (std::size_t l = 0; l < m.layers; ++l) {
    std::vector<float> qkv = project(rms(x, m.input_norm[l], d.rms_eps), m.qkv_w[l], d.qkv_features(), &m.qkv_b[l],
                                     nullptr);
    for (std::size_t h = 0; h < d.num_heads + d.num_kv_heads; ++h) {  // rotate_half RoPE on q and k heads
      float* v = &qkv[h * hd];
      const float* c = &m.cos_sin[static_cast<std::size_t>(position) * hd];
      const float* s = &m.cos_sin[(d.max_position + static_cast<std::size_t>(position)) * hd];
      std::vector<float> out(hd);
      for (std::size_t i = 0; i < hd; ++i) {
        const float rotated = i < half ? -v[i + half] : v[i - half];
        out[i] = bf(bf(v[i] * bf(c[i])) + bf(rotated * bf(s[i])));  // the table is rounded to bf16 too
      }
      std::copy(out.begin(), out.end(), v);
    }
    for (std::size_t i = 0; i < kv_n; ++i) {
      m.k_cache[l][static_cast<std::size_t>(slot) * kv_n + i] = float_to_bf16(qkv[d.num_heads * hd + i]);
      m.v_cache[l][static_cast<std::size_t>(slot) * kv_n + i] = float_to_bf16(qkv[d.num_heads * hd + kv_n + i]);
    }
    std::vector<float> attention(d.num_heads * hd);
    const std::size_t group = d.num_heads / d.num_kv_heads;
    for (std::size_t h = 0; h < d.num_heads; ++h) {
      const std::size_t kvh = h / group;
      std::vector<double> scores(static_cast<std::size_t>(seq_len));
      double top = -1e300;
      for (std::size_t t = 0; t < scores.size(); ++t) {
        const auto at = (static_cast<std::size_t>(blocks[t / d.block_size]) * d.block_size + t % d.block_size) * kv_n +
                        kvh * hd;
        double dot = 0.0;
        for (std::size_t i = 0; i < hd; ++i) dot += double{qkv[h * hd + i]} * bf16_to_float(m.k_cache[l][at + i]);
        scores[t] = dot * d.attention_scale;
        top = std::max(top, scores[t]);
      }
      double total = 0.0;
      for (double& s : scores) total += (s = std::exp(s - top));
      for (std::size_t i = 0; i < hd; ++i) {
        double acc = 0.0;
        for (std::size_t t = 0; t < scores.size(); ++t) {
          const auto at = (static_cast<std::size_t>(blocks[t / d.block_size]) * d.block_size + t % d.block_size) *
                              kv_n + kvh * hd;
          acc += scores[t] * bf16_to_float(m.v_cache[l][at + i]);
        }
        attention[h * hd + i] = bf(static_cast<float>(acc / total));
      }
    }
    x = project(attention, m.o_w[l], d.hidden, nullptr, &x);
    std::vector<float> gate_up = project(rms(x, m.post_norm[l], d.rms_eps), m.gate_up_w[l], 2 * d.intermediate,
                                         nullptr, nullptr);
    std::vector<float> activated(d.intermediate);
    for (std::size_t i = 0; i < d.intermediate; ++i) {
      const float g = gate_up[i];
      activated[i] = bf(g / (1.0F + std::exp(-g)) * gate_up[d.intermediate + i]);
    }
    x = project(activated, m.down_w[l], d.hidden, nullptr, &x);
  }
  return rms(x, m.final_norm, d.rms_eps);
}

struct Step {
  std::size_t rows = 3;
  std::size_t stride = 3;
  std::vector<int64_t> positions{4, 9, 0};
  std::vector<int32_t> seq_lens{5, 10, 1};
  std::vector<int32_t> tables{7, 2, 0, 1, 5, 11, 3, 0, 0};  // sequence 2's unused entries are padding
  std::vector<int32_t> cu{0, 1, 2, 3};                       // one row per sequence
  std::vector<int64_t> slots;
  Bf16 hidden, normed;

  explicit Step(const DecoderDims& d) {
    for (std::size_t r = 0; r < rows; ++r) {
      const auto p = static_cast<std::size_t>(positions[r]);
      slots.push_back(int64_t{tables[r * stride + p / d.block_size]} * static_cast<int64_t>(d.block_size) +
                      static_cast<int64_t>(p % d.block_size));
    }
    std::mt19937 gen(11);
    std::normal_distribution<float> normal;
    hidden.resize(rows * d.hidden);
    for (auto& v : hidden) v = float_to_bf16(normal(gen));
    normed.assign(rows * d.hidden, 0);
  }

  DecodeStepBf16 view(const std::vector<float>& cos_sin) {
    return {rows, rows, hidden, normed, positions, slots, cos_sin, tables, seq_lens, cu, stride};
  }
};

void decode_matches_reference(bool bias, int threads) {
  TinyModel model(bias);
  TinyModel reference(bias);  // the same weights and caches (same seed); the reference writes its own KV
  DecoderBf16 decoder = model.decoder();
  Step step(model.d);
  const Bf16 embeddings = step.hidden;
  decoder.decode(step.view(model.cos_sin), threads);
  const std::size_t hidden = model.d.hidden;
  float worst = 0.0F;
  for (std::size_t r = 0; r < step.rows; ++r) {
    std::vector<float> x(hidden);
    for (std::size_t i = 0; i < hidden; ++i) x[i] = bf16_to_float(embeddings[r * hidden + i]);
    const std::vector<int32_t> blocks(step.tables.begin() + static_cast<std::ptrdiff_t>(r * step.stride),
                                      step.tables.begin() + static_cast<std::ptrdiff_t>((r + 1) * step.stride));
    const std::vector<float> want = reference_token(reference, x, step.positions[r], step.slots[r], blocks,
                                                    step.seq_lens[r]);
    for (std::size_t i = 0; i < hidden; ++i) {
      worst = std::max(worst, std::abs(bf16_to_float(step.normed[r * hidden + i]) - want[i]) /
                                  (1.0F + std::abs(want[i])));
    }
  }
  CHECK(worst < 0.05F);  // bf16 storage after every operation; summation orders differ
  // The new tokens' K/V went to their slots in every layer, as the reference wrote them (one bf16 ulp apart at most).
  const std::size_t kv_n = model.d.num_kv_heads * model.d.head_dim;
  std::size_t far = 0;
  for (std::size_t l = 0; l < model.layers; ++l) {
    for (const int64_t slot : step.slots) {
      for (std::size_t i = 0; i < kv_n; ++i) {
        const std::size_t at = static_cast<std::size_t>(slot) * kv_n + i;
        const float got = bf16_to_float(model.k_cache[l][at]), want = bf16_to_float(reference.k_cache[l][at]);
        far += std::abs(got - want) > 0.03F * (1.0F + std::abs(want)) ? 1 : 0;
      }
    }
  }
  CHECK(far == 0);
}

}  // namespace

TEST(decode_step_matches_the_scalar_reference) { decode_matches_reference(false, 1); }

TEST(decode_step_with_qkv_bias_matches_the_scalar_reference) { decode_matches_reference(true, 1); }

TEST(two_threads_give_the_same_bits_as_one) {
  TinyModel a(true), b(true);
  DecoderBf16 one = a.decoder(), two = b.decoder();
  Step sa(a.d), sb(b.d);
  one.decode(sa.view(a.cos_sin), 1);
  two.decode(sb.view(b.cos_sin), 2);
  CHECK(sa.normed == sb.normed);
  CHECK(sa.hidden == sb.hidden);
  CHECK(a.k_cache == b.k_cache && a.v_cache == b.v_cache);
}

TEST(out_of_range_input_is_refused_before_anything_is_written) {
  TinyModel model(false);
  DecoderBf16 decoder = model.decoder();
  const auto caches = model.k_cache;
  const auto check_refused = [&](Step& step) {
    const Bf16 before = step.hidden;
    bool threw = false;
    try {
      decoder.decode(step.view(model.cos_sin), 1);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw);
    CHECK(step.hidden == before);
    CHECK(model.k_cache == caches);
  };
  Step bad_slot(model.d);
  bad_slot.slots[1] = static_cast<int64_t>(model.d.num_blocks * model.d.block_size);
  check_refused(bad_slot);
  Step bad_position(model.d);
  bad_position.positions[0] = static_cast<int64_t>(model.d.max_position);
  check_refused(bad_position);
  Step bad_block(model.d);
  bad_block.tables[1] = static_cast<int32_t>(model.d.num_blocks);
  check_refused(bad_block);
  Step too_long(model.d);
  too_long.seq_lens[2] = static_cast<int32_t>(too_long.stride * model.d.block_size + 1);
  check_refused(too_long);
}

TEST(mismatched_weights_are_refused_naming_the_tensor) {
  TinyModel model(false);
  model.down_w[1].pop_back();
  bool named = false;
  try {
    (void)model.decoder();
  } catch (const std::invalid_argument& e) {
    named = std::string(e.what()).find("layer 1 down_weight") != std::string::npos;
  }
  CHECK(named);
}

TEST(quantized_projections_are_checked_by_their_block_bytes) {
  const DecoderDims d = TinyModel(false).d;
  std::vector<float> norm(d.hidden, 1.0F), k_cache(d.cache_values()), v_cache(d.cache_values());
  const auto blocks = [](std::size_t n, std::size_t k) {
    return std::vector<uint8_t>(n * (k / kQuantBlock) * quant_block_bytes(QuantType::kQ4_1));
  };
  std::vector<uint8_t> qkv = blocks(d.qkv_features(), d.hidden), o = blocks(d.hidden, d.num_heads * d.head_dim),
                       gate_up = blocks(2 * d.intermediate, d.hidden), down = blocks(d.hidden, d.intermediate);
  const auto decoder = [&] {
    using P = Projection<float>;
    std::vector<DecoderLayer<float>> layers{{norm, P::of_blocks(QuantType::kQ4_1, qkv), {},
                                             P::of_blocks(QuantType::kQ4_1, o), norm,
                                             P::of_blocks(QuantType::kQ4_1, gate_up),
                                             P::of_blocks(QuantType::kQ4_1, down), k_cache, v_cache}};
    return DecoderF32(d, std::move(layers), norm);
  };
  CHECK(decoder().num_layers() == 1);
  down.pop_back();
  bool named = false;
  try {
    (void)decoder();
  } catch (const std::invalid_argument& e) {
    named = std::string(e.what()).find("layer 0 down_weight holds 3839 bytes of blocks") != std::string::npos;
  }
  CHECK(named);
}

TEST_MAIN()
