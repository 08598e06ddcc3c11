#include "ringserve/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ringserve {
namespace {

// Fixed bytes of a StepPlan record and per entry, used to keep a plan under the ring's record size.
constexpr size_t kPlanFixedBytes = 64;
constexpr size_t kPlanBytesPerScheduled = 4 + 4 + 4 + 1;
constexpr size_t kPlanBytesPerAppend = 8;
constexpr size_t kPlanBytesPerNewRequest = 128;  // NewRequestData fixed fields and array counts, rounded up

bool contains(const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// splitmix64's finalizer: a bijective 64-bit mix.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Takes an element with storage from `spare` (or a new one) onto the back of `v`.
template <class T>
T& reuse_back(std::vector<T>& v, std::vector<T>& spare) {
  if (spare.empty()) return v.emplace_back();
  v.push_back(std::move(spare.back()));
  spare.pop_back();
  return v.back();
}

template <class T>
void recycle(std::vector<T>& v, std::vector<T>& spare) {
  for (T& x : v) spare.push_back(std::move(x));
  v.clear();
}

}  // namespace

uint64_t block_hash(uint64_t parent, bool is_first, uint64_t cache_salt, std::span<const int32_t> tokens) {
  // The salt seeds the chain's root, so requests with different salts never share a block.
  uint64_t h = is_first ? mix64(cache_salt ^ 0x243f6a8885a308d3ull) : parent;
  for (const int32_t t : tokens) h = mix64(h ^ (uint64_t{static_cast<uint32_t>(t)} + 0x9e3779b97f4a7c15ull));
  return h;
}

Scheduler::Scheduler(EngineConfig config, size_t max_plan_bytes)
    : config_(std::move(config)), max_plan_bytes_(max_plan_bytes), pool_(config_.num_blocks) {
  if (config_.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
  if (config_.max_num_seqs <= 0) throw std::invalid_argument("max_num_seqs must be > 0");
  if (config_.max_num_batched_tokens <= 0) throw std::invalid_argument("max_num_batched_tokens must be > 0");
  if (config_.num_blocks <= 0) throw std::invalid_argument("num_blocks must be > 0");
  if (config_.long_prefill_token_threshold < 0) throw std::invalid_argument("long_prefill_token_threshold must be >= 0");
  if (config_.max_model_len <= 0) config_.max_model_len = config_.num_blocks * config_.block_size;
  const auto seqs = static_cast<size_t>(config_.max_num_seqs);
  for (int32_t s = config_.max_num_seqs - 1; s >= 0; --s) free_slots_.push_back(s);  // hand out slot 0 first
  slot_owner_.assign(seqs, -1);
  result_of_slot_.assign(seqs, -1);
  running_.reserve(seqs);
  in_flight_.reserve(seqs);
  released_slots_.reserve(seqs);
  outputs_.reserve(seqs);
  spare_appends_.reserve(seqs);
  hits_.reserve(static_cast<size_t>(config_.num_blocks));
  pending_cache_.reserve(static_cast<size_t>(config_.num_blocks));
  finished_.reserve(seqs);
}

RequestRejected Scheduler::reject(uint64_t id, uint32_t code, std::string message) const {
  return RequestRejected{id, code, std::move(message)};
}

bool Scheduler::runs_before(int32_t a, int32_t b) const {
  const RequestState& x = table_[static_cast<size_t>(a)];
  const RequestState& y = table_[static_cast<size_t>(b)];
  if (x.priority != y.priority) return x.priority < y.priority;
  return x.arrival_seq < y.arrival_seq;
}

void Scheduler::insert_waiting(int32_t index) {
  // waiting_ is sorted last-to-run first, so the next to admit is waiting_.back().
  const auto at = std::partition_point(waiting_.begin(), waiting_.end(),
                                       [&](int32_t w) { return runs_before(index, w); });
  waiting_.insert(at, index);
}

void Scheduler::insert_running(int32_t index) {
  const auto at = std::partition_point(running_.begin(), running_.end(),
                                       [&](int32_t r) { return runs_before(r, index); });
  running_.insert(at, index);
}

int32_t Scheduler::chunk_cap(int32_t budget) const {
  const int32_t cap = config_.long_prefill_token_threshold;
  return cap > 0 ? std::min(budget, cap) : budget;
}

std::optional<RequestRejected> Scheduler::add_request(const AddRequest& req, int64_t now_ns) {
  const uint64_t id = req.request_id;
  if (req.prompt_token_ids.empty()) return reject(id, kStatusInvalidArgument, "prompt is empty");
  if (req.max_tokens < 1) {
    return reject(id, kStatusInvalidArgument, "max_tokens must be >= 1, got " + std::to_string(req.max_tokens));
  }
  if (req.min_tokens < 0 || req.min_tokens > req.max_tokens) {
    return reject(id, kStatusInvalidArgument,
                  "min_tokens must be in [0, max_tokens], got " + std::to_string(req.min_tokens));
  }
  if (req.num_logprobs < 0) {
    return reject(id, kStatusInvalidArgument, "num_logprobs must be >= 0, got " + std::to_string(req.num_logprobs));
  }
  for (const int32_t t : req.prompt_token_ids) {
    if (t < 0) return reject(id, kStatusInvalidArgument, "prompt token id " + std::to_string(t) + " is negative");
  }
  if (index_of_.contains(id)) {
    return reject(id, kStatusInvalidArgument, "request id " + std::to_string(id) + " is already active");
  }
  const int64_t prompt = static_cast<int64_t>(req.prompt_token_ids.size());
  const int64_t total = prompt + req.max_tokens;
  const std::string need = "request needs " + std::to_string(total) + " tokens (prompt " + std::to_string(prompt) +
                           " + max_tokens " + std::to_string(req.max_tokens) + ")";
  if (total > config_.max_model_len) {
    return reject(id, kStatusResourceExhausted, need + " but max_model_len is " + std::to_string(config_.max_model_len));
  }
  const int64_t blocks = (total + config_.block_size - 1) / config_.block_size;
  if (blocks > config_.num_blocks) {
    return reject(id, kStatusResourceExhausted,
                  need + " but the KV cache holds only " +
                      std::to_string(int64_t{config_.num_blocks} * config_.block_size) + " tokens");
  }
  const size_t suppress = config_.eos_token_ids.size() + req.stop_token_ids.size();
  if (kPlanFixedBytes + kPlanBytesPerNewRequest + static_cast<size_t>(total + blocks) * sizeof(int32_t) +
          suppress * sizeof(int32_t) > max_plan_bytes_) {
    return reject(id, kStatusResourceExhausted, need + " but a step plan carrying it exceeds the step ring's " +
                                                    std::to_string(max_plan_bytes_) + "-byte record limit");
  }

  int32_t index;
  if (!free_entries_.empty()) {
    index = free_entries_.back();
    free_entries_.pop_back();
  } else {
    index = static_cast<int32_t>(table_.size());
    table_.emplace_back();
  }
  RequestState& r = table_[static_cast<size_t>(index)];
  r.request_id = id;
  r.status = RequestStatus::kWaiting;
  r.slot = -1;
  r.num_prompt_tokens = static_cast<int32_t>(prompt);
  r.num_computed_tokens = 0;
  r.num_cached_tokens = -1;
  r.num_registered_blocks = 0;
  r.num_preemptions = 0;
  r.arrival_seq = next_arrival_seq_++;
  r.token_ids.assign(req.prompt_token_ids.begin(), req.prompt_token_ids.end());
  r.token_ids.reserve(static_cast<size_t>(total));  // no reallocation while generating
  r.block_ids.clear();
  r.block_ids.reserve(static_cast<size_t>(blocks));
  r.block_hashes.clear();
  r.block_hashes.reserve(static_cast<size_t>(blocks));
  r.max_tokens = req.max_tokens;
  r.min_tokens = req.min_tokens;
  r.temperature = req.temperature;
  r.top_p = req.top_p;
  r.top_k = req.top_k;
  r.min_p = req.min_p;
  r.repetition_penalty = req.repetition_penalty;
  r.frequency_penalty = req.frequency_penalty;
  r.presence_penalty = req.presence_penalty;
  r.num_logprobs = req.num_logprobs;
  r.seed = req.seed;
  r.has_seed = req.has_seed;
  r.ignore_eos = req.ignore_eos;
  r.priority = req.priority;
  r.cache_salt = req.cache_salt;
  r.stop_token_ids = req.stop_token_ids;
  r.suppress_token_ids.clear();
  if (!req.ignore_eos) r.suppress_token_ids = config_.eos_token_ids;
  r.suppress_token_ids.insert(r.suppress_token_ids.end(), req.stop_token_ids.begin(), req.stop_token_ids.end());
  r.arrival_time_ns = now_ns;
  r.first_scheduled_time_ns = 0;
  r.first_token_time_ns = 0;
  index_of_.emplace(id, index);
  insert_waiting(index);
  return std::nullopt;
}

bool Scheduler::abort_request(uint64_t request_id) {
  if (step_in_flight_) throw std::logic_error("abort_request while a step is in flight");
  const auto it = index_of_.find(request_id);
  if (it == index_of_.end()) return false;
  const int32_t index = it->second;
  RequestState& r = table_[static_cast<size_t>(index)];
  if (r.status == RequestStatus::kWaiting) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), index));
  } else {
    running_.erase(std::find(running_.begin(), running_.end(), index));
  }
  new_output(r, FinishReason::kAbort, 0);
  release(index);
  return true;
}

