// The scheduler tests' harness: a fake worker that keeps a persistent batch from the plan deltas and checks every
// plan against it, and a Harness that runs engine iterations and collects the outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "check.h"
#include "ringserve/scheduler.h"

namespace ringserve::scheduler_testing {

inline constexpr int32_t kEos = 2;

inline EngineConfig make_config(int32_t num_blocks, int32_t max_seqs = 8, int32_t budget = 64, int32_t block_size = 4) {
  EngineConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = budget;
  c.eos_token_ids = {kEos};
  return c;
}

// make_config as the scheduler completes it (max_model_len: the whole pool), for the policies tested on their own.
inline EngineConfig table_config(int32_t num_blocks = 16) {
  EngineConfig c = make_config(num_blocks);
  check_scheduler_config(c);
  return c;
}

inline AddRequest make_request(uint64_t id, int32_t prompt_len, int32_t max_tokens) {
  AddRequest r;
  r.request_id = id;
  r.max_tokens = max_tokens;
  for (int32_t i = 0; i < prompt_len; ++i) r.prompt_token_ids.push_back(100 + i);
  return r;
}

// Plays the workers: keeps a persistent batch from the plan deltas and checks that every plan is consistent with it.
class FakeWorker {
 public:
  explicit FakeWorker(const EngineConfig& c) : config_(c), slots_(static_cast<size_t>(c.max_num_seqs)) {}

  // token_for(slot state tokens) -> sampled token
  const std::vector<int32_t>& tokens_of(int32_t slot) const { return slots_.at(static_cast<size_t>(slot)).tokens; }

  // Speculation: proposes draft tokens for a slot's tokens (up to `max`); verification is greedy against token_for
  // evaluated on the tokens plus the drafts accepted so far, like a real target model.
  std::function<std::vector<int32_t>(const std::vector<int32_t>& tokens, int32_t max)> proposer;

  StepResult execute(const StepPlan& plan, const std::function<int32_t(int32_t slot)>& token_for) {
    CHECK(plan.trim_slots.size() == plan.trim_num_blocks.size());
    for (size_t i = 0; i < plan.trim_slots.size(); ++i) {  // before finished_slots: the slot's old occupant
      Slot& s = slots_.at(static_cast<size_t>(plan.trim_slots[i]));
      CHECK(s.live && plan.trim_num_blocks[i] < static_cast<int32_t>(s.blocks.size()));
      CHECK(plan.trim_num_blocks[i] * config_.block_size >= s.computed);
      s.blocks.resize(static_cast<size_t>(plan.trim_num_blocks[i]));
    }
    for (int32_t s : plan.finished_slots) slots_.at(static_cast<size_t>(s)).live = false;
    for (const NewRequestData& nr : plan.new_requests) {
      Slot& s = slots_.at(static_cast<size_t>(nr.slot));
      CHECK(!s.live);
      s = Slot{true, nr.token_ids, nr.block_ids, nr.num_computed_tokens};
    }
    for (const BlockAppend& ba : plan.block_appends) {
      Slot& s = slots_.at(static_cast<size_t>(ba.slot));
      CHECK(s.live);
      s.blocks.insert(s.blocks.end(), ba.block_ids.begin(), ba.block_ids.end());
    }
    // A block may back two live slots only as a shared prefix-cache block: fully computed in every slot holding it,
    // so no step writes into it.
    std::map<int32_t, int> holders;
    for (const Slot& s : slots_) {
      if (!s.live) continue;
      for (int32_t b : s.blocks) ++holders[b];
    }
    for (const Slot& s : slots_) {
      if (!s.live) continue;
      for (size_t j = 0; j < s.blocks.size(); ++j) {
        if (holders[s.blocks[j]] > 1) CHECK(static_cast<int32_t>(j + 1) * config_.block_size <= s.computed);
      }
    }
    StepResult result;
    result.step_id = plan.step_id;
    for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
      Slot& s = slots_.at(static_cast<size_t>(plan.sched_slots[i]));
      CHECK(s.live);
      CHECK(plan.sched_start[i] == s.computed);
      s.computed += plan.sched_len[i];
      CHECK(s.computed <= static_cast<int32_t>(s.tokens.size()));
      CHECK(static_cast<int32_t>(s.blocks.size()) * config_.block_size >= s.computed);
      CHECK((plan.sched_sample[i] != 0) == (s.computed == static_cast<int32_t>(s.tokens.size())));
      const int32_t lookahead = plan.sched_lookahead.empty() ? 0 : plan.sched_lookahead[i];
      CHECK(lookahead >= 0 && lookahead <= kMaxLookaheadSlots);
      if (lookahead > 0) {
        CHECK(plan.sched_sample[i] != 0 && plan.sched_len[i] == 1);
        CHECK(static_cast<int32_t>(s.blocks.size()) * config_.block_size >= s.computed + lookahead);  // reserved
      }
      if (plan.sched_sample[i] == 0) continue;
      std::vector<int32_t> drafts;
      if (lookahead > 0 && proposer) drafts = proposer(s.tokens, lookahead);
      CHECK(static_cast<int32_t>(drafts.size()) <= lookahead);
      int32_t accepted = 0;
      int32_t token = token_for(plan.sched_slots[i]);
      while (accepted < static_cast<int32_t>(drafts.size()) && token == drafts[static_cast<size_t>(accepted)]) {
        s.tokens.push_back(token);
        result.token_ids.push_back(token);
        result.logprobs.push_back(-0.25f);
        ++accepted;
        token = token_for(plan.sched_slots[i]);  // the target's next token given the accepted drafts
      }
      s.tokens.push_back(token);
      s.computed += accepted;  // the accepted drafts' KV was computed in this step
      result.slots.push_back(plan.sched_slots[i]);
      result.token_ids.push_back(token);
      result.logprobs.push_back(-0.5f);
      if (!plan.sched_lookahead.empty()) {
        result.token_counts.push_back(accepted + 1);
        result.num_proposed.push_back(static_cast<int32_t>(drafts.size()));
      }
    }
    return result;
  }

