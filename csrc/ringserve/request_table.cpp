#include "ringserve/request_table.h"

#include <string>

#include "ringserve/in_flight_step.h"
#include "ringserve/kv_pins.h"

namespace ringserve {
namespace {

// Output tokens whose storage add() touches up front (32 KiB).
constexpr int64_t kPrefaultedOutputTokens = 8192;

RequestRejected reject(uint64_t id, uint32_t code, std::string message) {
  return RequestRejected{id, code, std::move(message)};
}

}  // namespace

std::optional<RequestRejected> RequestTable::check(const AddRequest& req, const KvRequestOptions* kv,
                                                   const EngineConfig& config, size_t max_plan_bytes) const {
  const uint64_t id = req.request_id;
  if (req.prompt_token_ids.empty()) return reject(id, kStatusInvalidArgument, "prompt is empty");
  if (req.max_tokens < 1) {
    return reject(id, kStatusInvalidArgument, "max_tokens must be >= 1, got " + std::to_string(req.max_tokens));
  }
  if (req.sampling.min_tokens < 0 || req.sampling.min_tokens > req.max_tokens) {
    return reject(id, kStatusInvalidArgument,
                  "min_tokens must be in [0, max_tokens], got " + std::to_string(req.sampling.min_tokens));
  }
  if (req.sampling.num_logprobs < 0) {
    return reject(id, kStatusInvalidArgument,
                  "num_logprobs must be >= 0, got " + std::to_string(req.sampling.num_logprobs));
  }
  for (const int32_t t : req.prompt_token_ids) {
    if (t < 0) return reject(id, kStatusInvalidArgument, "prompt token id " + std::to_string(t) + " is negative");
  }
  if (index_of_.contains(id)) {
    return reject(id, kStatusInvalidArgument, "request id " + std::to_string(id) + " is already active");
  }
  if (kv != nullptr) {
    if (auto rejected = check_kv_options(req, *kv, config.block_size, max_plan_bytes)) return rejected;
  }
  const int64_t prompt = static_cast<int64_t>(req.prompt_token_ids.size());
  const int64_t total = prompt + req.max_tokens;
  const std::string need = "request needs " + std::to_string(total) + " tokens (prompt " + std::to_string(prompt) +
                           " + max_tokens " + std::to_string(req.max_tokens) + ")";
  if (total > config.max_model_len) {
    return reject(id, kStatusResourceExhausted, need + " but max_model_len is " + std::to_string(config.max_model_len));
  }
  const int64_t blocks = (total + config.block_size - 1) / config.block_size;
  if (blocks > config.num_blocks) {
    return reject(id, kStatusResourceExhausted,
                  need + " but the KV cache holds only " +
                      std::to_string(int64_t{config.num_blocks} * config.block_size) + " tokens");
  }
  const size_t suppress = config.eos_token_ids.size() + req.stop_token_ids.size();
  if (kPlanFixedBytes + kPlanBytesPerNewRequest + static_cast<size_t>(total + blocks) * sizeof(int32_t) +
          suppress * sizeof(int32_t) > max_plan_bytes) {
    return reject(id, kStatusResourceExhausted, need + " but a step plan carrying it exceeds the step ring's " +
                                                    std::to_string(max_plan_bytes) + "-byte record limit");
  }
  return std::nullopt;
}

int32_t RequestTable::add(const AddRequest& req, const EngineConfig& config, const KvRequestOptions* kv,
                          int64_t now_ns) {
  int32_t index;
  if (!free_entries_.empty()) {
    index = free_entries_.back();
    free_entries_.pop_back();
  } else {
    index = static_cast<int32_t>(states_.size());
    states_.emplace_back();
    details_.emplace_back();
  }
  const int64_t prompt = static_cast<int64_t>(req.prompt_token_ids.size());
  const int64_t total = prompt + req.max_tokens;
  const int64_t blocks = (total + config.block_size - 1) / config.block_size;
  RequestState& r = state(index);
  RequestDetails& d = details(index);
  r.request_id = req.request_id;
  r.status = RequestStatus::kWaiting;
  r.slot = -1;
  r.num_prompt_tokens = static_cast<int32_t>(prompt);
  r.num_computed_tokens = 0;
  r.num_cached_tokens = 0;
  r.admitted = false;
  r.num_preemptions = 0;
  r.length_limit = static_cast<int32_t>(std::min<int64_t>(total, config.max_model_len));
  r.stop_check_from = static_cast<int32_t>(prompt) + req.sampling.min_tokens;
  r.token_ids.reserve(static_cast<size_t>(total));  // no reallocation while generating
  // Writing the capacity once faults its pages in now: a decode step appending into fresh memory would otherwise
  // stop on a page fault (clearing a page) whenever a request's tokens cross into a new page. Bounded, so a huge
  // max_tokens does not commit memory the request may never use (later pages fault once per 1,024 tokens).
  r.token_ids.resize(static_cast<size_t>(std::min<int64_t>(total, prompt + kPrefaultedOutputTokens)));
  r.token_ids.assign(req.prompt_token_ids.begin(), req.prompt_token_ids.end());
  r.block_ids.clear();
  r.block_ids.reserve(static_cast<size_t>(blocks));
  d.block_hashes.clear();
  d.block_hashes.reserve(static_cast<size_t>(blocks));
  d.max_tokens = req.max_tokens;
  d.sampling = req.sampling;
  d.ignore_eos = req.ignore_eos;
  d.priority = req.priority;
  d.cache_salt = req.cache_salt;
  d.stop_token_ids = req.stop_token_ids;
  d.spec_acceptance = 1.0f;
  d.spec_backoff = 0;
  d.spec_proposed_tokens = 0;
  d.spec_accepted_tokens = 0;
  d.suppress_token_ids.clear();
  if (!req.ignore_eos) d.suppress_token_ids = config.eos_token_ids;
  d.suppress_token_ids.insert(d.suppress_token_ids.end(), req.stop_token_ids.begin(), req.stop_token_ids.end());
  // The ids that end the request are exactly the ones masked before min_tokens.
  r.num_stop_ids = static_cast<uint8_t>(std::min<size_t>(d.suppress_token_ids.size(), 255));
  for (size_t k = 0; k < 2; ++k) r.stop_ids[k] = k < d.suppress_token_ids.size() ? d.suppress_token_ids[k] : 0;
  r.arrival_time_ns = now_ns;
  r.first_scheduled_time_ns = 0;
  r.first_token_time_ns = 0;
  d.kv_mode = kv != nullptr ? kv->mode : KvMode::kNone;
  d.kv_pin_timeout_ms = kv != nullptr ? kv->pin_timeout_ms : 0;
  d.kv_pull_pending = d.kv_mode == KvMode::kPullRemote;
  d.kv_remote_block_ids.clear();
  d.kv_peer.clear();
  if (d.kv_mode == KvMode::kPrefillOnly) {
    r.length_limit = std::min(r.length_limit, r.num_prompt_tokens + 1);  // the first token only
  } else if (d.kv_pull_pending) {
    d.kv_remote_block_ids = kv->remote_block_ids;
    d.kv_peer = kv->peer;
    r.token_ids.push_back(kv->first_token_id);  // sampled by the prefill side: the first output
  }
  index_of_.emplace(req.request_id, index);
  return index;
}

void RequestTable::remove(int32_t index) {
  RequestState& r = state(index);
  r.status = RequestStatus::kFree;
  index_of_.erase(r.request_id);
  free_entries_.push_back(index);
}

}  // namespace ringserve
