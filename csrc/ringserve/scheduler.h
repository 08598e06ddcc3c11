// The scheduler: the step loop that applies the one scheduling rule, over small policies held by value.
//
// Every request has num_computed_tokens catching up to its token count (prompt + outputs). Each step spends
// max_num_batched_tokens on running requests first, then admits waiting requests while fewer than max_num_seqs run;
// a prompt longer than the remaining budget (or than long_prefill_token_threshold) is chunked. KV blocks are
// allocated as a request grows. When a running request cannot get a block even after evicting unreferenced cached
// blocks, the running request last in queue order (lowest priority, latest arrival) is preempted by recompute: its
// blocks are freed (full ones stay cached), it goes back to the waiting queue at its old place (ahead of every later
// arrival of its priority) with its generated tokens kept, and it is re-sent later as a new request.
//
// The policies, each in its own file:
//   request_table.h       RequestState / RequestDetails tables, free list, admission checks, stop rules
//   request_queues.h      waiting / running order (priority, aging) and batch slots
//   prefix_index.h        block hashing, cached-prefix lookup, registration of computed blocks
//   prefill_budget.h      chunk cap and the decode-latency guard (StepCostModel, step_cost.h)
//   speculation_policy.h  lookahead per request, acceptance moving average, backoff
//   kv_pins.h             disaggregation: pins of prefill-only requests, remote KV pulls
//   in_flight_step.h      the plan's entries, matching and checking the StepResult
//   step_outputs.h        packed outputs
//   block_growth.cpp      growing a request's blocks, preemption, trimming lookahead blocks
//
// Steady-state decode steps do not touch the heap: the table, lists, outputs and plan entries reuse their storage.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "ringserve/block_pool.h"
#include "ringserve/engine_config.h"
#include "ringserve/in_flight_step.h"
#include "ringserve/kv_pins.h"
#include "ringserve/prefill_budget.h"
#include "ringserve/prefix_index.h"
#include "ringserve/records.h"
#include "ringserve/request_queues.h"
#include "ringserve/request_table.h"
#include "ringserve/speculation_policy.h"
#include "ringserve/step_cost.h"
#include "ringserve/step_outputs.h"

namespace ringserve {

class Scheduler {
 public:
  // `max_plan_bytes`: the step ring's max record size; admission stops before a plan would outgrow it.
  explicit Scheduler(EngineConfig config, size_t max_plan_bytes = std::numeric_limits<size_t>::max());

  // Queues the request, or returns why it can never run (INVALID_ARGUMENT / RESOURCE_EXHAUSTED). `kv` (optional)
  // makes it a prefill-only request (its blocks are pinned when it finishes) or one whose prompt KV is pulled.
  std::optional<RequestRejected> add_request(const AddRequest& request, int64_t now_ns,
                                             const KvRequestOptions* kv = nullptr);
  // Removes a waiting or running request, frees its blocks and queues its final ABORT output. False if unknown.
  // Between steps, or while one step is in flight that nothing was planned on top of (async scheduling): its entry
  // of the request is then dropped (the workers still compute it, into blocks that no later step has yet been given).
  bool abort_request(uint64_t request_id);
  // Builds the next step into `plan`, with no step in flight. False when nothing is runnable; then no step is in flight.
  bool schedule(StepPlan& plan, int64_t now_ns);
  // Async scheduling (config.async_scheduling): builds the step after the one in flight, before its result arrives,
  // counting that step's tokens as computed and its sampled tokens as pending (placeholders that its update()
  // replaces; the workers feed each slot the token they sampled). False, changing nothing, when it may not: no or two
  // steps in flight, speculation on (the accepted count is unknown), or a pool that might run dry in the step (a step
  // planned ahead never preempts: the free blocks must cover every running request's worst-case growth). A request
  // that finishes in the step in flight has its entry in this one dropped by update(); its row is ignored.
  bool schedule_ahead(StepPlan& plan, int64_t now_ns);
  // Steps sent whose result has not been applied: 0, 1, or 2 with async scheduling.
  int32_t num_steps_in_flight() const { return int32_t{in_flight_.in_flight()} + int32_t{ahead_.in_flight()}; }
  // Applies the result of the oldest plan in flight: advances num_computed_tokens, caches newly computed full blocks,
  // appends sampled tokens, applies stop rules, frees finished requests. Throws std::runtime_error when the result
  // does not match the plan.
  void update(const StepResult& result, int64_t now_ns);
  // The outputs since the last clear_outputs(): one per scheduled request per step and one per abort, packed, their
  // top logprobs in the two side arrays (see PackedOutput). Valid until the next update/abort: schedule() leaves
  // them, so the engine sends them while the workers run the next step.
  std::span<const PackedOutput> outputs() const { return outputs_.outputs(); }
  std::span<const int32_t> output_top_token_ids() const { return outputs_.top_token_ids(); }
  std::span<const float> output_top_logprobs() const { return outputs_.top_logprobs(); }
  void clear_outputs() { outputs_.clear(); }
  // Unpacks the pending outputs into `out` and clears them (tests and bindings).
  void take_outputs(std::vector<RequestOutput>& out) { outputs_.take(out); }

