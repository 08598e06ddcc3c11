#include "ringserve/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace ringserve {
namespace {

EngineConfig checked(EngineConfig config) {
  check_scheduler_config(config);
  return config;
}

}  // namespace

Scheduler::Scheduler(EngineConfig config, size_t max_plan_bytes)
    : config_(checked(std::move(config))),
      queues_(config_.priority_aging_ms, config_.max_num_seqs),
      in_flight_(config_.max_num_seqs),
      ahead_(config_.async_scheduling ? config_.max_num_seqs : 0),
      outputs_(static_cast<size_t>(config_.max_num_seqs)),
      spec_(config_),
      pool_(config_.num_blocks),
      prefix_(config_.block_size, config_.enable_prefix_caching, config_.num_blocks),
      slots_(config_.max_num_seqs),
      max_plan_bytes_(max_plan_bytes),
      prefill_(config_) {
  const auto seqs = static_cast<size_t>(config_.max_num_seqs);
  spare_appends_.reserve(seqs);
  finished_.reserve(seqs);
  registering_.reserve(seqs);
  trimming_.reserve(seqs);
  sharing_.reserve(seqs);
  pending_trim_slots_.reserve(seqs);
  pending_trim_blocks_.reserve(seqs);
}

std::optional<RequestRejected> Scheduler::add_request(const AddRequest& req, int64_t now_ns,
                                                      const KvRequestOptions* kv) {
  if (auto rejected = table_.check(req, kv, config_, max_plan_bytes_)) return rejected;
  const int32_t index = table_.add(req, config_, kv, now_ns);
  prefix_.set_registered_blocks(table_.state(index), 0);
  queues_.stamp_arrival(table_.details(index), req.priority, now_ns);
  queues_.insert_waiting(table_, index);
  return std::nullopt;
}

bool Scheduler::abort_request(uint64_t request_id) {
  if (ahead_.in_flight() || in_flight_.advanced()) {
    throw std::logic_error("abort_request while a step is planned on top of the one in flight");
  }
  const int32_t index = table_.find(request_id);
  if (index < 0) return release_pinned(request_id);  // a finished prefill-only request's blocks
  RequestState& r = table_.state(index);
  // Its row in the step in flight, if any, is ignored. The blocks it writes go back to the pool now: any later
  // step that gets them runs after this one on the workers and overwrites what it wrote.
  if (in_flight_.in_flight()) in_flight_.drop_request(index);
  queues_.erase(index, r.status);
  outputs_.append() = make_output(r, FinishReason::kAbort, 0, false, 0, 0.0f);
  release(index);
  return true;
}

void Scheduler::release(int32_t index) {
  RequestState& r = table_.state(index);
  pool_.free(r.block_ids, /*tail_first=*/true);  // its full blocks stay cached; the tail is evicted first
  r.block_ids.clear();
  if (r.slot >= 0) {
    slots_.give_back(r.slot);
    slots_.released().push_back(r.slot);
    r.slot = -1;
  }
  table_.remove(index);
}

