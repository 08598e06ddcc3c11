// The scheduler: request table, waiting queue, running list, prefix cache lookups and the one scheduling rule.
//
// Every request has num_computed_tokens catching up to its token count (prompt + outputs). Each step spends
// max_num_batched_tokens on running requests first, then admits waiting requests while fewer than max_num_seqs run;
// a prompt longer than the remaining budget (or than long_prefill_token_threshold) is chunked. Both lists are kept in
// priority order: lower `priority` value first, then earlier arrival (FCFS within a priority). With aging
// (priority_aging_ms = A > 0) the order is by priority x A + arrival time instead: a request's effective priority
// improves by one per A waited, so one of priority p is overtaken only by requests of priority q < p that arrived
// less than (p - q) x A after it, and nobody waits forever behind a stream of better ones. On admission a request
// reuses every cached leading full block (chained prefix hashes), so it starts at num_computed_tokens > 0; it always
// computes at least its last token. KV blocks are allocated as a request grows. When a running request cannot get a
// block even after evicting unreferenced cached blocks, the running request last in that order (lowest priority,
// latest arrival) is preempted by recompute: its blocks are freed (full ones stay cached), it goes back to the
// waiting queue at its old place (ahead of every later arrival of its priority) with its generated tokens kept, and
// it is re-sent later as a new request.
//
// Slots: a running request owns a batch slot in [0, max_num_seqs) that the workers use to index their persistent
// batch. A slot released (finish, abort, preemption) is listed in the next plan's finished_slots; the workers drop it
// before running that plan, so the same plan may hand the slot to a new request.
//
// Steady-state decode steps do not touch the heap: the table, lists, outputs and plan entries reuse their storage.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "ringserve/block_pool.h"
#include "ringserve/records.h"
#include "ringserve/step_cost.h"

namespace ringserve {

struct EngineConfig {
  int32_t block_size = 16;
  int32_t num_blocks = 0;  // 0 = take num_kv_blocks from the worker's WorkerReady
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;
  int32_t max_model_len = 0;  // 0 = as many tokens as the KV pool holds
  std::vector<int32_t> eos_token_ids;
  bool enable_prefix_caching = true;
  int32_t long_prefill_token_threshold = 0;  // 0 = no per-request cap on a step's prefill chunk
  int32_t stats_interval_ms = 100;           // unsolicited EngineStats at most this often while busy
  // Aging: a request's effective priority value drops by one for every priority_aging_ms it has waited since it
  // arrived, so later arrivals of a better priority stop overtaking it after a bounded time (0 = strict priority).
  int32_t priority_aging_ms = 0;
  // Speculative decoding: a decoding request may get up to num_speculative_tokens lookahead slots per step (0 = off,
  // at most kMaxLookaheadSlots); the workers propose and verify that many draft tokens in the same step. Policy:
  // no speculation in a step where more than spec_max_batch requests run (0 = no limit: a large batch is already
  // compute bound, verifying drafts would cost throughput), and a request whose recent acceptance rate (moving
  // average) drops below spec_min_acceptance decodes without it for spec_backoff_steps steps, then tries again.
  int32_t num_speculative_tokens = 0;
  int32_t spec_max_batch = 16;
  float spec_min_acceptance = 0.25f;
  int32_t spec_backoff_steps = 16;
  // Decode-latency guard: while requests decode, the prefill chunks of a step are cut so that its estimated time
  // stays within max_step_slowdown x that of a step with only those decodes (0 = off; otherwise >= 1). Step times
  // are learnt online (StepCostModel: a decode-only step's time, and what prefill tokens and attention pairs add) from
  // what the engine reports through observe_step_time(); until it has seen both kinds of steps, only the token budget
  // applies. The first prefill row of a step always gets at least block_size tokens, so prompts make progress.
  float max_step_slowdown = 0.0f;
};

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
  // block_size, or never without prefix caching (set_registered_blocks keeps it).
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

// The chained prefix hash of one full block: parent hash (or the salt-derived root for the first block) + its tokens.
uint64_t block_hash(uint64_t parent, bool is_first, uint64_t cache_salt, std::span<const int32_t> tokens);

class Scheduler {
 public:
  // `max_plan_bytes`: the step ring's max record size; admission stops before a plan would outgrow it.
  explicit Scheduler(EngineConfig config, size_t max_plan_bytes = std::numeric_limits<size_t>::max());

