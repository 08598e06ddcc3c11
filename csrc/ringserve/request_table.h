// The request table: every live request's state in two tables indexed alike, the free list that reuses their
// entries, the request id -> entry map, and admission's bookkeeping (the checks that reject a request that can never
// run, and the entry a new request starts from). The stop rules read a request's hot line only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ringserve/engine_config.h"
#include "ringserve/records.h"

namespace ringserve {

enum class RequestStatus : uint8_t { kFree, kWaiting, kRunning };

// One request's state, split in two tables indexed alike. RequestState holds what every scheduled request touches
// in every step: two cache lines (the table is aligned to them), so a decode step streams 128 bytes per request
// through the caches and nothing else of its entry. RequestDetails holds the rest (admission, preemption, prefix
// hashing, the plan's NewRequestData, speculation), read only when one of those happens.
struct alignas(64) RequestState {
  // Line 1: schedule() and update() for every running request.
  std::vector<int32_t> token_ids;  // prompt then outputs (capacity reserved for prompt + max_tokens)
  std::vector<int32_t> block_ids;  // covers at least num_computed_tokens tokens
  int32_t num_computed_tokens = 0;
  int32_t slot = -1;  // batch slot while running, else -1
  int32_t num_registered_blocks = 0;  // leading blocks already offered to the prefix cache
  int32_t length_limit = 0;  // num_tokens() at which the request ends with LENGTH: prompt + max_tokens
  // Line 2: update()'s stop check and output.
  uint64_t request_id = 0;
  int64_t arrival_time_ns = 0;  // engine timestamps, CLOCK_REALTIME ns (0 = not yet)
  int64_t first_scheduled_time_ns = 0;
  int64_t first_token_time_ns = 0;
  int32_t num_prompt_tokens = 0;
  uint32_t num_cached_tokens = 0;  // prefix-cache hit at first admission
  int32_t stop_check_from = 0;  // num_tokens() from which EOS / stop ids end it: prompt + min_tokens
  int32_t stop_ids[2] = {0, 0};  // the first two of suppress_token_ids (its ids end the request), kept in this line
  uint16_t num_preemptions = 0;  // saturates at 65,535 (as outputs carry it)
  RequestStatus status = RequestStatus::kFree;
  uint8_t num_stop_ids = 0;  // size of suppress_token_ids, capped at 255 (more are searched there)
  bool admitted = false;     // num_cached_tokens is set (a resumed request keeps its first figure)
  // num_computed_tokens from which the next block is full and gets registered: (num_registered_blocks + 1) x
  // block_size, or never without prefix caching (PrefixIndex::set_registered_blocks keeps it).
  int32_t register_from = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
};
static_assert(sizeof(RequestState) == 128, "a request's per-step state is two cache lines");

struct RequestDetails {
  int64_t rank = 0;            // queue order key, lower first: priority, or priority x aging + arrival with aging
  uint64_t arrival_seq = 0;    // FCFS order among equal ranks
  std::vector<uint64_t> block_hashes;  // chained hash of each full block of token_ids known so far
  int32_t max_tokens = 0;
  SamplingParams sampling;  // as the request asked; every new NewRequestData of it carries a copy
  bool ignore_eos = false;
  int32_t priority = 0;
  uint64_t cache_salt = 0;
  std::vector<int32_t> stop_token_ids;
  std::vector<int32_t> suppress_token_ids;  // EOS (unless ignore_eos) + stop ids, masked before min_tokens
  float spec_acceptance = 1.0f;  // moving average of accepted / proposed draft tokens
  int32_t spec_backoff = 0;      // steps left without speculation
  uint64_t spec_proposed_tokens = 0;  // cumulative, for tests and usage
  uint64_t spec_accepted_tokens = 0;
  // Disaggregated prefill/decode (issue #8).
  KvMode kv_mode = KvMode::kNone;
  uint32_t kv_pin_timeout_ms = 0;
  bool kv_pull_pending = false;  // kPullRemote until its first admission (a preempted one recomputes locally)
  std::vector<int32_t> kv_remote_block_ids;
  std::vector<uint8_t> kv_peer;
};

// The stop rules. The ids that end a request: the first two sit in its hot line, the rest (rare) in its details'
// suppress_token_ids (`details` is its entry there, addressed only then).
[[gnu::always_inline]] inline bool is_stop_token(const RequestState& r, const RequestDetails* details, int32_t token) {
  if (r.num_stop_ids == 0) return false;
  if (token == r.stop_ids[0] || (r.num_stop_ids > 1 && token == r.stop_ids[1])) return true;
  return r.num_stop_ids > 2 && std::find(details->suppress_token_ids.begin(), details->suppress_token_ids.end(),
                                         token) != details->suppress_token_ids.end();
}

// Below min_tokens only the length limits apply (the sampler masks EOS and stop ids meanwhile).
// length_limit = min(prompt + max_tokens, max_model_len); stop_check_from = prompt + min_tokens.
[[gnu::always_inline]] inline FinishReason stop_reason(const RequestState& r, const RequestDetails* details,
                                                        int32_t token) {
  const int32_t n = r.num_tokens();
  if (n >= r.stop_check_from && is_stop_token(r, details, token)) return FinishReason::kStop;
  return n >= r.length_limit ? FinishReason::kLength : FinishReason::kNone;
}

class RequestTable {
 public:
  // Why `req` can never run under `config` (INVALID_ARGUMENT / RESOURCE_EXHAUSTED), or nothing. `max_plan_bytes` is
  // the step ring's record limit: a plan carrying the request whole must fit an otherwise empty plan.
  // `kv` (optional) is checked by check_kv_options.
  std::optional<RequestRejected> check(const AddRequest& req, const KvRequestOptions* kv, const EngineConfig& config,
                                       size_t max_plan_bytes) const;

  // A table entry for a new request (a freed one when there is one), filled from `req` as waiting, nothing computed,
  // and registered under its id. The caller sets what other policies own (queue rank, registered blocks).
  int32_t add(const AddRequest& req, const EngineConfig& config, const KvRequestOptions* kv, int64_t now_ns);
  // Frees the entry: its status becomes kFree, its id is forgotten, the entry is reused by a later add().
  void remove(int32_t index);

  // The entry of a live request, or -1.
  int32_t find(uint64_t request_id) const {
    const auto it = index_of_.find(request_id);
    return it == index_of_.end() ? -1 : it->second;
  }
  RequestState& state(int32_t index) { return states_[static_cast<size_t>(index)]; }
  const RequestState& state(int32_t index) const { return states_[static_cast<size_t>(index)]; }
  RequestDetails& details(int32_t index) { return details_[static_cast<size_t>(index)]; }
  const RequestDetails& details(int32_t index) const { return details_[static_cast<size_t>(index)]; }
  // The tables' storage, for the step loops (only add() grows them).
  RequestState* states() { return states_.data(); }
  RequestDetails* details() { return details_.data(); }
  size_t size() const { return states_.size(); }  // entries, live or free
  size_t num_live() const { return index_of_.size(); }

 private:
  std::vector<RequestState> states_;     // dense; entries are reused through free_entries_
  std::vector<RequestDetails> details_;  // the same indices as states_
  std::vector<int32_t> free_entries_;
  std::unordered_map<uint64_t, int32_t> index_of_;  // request_id -> entry, for aborts
};

}  // namespace ringserve