void Scheduler::release(int32_t index) {
  RequestState& r = table_[static_cast<size_t>(index)];
  pool_.free(r.block_ids, /*tail_first=*/true);  // its full blocks stay cached; the tail is evicted first
  r.block_ids.clear();
  if (r.slot >= 0) {
    slot_owner_[static_cast<size_t>(r.slot)] = -1;
    free_slots_.push_back(r.slot);
    released_slots_.push_back(r.slot);
    r.slot = -1;
  }
  r.status = RequestStatus::kFree;
  index_of_.erase(r.request_id);
  free_entries_.push_back(index);
}

void Scheduler::preempt(int32_t index, StepPlan& plan) {
  RequestState& r = table_[static_cast<size_t>(index)];
  pool_.free(r.block_ids, /*tail_first=*/true);
  r.block_ids.clear();
  // Recompute later; the generated tokens stay in token_ids and are re-sent as part of the prompt (and its computed
  // full blocks stay cached, so the recompute is mostly prefix hits unless they get evicted meanwhile).
  r.num_computed_tokens = 0;
  r.num_registered_blocks = 0;
  slot_owner_[static_cast<size_t>(r.slot)] = -1;
  free_slots_.push_back(r.slot);
  plan.finished_slots.push_back(r.slot);  // the workers drop its state before this step
  r.slot = -1;
  r.status = RequestStatus::kWaiting;
  insert_waiting(index);
  ++r.num_preemptions;
  ++num_preemptions_;
}

