#include "ringserve/step_cost.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace ringserve {

namespace {
constexpr size_t kMinDecodeSteps = 3;  // before the base counts

// The features of the prefill fit, in the order the subsets below name them.
enum Feature : uint8_t { kTokens, kPairs, kContext, kDecodes, kFeatures };
using Vector = std::array<double, kFeatures>;
using Matrix = std::array<Vector, kFeatures>;
// Solves the k x k system a x = b (a symmetric positive semi-definite, from normal equations) by Gaussian elimination
// with partial pivoting. False when a is close to singular: its determinant at most 1e-9 x the product of its
// diagonal (scale-free: the features differ by orders of magnitude).
bool solve(Matrix a, Vector b, size_t k, Vector& x) {
  double diagonal = 1;
  for (size_t i = 0; i < k; ++i) diagonal *= a[i][i];
  if (!(diagonal > 0)) return false;
  double det = 1;
  for (size_t c = 0; c < k; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < k; ++r) {
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    }
    if (pivot != c) {
      std::swap(a[pivot], a[c]);
      std::swap(b[pivot], b[c]);
      det = -det;
    }
    det *= a[c][c];
    if (a[c][c] == 0) return false;
    for (size_t r = c + 1; r < k; ++r) {
      const double f = a[r][c] / a[c][c];
      for (size_t j = c; j < k; ++j) a[r][j] -= f * a[c][j];
      b[r] -= f * b[c];
    }
  }
  if (!(std::abs(det) > 1e-9 * diagonal)) return false;
  for (size_t c = k; c-- > 0;) {
    double v = b[c];
    for (size_t j = c + 1; j < k; ++j) v -= a[c][j] * x[j];
    x[c] = v / a[c][c];
  }
  return true;
}

template <class T>
double median_of(const T& items, size_t size, double (*key)(const typename T::value_type&)) {
  std::array<double, std::tuple_size_v<T>> values{};
  for (size_t i = 0; i < size; ++i) values[i] = key(items[i]);
  const auto mid = values.begin() + static_cast<std::ptrdiff_t>(size / 2);
  std::nth_element(values.begin(), mid, values.begin() + static_cast<std::ptrdiff_t>(size));
  return *mid;
}
}  // namespace

void StepCostModel::observe(const StepShape& step, int64_t ns) {
  if (ns <= 0 || step.decode_rows < 0 || step.prefill_tokens < 0 || !(step.prefill_pairs >= 0) ||
      !(step.prefill_context >= 0)) {
    return;
  }
  if (step.prefill_tokens == 0) {
    if (step.decode_rows == 0) return;  // nothing ran
    decode_.push({static_cast<double>(step.decode_rows), static_cast<double>(ns)});
    refit_base();
    return;
  }
  // A step with prefill, with or without decodes (the weights are read once either way): what it adds to the base.
  prefill_.push({static_cast<double>(step.decode_rows), static_cast<double>(step.prefill_tokens), step.prefill_pairs,
                 step.prefill_context, static_cast<double>(ns)});
  refit_prefill();
}

void StepCostModel::refit_base() {
  if (decode_.size < kMinDecodeSteps) return;
  base_ns_ = median_of(decode_.items, decode_.size, [](const Decode& d) { return d.ns; });
  base_rows_ = median_of(decode_.items, decode_.size, [](const Decode& d) { return d.rows; });
  has_base_ = true;
  refit_prefill();
}

void StepCostModel::refit_prefill() {
  // Least squares through the origin over the features, on every step kept: a prefill step's time beyond the base,
  // and a decode-only one's (its features are its decode rows beyond the base's alone, so it informs per_decode only).
  Matrix m{};
  Vector rhs{};
  fitted_ = false;
  if (!has_base_ || prefill_.size == 0) return;
  const auto add = [&](const Vector& f, double extra) {
    for (size_t r = 0; r < kFeatures; ++r) {
      for (size_t c = 0; c < kFeatures; ++c) m[r][c] += f[r] * f[c];
      rhs[r] += f[r] * extra;
    }
  };
  for (size_t i = 0; i < prefill_.size; ++i) {
    const Prefill& p = prefill_.items[i];
    add({p.tokens, p.pairs, p.context, p.decode_rows - base_rows_}, p.ns - base_ns_);
  }
  for (size_t i = 0; i < decode_.size; ++i) {
    const Decode& d = decode_.items[i];
    add({0, 0, 0, d.rows - base_rows_}, d.ns - base_ns_);
  }
  // Non-negative least squares, small enough to do exactly: of the feature sets with tokens (prefill must cost
  // something) whose fit is determined and has no negative slope, the one that explains the most (the smallest
  // residual: at a least-squares solution it is the constant y'y less x'rhs).
  double best = -std::numeric_limits<double>::infinity();
  for (unsigned mask = 1; mask < (1U << kFeatures); mask += 2) {  // odd masks: kTokens is bit 0
    std::array<size_t, kFeatures> which{};  // the set's features, in order
    size_t k = 0;
    for (size_t f = 0; f < kFeatures; ++f) {
      if ((mask >> f) & 1U) which[k++] = f;
    }
    Matrix a{};
    Vector b{};
    for (size_t r = 0; r < k; ++r) {
      for (size_t c = 0; c < k; ++c) a[r][c] = m[which[r]][which[c]];
      b[r] = rhs[which[r]];
    }
    Vector x{};
    if (!solve(a, b, k, x) || !(x[0] > 0)) continue;
    double explained = 0;
    bool valid = true;
    for (size_t i = 0; i < k; ++i) {
      valid = valid && x[i] >= 0;
      explained += x[i] * b[i];
    }
    if (!valid || !(explained > best)) continue;
    best = explained;
    Vector slope{};
    for (size_t i = 0; i < k; ++i) slope[which[i]] = x[i];
    per_token_ns_ = slope[kTokens];
    per_pair_ns_ = slope[kPairs];
    per_context_ns_ = slope[kContext];
    per_decode_ns_ = slope[kDecodes];
    fitted_ = true;
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
