// The outputs of the steps since the engine last sent them: one PackedOutput (a cache line) per scheduled request per
// step and one per abort, their top logprobs in two side arrays in output order. The storage keeps its high-water
// mark, so steady-state steps write outputs in place without touching the heap.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "ringserve/records.h"
#include "ringserve/request_table.h"

namespace ringserve {

// Every field written once (no value-initialization first): this runs for every scheduled request in every step.
[[gnu::always_inline]] inline PackedOutput make_output(const RequestState& r, FinishReason reason, int32_t num_scheduled,
                                                       bool has_token, int32_t token, float logprob) {
  return PackedOutput{
      .request_id = r.request_id,
      .arrival_time_ns = r.arrival_time_ns,
      .first_scheduled_time_ns = r.first_scheduled_time_ns,
      .first_token_time_ns = r.first_token_time_ns,
      .num_prompt_tokens = static_cast<uint32_t>(r.num_prompt_tokens),
      .num_cached_tokens = r.num_cached_tokens,
      // Prompt progress; a sampled token means the whole prompt is computed.
      .num_computed_tokens =
          static_cast<uint32_t>(has_token ? r.num_prompt_tokens : std::min(r.num_computed_tokens, r.num_prompt_tokens)),
      .num_scheduled_tokens = static_cast<uint32_t>(num_scheduled),
      .token_id = token,
      .logprob = logprob,
      .num_preemptions = r.num_preemptions,
      .num_spec_proposed_tokens = 0,
      .num_spec_accepted_tokens = 0,
      .finish_reason = reason,
      .has_token = has_token,
      .num_top = 0,
  };
}

class StepOutputs {
 public:
  explicit StepOutputs(size_t max_num_seqs) { outputs_.reserve(max_num_seqs); }

  std::span<const PackedOutput> outputs() const { return {outputs_.data(), size_}; }
  std::span<const int32_t> top_token_ids() const { return top_token_ids_; }
  std::span<const float> top_logprobs() const { return top_logprobs_; }
  void clear() {
    size_ = 0;
    top_token_ids_.clear();
    top_logprobs_.clear();
  }
  // Unpacks the pending outputs into `out` and clears them (tests and bindings).
  void take(std::vector<RequestOutput>& out);

  // Room for `more` outputs after the pending ones, to be written in place and then counted with commit(). Grows the
  // storage only past its high-water mark.
  PackedOutput* reserve(size_t more) {
    if (outputs_.size() < size_ + more) outputs_.resize(size_ + more);
    return outputs_.data() + size_;
  }
  // The outputs written in place up to (not including) `end` are pending.
  void commit(const PackedOutput* end) { size_ = static_cast<size_t>(end - outputs_.data()); }
  // One more output, set by the caller.
  PackedOutput& append() {
    PackedOutput& o = *reserve(1);
    ++size_;
    return o;
  }
  // Attaches a token's top logprobs to its output o (the last one appended).
  void add_top(PackedOutput& o, std::span<const int32_t> ids, std::span<const float> logprobs) {
    o.num_top = static_cast<uint16_t>(ids.size());
    top_token_ids_.insert(top_token_ids_.end(), ids.begin(), ids.end());
    top_logprobs_.insert(top_logprobs_.end(), logprobs.begin(), logprobs.end());
  }

 private:
  std::vector<PackedOutput> outputs_;  // storage (its high-water mark); the first size_ are the outputs
  size_t size_ = 0;
  std::vector<int32_t> top_token_ids_;  // the outputs' top logprobs, in output order
  std::vector<float> top_logprobs_;
};

}  // namespace ringserve
