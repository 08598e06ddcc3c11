#include "ringserve/step_cost.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ringserve {

namespace {
constexpr size_t kMinDecodeSteps = 3;  // before the base counts
}  // namespace

void StepCostModel::observe(const StepShape& step, int64_t ns) {
  if (ns <= 0 || step.decode_rows < 0 || step.prefill_tokens < 0 || !(step.prefill_pairs >= 0) ||
      !(step.prefill_context >= 0)) {
    return;
  }
  if (step.prefill_tokens == 0) {
    if (step.decode_rows == 0) return;  // nothing ran
    decode_ns_.push(static_cast<double>(ns));
    refit_base();
    return;
  }
  // A step with prefill, with or without decodes (the weights are read once either way): what it adds to the base.
  prefill_.push({static_cast<double>(step.prefill_tokens), step.prefill_pairs, step.prefill_context,
                 static_cast<double>(ns)});
  refit_prefill();
}

void StepCostModel::refit_base() {
  if (decode_ns_.size < kMinDecodeSteps) return;
  std::array<double, kWindow> sorted{};
  std::copy_n(decode_ns_.items.begin(), decode_ns_.size, sorted.begin());
  const auto mid = sorted.begin() + static_cast<std::ptrdiff_t>(decode_ns_.size / 2);
  std::nth_element(sorted.begin(), mid, sorted.begin() + static_cast<std::ptrdiff_t>(decode_ns_.size));
  base_ns_ = *mid;
  has_base_ = true;
  refit_prefill();
}

void StepCostModel::refit_prefill() {
  // Least squares through the origin: no prefill adds nothing.
  double stt = 0;
  double spp = 0;
  double stp = 0;
  double ste = 0;
  double spe = 0;
  double scc = 0;
  double stc = 0;
  double spc = 0;
  double sce = 0;
  fitted_ = false;
  per_context_ns_ = 0;
  if (!has_base_ || prefill_.size == 0) return;
  for (size_t i = 0; i < prefill_.size; ++i) {
    const Prefill& p = prefill_.items[i];
    const double extra = p.ns - base_ns_;
    stt += p.tokens * p.tokens;
    spp += p.pairs * p.pairs;
    stp += p.tokens * p.pairs;
    ste += p.tokens * extra;
    spe += p.pairs * extra;
    scc += p.context * p.context;
    stc += p.tokens * p.context;
    spc += p.pairs * p.context;
    sce += p.context * extra;
  }
  // All three slopes: the normal equations solved by Cramer's rule, kept when the features are far from dependent
  // and every slope comes out non-negative (tokens: positive).
  {
    const double m[3][3] = {{stt, stp, stc}, {stp, spp, spc}, {stc, spc, scc}};
    const double rhs[3] = {ste, spe, sce};
    const auto det3 = [](const double a[3][3]) {
      return a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0]) +
             a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]);
    };
    const double det = det3(m);
    if (det > 1e-9 * stt * spp * scc) {
      double x[3];
      for (int c = 0; c < 3; ++c) {
        double mc[3][3];
        for (int r = 0; r < 3; ++r) {
          for (int k = 0; k < 3; ++k) mc[r][k] = k == c ? rhs[r] : m[r][k];
        }
        x[c] = det3(mc) / det;
      }
      if (x[0] > 0 && x[1] >= 0 && x[2] >= 0) {
        per_token_ns_ = x[0];
        per_pair_ns_ = x[1];
        per_context_ns_ = x[2];
        fitted_ = true;
        return;
      }
    }
  }
  // Both slopes when the two features are not (nearly) proportional and both come out non-negative; else tokens
  // alone.
  const double det = stt * spp - stp * stp;
  if (det > 1e-9 * stt * spp) {
    const double per_token = (ste * spp - spe * stp) / det;
    const double per_pair = (spe * stt - ste * stp) / det;
    if (per_token > 0 && per_pair >= 0) {
      per_token_ns_ = per_token;
      per_pair_ns_ = per_pair;
      fitted_ = true;
      return;
    }
  }
  if (ste <= 0) return;  // prefill must cost something
  per_token_ns_ = ste / stt;
  per_pair_ns_ = 0;
  fitted_ = true;
}

int32_t StepCostModel::max_tokens_within(int32_t start, double ns) const {
  if (!fitted_ || !(ns > 0)) return 0;
  // per_pair n^2 + (per_token + per_pair start + per_context) n <= ns - per_context start: the positive root of the
  // quadratic, rounded down.
  ns -= per_context_ns_ * static_cast<double>(start);
  if (!(ns > 0)) return 0;
  const double a = per_pair_ns_;
  const double b = per_token_ns_ + per_pair_ns_ * static_cast<double>(start) + per_context_ns_;
  const double root = a > 0 ? (2 * ns) / (b + std::sqrt(b * b + 4 * a * ns)) : ns / b;  // stable form of the root
  constexpr double kMax = std::numeric_limits<int32_t>::max();
  return static_cast<int32_t>(std::clamp(std::floor(root * (1 + 1e-9) + 1e-9), 0.0, kMax));  // float noise of the fit
}

}  // namespace ringserve
