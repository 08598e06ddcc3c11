// The AVX-512 VNNI panels against the AVX2 panels, bit for bit, for every block type, input-row tile and tail, lone
// last panel, chunking and output type: on SIMDe's portable AVX-512 (cpu_quant_vnni_emulated.cpp) on every AVX2 CPU,
// and natively (also through linear_quant's public path choice) where the CPU has AVX-512 VNNI.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu_quant.h"
#include "kernels/cpu_quant_blocks.h"
#include "tests/check.h"
#include "tests/quant_blocks.h"

using namespace ringserve::kernels;
using ringserve::testing::from_float;
using ringserve::testing::kTypes;
using ringserve::testing::random_block;

namespace ringserve::kernels::quant {
template <class T>
void panel_products_avx512_vnni_emulated(QuantType type, LinearShape s, const ActBlock* act, const PanelBlock* panels,
                                         const EpilogueOf<T>& epi, T* y, std::size_t j0, std::size_t j1);
}  // namespace ringserve::kernels::quant

namespace {

using quant::ActBlock;
using quant::EpilogueOf;
using quant::PanelBlock;

// Random input blocks as linear_quant's quantizer leaves them: int8 values in [-127, 127] (both ends included), a
// positive scale, and the scale times the values' sum.
std::vector<ActBlock> random_inputs(std::size_t m, std::size_t k, std::mt19937& gen) {
  std::uniform_int_distribution<int> value(-127, 127);
  std::uniform_real_distribution<float> scale(0.001F, 0.05F);
  std::vector<ActBlock> act(m * k / kQuantBlock);
  for (std::size_t b = 0; b < act.size(); ++b) {
    int sum = 0;
    for (std::size_t v = 0; v < kQuantBlock; ++v) {
      const int q = b % 5 == 0 ? (v % 2 == 0 ? 127 : -127) : value(gen);  // every fifth block at the extremes
      act[b].q[v] = static_cast<int8_t>(q);
      sum += q;
    }
    act[b].d = scale(gen);
    act[b].s = act[b].d * static_cast<float>(sum);
  }
  return act;
}

using VnniEntry = void (*)(QuantType, LinearShape, const ActBlock*, const PanelBlock*, const EpilogueOf<float>&,
                           float*, std::size_t, std::size_t);
using VnniEntryBf16 = void (*)(QuantType, LinearShape, const ActBlock*, const PanelBlock*,
                               const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t, std::size_t);

// Weight rows [0, n / 8 * 8) against m input rows through `vnni` and through the AVX2 panels, over the whole range and
// in chunks of 16 rows as linear_quant hands them to threads; the outputs must be the same bits.
template <class T, class Entry>
void compare(Entry vnni, QuantType type, std::size_t m, std::size_t n, std::size_t k, bool epilogue) {
  std::mt19937 gen(static_cast<unsigned>(static_cast<int>(type) * 131 + m * 17 + n * 3 + k));
  std::vector<uint8_t> w;
  std::vector<double> values;
  for (std::size_t b = 0; b < n * k / kQuantBlock; ++b) random_block(type, gen, w, values);
  const std::size_t block_bytes = quant_block_bytes(type);
  if (type == QuantType::kQ8_0 || type == QuantType::kQ8_2F) {
    // -128 is a valid int8 weight in a file even where the quantizer never writes it.
    for (std::size_t b = 0; b < n * k / kQuantBlock; b += 3) w[(b + 1) * block_bytes - 1] = 0x80;
  }
  std::vector<uint8_t> panels(quant_panel_bytes(type, n, k));
  pack_quant_panels(type, n, k, w, panels);
  const auto* packed = reinterpret_cast<const PanelBlock*>(panels.data());
  const std::vector<ActBlock> act = random_inputs(m, k, gen);
  std::normal_distribution<float> normal;
  std::vector<T> bias(n), residual(m * n);
  for (auto& v : bias) v = from_float<T>(normal(gen));
  for (auto& v : residual) v = from_float<T>(normal(gen));
  const EpilogueOf<T> epi{epilogue ? bias.data() : nullptr, epilogue ? residual.data() : nullptr};
  const LinearShape s{m, n, k};
  const std::size_t rows = n / kQuantPanelRows * kQuantPanelRows;
  std::vector<T> want(m * n), whole(m * n), chunked(m * n);
  quant::panel_products_avx2<T>(type, s, block_bytes, act.data(), w.data(), panels.data(), epi, want.data(), 0, rows);
  vnni(type, s, act.data(), packed, epi, whole.data(), 0, rows);
  for (std::size_t j = 0; j < rows; j += 16) {
    vnni(type, s, act.data(), packed, epi, chunked.data(), j, std::min(rows, j + 16));
  }
  const bool same_whole = std::memcmp(want.data(), whole.data(), want.size() * sizeof(T)) == 0;
  const bool same_chunked = std::memcmp(want.data(), chunked.data(), want.size() * sizeof(T)) == 0;
  if (!same_whole || !same_chunked) {
    std::fprintf(stderr, "  type %d, m %zu, n %zu, k %zu, epilogue %d: whole %d, chunked %d\n", static_cast<int>(type),
                 m, n, k, epilogue ? 1 : 0, same_whole ? 1 : 0, same_chunked ? 1 : 0);
  }
  CHECK(same_whole);
  CHECK(same_chunked);
}

// n = 8 is one lone panel, 40 five (two pairs and a lone one), 56 seven; m reaches every tail of the 8-row input
// tiles, k one block and several.
template <class Entry, class EntryBf16>
void compare_all(Entry vnni, EntryBf16 vnni_bf16) {
  for (const QuantType type : kTypes) {
    for (const std::size_t n : {8, 40, 56}) {
      for (const std::size_t k : {32, 160}) {
        for (const std::size_t m : {1, 3, 7, 8, 9, 16, 23, 33}) {
          compare<float>(vnni, type, m, n, k, m % 2 == 1);
        }
        compare<bf16_bits>(vnni_bf16, type, 13, n, k, true);
      }
    }
  }
}

TEST(emulated_vnni_panels_give_the_avx2_panels_bits) {
  if (!has_avx2_quant()) {
    std::fprintf(stderr, "  skipped: the emulated build runs on AVX2 and the AVX2 panels are the reference\n");
    return;
  }
  compare_all(static_cast<VnniEntry>(&quant::panel_products_avx512_vnni_emulated<float>),
              static_cast<VnniEntryBf16>(&quant::panel_products_avx512_vnni_emulated<bf16_bits>));
}

TEST(native_vnni_panels_give_the_avx2_panels_bits) {
  if (!has_avx512_vnni_quant()) {
    std::fprintf(stderr, "  skipped: this CPU has no AVX-512 VNNI\n");
    return;
  }
  compare_all(static_cast<VnniEntry>(&quant::panel_products_avx512_vnni<float>),
              static_cast<VnniEntryBf16>(&quant::panel_products_avx512_vnni<bf16_bits>));
  // Through the public entry: the fastest path (VNNI with packed panels) against the AVX2 one, 2 threads.
  for (const QuantType type : kTypes) {
    const std::size_t m = 37, n = 45, k = 96;
    std::mt19937 gen(static_cast<unsigned>(type));
    std::vector<uint8_t> w;
    std::vector<double> values;
    for (std::size_t b = 0; b < n * k / kQuantBlock; ++b) random_block(type, gen, w, values);
    std::vector<uint8_t> panels(quant_panel_bytes(type, n, k));
    pack_quant_panels(type, n, k, w, panels);
    std::normal_distribution<float> normal;
    std::vector<float> x(m * k), fastest(m * n), avx2(m * n);
    for (auto& v : x) v = normal(gen);
    linear_quant_f32({m, n, k}, type, x, w, {}, fastest, QuantPath::kFastest, 2, {}, panels);
    linear_quant_f32({m, n, k}, type, x, w, {}, avx2, QuantPath::kAvx2, 2, {}, panels);
    CHECK(std::memcmp(fastest.data(), avx2.data(), avx2.size() * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_MAIN()