Scheduler::Admission Scheduler::try_admit(int32_t index, StepPlan& plan, int32_t& budget, size_t& plan_bytes,
                                          int64_t now_ns) {
  RequestState& r = table_.state(index);
  RequestDetails& d = table_.details(index);
  const int32_t bs = config_.block_size;
  const bool pull = d.kv_pull_pending;  // the prompt's KV arrives from a remote engine before this step runs
  // Hits that sit on the free list now stop counting as free once taken.
  const int32_t revived = pull ? 0 : prefix_.find_cached_prefix(r, d, pool_);
  const std::vector<int32_t>& hits = prefix_.hits();
  const auto cached_blocks = pull ? 0 : static_cast<int32_t>(hits.size());
  const int32_t cached_tokens = pull ? r.num_prompt_tokens : cached_blocks * bs;
  if (!pull && prefix_.waits_for_claimed(d, (r.num_tokens() - 1) / bs)) return Admission::kWaitsForShared;
  // A pulled prompt computes nothing of itself here; others count against the decode-latency guard.
  int32_t n = std::min(r.num_tokens() - cached_tokens, prefill_.chunk_cap(budget));
  if (!pull) n = prefill_.guarded_chunk(cached_tokens, n);
  if (n <= 0) return Admission::kQueueWaits;
  const int32_t needed = blocks_for(cached_tokens + n) - cached_blocks;
  if (needed + revived > pool_.num_free()) return Admission::kQueueWaits;  // the head waits, nobody overtakes it
  const size_t bytes = kPlanBytesPerScheduled + kPlanBytesPerNewRequest +
                       (r.token_ids.size() + static_cast<size_t>(cached_blocks + needed) +
                        d.suppress_token_ids.size()) * sizeof(int32_t);
  // Next step; add_request made sure it fits an empty plan.
  if (plan_bytes + bytes > max_plan_bytes_) return Admission::kQueueWaits;

  queues_.waiting().pop_back();
  for (int32_t j = 0; j < cached_blocks; ++j) {
    const int32_t id = hits[static_cast<size_t>(j)];
    pool_.acquire_cached(id);  // before allocate(), which would otherwise evict a free hit
    r.block_ids.push_back(id);
  }
  pool_.allocate(needed, r.block_ids);
  r.num_computed_tokens = cached_tokens;
  prefix_.set_registered_blocks(r, cached_blocks);
  if (!r.admitted) {  // first admission (a resumed request keeps its first figure)
    r.admitted = true;
    r.num_cached_tokens = pull ? 0 : static_cast<uint32_t>(cached_tokens);
    total_prompt_tokens_ += static_cast<uint64_t>(r.num_prompt_tokens);
  }
  if (prefix_.enabled() && !pull) prefix_.count_lookup(r.num_tokens(), cached_tokens);
  r.slot = slots_.take(index);
  r.status = RequestStatus::kRunning;
  queues_.insert_running(table_, index);
  if (pull) kv_.add_pull(r.slot, d, r.block_ids);

  NewRequestData& nr = reuse_back(plan.new_requests, spare_new_requests_);
  nr.slot = r.slot;
  nr.num_computed_tokens = r.num_computed_tokens;
  nr.num_prompt_tokens = r.num_prompt_tokens;
  nr.sampling = d.sampling;
  nr.token_ids.assign(r.token_ids.begin(), r.token_ids.end());
  nr.block_ids.assign(r.block_ids.begin(), r.block_ids.end());
  nr.suppress_token_ids.assign(d.suppress_token_ids.begin(), d.suppress_token_ids.end());
  if (r.first_scheduled_time_ns == 0) r.first_scheduled_time_ns = now_ns;
  in_flight_.push(index, r.slot, r.num_computed_tokens, n, r.num_tokens(), 0);
  plan_bytes += bytes;
  budget -= n;
  if (!pull) {
    prefill_.charge_prefill(cached_tokens, n);
    prefix_.claim_completed(d, cached_tokens, n);
  }
  return Admission::kAdmitted;
}

void Scheduler::recycle_plan(StepPlan& plan) {
  recycle(plan.new_requests, spare_new_requests_);
  recycle(plan.block_appends, spare_appends_);
  plan.step_id = 0;
  plan.finished_slots.clear();  // the sched_* arrays are rewritten whole by InFlightStep::write_entries()
  plan.trim_slots.clear();
  plan.trim_num_blocks.clear();
}

