// The scheduler: request table, waiting queue, running list and the one scheduling rule.
//
// Every request has num_computed_tokens catching up to its token count (prompt + outputs). Each step spends
// max_num_batched_tokens on running requests first (admission order), then admits waiting requests (FCFS) while
// fewer than max_num_seqs run; a prompt longer than the remaining budget is chunked. KV blocks are allocated as a
// request grows. When a running request cannot get a block, the latest-admitted running request is preempted by
// recompute: its blocks are freed, it goes back to the head of the waiting queue with its generated tokens kept,
// and it is re-sent to the workers later as a new request carrying all its tokens.
//
// Slots: a running request owns a batch slot in [0, max_num_seqs) that the workers use to index their persistent
// batch. A slot released (finish, abort, preemption) is listed in the next plan's finished_slots; the workers drop it
// before running that plan, so the same plan may hand the slot to a new request.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ringserve/block_pool.h"
#include "ringserve/records.h"

namespace ringserve {

struct EngineConfig {
  int32_t block_size = 16;
  int32_t num_blocks = 0;  // 0 = take num_kv_blocks from the worker's WorkerReady
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;
  int32_t max_model_len = 0;  // 0 = as many tokens as the KV pool holds
  std::vector<int32_t> eos_token_ids;
};

enum class RequestStatus : uint8_t { kFree, kWaiting, kRunning };

struct RequestState {
  uint64_t request_id = 0;
  RequestStatus status = RequestStatus::kFree;
  int32_t slot = -1;  // batch slot while running, else -1
  int32_t num_prompt_tokens = 0;
  int32_t num_computed_tokens = 0;
  std::vector<int32_t> token_ids;  // prompt then outputs
  std::vector<int32_t> block_ids;  // covers at least num_computed_tokens tokens
  // sampling and stop parameters, as received
  int32_t max_tokens = 0;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  bool has_seed = false;
  bool ignore_eos = false;
  int32_t priority = 0;  // carried; ordering is FCFS for now
  std::vector<int32_t> stop_token_ids;
  // engine timestamps, CLOCK_REALTIME ns (0 = not yet)
  int64_t arrival_time_ns = 0;
  int64_t first_scheduled_time_ns = 0;
  int64_t first_token_time_ns = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
};

class Scheduler {
 public:
  // `max_plan_bytes`: the step ring's max record size; admission stops before a plan would outgrow it.
  explicit Scheduler(EngineConfig config, size_t max_plan_bytes = std::numeric_limits<size_t>::max());

  // Queues the request, or returns why it can never run (INVALID_ARGUMENT / RESOURCE_EXHAUSTED).
  std::optional<RequestRejected> add_request(const AddRequest& request, int64_t now_ns);
  // Removes a waiting or running request, frees its blocks and queues its final ABORT output. False if unknown.
  // Only between steps (not while a plan is in flight).
  bool abort_request(uint64_t request_id);
  // Builds the next step into `plan` (cleared first). False when nothing is runnable; then no step is in flight.
  bool schedule(StepPlan& plan, int64_t now_ns);
  // Applies the result of the plan in flight: advances num_computed_tokens, appends sampled tokens, applies stop
  // rules, frees finished requests. Throws std::runtime_error when the result does not match the plan.
  void update(const StepResult& result, int64_t now_ns);
  // Moves the outputs produced since the last call into `out` (cleared first).
  void take_outputs(std::vector<RequestOutput>& out);

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  EngineStats stats(uint64_t query_id) const;
  const EngineConfig& config() const { return config_; }
  const BlockPool& block_pool() const { return pool_; }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  uint64_t num_steps() const { return num_steps_; }
  uint64_t num_preemptions() const { return num_preemptions_; }
  // Throws std::logic_error when a table / slot / block invariant is broken (tests; O(table size)).
  void check_invariants() const;

 private:
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + config_.block_size - 1) / config_.block_size; }
  void schedule_chunk(StepPlan& plan, int32_t index, int32_t num_tokens, int64_t now_ns);
  void preempt(int32_t index, StepPlan& plan);
  void release(int32_t index);  // frees blocks, slot and table entry
  FinishReason stop_reason(const RequestState& r, int32_t token) const;
  RequestOutput make_output(const RequestState& r, FinishReason reason) const;
  RequestRejected reject(uint64_t id, uint32_t code, std::string message) const;

  EngineConfig config_;
  size_t max_plan_bytes_;
  BlockPool pool_;

  std::vector<RequestState> table_;           // dense; entries are reused through free_entries_
  std::vector<int32_t> free_entries_;
  std::unordered_map<uint64_t, int32_t> index_of_;  // request_id -> table index, for aborts
  std::deque<int32_t> waiting_;               // table indices, FCFS (preempted requests go to the front)
  std::vector<int32_t> running_;              // table indices in admission order; size <= max_num_seqs
  std::vector<int32_t> free_slots_;           // batch slots not owned by a running request
  std::vector<int32_t> slot_owner_;           // batch slot -> table index or -1
  std::vector<int32_t> released_slots_;       // go into the next plan's finished_slots

  struct Scheduled {
    int32_t index;
    int32_t num_tokens;
    bool sample;
  };
  std::vector<Scheduled> in_flight_;  // the plan awaiting its StepResult
  uint64_t in_flight_step_ = 0;
  bool step_in_flight_ = false;
  std::vector<int32_t> result_of_slot_;  // scratch for update(): slot -> index into StepResult, or -1

  std::vector<RequestOutput> outputs_;
  uint64_t next_step_id_ = 1;
  uint64_t num_steps_ = 0;
  uint64_t num_preemptions_ = 0;
};

}  // namespace ringserve