void Scheduler::extend_block_hashes(RequestState& r, int32_t num_blocks) {
  const auto bs = static_cast<size_t>(config_.block_size);
  for (auto k = r.block_hashes.size(); k < static_cast<size_t>(num_blocks); ++k) {
    const uint64_t parent = k == 0 ? 0 : r.block_hashes[k - 1];
    r.block_hashes.push_back(block_hash(parent, k == 0, r.cache_salt, std::span(r.token_ids).subspan(k * bs, bs)));
  }
}

void Scheduler::register_computed_blocks(RequestState& r) {
  if (!config_.enable_prefix_caching) return;
  // Only full blocks whose KV is computed may be shared: their contents never change again.
  const int32_t full = std::min(r.num_computed_tokens / config_.block_size, static_cast<int32_t>(r.block_ids.size()));
  if (full <= r.num_registered_blocks) return;
  extend_block_hashes(r, full);
  for (int32_t j = r.num_registered_blocks; j < full; ++j) {
    const uint64_t hash = r.block_hashes[static_cast<size_t>(j)];
    pool_.prefetch(hash);  // registered after the update loop, so these table misses overlap
    pending_cache_.push_back({r.block_ids[static_cast<size_t>(j)], hash});
  }
  r.num_registered_blocks = full;
}

void Scheduler::schedule_chunk(StepPlan& plan, int32_t index, int32_t num_tokens, int64_t now_ns) {
  RequestState& r = table_[static_cast<size_t>(index)];
  const bool sample = r.num_computed_tokens + num_tokens == r.num_tokens();
  plan.sched_slots.push_back(r.slot);
  plan.sched_start.push_back(r.num_computed_tokens);
  plan.sched_len.push_back(num_tokens);
  plan.sched_sample.push_back(sample ? 1 : 0);
  in_flight_.push_back({index, r.slot, num_tokens, sample});
  num_in_flight_samples_ += sample ? 1 : 0;
  if (r.first_scheduled_time_ns == 0) r.first_scheduled_time_ns = now_ns;
}