bool Scheduler::schedule(StepPlan& plan, int64_t now_ns) {
  if (in_flight_.in_flight()) throw std::logic_error("schedule while a step is in flight");
  recycle_plan(plan);
  kv_.clear_pulls();
  in_flight_.clear();
  plan.finished_slots.swap(slots_.released());
  plan.trim_slots.swap(pending_trim_slots_);
  plan.trim_num_blocks.swap(pending_trim_blocks_);

  // Invariant: the tokens scheduled this step, lookahead slots included, never exceed max_num_batched_tokens.
  int32_t budget = config_.max_num_batched_tokens;
  size_t plan_bytes = kPlanFixedBytes + plan.finished_slots.size() * sizeof(int32_t) +
                      plan.trim_slots.size() * kPlanBytesPerTrim;
  bool preempted = false;
  std::vector<int32_t>& running = queues_.running();
  const bool spec_step = spec_.begin_step(running.size());
  prefill_.begin_step(!running.empty());
  int32_t decode_rows = 0;

  // 1. Running requests first, highest priority / earliest arrival first.
  const int32_t bs = config_.block_size;
  RequestState* const table = table_.states();  // add_request() alone grows the table
  RequestDetails* const details = table_.details();
  size_t num_running = running.size();  // re-read after a preemption shrinks the running list
  for (size_t i = 0; i < num_running && budget > 0; ++i) {
    const int32_t* const run = running.data();
    // The entries are cold after a whole step's traffic: fetch a few requests ahead so their misses overlap.
    if (i + kPrefetchAhead < num_running) __builtin_prefetch(&table[run[i + kPrefetchAhead]]);
    const int32_t index = run[i];
    RequestState& r = table[index];
    const int32_t computed = r.num_computed_tokens;
    const int32_t total = r.num_tokens();
    const int32_t left = total - computed;
    // One token (a decode, the common case: kept to a single test), or a prefill chunk.
    int32_t n = 1;
    if (left != 1) [[unlikely]] {
      n = left > 1 ? prefill_.guarded_chunk(computed, std::min(left, prefill_.chunk_cap(budget))) : 0;
      if (n <= 0) continue;
    }
    // Lookahead only for a one-token decode that samples: its drafts are verified right after that token.
    int32_t k = spec_step && left == 1 ? spec_.lookahead_for(r, details[index], budget - n) : 0;
    if (computed + n + k > static_cast<int32_t>(r.block_ids.size()) * bs) {
      // Needs blocks: a decode step does once every block_size tokens. Out of line, so the loop keeps its registers.
      const Growth grown = grow_blocks(index, n, k, plan, plan_bytes);
      if (grown != Growth::kGrown) {
        preempted = true;
        num_running = running.size();
        if (grown == Growth::kPreemptedSelf) break;
      }
    }
    in_flight_.push(index, r.slot, computed, n, total, k);
    plan_bytes += kPlanBytesPerScheduled;
    budget -= n + k;
    if (left > 1) {
      prefill_.charge_prefill(computed, n);
      prefix_.claim_completed(details[index], computed, n);
    } else {
      ++decode_rows;
    }
  }

  // 2. Admit waiting requests in priority order. Not in a step that had to preempt: blocks are short right now.
  //    A head that waits for shared blocks steps aside (at most max_num_seqs of them a step) and goes back in place.
  std::vector<int32_t>& waiting = queues_.waiting();
  while (!preempted && !waiting.empty() && budget > 0 && static_cast<int32_t>(running.size()) < config_.max_num_seqs) {
    const Admission admission = try_admit(waiting.back(), plan, budget, plan_bytes, now_ns);
    if (admission == Admission::kQueueWaits) break;
    if (admission == Admission::kWaitsForShared) {
      sharing_.push_back(waiting.back());
      waiting.pop_back();
      if (std::ssize(sharing_) == config_.max_num_seqs) break;
    }
  }
  waiting.insert(waiting.end(), sharing_.rbegin(), sharing_.rend());
  sharing_.clear();

  const size_t samples = in_flight_.write_entries(plan, spec_.enabled());
  if (in_flight_.size() == 0) {
    // Nothing runs: keep the released slots and trims for the next plan that is actually sent.
    slots_.released().swap(plan.finished_slots);
    plan.finished_slots.clear();
    pending_trim_slots_.swap(plan.trim_slots);
    pending_trim_blocks_.swap(plan.trim_num_blocks);
    plan.trim_slots.clear();
    plan.trim_num_blocks.clear();
    return false;
  }
  last_step_tokens_ = config_.max_num_batched_tokens - budget;
  prefill_.end_step(decode_rows);
  in_flight_.shape = prefill_.last_shape();
  plan.step_id = next_step_id_++;
  in_flight_.send(plan.step_id, samples);
  ++num_steps_;
  return true;
}

