// The greedy argmax / log-probability kernel (the AVX-512, AVX2 or portable path, whichever this CPU takes) against a
// float64 reference: ties, tails, NaN, all -inf, threads.
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu_sampling.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

struct Reference {
  int64_t id;
  double logprob;
};

std::vector<Reference> reference(std::size_t rows, std::size_t vocab, const std::vector<float>& logits) {
  std::vector<Reference> out;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * vocab;
    std::size_t best = 0;
    for (std::size_t i = 1; i < vocab; ++i) {
      if (row[i] > row[best]) best = i;
    }
    double sum = 0.0;
    for (std::size_t i = 0; i < vocab; ++i) sum += std::exp(double{row[i]} - row[best]);
    out.push_back({static_cast<int64_t>(best), -std::log(sum)});
  }
  return out;
}

void check_both_types(std::size_t rows, std::size_t vocab, std::vector<float> logits, int threads) {
  // Round the inputs to bf16 first, so both storage types hold exactly the same values.
  std::vector<bf16_bits> bf(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) {
    bf[i] = float_to_bf16(logits[i]);
    logits[i] = bf16_to_float(bf[i]);
  }
  const auto want = reference(rows, vocab, logits);
  for (bool use_bf16 : {false, true}) {
    std::vector<int64_t> ids(rows, -7);
    std::vector<float> lps(rows, 1.0F);
    if (use_bf16) {
      argmax_logprob_bf16(rows, vocab, bf, ids, lps, threads);
    } else {
      argmax_logprob_f32(rows, vocab, logits, ids, lps, threads);
    }
    for (std::size_t r = 0; r < rows; ++r) {
      const bool ok = ids[r] == want[r].id && std::abs(lps[r] - want[r].logprob) <= 1e-5 * (1 + std::abs(want[r].logprob));
      if (!ok) {
        std::fprintf(stderr, "  rows=%zu vocab=%zu bf16=%d row %zu: id %lld lp %g, want %lld %g\n", rows, vocab,
                     use_bf16, r, static_cast<long long>(ids[r]), lps[r], static_cast<long long>(want[r].id),
                     want[r].logprob);
        CHECK(false);
        return;
      }
    }
  }
}

std::vector<float> random_logits(std::size_t count, unsigned seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0F, scale);
  std::vector<float> values(count);
  for (auto& v : values) v = normal(gen);
  return values;
}

}  // namespace

TEST(random_rows_of_every_tail_length_match_the_reference) {
  for (std::size_t vocab : {1, 5, 15, 16, 17, 31, 33, 100, 4099}) {
    for (std::size_t rows : {1, 3, 8}) {
      for (int threads : {1, 2}) {
        check_both_types(rows, vocab, random_logits(rows * vocab, static_cast<unsigned>(vocab * 31 + rows), 4.0F),
                         threads);
      }
    }
  }
}

TEST(ties_go_to_the_first_index_in_every_lane_and_in_the_tail) {
  const std::size_t vocab = 83;  // five vectors and a tail of three
  for (std::size_t first : {0, 7, 16, 40, 79, 81}) {
    std::vector<float> logits(vocab, -1.0F);
    for (std::size_t i = first; i < vocab; i += 5) logits[i] = 3.0F;  // the maximum, again and again after `first`
    check_both_types(1, vocab, logits, 1);
  }
  // A later lane holds the maximum in an earlier vector than a lower lane does.
  std::vector<float> logits(64, 0.0F);
  logits[20] = 2.0F;  // lane 4, second vector
  logits[35] = 2.0F;  // lane 3, third vector
  check_both_types(1, 64, logits, 1);
}

TEST(a_peaked_row_has_a_log_probability_near_zero_and_a_flat_row_minus_log_vocab) {
  std::vector<float> logits(2 * 1000, 0.0F);
  logits[123] = 100.0F;
  std::vector<int64_t> ids(2);
  std::vector<float> lps(2);
  argmax_logprob_f32(2, 1000, logits, ids, lps);
  CHECK(ids[0] == 123 && std::abs(lps[0]) < 1e-6F);
  CHECK(ids[1] == 0 && std::abs(lps[1] + std::log(1000.0F)) < 1e-5F);
}

TEST(nan_counts_as_the_maximum_and_all_minus_infinity_gives_nan) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits(3 * 40, 1.0F);
  logits[0 * 40 + 9] = 5.0F;
  logits[0 * 40 + 21] = std::numeric_limits<float>::quiet_NaN();
  logits[0 * 40 + 30] = std::numeric_limits<float>::quiet_NaN();
  for (std::size_t i = 0; i < 40; ++i) logits[1 * 40 + i] = -inf;
  logits[2 * 40 + 38] = inf;
  std::vector<int64_t> ids(3);
  std::vector<float> lps(3);
  argmax_logprob_f32(3, 40, logits, ids, lps);
  CHECK(ids[0] == 21 && std::isnan(lps[0]));
  CHECK(ids[1] == 0 && std::isnan(lps[1]));
  CHECK(ids[2] == 38);
}

TEST(mismatched_sizes_are_refused) {
  std::vector<float> logits(10);
  std::vector<int64_t> ids(2);
  std::vector<float> lps(2);
  CHECK_THROWS(std::invalid_argument, argmax_logprob_f32(2, 4, logits, ids, lps));
  CHECK_THROWS(std::invalid_argument, argmax_logprob_f32(2, 5, logits, std::span<int64_t>(ids.data(), 1), lps));
  CHECK_THROWS(std::invalid_argument, argmax_logprob_f32(0, 0, {}, {}, {}));
}

TEST_MAIN()