bool Scheduler::try_admit(int32_t index, StepPlan& plan, int32_t& budget, size_t& plan_bytes, int64_t now_ns) {
  RequestState& r = table_[static_cast<size_t>(index)];
  const int32_t bs = config_.block_size;
  hits_.clear();
  int32_t revived = 0;  // hits that sit on the free list now and stop counting as free once taken
  if (config_.enable_prefix_caching) {
    extend_block_hashes(r, r.num_tokens() / bs);
    // At least the last token is computed, so its logits exist to sample from.
    const int32_t max_hits = (r.num_tokens() - 1) / bs;
    for (int32_t j = 0; j < max_hits; ++j) {
      const int32_t id = pool_.lookup(r.block_hashes[static_cast<size_t>(j)]);
      if (id == BlockPool::kNone) break;
      hits_.push_back(id);
      revived += pool_.ref_count(id) == 0 ? 1 : 0;
    }
  }
  const auto cached_blocks = static_cast<int32_t>(hits_.size());
  const int32_t cached_tokens = cached_blocks * bs;
  const int32_t n = std::min(r.num_tokens() - cached_tokens, chunk_cap(budget));
  const int32_t needed = blocks_for(cached_tokens + n) - cached_blocks;
  if (needed + revived > pool_.num_free()) return false;  // the head waits for blocks, nobody overtakes it
  const size_t bytes = kPlanBytesPerScheduled + kPlanBytesPerNewRequest +
                       (r.token_ids.size() + static_cast<size_t>(cached_blocks + needed) +
                        r.suppress_token_ids.size()) * sizeof(int32_t);
  if (plan_bytes + bytes > max_plan_bytes_) return false;  // next step; add_request made sure it fits an empty plan

  waiting_.pop_back();
  for (const int32_t id : hits_) {
    pool_.acquire_cached(id);  // before allocate(), which would otherwise evict a free hit
    r.block_ids.push_back(id);
  }
  pool_.allocate(needed, r.block_ids);
  r.num_computed_tokens = cached_tokens;
  r.num_registered_blocks = cached_blocks;
  if (r.num_cached_tokens < 0) {  // first admission (a resumed request keeps its first figure)
    r.num_cached_tokens = cached_tokens;
    total_prompt_tokens_ += static_cast<uint64_t>(r.num_prompt_tokens);
  }
  if (config_.enable_prefix_caching) {
    prefix_cache_queries_ += static_cast<uint64_t>(r.num_tokens());
    prefix_cache_hits_ += static_cast<uint64_t>(cached_tokens);
  }
  r.slot = free_slots_.back();
  free_slots_.pop_back();
  slot_owner_[static_cast<size_t>(r.slot)] = index;
  r.status = RequestStatus::kRunning;
  insert_running(index);

  NewRequestData& nr = reuse_back(plan.new_requests, spare_new_requests_);
  nr.slot = r.slot;
  nr.num_computed_tokens = r.num_computed_tokens;
  nr.num_prompt_tokens = r.num_prompt_tokens;
  nr.temperature = r.temperature;
  nr.top_p = r.top_p;
  nr.top_k = r.top_k;
  nr.min_p = r.min_p;
  nr.min_tokens = r.min_tokens;
  nr.repetition_penalty = r.repetition_penalty;
  nr.frequency_penalty = r.frequency_penalty;
  nr.presence_penalty = r.presence_penalty;
  nr.num_logprobs = r.num_logprobs;
  nr.seed = r.seed;
  nr.has_seed = r.has_seed;
  nr.token_ids.assign(r.token_ids.begin(), r.token_ids.end());
  nr.block_ids.assign(r.block_ids.begin(), r.block_ids.end());
  nr.suppress_token_ids.assign(r.suppress_token_ids.begin(), r.suppress_token_ids.end());
  schedule_chunk(plan, index, n, now_ns);
  plan_bytes += bytes;
  budget -= n;
  return true;
}