bool Scheduler::can_plan_ahead() const {
  if (!config_.async_scheduling || !in_flight_.in_flight() || ahead_.in_flight() || spec_.enabled()) return false;
  // A step planned ahead must not preempt (a preempted request's token may still be on its way). Growing a request
  // by n tokens takes at most ceil(n / block_size) blocks (its blocks cover what it computed), so the step's rows
  // take at most budget / block_size + 1 per running request; admissions only take free blocks.
  const int64_t worst = int64_t{config_.max_num_batched_tokens} / config_.block_size +
                        static_cast<int64_t>(queues_.running().size()) + 1;
  return pool_.num_free() >= worst;
}

void Scheduler::advance_in_flight() {
  // What the step in flight computes counts as computed; what it samples is pending: a placeholder token that its
  // update() replaces. The next plan then schedules that token as (slot, its position, 1), and the workers, which
  // append every token they sample to their batch, compute it from their own copy.
  RequestState* const table = table_.states();
  const int32_t* const index = in_flight_.index();
  const int32_t* const len = in_flight_.len();
  const int32_t* const sample = in_flight_.sample();
  const int32_t* const dropped = in_flight_.dropped();
  for (size_t k = 0; k < in_flight_.size(); ++k) {
    if (dropped[k] != 0) continue;  // aborted: its table entry may hold another request by now
    RequestState& r = table[index[k]];
    r.num_computed_tokens += len[k];
    if (sample[k] != 0) r.token_ids.push_back(kPendingToken);  // within capacity: the request has not ended yet
  }
  in_flight_.mark_advanced();
}

bool Scheduler::schedule_ahead(StepPlan& plan, int64_t now_ns) {
  if (!can_plan_ahead()) return false;
  advance_in_flight();
  // schedule() builds into in_flight_: lend it the spare entries and put the step in flight back in front.
  std::swap(in_flight_, ahead_);
  bool planned = false;
  try {
    planned = schedule(plan, now_ns);
  } catch (...) {
    std::swap(in_flight_, ahead_);
    throw;
  }
  std::swap(in_flight_, ahead_);
  return planned;
}

// A row with drafts, several tokens or top logprobs: appends its tokens (stop rules apply token by token and drop the
// rest), one output each, and updates the request's acceptance rate. Out of line, so the plain loop keeps its registers.
FinishReason Scheduler::append_row(int32_t index, int32_t num_tokens, size_t row_index, const StepResult& result,
                                   int64_t now_ns, uint64_t& generated, bool advanced) {
  RequestState& r = table_.state(index);
  RequestDetails& d = table_.details(index);
  const bool multi = !result.token_counts.empty();
  const int32_t* tokens = result.token_ids.data();
  const float* logprobs = result.logprobs.data();
  FinishReason reason = FinishReason::kNone;
  const size_t first = multi ? in_flight_.row_offset(row_index) : row_index;
  const int32_t num_new = multi ? result.token_counts[row_index] : 1;
  const int32_t proposed = result.num_proposed.empty() ? 0 : result.num_proposed[row_index];
  // num_logprobs sits in the request's details: read it only when the worker sent top logprobs at all.
  const uint32_t top = result.num_top == 0 ? 0
                                           : std::min({result.num_top, static_cast<uint32_t>(d.sampling.num_logprobs),
                                                       uint32_t{std::numeric_limits<uint16_t>::max()}});
  if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
  if (!advanced) r.num_computed_tokens += num_tokens;
  // Accepted draft tokens come first, then the target's own; stop rules apply token by token and drop the rest.
  int32_t appended = 0;
  while (appended < num_new && reason == FinishReason::kNone) {
    const size_t at = first + static_cast<size_t>(appended);
    const int32_t token = tokens[at];
    if (advanced && appended == 0) {  // (no drafts: a step with lookahead is never planned on)
      r.token_ids.back() = token;      // the placeholder
    } else {
      r.token_ids.push_back(token);  // within the capacity reserved at add_request (lookahead stops at the limit)
    }
    reason = stop_reason(r, &d, token);
    const int32_t scheduled = appended == 0 ? num_tokens + proposed : 0;
    PackedOutput& o = outputs_.append();
    o = make_output(r, reason, scheduled, true, token, logprobs[at]);
    if (appended == 0 && proposed > 0) {
      o.num_spec_proposed_tokens = static_cast<uint8_t>(proposed);
      o.num_spec_accepted_tokens = static_cast<uint8_t>(num_new - 1);
    }
    if (top > 0) {
      const size_t row = at * result.num_top;
      outputs_.add_top(o, std::span(result.top_token_ids).subspan(row, top),
                       std::span(result.top_logprobs).subspan(row, top));
    }
    ++appended;
  }
  generated += static_cast<uint64_t>(appended);
  // The KV of the accepted drafts was computed in this step; the last token's is computed next step.
  r.num_computed_tokens += appended - 1;
  if (proposed > 0) spec_.record_verification(d, proposed, num_new - 1);
  return reason;
}