  // Queues the request, or returns why it can never run (INVALID_ARGUMENT / RESOURCE_EXHAUSTED). `kv` (optional)
  // makes it a prefill-only request (its blocks are pinned when it finishes) or one whose prompt KV is pulled.
  std::optional<RequestRejected> add_request(const AddRequest& request, int64_t now_ns,
                                             const KvRequestOptions* kv = nullptr);
  // Removes a waiting or running request, frees its blocks and queues its final ABORT output. False if unknown.
  // Only between steps (not while a plan is in flight).
  bool abort_request(uint64_t request_id);
  // Builds the next step into `plan`. False when nothing is runnable; then no step is in flight.
  bool schedule(StepPlan& plan, int64_t now_ns);
  // Applies the result of the plan in flight: advances num_computed_tokens, caches newly computed full blocks,
  // appends sampled tokens, applies stop rules, frees finished requests. Throws std::runtime_error when the result
  // does not match the plan.
  void update(const StepResult& result, int64_t now_ns);
  // The outputs since the last clear_outputs(): one per scheduled request per step and one per abort, packed, their
  // top logprobs in the two side arrays (see PackedOutput). Valid until the next update/abort: schedule() leaves
  // them, so the engine sends them while the workers run the next step.
  std::span<const PackedOutput> outputs() const { return {outputs_.data(), num_outputs_}; }
  std::span<const int32_t> output_top_token_ids() const { return top_token_ids_; }
  std::span<const float> output_top_logprobs() const { return top_logprobs_; }
  void clear_outputs() {
    num_outputs_ = 0;
    top_token_ids_.clear();
    top_logprobs_.clear();
  }
  // Unpacks the pending outputs into `out` and clears them (tests and bindings).
  void take_outputs(std::vector<RequestOutput>& out);

  // Disaggregation. Pinned blocks of finished prefill-only requests are freed by release_pinned (ReleaseKv, or an
  // abort of that id), or by expire_pinned once their timeout passed. Only between steps.
  bool release_pinned(uint64_t request_id);
  int32_t expire_pinned(int64_t now_ns);  // returns how many pins it freed
  int32_t num_pinned_requests() const { return static_cast<int32_t>(pinned_.size()); }
  // The pulls the workers must do before the plan of the last schedule() (one per admitted kPullRemote request).
  std::span<const KvPull> kv_pulls() const { return kv_pulls_; }
  // KvPinned events since the last clear (sent before the outputs of the same update).
  std::span<const KvPinned> kv_pins() const { return kv_pins_; }
  void clear_kv_pins() { kv_pins_.clear(); }

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  EngineStats stats(uint64_t query_id) const;
  const EngineConfig& config() const { return config_; }
  const BlockPool& block_pool() const { return pool_; }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  uint64_t num_steps() const { return num_steps_; }
  uint64_t num_preemptions() const { return num_preemptions_; }
  int32_t last_step_tokens() const { return last_step_tokens_; }
  // The measured wall time of the step last scheduled (plan to result), for the decode-latency guard's cost model.
  // Nothing to learn while the guard is off.
  void observe_step_time(int64_t ns) {
    if (config_.max_step_slowdown > 0.0f) step_cost_.observe(last_shape_, ns);
  }
  const StepCostModel& step_cost() const { return step_cost_; }
  // The estimated time the guard lets the next step's prefill rows add (+infinity when it does not apply).
  double prefill_time_budget() const;
  // Throws std::logic_error when a table / slot / block / order invariant is broken (tests; O(table size)).
  void check_invariants() const;

