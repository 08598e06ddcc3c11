#include "ringserve/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ringserve {
namespace {

// Fixed bytes of a StepPlan record and per scheduled entry, used to keep a plan under the ring's record size.
constexpr size_t kPlanFixedBytes = 64;
constexpr size_t kPlanBytesPerScheduled = 4 + 4 + 4 + 1;
constexpr size_t kPlanBytesPerAppend = 8;

bool contains(const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

Scheduler::Scheduler(EngineConfig config, size_t max_plan_bytes)
    : config_(std::move(config)), max_plan_bytes_(max_plan_bytes), pool_(config_.num_blocks) {
  if (config_.block_size <= 0) throw std::invalid_argument("block_size must be > 0");
  if (config_.max_num_seqs <= 0) throw std::invalid_argument("max_num_seqs must be > 0");
  if (config_.max_num_batched_tokens <= 0) throw std::invalid_argument("max_num_batched_tokens must be > 0");
  if (config_.num_blocks <= 0) throw std::invalid_argument("num_blocks must be > 0");
  if (config_.max_model_len <= 0) config_.max_model_len = config_.num_blocks * config_.block_size;
  for (int32_t s = config_.max_num_seqs - 1; s >= 0; --s) free_slots_.push_back(s);  // hand out slot 0 first
  slot_owner_.assign(static_cast<size_t>(config_.max_num_seqs), -1);
  result_of_slot_.assign(static_cast<size_t>(config_.max_num_seqs), -1);
  running_.reserve(static_cast<size_t>(config_.max_num_seqs));
  in_flight_.reserve(static_cast<size_t>(config_.max_num_seqs));
}

RequestRejected Scheduler::reject(uint64_t id, uint32_t code, std::string message) const {
  return RequestRejected{id, code, std::move(message)};
}

std::optional<RequestRejected> Scheduler::add_request(const AddRequest& req, int64_t now_ns) {
  const uint64_t id = req.request_id;
  if (req.prompt_token_ids.empty()) return reject(id, kStatusInvalidArgument, "prompt is empty");
  if (req.max_tokens < 1) {
    return reject(id, kStatusInvalidArgument, "max_tokens must be >= 1, got " + std::to_string(req.max_tokens));
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
  if (kPlanFixedBytes + 64 + static_cast<size_t>(total + blocks) * sizeof(int32_t) > max_plan_bytes_) {
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
  r.token_ids.assign(req.prompt_token_ids.begin(), req.prompt_token_ids.end());
  r.token_ids.reserve(static_cast<size_t>(total));  // no reallocation while generating
  r.block_ids.clear();
  r.max_tokens = req.max_tokens;
  r.temperature = req.temperature;
  r.top_p = req.top_p;
  r.top_k = req.top_k;
  r.seed = req.seed;
  r.has_seed = req.has_seed;
  r.ignore_eos = req.ignore_eos;
  r.priority = req.priority;
  r.stop_token_ids = req.stop_token_ids;
  r.arrival_time_ns = now_ns;
  r.first_scheduled_time_ns = 0;
  r.first_token_time_ns = 0;
  index_of_.emplace(id, index);
  waiting_.push_back(index);
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
  outputs_.push_back(make_output(r, FinishReason::kAbort));
  release(index);
  return true;
}

void Scheduler::release(int32_t index) {
  RequestState& r = table_[static_cast<size_t>(index)];
  pool_.free(r.block_ids);
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
  pool_.free(r.block_ids);
  r.block_ids.clear();
  // Recompute from scratch later; the generated tokens stay in token_ids and are re-sent as part of the prompt.
  r.num_computed_tokens = 0;
  slot_owner_[static_cast<size_t>(r.slot)] = -1;
  free_slots_.push_back(r.slot);
  plan.finished_slots.push_back(r.slot);  // the workers drop its state before this step
  r.slot = -1;
  r.status = RequestStatus::kWaiting;
  waiting_.push_front(index);
  ++num_preemptions_;
}

void Scheduler::schedule_chunk(StepPlan& plan, int32_t index, int32_t num_tokens, int64_t now_ns) {
  RequestState& r = table_[static_cast<size_t>(index)];
  const bool sample = r.num_computed_tokens + num_tokens == r.num_tokens();
  plan.sched_slots.push_back(r.slot);
  plan.sched_start.push_back(r.num_computed_tokens);
  plan.sched_len.push_back(num_tokens);
  plan.sched_sample.push_back(sample ? 1 : 0);
  in_flight_.push_back({index, num_tokens, sample});
  if (r.first_scheduled_time_ns == 0) r.first_scheduled_time_ns = now_ns;
}

bool Scheduler::schedule(StepPlan& plan, int64_t now_ns) {
  if (step_in_flight_) throw std::logic_error("schedule while a step is in flight");
  plan.clear();
  in_flight_.clear();
  plan.finished_slots.swap(released_slots_);
  released_slots_.clear();

  // Invariant: the tokens scheduled this step never exceed max_num_batched_tokens.
  int32_t budget = config_.max_num_batched_tokens;
  size_t plan_bytes = kPlanFixedBytes + plan.finished_slots.size() * sizeof(int32_t);
  bool preempted = false;

  // 1. Running requests first, in admission order.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const int32_t index = running_[i];
    RequestState& r = table_[static_cast<size_t>(index)];
    const int32_t n = std::min(r.num_tokens() - r.num_computed_tokens, budget);
    if (n <= 0) continue;
    const int32_t needed = blocks_for(r.num_computed_tokens + n) - static_cast<int32_t>(r.block_ids.size());
    bool preempted_self = false;
    while (needed > pool_.num_free()) {
      // Recompute-preempt the latest-admitted request; it sits behind position i, so it is not scheduled yet.
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
      BlockAppend& append = plan.block_appends.emplace_back();
      append.slot = r.slot;
      append.block_ids.assign(r.block_ids.begin() + static_cast<std::ptrdiff_t>(first_new), r.block_ids.end());
      plan_bytes += kPlanBytesPerAppend + static_cast<size_t>(needed) * sizeof(int32_t);
    }
    schedule_chunk(plan, index, n, now_ns);
    plan_bytes += kPlanBytesPerScheduled;
    budget -= n;
  }

  // 2. Admit waiting requests FCFS. Not in a step that had to preempt: blocks are short right now.
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    const int32_t index = waiting_.front();
    RequestState& r = table_[static_cast<size_t>(index)];
    const int32_t n = std::min(r.num_tokens(), budget);  // the chunk: whole prompt or what the budget allows
    const int32_t needed = blocks_for(n);
    if (needed > pool_.num_free()) break;  // FCFS: the head waits for blocks, nobody overtakes it
    const size_t bytes = kPlanBytesPerScheduled + 64 +
                         static_cast<size_t>(r.num_tokens() + needed) * sizeof(int32_t);
    if (plan_bytes + bytes > max_plan_bytes_) break;  // next step; add_request guarantees it fits an empty plan
    waiting_.pop_front();
    pool_.allocate(needed, r.block_ids);
    r.slot = free_slots_.back();
    free_slots_.pop_back();
    slot_owner_[static_cast<size_t>(r.slot)] = index;
    r.status = RequestStatus::kRunning;
    running_.push_back(index);

    NewRequestData& nr = plan.new_requests.emplace_back();
    nr.slot = r.slot;
    nr.num_computed_tokens = r.num_computed_tokens;
    nr.temperature = r.temperature;
    nr.top_p = r.top_p;
    nr.top_k = r.top_k;
    nr.seed = r.seed;
    nr.has_seed = r.has_seed;
    nr.token_ids = r.token_ids;
    nr.block_ids = r.block_ids;
    schedule_chunk(plan, index, n, now_ns);
    plan_bytes += bytes;
    budget -= n;
  }

  if (in_flight_.empty()) {
    // Nothing runs: keep the released slots for the next plan that is actually sent.
    released_slots_.swap(plan.finished_slots);
    plan.finished_slots.clear();
    return false;
  }
  plan.step_id = next_step_id_++;
  in_flight_step_ = plan.step_id;
  step_in_flight_ = true;
  ++num_steps_;
  return true;
}

FinishReason Scheduler::stop_reason(const RequestState& r, int32_t token) const {
  if (!r.ignore_eos && contains(config_.eos_token_ids, token)) return FinishReason::kStop;
  if (contains(r.stop_token_ids, token)) return FinishReason::kStop;
  if (r.num_output_tokens() >= r.max_tokens) return FinishReason::kLength;
  if (r.num_tokens() >= config_.max_model_len) return FinishReason::kLength;
  return FinishReason::kNone;
}

RequestOutput Scheduler::make_output(const RequestState& r, FinishReason reason) const {
  RequestOutput o;
  o.request_id = r.request_id;
  o.finish_reason = reason;
  o.num_prompt_tokens = static_cast<uint32_t>(r.num_prompt_tokens);
  o.num_cached_tokens = 0;  // no prefix cache yet
  o.arrival_time_ns = r.arrival_time_ns;
  o.first_scheduled_time_ns = r.first_scheduled_time_ns;
  o.first_token_time_ns = r.first_token_time_ns;
  return o;
}

void Scheduler::update(const StepResult& result, int64_t now_ns) {
  if (!step_in_flight_) throw std::logic_error("update without a step in flight");
  if (result.step_id != in_flight_step_) {
    throw std::runtime_error("StepResult for step " + std::to_string(result.step_id) + " but step " +
                             std::to_string(in_flight_step_) + " is in flight");
  }
  size_t expected = 0;
  for (const Scheduled& s : in_flight_) expected += s.sample ? 1 : 0;
  if (result.slots.size() != expected || result.token_ids.size() != expected) {
    throw std::runtime_error("StepResult has " + std::to_string(result.slots.size()) + " sampled slots, plan asked for " +
                             std::to_string(expected));
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
    if (s.sample && result_of_slot_[static_cast<size_t>(table_[static_cast<size_t>(s.index)].slot)] == -1) {
      for (const int32_t slot : result.slots) result_of_slot_[static_cast<size_t>(slot)] = -1;
      throw std::runtime_error("StepResult misses a sampled slot");
    }
  }
  step_in_flight_ = false;

  bool any_finished = false;
  for (const Scheduled& s : in_flight_) {
    RequestState& r = table_[static_cast<size_t>(s.index)];
    r.num_computed_tokens += s.num_tokens;
    if (!s.sample) continue;
    const auto at = static_cast<size_t>(result_of_slot_[static_cast<size_t>(r.slot)]);
    result_of_slot_[static_cast<size_t>(r.slot)] = -1;
    const int32_t token = result.token_ids[at];
    r.token_ids.push_back(token);
    if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
    const FinishReason reason = stop_reason(r, token);
    RequestOutput& o = outputs_.emplace_back(make_output(r, reason));
    o.new_token_ids.push_back(token);
    o.logprobs.push_back(result.logprobs.empty() ? 0.0f : result.logprobs[at]);
    if (reason != FinishReason::kNone) {
      release(s.index);  // status becomes kFree; removed from running_ below
      any_finished = true;
    }
  }
  if (any_finished) {
    std::erase_if(running_, [this](int32_t i) { return table_[static_cast<size_t>(i)].status != RequestStatus::kRunning; });
  }
  in_flight_.clear();
}

void Scheduler::take_outputs(std::vector<RequestOutput>& out) {
  out.clear();
  out.swap(outputs_);
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
  return s;
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("Scheduler invariant broken: " + what); };
  pool_.check_invariants();
  if (static_cast<int32_t>(running_.size()) > config_.max_num_seqs) fail("more running than max_num_seqs");
  int64_t held_blocks = 0;
  size_t live = 0;
  for (size_t i = 0; i < table_.size(); ++i) {
    const RequestState& r = table_[i];
    if (r.status == RequestStatus::kFree) continue;
    ++live;
    held_blocks += static_cast<int64_t>(r.block_ids.size());
    if (r.block_ids.size() < static_cast<size_t>(blocks_for(r.num_computed_tokens))) fail("too few blocks");
    if (r.status == RequestStatus::kRunning) {
      if (r.slot < 0 || slot_owner_[static_cast<size_t>(r.slot)] != static_cast<int32_t>(i)) fail("slot owner");
      if (std::count(running_.begin(), running_.end(), static_cast<int32_t>(i)) != 1) fail("running list");
    } else {
      if (r.slot != -1 || !r.block_ids.empty() || r.num_computed_tokens != 0) fail("waiting request holds state");
      if (std::count(waiting_.begin(), waiting_.end(), static_cast<int32_t>(i)) != 1) fail("waiting queue");
    }
  }
  if (live != running_.size() + waiting_.size() || live != index_of_.size()) fail("request counts");
  // No block sharing yet: every referenced block belongs to exactly one request.
  if (held_blocks + pool_.num_free() != pool_.num_blocks()) fail("blocks leaked or double-owned");
  if (free_slots_.size() + running_.size() != static_cast<size_t>(config_.max_num_seqs)) fail("slot count");
}

}  // namespace ringserve
