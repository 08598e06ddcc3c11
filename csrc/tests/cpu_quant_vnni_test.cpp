// The AVX-512 VNNI products against the AVX2 ones, bit for bit: the panels for every block type, input-row tile and
// tail, lone last panel, chunking and output type, and the tiles (1 to 31 input rows, every weight-row tail) for
// every block type; on SIMDe's portable AVX-512 (cpu_quant_vnni_emulated.cpp) on every AVX2 CPU, and natively (also
// through linear_quant's public path choice) where the CPU has AVX-512 VNNI.
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
template <class T>
void tile_products_avx512_vnni_emulated(QuantType type, LinearShape s, std::size_t block_bytes, const ActBlock* act,
                                        const uint8_t* w, const EpilogueOf<T>& epi, T* y, std::size_t j0,
                                        std::size_t j1);
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

// Random weights of `type` (n rows of k / 32 blocks; the 8-bit formats with some -128s, valid in a file though the
// quantizer never writes one), m rows of input blocks, a bias and a residual.
template <class T>
struct Case {
  std::vector<uint8_t> w;
  std::vector<ActBlock> act;
  std::vector<T> bias;
  std::vector<T> residual;
};

template <class T>
Case<T> random_case(QuantType type, std::size_t m, std::size_t n, std::size_t k, unsigned seed) {
  std::mt19937 gen(seed);
  Case<T> c;
  std::vector<double> values;
  for (std::size_t b = 0; b < n * k / kQuantBlock; ++b) random_block(type, gen, c.w, values);
  const std::size_t block_bytes = quant_block_bytes(type);
  if (type == QuantType::kQ8_0 || type == QuantType::kQ8_2F) {
    for (std::size_t b = 0; b < n * k / kQuantBlock; b += 3) c.w[(b + 1) * block_bytes - 1] = 0x80;
  }
  c.act = random_inputs(m, k, gen);
  std::normal_distribution<float> normal;
  c.bias.resize(n);
  c.residual.resize(m * n);
  for (auto& v : c.bias) v = from_float<T>(normal(gen));
  for (auto& v : c.residual) v = from_float<T>(normal(gen));
  return c;
}

using VnniEntry = void (*)(QuantType, LinearShape, const ActBlock*, const PanelBlock*, const EpilogueOf<float>&,
                           float*, std::size_t, std::size_t);
using VnniEntryBf16 = void (*)(QuantType, LinearShape, const ActBlock*, const PanelBlock*,
                               const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t, std::size_t);