 private:
  struct Slot {
    bool live = false;
    std::vector<int32_t> tokens;
    std::vector<int32_t> blocks;
    int32_t computed = 0;
  };
  EngineConfig config_;
  std::vector<Slot> slots_;
};

struct Harness {
  EngineConfig config;
  Scheduler scheduler;
  FakeWorker worker;
  StepPlan plan;
  std::vector<RequestOutput> outputs;
  std::map<uint64_t, std::vector<int32_t>> tokens;  // request -> emitted tokens
  std::map<uint64_t, FinishReason> finished;
  int64_t now = 1000;

  explicit Harness(EngineConfig c) : config(c), scheduler(c), worker(c) {}

  bool add(const AddRequest& r) { return !scheduler.add_request(r, ++now).has_value(); }

  // One engine iteration; returns false when nothing was scheduled.
  bool step(const std::function<int32_t(int32_t)>& token_for = [](int32_t) { return 7; }) {
    const bool scheduled = scheduler.schedule(plan, ++now);
    if (scheduled) {
      const int32_t total = std::accumulate(plan.sched_len.begin(), plan.sched_len.end(), 0) +
                            std::accumulate(plan.sched_lookahead.begin(), plan.sched_lookahead.end(), 0);
      CHECK(total <= config.max_num_batched_tokens);
      CHECK(scheduler.num_running() <= config.max_num_seqs);
      for (int32_t s : plan.sched_slots) CHECK(s >= 0 && s < config.max_num_seqs);
      scheduler.update(worker.execute(plan, token_for), ++now);
    }
    collect();
    scheduler.check_invariants();
    return scheduled;
  }

  void collect() {
    scheduler.take_outputs(outputs);
    for (const RequestOutput& o : outputs) {
      CHECK(!finished.contains(o.request_id));  // nothing after the final output
      auto& t = tokens[o.request_id];
      t.insert(t.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (o.finish_reason != FinishReason::kNone) finished[o.request_id] = o.finish_reason;
    }
  }

  void run_to_completion(int max_steps = 10000) {
    while (scheduler.has_unfinished() && max_steps-- > 0) step();
    CHECK(!scheduler.has_unfinished());
  }
};

inline AddRequest prompt_of(uint64_t id, std::vector<int32_t> prompt, int32_t max_tokens) {
  AddRequest r;
  r.request_id = id;
  r.max_tokens = max_tokens;
  r.prompt_token_ids = std::move(prompt);
  return r;
}

inline std::vector<int32_t> iota_tokens(int32_t n, int32_t first = 100) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

inline const RequestOutput* final_output(const Harness& h, uint64_t id) {
  for (const RequestOutput& o : h.outputs) {
    if (o.request_id == id && o.finish_reason != FinishReason::kNone) return &o;
  }
  return nullptr;
}

// True when f() throws an E.
template <class E, class F>
bool throws(F&& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  }
  return false;
}

}  // namespace ringserve::scheduler_testing
