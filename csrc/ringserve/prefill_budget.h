// The prefill side of a step's token budget: the per-request chunk cap (long_prefill_token_threshold) and the
// decode-latency guard. While requests decode, the guard cuts a step's prefill chunks so that its estimated time
// stays within max_step_slowdown x that of a step with only those decodes, from a StepCostModel learnt online from
// the step times the engine reports (observe_step_time). Until the model has seen both kinds of steps only the token
// budget applies. The first prefill row of a guarded step always gets a quarter of a block, so prompts progress.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "ringserve/engine_config.h"
#include "ringserve/step_cost.h"

namespace ringserve {

class PrefillBudget {
 public:
  explicit PrefillBudget(const EngineConfig& config)
      : long_prefill_threshold_(config.long_prefill_token_threshold),
        block_size_(config.block_size),
        max_step_slowdown_(config.max_step_slowdown) {}

  // The estimated time the guard lets the next step's prefill rows add (+infinity when it does not apply: guard
  // off, no decodes last step, nothing running now, or the model not fitted yet). The last step's decodes stand for
  // this one's (the guard is decided before the running list is walked).
  double time_budget(bool requests_running) const {
    if (max_step_slowdown_ <= 0.0f || last_shape_.decode_rows == 0 || !requests_running || !cost_.fitted()) {
      return std::numeric_limits<double>::infinity();
    }
    return (max_step_slowdown_ - 1.0) * cost_.base_ns(last_shape_.decode_rows);
  }

  // schedule(): a new step is being built.
  void begin_step(bool requests_running) {
    ns_left_ = time_budget(requests_running);
    guard_active_ = ns_left_ < std::numeric_limits<double>::infinity();
    prefilled_this_step_ = false;
    shape_ = StepShape{};
  }
  // A prefill row may take at most this much of the step's remaining token budget.
  int32_t chunk_cap(int32_t budget) const {
    const int32_t cap = long_prefill_threshold_;
    return cap > 0 && cap < budget ? cap : budget;
  }
  // The guard's cut of a prefill row of (up to) n tokens after `start` computed ones.
  int32_t guarded_chunk(int32_t start, int32_t n) const {
    if (!guard_active_) return n;
    int32_t allowed = cost_.max_tokens_within(start, ns_left_);
    if (!prefilled_this_step_) allowed = std::max(allowed, guard_floor());
    return std::min(n, allowed);
  }
  // A prefill row of n tokens after `start` is in the step: charged against the guard's time, counted in its shape.
  void charge_prefill(int32_t start, int32_t n) {
    if (guard_active_) ns_left_ -= cost_.row_ns(start, n);
    prefilled_this_step_ = true;
    shape_.prefill_tokens += n;
    shape_.prefill_pairs += attention_pairs(start, n);
    shape_.prefill_context += static_cast<double>(start) + static_cast<double>(n);
  }
  // schedule(): the step is sent with `decode_rows` one-token rows; it is the one observe_step_time() measures.
  void end_step(int32_t decode_rows) {
    shape_.decode_rows = decode_rows;
    last_shape_ = shape_;
  }
  // The measured wall time of the step last sent (plan to result). Nothing to learn while the guard is off.
  void observe_step_time(int64_t ns) { observe_step_time(ns, last_shape_); }
  // The same for a given step's shape (with async scheduling the step measured is not the last one sent).
  void observe_step_time(int64_t ns, const StepShape& shape) {
    if (max_step_slowdown_ > 0.0f) cost_.observe(shape, ns);
  }
  const StepShape& last_shape() const { return last_shape_; }
  const StepCostModel& cost() const { return cost_; }

 private:
  // The first prefill row of a guarded step gets at least this many tokens, so every prompt progresses: a quarter of
  // a block (at least one token), not a whole one, because deep into a long prompt a block's attention over the
  // context can cost more than the guard's allowance by itself (measured: ITL up to 3x instead of 2x on a 2-core CPU).
  int32_t guard_floor() const { return std::max(1, block_size_ / 4); }

  int32_t long_prefill_threshold_;
  int32_t block_size_;
  float max_step_slowdown_;
  StepCostModel cost_;
  StepShape shape_;                  // the step being built
  StepShape last_shape_;             // the last step sent; its decodes are the batch the guard protects next step
  bool guard_active_ = false;        // the guard applies to the step being built
  bool prefilled_this_step_ = false;
  double ns_left_ = 0;               // estimated time the guard still lets prefill rows add
};

}  // namespace ringserve