  // Disaggregation. Pinned blocks of finished prefill-only requests are freed by release_pinned (ReleaseKv, or an
  // abort of that id), or by expire_pinned once their timeout passed. Only between steps.
  bool release_pinned(uint64_t request_id) { return kv_.release(request_id, pool_); }
  int32_t expire_pinned(int64_t now_ns) { return kv_.expire(now_ns, pool_); }  // returns how many pins it freed
  int32_t num_pinned_requests() const { return kv_.num_pinned(); }
  // The pulls the workers must do before the plan of the last schedule() (one per admitted kPullRemote request).
  std::span<const KvPull> kv_pulls() const { return kv_.pulls(); }
  // KvPinned events since the last clear (sent before the outputs of the same update).
  std::span<const KvPinned> kv_pins() const { return kv_.events(); }
  void clear_kv_pins() { kv_.clear_events(); }

  bool has_unfinished() const { return !queues_.running().empty() || !queues_.waiting().empty(); }
  EngineStats stats(uint64_t query_id) const;
  const EngineConfig& config() const { return config_; }
  const BlockPool& block_pool() const { return pool_; }
  int32_t num_running() const { return static_cast<int32_t>(queues_.running().size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(queues_.waiting().size()); }
  uint64_t num_steps() const { return num_steps_; }
  uint64_t num_preemptions() const { return num_preemptions_; }
  int32_t last_step_tokens() const { return last_step_tokens_; }
  // The measured wall time of the step last scheduled (plan to result), for the decode-latency guard's cost model.
  // Nothing to learn while the guard is off.
  void observe_step_time(int64_t ns) { prefill_.observe_step_time(ns, applied_shape_); }
  const StepCostModel& step_cost() const { return prefill_.cost(); }
  // The estimated time the guard lets the next step's prefill rows add (+infinity when it does not apply).
  double prefill_time_budget() const { return prefill_.time_budget(!queues_.running().empty()); }
  // Throws std::logic_error when a table / slot / block / order invariant is broken (tests; O(table size)).
  void check_invariants() const;

 private:
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + config_.block_size - 1) / config_.block_size; }
  // Admission of the waiting head: admitted; kept waiting, and so is everyone behind it (no blocks, budget or plan
  // room); or waiting one step for the blocks a request in this step completes (PrefixIndex's claims) while the
  // requests behind it may be admitted.
  enum class Admission : uint8_t { kAdmitted, kQueueWaits, kWaitsForShared };
  Admission try_admit(int32_t index, StepPlan& plan, int32_t& budget, size_t& plan_bytes, int64_t now_ns);
  // Applies a result row with drafts, several tokens or top logprobs (update()'s uncommon case).
  // `advanced`: the step was planned on (its tokens counted as computed, the request's last token a placeholder).
  [[gnu::noinline]] FinishReason append_row(int32_t index, int32_t num_tokens, size_t row_index,
                                            const StepResult& result, int64_t now_ns, uint64_t& generated,
                                            bool advanced);
  // schedule_ahead(): whether the step in flight may be planned on, and counting it as computed.
  bool can_plan_ahead() const;
  void advance_in_flight();
  void recycle_plan(StepPlan& plan);
  // Frees a request's blocks, slot and table entry.
  void release(int32_t index);

  // block_growth.cpp.
  enum class Growth : uint8_t { kGrown, kGrownAfterPreempting, kPreemptedSelf };
  // Gives a scheduled request the blocks for its n tokens + k lookahead slots (k shrinks to what free blocks allow),
  // preempting from the back of the running list when needed, and lists them in the plan.
  [[gnu::noinline]] Growth grow_blocks(int32_t index, int32_t n, int32_t& k, StepPlan& plan, size_t& plan_bytes);
  void preempt(int32_t index, StepPlan& plan);
  // Returns the blocks of a request's unfilled lookahead slots and lists the trim for the workers' next plan.
  void trim_lookahead_blocks(RequestState& r);

  // The members the step loops touch first and together; the KV pins and the guard's cost model (2 KiB of step
  // history) last, so they do not spread the hot ones over more cache lines.
  EngineConfig config_;
  RequestTable table_;
  RequestQueues queues_;
  InFlightStep in_flight_;
  InFlightStep ahead_;  // async scheduling: the step planned on top of in_flight_ (in flight too), else unused
  StepOutputs outputs_;
  std::vector<int32_t> finished_;            // scratch for update(): requests released after the registrations
  std::vector<int32_t> registering_;         // scratch for update(): requests that completed a block
  std::vector<int32_t> trimming_;            // scratch for update(): speculating requests, trimmed after registration
  std::vector<int32_t> sharing_;             // scratch for schedule(): waiting heads that wait for claimed blocks
  SpeculationPolicy spec_;
  BlockPool pool_;
  PrefixIndex prefix_;
  BatchSlots slots_;
  size_t max_plan_bytes_;
  std::vector<int32_t> pending_trim_slots_;  // go into the next plan's trim_slots / trim_num_blocks
  std::vector<int32_t> pending_trim_blocks_;

  // Plan entries keep their arrays' storage between steps.
  std::vector<BlockAppend> spare_appends_;
  std::vector<NewRequestData> spare_new_requests_;

  StepShape applied_shape_;  // the shape of the step update() last applied (observe_step_time measures it)
  uint64_t next_step_id_ = 1;
  uint64_t num_steps_ = 0;
  uint64_t num_preemptions_ = 0;
  int32_t last_step_tokens_ = 0;
  uint64_t total_prompt_tokens_ = 0;
  uint64_t total_generation_tokens_ = 0;
  KvPins kv_;
  PrefillBudget prefill_;
};

}  // namespace ringserve
