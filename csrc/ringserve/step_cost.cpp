#include "ringserve/step_cost.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ringserve {

void StepCostModel::Ring::push(Observation o) {
  items[next] = o;
  next = (next + 1) % kWindow;
  size = std::min(size + 1, kWindow);
}

void StepCostModel::observe(int32_t tokens, int32_t rows, int64_t ns) {
  if (tokens <= 0 || rows <= 0 || ns <= 0) return;  // nothing ran, or a clock step: no information
  (tokens > rows ? mixed_ : decode_).push({static_cast<double>(tokens), static_cast<double>(ns)});
  refit();
}

void StepCostModel::refit() {
  // Ordinary least squares over both windows (64 points at most: cheaper than the step it follows).
  double n = 0;
  double sum_x = 0;
  double sum_y = 0;
  for (const Ring* ring : {&decode_, &mixed_}) {
    for (size_t i = 0; i < ring->size; ++i) {
      n += 1;
      sum_x += ring->items[i].tokens;
      sum_y += ring->items[i].ns;
    }
  }
  fitted_ = false;
  if (n < 4) return;
  const double mean_x = sum_x / n;
  const double mean_y = sum_y / n;
  double sxx = 0;
  double sxy = 0;
  for (const Ring* ring : {&decode_, &mixed_}) {
    for (size_t i = 0; i < ring->size; ++i) {
      const double dx = ring->items[i].tokens - mean_x;
      sxx += dx * dx;
      sxy += dx * (ring->items[i].ns - mean_y);
    }
  }
  // Sizes must spread by at least a token on average, and a step must cost more with more tokens.
  if (sxx < n || sxy <= 0) return;
  per_token_ns_ = sxy / sxx;
  fixed_ns_ = std::max(0.0, mean_y - per_token_ns_ * mean_x);  // a negative intercept is noise: clamp
  fitted_ = true;
}

int32_t StepCostModel::token_limit(int32_t base_tokens, double slowdown) const {
  if (!fitted_ || !(slowdown >= 1.0)) return -1;
  const double base_ns = fixed_ns_ + per_token_ns_ * static_cast<double>(base_tokens);
  const double limit = (slowdown * base_ns - fixed_ns_) / per_token_ns_;
  constexpr double kMax = std::numeric_limits<int32_t>::max();
  return static_cast<int32_t>(std::clamp(std::floor(limit + 1e-6), 0.0, kMax));  // 1e-6: float noise of the fit
}

}  // namespace ringserve