// Weight rows [0, n / 8 * 8) against m input rows through `vnni` and through the AVX2 panels, over the whole range and
// in chunks of 16 rows as linear_quant hands them to threads; the outputs must be the same bits.
template <class T, class Entry>
void compare(Entry vnni, QuantType type, std::size_t m, std::size_t n, std::size_t k, bool epilogue) {
  const auto seed = static_cast<unsigned>(static_cast<int>(type) * 131 + m * 17 + n * 3 + k);
  const Case<T> c = random_case<T>(type, m, n, k, seed);
  const std::size_t block_bytes = quant_block_bytes(type);
  std::vector<uint8_t> panels(quant_panel_bytes(type, n, k));
  pack_quant_panels(type, n, k, c.w, panels);
  const auto* packed = reinterpret_cast<const PanelBlock*>(panels.data());
  const EpilogueOf<T> epi{epilogue ? c.bias.data() : nullptr, epilogue ? c.residual.data() : nullptr};
  const LinearShape s{m, n, k};
  const std::size_t rows = n / kQuantPanelRows * kQuantPanelRows;
  std::vector<T> want(m * n), whole(m * n), chunked(m * n);
  quant::panel_products_avx2<T>(type, s, block_bytes, c.act.data(), c.w.data(), panels.data(), epi, want.data(), 0,
                                rows);
  vnni(type, s, c.act.data(), packed, epi, whole.data(), 0, rows);
  for (std::size_t j = 0; j < rows; j += 16) {
    vnni(type, s, c.act.data(), packed, epi, chunked.data(), j, std::min(rows, j + 16));
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

using TileEntry = void (*)(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                           const EpilogueOf<float>&, float*, std::size_t, std::size_t);
using TileEntryBf16 = void (*)(QuantType, LinearShape, std::size_t, const ActBlock*, const uint8_t*,
                               const EpilogueOf<bf16_bits>&, bf16_bits*, std::size_t, std::size_t);

// Every weight row against m input rows through the tiles of `vnni` and of AVX2 (whole, and in chunks of 16 rows);
// n = 45 ends in a lone row after the pairs, 46 in a pair.
template <class T, class Entry, class Avx2Entry>
void compare_tiles(Entry vnni, Avx2Entry avx2, QuantType type, std::size_t m, std::size_t n, std::size_t k) {
  const auto seed = static_cast<unsigned>(static_cast<int>(type) * 977 + m * 31 + n * 7 + k);
  const Case<T> c = random_case<T>(type, m, n, k, seed);
  const std::size_t block_bytes = quant_block_bytes(type);
  const EpilogueOf<T> epi{c.bias.data(), m % 2 == 0 ? c.residual.data() : nullptr};
  const LinearShape s{m, n, k};
  std::vector<T> want(m * n), whole(m * n), chunked(m * n);
  avx2(type, s, block_bytes, c.act.data(), c.w.data(), epi, want.data(), 0, n);
  vnni(type, s, block_bytes, c.act.data(), c.w.data(), epi, whole.data(), 0, n);
  for (std::size_t j = 0; j < n; j += 16) {
    vnni(type, s, block_bytes, c.act.data(), c.w.data(), epi, chunked.data(), j, std::min(n, j + 16));
  }
  const bool same = std::memcmp(want.data(), whole.data(), want.size() * sizeof(T)) == 0 &&
                    std::memcmp(want.data(), chunked.data(), want.size() * sizeof(T)) == 0;
  if (!same) {
    std::fprintf(stderr, "  tiles: type %d, m %zu, n %zu, k %zu differ\n", static_cast<int>(type), m, n, k);
  }
  CHECK(same);
}

template <class Entry, class EntryBf16>
void compare_all_tiles(Entry vnni, EntryBf16 vnni_bf16) {
  for (const QuantType type : kTypes) {
    for (const std::size_t n : {45, 46}) {
      for (const std::size_t m : {1, 2, 3, 4, 5, 7, 9, 31}) {
        compare_tiles<float>(vnni, static_cast<TileEntry>(&quant::tile_products_avx2<float>), type, m, n, 96);
      }
      compare_tiles<bf16_bits>(vnni_bf16, static_cast<TileEntryBf16>(&quant::tile_products_avx2<bf16_bits>), type, 6,
                               n, 160);
    }
  }
}

TEST(emulated_vnni_tiles_give_the_avx2_tiles_bits) {
  if (!has_avx2_quant()) {
    std::fprintf(stderr, "  skipped: the emulated build runs on AVX2 and the AVX2 tiles are the reference\n");
    return;
  }
  compare_all_tiles(static_cast<TileEntry>(&quant::tile_products_avx512_vnni_emulated<float>),
                    static_cast<TileEntryBf16>(&quant::tile_products_avx512_vnni_emulated<bf16_bits>));
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
  compare_all_tiles(static_cast<TileEntry>(&quant::tile_products_avx512_vnni<float>),
                    static_cast<TileEntryBf16>(&quant::tile_products_avx512_vnni<bf16_bits>));
  // Through the public entry: the fastest path (VNNI; panels from 32 rows) against the AVX2 one, 2 threads.
  for (const QuantType type : kTypes) {
    for (const std::size_t m : {1, 5, 37}) {
      const std::size_t n = 45, k = 96;
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
}

}  // namespace

TEST_MAIN()