void Scheduler::recycle_plan(StepPlan& plan) {
  recycle(plan.new_requests, spare_new_requests_);
  recycle(plan.block_appends, spare_appends_);
  plan.step_id = 0;
  plan.sched_slots.clear();
  plan.sched_start.clear();
  plan.sched_len.clear();
  plan.sched_sample.clear();
  plan.finished_slots.clear();
}

bool Scheduler::schedule(StepPlan& plan, int64_t now_ns) {
  if (step_in_flight_) throw std::logic_error("schedule while a step is in flight");
  recycle_plan(plan);
  in_flight_.clear();
  num_in_flight_samples_ = 0;
  plan.finished_slots.swap(released_slots_);

  // Invariant: the tokens scheduled this step never exceed max_num_batched_tokens.
  int32_t budget = config_.max_num_batched_tokens;
  size_t plan_bytes = kPlanFixedBytes + plan.finished_slots.size() * sizeof(int32_t);
  bool preempted = false;

  // 1. Running requests first, highest priority / earliest arrival first.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const int32_t index = running_[i];
    RequestState& r = table_[static_cast<size_t>(index)];
    const int32_t n = std::min(r.num_tokens() - r.num_computed_tokens, chunk_cap(budget));
    if (n <= 0) continue;
    const int32_t needed = blocks_for(r.num_computed_tokens + n) - static_cast<int32_t>(r.block_ids.size());
    bool preempted_self = false;
    while (needed > pool_.num_free()) {
      // running_ is in priority order, so its back is the lowest-priority, latest-arrived request; it sits behind
      // position i (or is this request), so nothing of it is in the plan yet.
      const int32_t victim = running_.back();
      running_.pop_back();
      preempt(victim, plan);
      preempted = true;
      if (victim == index) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;
    if (needed > 0) {
      const size_t first_new = r.block_ids.size();
      pool_.allocate(needed, r.block_ids);
      BlockAppend& append = reuse_back(plan.block_appends, spare_appends_);
      append.slot = r.slot;
      append.block_ids.assign(r.block_ids.begin() + static_cast<std::ptrdiff_t>(first_new), r.block_ids.end());
      plan_bytes += kPlanBytesPerAppend + static_cast<size_t>(needed) * sizeof(int32_t);
    }
    schedule_chunk(plan, index, n, now_ns);
    plan_bytes += kPlanBytesPerScheduled;
    budget -= n;
  }

  // 2. Admit waiting requests in priority order. Not in a step that had to preempt: blocks are short right now.
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    if (!try_admit(waiting_.back(), plan, budget, plan_bytes, now_ns)) break;
  }

  if (in_flight_.empty()) {
    // Nothing runs: keep the released slots for the next plan that is actually sent.
    released_slots_.swap(plan.finished_slots);
    plan.finished_slots.clear();
    return false;
  }
  last_step_tokens_ = config_.max_num_batched_tokens - budget;
  plan.step_id = next_step_id_++;
  in_flight_step_ = plan.step_id;
  step_in_flight_ = true;
  ++num_steps_;
  return true;
}

FinishReason Scheduler::stop_reason(const RequestState& r, int32_t token) const {
  // Below min_tokens only the length limits apply (the sampler masks EOS and stop ids meanwhile).
  if (r.num_output_tokens() >= r.min_tokens) {
    if (!r.ignore_eos && contains(config_.eos_token_ids, token)) return FinishReason::kStop;
    if (contains(r.stop_token_ids, token)) return FinishReason::kStop;
  }
  if (r.num_output_tokens() >= r.max_tokens) return FinishReason::kLength;
  if (r.num_tokens() >= config_.max_model_len) return FinishReason::kLength;
  return FinishReason::kNone;
}