 private:
  // The plan awaiting its StepResult: one entry per scheduled request, as parallel arrays sized max_num_seqs once (a
  // plan never holds more), so scheduling appends without growing anything and the plan's sched_* arrays are copies.
  struct InFlight {
    std::vector<int32_t> index;      // + 2 x kPrefetchAhead entries past the end repeating the last (update() reads)
    std::vector<int32_t> slot;
    std::vector<int32_t> start;      // num_computed_tokens when scheduled
    std::vector<int32_t> len;        // tokens scheduled
    std::vector<int32_t> lookahead;  // draft tokens the workers may verify after its token (reserved KV slots)
    std::vector<int32_t> sample;     // 1 when the entry reaches its last known token (int32: no char aliasing)
    std::vector<int32_t> result;     // update(): its row in the StepResult, -1 until matched
    size_t size = 0;
  };
  struct SampleMark {  // slot -> the in-flight entry that samples it, valid while step == in_flight_step_
    uint64_t step = 0;
    int32_t pos = -1;
  };
  struct PendingBlock {
    int32_t block;
    uint64_t hash;
  };

  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + config_.block_size - 1) / config_.block_size; }
  // True when request a runs before request b: lower rank (priority, aged when aging is on), then earlier arrival.
  bool runs_before(int32_t a, int32_t b) const;
  int64_t rank_of(int32_t priority, int64_t now_ns);
  void insert_waiting(int32_t index);
  void insert_running(int32_t index);
  int32_t chunk_cap(int32_t budget) const {
    const int32_t cap = config_.long_prefill_token_threshold;
    return cap > 0 && cap < budget ? cap : budget;
  }
  // The decode-latency guard's cut of a prefill row of (up to) n tokens after `start` computed ones, and its charge.
  int32_t guarded_chunk(int32_t start, int32_t n) const {
    if (!guard_active_) return n;
    int32_t allowed = step_cost_.max_tokens_within(start, prefill_ns_left_);
    if (!prefilled_this_step_) allowed = std::max(allowed, guard_floor());
    return std::min(n, allowed);
  }
  // The first prefill row of a guarded step gets at least this many tokens, so every prompt progresses: a quarter of
  // a block (at least one token), not a whole one, because deep into a long prompt a block's attention over the
  // context can cost more than the guard's allowance by itself (measured: ITL up to 3x instead of 2x on a 2-core CPU).
  int32_t guard_floor() const { return std::max(1, config_.block_size / 4); }
  void charge_prefill(int32_t start, int32_t n) {
    if (guard_active_) prefill_ns_left_ -= step_cost_.row_ns(start, n);
    prefilled_this_step_ = true;
    shape_.prefill_tokens += n;
    shape_.prefill_pairs += attention_pairs(start, n);
    shape_.prefill_context += static_cast<double>(start) + static_cast<double>(n);
  }
  enum class Growth : uint8_t { kGrown, kGrownAfterPreempting, kPreemptedSelf };
  // Gives a scheduled request the blocks for its n tokens + k lookahead slots (k shrinks to what free blocks allow),
  // preempting from the back of the running list when needed, and lists them in the plan.
  [[gnu::noinline]] Growth grow_blocks(int32_t index, int32_t n, int32_t& k, StepPlan& plan, size_t& plan_bytes);
  // Applies a result row with drafts, several tokens or top logprobs (update()'s uncommon case).
  [[gnu::noinline]] FinishReason append_row(int32_t index, int32_t num_tokens, size_t row_index,
                                            const StepResult& result, int64_t now_ns, uint64_t& generated);
  void set_registered_blocks(RequestState& r, int32_t blocks) const {
    r.num_registered_blocks = blocks;
    r.register_from = config_.enable_prefix_caching ? (blocks + 1) * config_.block_size
                                                    : std::numeric_limits<int32_t>::max();
  }
  void extend_block_hashes(const RequestState& r, RequestDetails& d, int32_t num_blocks);
  void register_computed_blocks(int32_t index);
  bool try_admit(int32_t index, StepPlan& plan, int32_t& budget, size_t& plan_bytes, int64_t now_ns);
  void schedule_chunk(int32_t index, int32_t slot, int32_t start, int32_t num_tokens, int32_t total,
                      int32_t lookahead = 0);  // -> in_flight_
  int32_t lookahead_for(int32_t index, int32_t budget_left);
  void check_result_counts(const StepResult& result);  // fills row_offsets_ (multi-token rows); throws on a bad count
  void trim_lookahead_blocks(RequestState& r);
  size_t write_entries(StepPlan& plan);  // in_flight_ -> the plan's sched_* arrays (and sampled_slots_); returns samples
  // True when the rows come in plan order (their `result` then set only with fill_rows); else sets every `result`.
  bool match_result_rows(const StepResult& result, bool fill_rows);
  void preempt(int32_t index, StepPlan& plan);
  void release(int32_t index);  // frees blocks, slot and table entry
  // Room for `more` outputs after the pending ones (grows the storage only past its high-water mark).
  PackedOutput* output_space(size_t more);
  void new_output(const RequestState& r, FinishReason reason, int32_t num_scheduled);  // one without a token
  RequestRejected reject(uint64_t id, uint32_t code, std::string message) const;
  std::optional<RequestRejected> check_kv_options(const AddRequest& req, const KvRequestOptions& kv) const;
  void pin_blocks(int32_t index, int64_t now_ns);  // a finished prefill-only request: its blocks -> pinned_
  void recycle_plan(StepPlan& plan);

  EngineConfig config_;
  size_t max_plan_bytes_;
  BlockPool pool_;

  std::vector<RequestState> table_;      // dense; entries are reused through free_entries_
  std::vector<RequestDetails> details_;  // the same indices as table_
  std::vector<int32_t> free_entries_;
  std::unordered_map<uint64_t, int32_t> index_of_;  // request_id -> table index, for aborts
  std::vector<int32_t> waiting_;  // table indices, the next to admit LAST (pop_back is O(1))
  std::vector<int32_t> running_;  // table indices, highest priority / earliest first; size <= max_num_seqs
  std::vector<int32_t> free_slots_;      // batch slots not owned by a running request
  std::vector<int32_t> slot_owner_;      // batch slot -> table index or -1
  std::vector<int32_t> released_slots_;  // go into the next plan's finished_slots
  std::vector<int32_t> hits_;            // scratch: cached blocks found for the request being admitted

  InFlight in_flight_;
  uint64_t in_flight_step_ = 0;
  bool step_in_flight_ = false;
  size_t num_in_flight_samples_ = 0;
  std::vector<int32_t> sampled_slots_;  // the plan in flight's sampled slots in plan order, when not every entry samples
  std::vector<SampleMark> sample_mark_;      // by batch slot: matches rows a worker sent out of plan order
  std::vector<PendingBlock> pending_cache_;  // scratch for update(): full blocks to register, prefetched first
  std::vector<int32_t> finished_;            // scratch for update(): requests released after the registrations
  std::vector<int32_t> registering_;         // scratch for update(): requests that completed a block
  std::vector<size_t> row_offsets_;          // scratch for update(): first token of each result row
  std::vector<int32_t> trimming_;            // scratch for update(): speculating requests, trimmed after registration
  std::vector<int32_t> pending_trim_slots_;  // go into the next plan's trim_slots / trim_num_blocks
  std::vector<int32_t> pending_trim_blocks_;
  bool spec_step_ = false;                   // the step in flight may speculate (sched_lookahead is sent)

  // Plan entries and outputs keep their arrays' storage between steps.
  std::vector<BlockAppend> spare_appends_;
  std::vector<NewRequestData> spare_new_requests_;
  std::vector<PackedOutput> outputs_;  // storage (its high-water mark); the first num_outputs_ are the outputs
  size_t num_outputs_ = 0;
  std::vector<int32_t> top_token_ids_;  // the outputs' top logprobs, in output order
  std::vector<float> top_logprobs_;

  struct PinnedBlocks {
    uint64_t request_id;
    int64_t expires_at_ns;
    std::vector<int32_t> block_ids;
  };
  std::vector<PinnedBlocks> pinned_;
  std::vector<KvPull> kv_pulls_;
  std::vector<KvPinned> kv_pins_;

  uint64_t next_step_id_ = 1;
  uint64_t next_arrival_seq_ = 0;
  int64_t arrival_clock_ = 0;  // latest arrival time seen: the aging key never runs backwards with the wall clock
  uint64_t num_steps_ = 0;
  uint64_t num_preemptions_ = 0;
  int32_t last_step_tokens_ = 0;
  StepShape shape_;                  // schedule(): the step being built, for the guard's cost model
  StepShape last_shape_;             // the last step sent; its decodes are the batch the guard protects next step
  bool guard_active_ = false;        // schedule(): the decode-latency guard applies to this step
  bool prefilled_this_step_ = false;
  double prefill_ns_left_ = 0;       // schedule(): estimated time the guard still lets prefill rows add
  StepCostModel step_cost_;
  uint64_t prefix_cache_queries_ = 0;
  uint64_t prefix_cache_hits_ = 0;
  uint64_t total_prompt_tokens_ = 0;
  uint64_t total_generation_tokens_ = 0;
  uint64_t spec_proposed_tokens_ = 0;
  uint64_t spec_accepted_tokens_ = 0;
  uint64_t spec_verify_rows_ = 0;
};

}  // namespace ringserve
