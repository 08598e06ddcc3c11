// When a decoding request gets lookahead slots for draft tokens, and how many. Speculation pays off while decoding
// is memory bound: no speculation in a step where more than spec_max_batch requests run (0 = no limit). A request
// gets up to num_speculative_tokens slots (never past its length limit, never past the step's token budget); one
// whose acceptance rate (a moving average of accepted / proposed) drops below spec_min_acceptance decodes without
// speculation for spec_backoff_steps steps, then starts afresh.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ringserve/engine_config.h"
#include "ringserve/request_table.h"

namespace ringserve {

class SpeculationPolicy {
 public:
  explicit SpeculationPolicy(const EngineConfig& config)
      : max_lookahead_(config.num_speculative_tokens),
        max_batch_(config.spec_max_batch),
        min_acceptance_(config.spec_min_acceptance),
        backoff_steps_(config.spec_backoff_steps) {}

  // Speculative decoding is configured (the plan then carries sched_lookahead).
  bool enabled() const { return max_lookahead_ > 0; }
  // schedule(): whether the step being built may speculate, with `num_running` requests running.
  bool begin_step(size_t num_running) {
    this_step_ = max_lookahead_ > 0 && (max_batch_ == 0 || static_cast<int32_t>(num_running) <= max_batch_);
    return this_step_;
  }
  bool this_step() const { return this_step_; }

  // Lookahead slots for a one-token decode that samples, within `budget_left` tokens. A request backing off spends
  // one of its plain steps.
  int32_t lookahead_for(const RequestState& r, RequestDetails& d, int32_t budget_left) const {
    if (d.spec_backoff > 0) {  // acceptance was low: plain decoding for a while
      --d.spec_backoff;
      return 0;
    }
    // Never past the length limit: a step yields at most lookahead + 1 tokens, and positions stay < max_model_len.
    const int32_t k = std::min({max_lookahead_, budget_left, r.length_limit - r.num_tokens() - 1});
    return std::max(k, 0);
  }

  // A verified row: `accepted` of `proposed` drafts were accepted.
  void record_verification(RequestDetails& d, int32_t proposed, int32_t accepted) {
    d.spec_proposed_tokens += static_cast<uint64_t>(proposed);
    d.spec_accepted_tokens += static_cast<uint64_t>(accepted);
    proposed_tokens_ += static_cast<uint64_t>(proposed);
    accepted_tokens_ += static_cast<uint64_t>(accepted);
    ++verify_rows_;
    const float weighted = 0.25f * static_cast<float>(accepted) / static_cast<float>(proposed);
    d.spec_acceptance = 0.75f * d.spec_acceptance + weighted;
    if (d.spec_acceptance < min_acceptance_) {
      d.spec_backoff = backoff_steps_;
      d.spec_acceptance = 1.0f;  // a fresh start after the pause
    }
  }

  uint64_t proposed_tokens() const { return proposed_tokens_; }
  uint64_t accepted_tokens() const { return accepted_tokens_; }
  uint64_t verify_rows() const { return verify_rows_; }

 private:
  int32_t max_lookahead_;
  int32_t max_batch_;
  float min_acceptance_;
  int32_t backoff_steps_;
  bool this_step_ = false;
  uint64_t proposed_tokens_ = 0;
  uint64_t accepted_tokens_ = 0;
  uint64_t verify_rows_ = 0;
};

}  // namespace ringserve