RequestOutput& Scheduler::new_output(const RequestState& r, FinishReason reason, int32_t num_scheduled) {
  if (num_outputs_ == outputs_.size()) outputs_.emplace_back();
  RequestOutput& o = outputs_[num_outputs_++];
  o.request_id = r.request_id;
  o.finish_reason = reason;
  o.num_prompt_tokens = static_cast<uint32_t>(r.num_prompt_tokens);
  o.num_cached_tokens = static_cast<uint32_t>(std::max(r.num_cached_tokens, 0));
  o.arrival_time_ns = r.arrival_time_ns;
  o.first_scheduled_time_ns = r.first_scheduled_time_ns;
  o.first_token_time_ns = r.first_token_time_ns;
  o.new_token_ids.clear();
  o.logprobs.clear();
  o.num_top = 0;
  o.top_token_ids.clear();
  o.top_logprobs.clear();
  o.num_computed_tokens = static_cast<uint32_t>(std::min(r.num_computed_tokens, r.num_prompt_tokens));
  o.num_scheduled_tokens = static_cast<uint32_t>(num_scheduled);
  o.num_preemptions = r.num_preemptions;
  return o;
}

void Scheduler::update(const StepResult& result, int64_t now_ns) {
  if (!step_in_flight_) throw std::logic_error("update without a step in flight");
  if (result.step_id != in_flight_step_) {
    throw std::runtime_error("StepResult for step " + std::to_string(result.step_id) + " but step " +
                             std::to_string(in_flight_step_) + " is in flight");
  }
  const size_t expected = num_in_flight_samples_;
  if (result.slots.size() != expected || result.token_ids.size() != expected) {
    throw std::runtime_error("StepResult has " + std::to_string(result.slots.size()) + " sampled slots, plan asked for " +
                             std::to_string(expected));
  }
  if (result.top_token_ids.size() != size_t{result.num_top} * expected ||
      result.top_logprobs.size() != result.top_token_ids.size()) {
    throw std::runtime_error("StepResult top arrays are not [sampled slots, num_top]");
  }
  for (size_t i = 0; i < result.slots.size(); ++i) {
    const int32_t slot = result.slots[i];
    if (slot < 0 || slot >= config_.max_num_seqs || result_of_slot_[static_cast<size_t>(slot)] != -1) {
      for (size_t j = 0; j < i; ++j) result_of_slot_[static_cast<size_t>(result.slots[j])] = -1;
      throw std::runtime_error("StepResult has an invalid or repeated slot " + std::to_string(slot));
    }
    result_of_slot_[static_cast<size_t>(slot)] = static_cast<int32_t>(i);
  }
  // Check every sampled slot got a token before changing any state.
  for (const Scheduled& s : in_flight_) {
    if (s.sample && result_of_slot_[static_cast<size_t>(s.slot)] == -1) {
      for (const int32_t slot : result.slots) result_of_slot_[static_cast<size_t>(slot)] = -1;
      throw std::runtime_error("StepResult misses a sampled slot");
    }
  }
  step_in_flight_ = false;

  pending_cache_.clear();
  finished_.clear();
  for (const Scheduled& s : in_flight_) {
    RequestState& r = table_[static_cast<size_t>(s.index)];
    r.num_computed_tokens += s.num_tokens;
    register_computed_blocks(r);
    if (!s.sample) {
      new_output(r, FinishReason::kNone, s.num_tokens);  // a prefill chunk: progress only, for tracing
      continue;
    }
    const auto at = static_cast<size_t>(result_of_slot_[static_cast<size_t>(r.slot)]);
    result_of_slot_[static_cast<size_t>(r.slot)] = -1;
    const int32_t token = result.token_ids[at];
    r.token_ids.push_back(token);
    ++total_generation_tokens_;
    if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
    const FinishReason reason = stop_reason(r, token);
    RequestOutput& o = new_output(r, reason, s.num_tokens);
    o.new_token_ids.push_back(token);
    o.logprobs.push_back(result.logprobs.empty() ? 0.0f : result.logprobs[at]);
    const uint32_t top = std::min(result.num_top, static_cast<uint32_t>(r.num_logprobs));
    if (top > 0) {
      const size_t row = at * result.num_top;
      o.num_top = top;
      o.top_token_ids.assign(result.top_token_ids.begin() + static_cast<std::ptrdiff_t>(row),
                             result.top_token_ids.begin() + static_cast<std::ptrdiff_t>(row + top));
      o.top_logprobs.assign(result.top_logprobs.begin() + static_cast<std::ptrdiff_t>(row),
                            result.top_logprobs.begin() + static_cast<std::ptrdiff_t>(row + top));
    }
    if (reason != FinishReason::kNone) finished_.push_back(s.index);
  }
  // Register before releasing: a block must still be referenced when it enters the cache.
  for (const PendingBlock& b : pending_cache_) pool_.cache(b.block, b.hash);
  for (const int32_t index : finished_) release(index);  // status becomes kFree; removed from running_ below
  if (!finished_.empty()) {
    std::erase_if(running_, [this](int32_t i) { return table_[static_cast<size_t>(i)].status != RequestStatus::kRunning; });
  }
  in_flight_.clear();
}