void Scheduler::update(const StepResult& result, int64_t now_ns) {
  in_flight_.check_result_header(result);
  const bool multi = !result.token_counts.empty();
  const bool plain = !multi && result.num_proposed.empty() && result.num_top == 0;
  // The common step: every entry a plain decode (one token, no drafts, no lookahead, no top logprobs) whose row is
  // its own position. Throws, changing nothing, unless every sampled entry got exactly one row; unless the step
  // turns out to be the common one, each entry's row is then in its result_row.
  const size_t count = in_flight_.size();
  const bool advanced = in_flight_.advanced();  // async scheduling planned the next step on this one
  const bool every_entry_decodes =
      plain && result.slots.size() == count && !spec_.enabled() && in_flight_.num_dropped() == 0;
  const bool in_order = in_flight_.match_result_rows(result, /*fill_rows=*/!every_entry_decodes);
  in_flight_.check_result_counts(result);  // throws, changing nothing, unless every row's tokens fit its lookahead
  in_flight_.mark_received();

  finished_.clear();
  registering_.clear();
  trimming_.clear();
  const int32_t* tokens = result.token_ids.data();
  const float* logprobs = result.logprobs.data();  // one per token (check_result_counts)
  // Without drafts every sampled row appends exactly one token.
  uint64_t generated = plain ? result.slots.size() : 0;
  RequestState* const table = table_.states();
  RequestDetails* const details = table_.details();
  const int32_t* const entry_index = in_flight_.index();
  const int32_t* const entry_len = in_flight_.len();
  const int32_t* const entry_sample = in_flight_.sample();
  const int32_t* const entry_lookahead = in_flight_.lookahead();
  const int32_t* const entry_result = in_flight_.result_row();
  const int32_t* const entry_dropped = in_flight_.dropped();
  // Each entry gives one output, or one per token it appends (at least one): room for them all, written in place.
  PackedOutput* out = outputs_.reserve(count + result.token_ids.size());
  // One walk over the entries, compiled twice: for the common step (entry k is row k; nothing to test per entry but
  // the stop rules) and for any other.
  const auto walk = [&](auto common_step, auto advanced_step) {
    constexpr bool kFast = decltype(common_step)::value;
    constexpr bool kAdvanced = decltype(advanced_step)::value;  // the step was planned on (async scheduling)
    for (size_t k = 0; k < count; ++k) {
      // Two stages ahead: the entry's hot lines, then (once that has arrived) the line its next token goes to. The
      // index array repeats its last entry past the end (write_entries pads it), so neither needs a bound check.
      const RequestState* ahead = &table[entry_index[k + 2 * kPrefetchAhead]];
      __builtin_prefetch(ahead);
      __builtin_prefetch(reinterpret_cast<const char*>(ahead) + 64);
      const RequestState& near = table[entry_index[k + kPrefetchAhead]];
      __builtin_prefetch(near.token_ids.data() + near.token_ids.size(), 1);
      const int32_t index = entry_index[k];
      const int32_t num_tokens = entry_len[k];
      if (!kFast && entry_dropped[k] != 0) {  // finished or aborted meanwhile: the row is ignored
        if (plain && entry_sample[k] != 0) --generated;
        continue;
      }
      RequestState& r = table[index];
      if (!kFast && entry_sample[k] == 0) {
        if (!kAdvanced) r.num_computed_tokens += num_tokens;
        if (r.num_computed_tokens >= r.register_from) registering_.push_back(index);
        *out++ = make_output(r, FinishReason::kNone, num_tokens, false, 0, 0.0f);  // a prefill chunk: progress only
        continue;
      }
      FinishReason reason = FinishReason::kNone;
      if (kFast || plain) {  // one token per row, no drafts, no top logprobs: kept short
        const size_t row = kFast ? k : static_cast<size_t>(entry_result[k]);
        const int32_t token = tokens[row];
        if (r.first_token_time_ns == 0) r.first_token_time_ns = now_ns;
        if constexpr (!kAdvanced) {
          r.num_computed_tokens += num_tokens;
          r.token_ids.push_back(token);  // within the capacity reserved at add_request
        } else {
          r.token_ids.back() = token;  // the placeholder advance_in_flight() appended
        }
        reason = stop_reason(r, details + index, token);
        *out++ = make_output(r, reason, num_tokens, true, token, logprobs[row]);
      } else {
        outputs_.commit(out);  // append_row adds its own
        reason = append_row(index, num_tokens, static_cast<size_t>(entry_result[k]), result, now_ns, generated,
                            kAdvanced);
        out = outputs_.reserve(0);
      }
      // Most decode steps complete no block: skip the registration unless the next unregistered one is full.
      if (r.num_computed_tokens >= r.register_from) registering_.push_back(index);
      if (reason != FinishReason::kNone) {
        finished_.push_back(index);
      } else if (!kFast && entry_lookahead[k] > 0) {
        trimming_.push_back(index);  // the lookahead slots it did not fill go back
      }
    }
  };
  if (every_entry_decodes && in_order) {
    if (advanced) {
      walk(std::true_type{}, std::true_type{});
    } else {
      walk(std::true_type{}, std::false_type{});
    }
  } else if (advanced) {
    walk(std::false_type{}, std::true_type{});  // entry_result holds every sampled entry's row (match_result_rows)
  } else {
    walk(std::false_type{}, std::false_type{});
  }
  outputs_.commit(out);
  total_generation_tokens_ += generated;
  // Register before releasing: a block must still be referenced when it enters the cache.
  prefix_.register_computed_blocks(registering_, table_, pool_);
  for (const int32_t index : trimming_) trim_lookahead_blocks(table_.state(index));
  for (const int32_t index : finished_) {  // status becomes kFree; removed from the running list below
    RequestState& r = table_.state(index);
    const RequestDetails& d = table_.details(index);
    if (d.kv_mode == KvMode::kPrefillOnly) kv_.pin(r, d, blocks_for(r.num_prompt_tokens), now_ns);
    // A step planned on this one has a row for it: that row is ignored, and its blocks are free for any later step
    // (which the workers run after that one).
    if (ahead_.in_flight()) ahead_.drop_request(index);
    release(index);
  }
  if (!finished_.empty()) {
    std::erase_if(queues_.running(), [this](int32_t i) { return table_.state(i).status != RequestStatus::kRunning; });
  }
  applied_shape_ = in_flight_.shape;
  // This step's blocks are registered now. A step planned on it loses its claims too: its blocks may be computed twice.
  prefix_.clear_claims();
  in_flight_.clear();
  if (ahead_.in_flight()) std::swap(in_flight_, ahead_);  // the step planned ahead is now the oldest in flight
}

