#include "ringserve/step_cost.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ringserve {

namespace {
constexpr size_t kMinDecodeSteps = 3;  // before the base counts

// The determinant of the leading k x k block of `a` (k = 1, 2 or 3).
double leading_det(const double a[3][3], int k) {
  if (k == 1) return a[0][0];
  if (k == 2) return a[0][0] * a[1][1] - a[0][1] * a[1][0];
  return a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0]) +
         a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]);
}
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
  // Least squares through the origin (no prefill adds nothing) over the features tokens, pairs, context: the normal
  // equations m x = rhs.
  constexpr int kFeatures = 3;
  double m[kFeatures][kFeatures] = {};
  double rhs[kFeatures] = {};
  fitted_ = false;
  if (!has_base_ || prefill_.size == 0) return;
  for (size_t i = 0; i < prefill_.size; ++i) {
    const Prefill& p = prefill_.items[i];
    const double f[kFeatures] = {p.tokens, p.pairs, p.context};
    for (int r = 0; r < kFeatures; ++r) {
      for (int c = 0; c < kFeatures; ++c) m[r][c] += f[r] * f[c];
      rhs[r] += f[r] * (p.ns - base_ns_);
    }
  }
  // The first k features for k = 3, 2, 1 (all slopes, then without context, then tokens alone), solved by Cramer's
  // rule: kept when they are far from dependent and every slope comes out non-negative (tokens: positive, prefill
  // must cost something).
  for (int k = kFeatures; k >= 1; --k) {
    double diagonal = 1;
    for (int i = 0; i < k; ++i) diagonal *= m[i][i];
    const double det = leading_det(m, k);
    if (!(det > 1e-9 * diagonal)) continue;
    double x[kFeatures] = {};
    bool valid = true;
    for (int c = 0; c < k; ++c) {
      double mc[kFeatures][kFeatures];
      for (int r = 0; r < k; ++r) {
        for (int j = 0; j < k; ++j) mc[r][j] = j == c ? rhs[r] : m[r][j];
      }
      x[c] = leading_det(mc, k) / det;
      valid = valid && (c == 0 ? x[c] > 0 : x[c] >= 0);
    }
    if (!valid) continue;
    per_token_ns_ = x[0];
    per_pair_ns_ = x[1];
    per_context_ns_ = x[2];
    fitted_ = true;
    return;
  }
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