void Scheduler::take_outputs(std::vector<RequestOutput>& out) {
  out.assign(outputs_.begin(), outputs_.begin() + static_cast<std::ptrdiff_t>(num_outputs_));
  num_outputs_ = 0;
}

EngineStats Scheduler::stats(uint64_t query_id) const {
  EngineStats s;
  s.query_id = query_id;
  s.num_running = static_cast<uint32_t>(running_.size());
  s.num_waiting = static_cast<uint32_t>(waiting_.size());
  s.num_total_blocks = static_cast<uint32_t>(pool_.num_blocks());
  s.num_free_blocks = static_cast<uint32_t>(pool_.num_free());
  s.block_size = static_cast<uint32_t>(config_.block_size);
  s.num_steps = num_steps_;
  s.num_preemptions = num_preemptions_;
  s.num_scheduled_tokens = static_cast<uint32_t>(last_step_tokens_);
  s.prefix_cache_queries = prefix_cache_queries_;
  s.prefix_cache_hits = prefix_cache_hits_;
  s.kv_usage = 1.0f - static_cast<float>(pool_.num_free()) / static_cast<float>(pool_.num_blocks());
  s.total_prompt_tokens = total_prompt_tokens_;
  s.total_generation_tokens = total_generation_tokens_;
  return s;
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("Scheduler invariant broken: " + what); };
  pool_.check_invariants();
  if (static_cast<int32_t>(running_.size()) > config_.max_num_seqs) fail("more running than max_num_seqs");
  std::vector<int32_t> holders(static_cast<size_t>(pool_.num_blocks()), 0);
  size_t live = 0;
  for (size_t i = 0; i < table_.size(); ++i) {
    const RequestState& r = table_[i];
    if (r.status == RequestStatus::kFree) continue;
    ++live;
    for (const int32_t b : r.block_ids) ++holders[static_cast<size_t>(b)];
    if (r.block_ids.size() < static_cast<size_t>(blocks_for(r.num_computed_tokens))) fail("too few blocks");
    if (r.num_computed_tokens >= r.num_tokens() && r.status == RequestStatus::kRunning) fail("nothing left to compute");
    if (r.status == RequestStatus::kRunning) {
      if (r.slot < 0 || slot_owner_[static_cast<size_t>(r.slot)] != static_cast<int32_t>(i)) fail("slot owner");
      if (std::count(running_.begin(), running_.end(), static_cast<int32_t>(i)) != 1) fail("running list");
    } else {
      if (r.slot != -1 || !r.block_ids.empty() || r.num_computed_tokens != 0) fail("waiting request holds state");
      if (std::count(waiting_.begin(), waiting_.end(), static_cast<int32_t>(i)) != 1) fail("waiting queue");
    }
  }
  if (live != running_.size() + waiting_.size() || live != index_of_.size()) fail("request counts");
  // Sharing: a block's reference count is exactly the number of requests holding it.
  for (int32_t b = 0; b < pool_.num_blocks(); ++b) {
    if (pool_.ref_count(b) != holders[static_cast<size_t>(b)]) fail("ref_count of block " + std::to_string(b));
  }
  for (size_t k = 1; k < running_.size(); ++k) {
    if (!runs_before(running_[k - 1], running_[k])) fail("running list out of priority order");
  }
  for (size_t k = 1; k < waiting_.size(); ++k) {
    if (!runs_before(waiting_[k], waiting_[k - 1])) fail("waiting queue out of priority order");
  }
  if (free_slots_.size() + running_.size() != static_cast<size_t>(config_.max_num_seqs)) fail("slot count");
}

}  // namespace ringserve