EngineStats Scheduler::stats(uint64_t query_id) const {
  EngineStats s;
  s.query_id = query_id;
  s.num_running = static_cast<uint32_t>(queues_.running().size());
  s.num_waiting = static_cast<uint32_t>(queues_.waiting().size());
  s.num_total_blocks = static_cast<uint32_t>(pool_.num_blocks());
  s.num_free_blocks = static_cast<uint32_t>(pool_.num_free());
  s.block_size = static_cast<uint32_t>(config_.block_size);
  s.num_steps = num_steps_;
  s.num_preemptions = num_preemptions_;
  s.num_scheduled_tokens = static_cast<uint32_t>(last_step_tokens_);
  s.prefix_cache_queries = prefix_.queried_tokens();
  s.prefix_cache_hits = prefix_.hit_tokens();
  s.kv_usage = 1.0f - static_cast<float>(pool_.num_free()) / static_cast<float>(pool_.num_blocks());
  s.total_prompt_tokens = total_prompt_tokens_;
  s.total_generation_tokens = total_generation_tokens_;
  s.spec_proposed_tokens = spec_.proposed_tokens();
  s.spec_accepted_tokens = spec_.accepted_tokens();
  s.spec_verify_rows = spec_.verify_rows();
  return s;
}

void Scheduler::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("Scheduler invariant broken: " + what); };
  pool_.check_invariants();
  const std::vector<int32_t>& running = queues_.running();
  const std::vector<int32_t>& waiting = queues_.waiting();
  if (static_cast<int32_t>(running.size()) > config_.max_num_seqs) fail("more running than max_num_seqs");
  std::vector<int32_t> holders(static_cast<size_t>(pool_.num_blocks()), 0);
  size_t live = 0;
  for (size_t i = 0; i < table_.size(); ++i) {
    const auto index = static_cast<int32_t>(i);
    const RequestState& r = table_.state(index);
    if (r.status == RequestStatus::kFree) continue;
    ++live;
    for (const int32_t b : r.block_ids) ++holders[static_cast<size_t>(b)];
    if (r.block_ids.size() < static_cast<size_t>(blocks_for(r.num_computed_tokens))) fail("too few blocks");
    if (r.register_from != prefix_.register_from(r)) fail("register_from does not follow num_registered_blocks");
    if (r.num_computed_tokens >= r.num_tokens() && r.status == RequestStatus::kRunning) fail("nothing left to compute");
    // Between steps a request holds no lookahead blocks: rejected drafts' slots went back to the pool.
    if (!in_flight_.in_flight() && r.block_ids.size() > static_cast<size_t>(blocks_for(r.num_tokens()))) {
      fail("blocks beyond the request's tokens");
    }
    if (r.status == RequestStatus::kRunning) {
      if (r.slot < 0 || slots_.owner(r.slot) != index) fail("slot owner");
      if (std::count(running.begin(), running.end(), index) != 1) fail("running list");
    } else {
      if (r.slot != -1 || !r.block_ids.empty() || r.num_computed_tokens != 0) fail("waiting request holds state");
      if (std::count(waiting.begin(), waiting.end(), index) != 1) fail("waiting queue");
    }
  }
  if (live != running.size() + waiting.size() || live != table_.num_live()) fail("request counts");
  kv_.for_each_pinned_block([&](int32_t b) { ++holders[static_cast<size_t>(b)]; });
  // Sharing: a block's reference count is exactly the number of requests holding it.
  for (int32_t b = 0; b < pool_.num_blocks(); ++b) {
    if (pool_.ref_count(b) != holders[static_cast<size_t>(b)]) fail("ref_count of block " + std::to_string(b));
  }
  queues_.check_order(table_);
  if (slots_.num_free() + running.size() != static_cast<size_t>(config_.max_num_seqs)) fail("slot count");
}

}  // namespace ringserve
