#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include <atomic>
#include <cstdlib>
#include <new>

#include "check.h"
#include "ringserve/scheduler.h"

using namespace ringserve;

// GCC flags malloc/free inside replaced operator new/delete as mismatched once inlined; they are a matched pair here.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Counts heap allocations so a test can prove the steady-state step does not allocate.
namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace {

constexpr int32_t kEos = 2;

EngineConfig make_config(int32_t num_blocks, int32_t max_seqs = 8, int32_t budget = 64, int32_t block_size = 4) {
  EngineConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = budget;
  c.eos_token_ids = {kEos};
  return c;
}

AddRequest make_request(uint64_t id, int32_t prompt_len, int32_t max_tokens) {
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

}  // namespace

TEST(long_prompts_are_chunked_within_the_budget) {
  Harness h(make_config(64, 8, 32));
  CHECK(h.add(make_request(1, 100, 3)));
  std::vector<int32_t> lens, starts, samples;
  for (int i = 0; i < 4; ++i) {
    CHECK(h.step());
    lens.push_back(h.plan.sched_len[0]);
    starts.push_back(h.plan.sched_start[0]);
    samples.push_back(h.plan.sched_sample[0]);
  }
  CHECK((lens == std::vector<int32_t>{32, 32, 32, 4}));
  CHECK((starts == std::vector<int32_t>{0, 32, 64, 96}));
  CHECK((samples == std::vector<int32_t>{0, 0, 0, 1}));
  CHECK(h.tokens[1].size() == 1);
  h.run_to_completion();
  CHECK(h.tokens[1].size() == 3 && h.finished[1] == FinishReason::kLength);
}

TEST(running_requests_are_served_before_new_prompts) {
  Harness h(make_config(64, 8, 16));
  CHECK(h.add(make_request(1, 4, 10)));
  CHECK(h.step());                         // prefill of 1, samples its first token
  CHECK(h.add(make_request(2, 40, 2)));
  CHECK(h.step());
  CHECK(h.plan.sched_len.size() == 2);
  CHECK(h.plan.sched_len[0] == 1);         // the decode of request 1 first
  CHECK(h.plan.sched_len[1] == 15);        // the rest of the budget chunks request 2's prompt
  CHECK(h.plan.new_requests.size() == 1 && h.plan.new_requests[0].token_ids.size() == 40);
}

TEST(max_num_seqs_caps_the_running_set_and_admission_is_fcfs) {
  Harness h(make_config(64, 2, 64));
  for (uint64_t id = 1; id <= 5; ++id) CHECK(h.add(make_request(id, 3, 2)));
  std::vector<uint64_t> first_token_order;
  while (h.scheduler.has_unfinished()) {
    h.step();
    for (const RequestOutput& o : h.outputs) {
      if (h.tokens[o.request_id].size() == 1 && !o.new_token_ids.empty()) first_token_order.push_back(o.request_id);
    }
  }
  CHECK((first_token_order == std::vector<uint64_t>{1, 2, 3, 4, 5}));
  CHECK(h.finished.size() == 5);
}

TEST(stop_rules_end_requests_with_the_right_reason) {
  Harness h(make_config(64));
  AddRequest eos = make_request(1, 3, 10);
  AddRequest ignore = make_request(2, 3, 4);
  ignore.ignore_eos = true;
  AddRequest stop_token = make_request(3, 3, 10);
  stop_token.stop_token_ids = {9};
  AddRequest length = make_request(4, 3, 2);
  for (const auto& r : {eos, ignore, stop_token, length}) CHECK(h.add(r));
  int step = 0;
  while (h.scheduler.has_unfinished()) {
    ++step;
    // Step 3 samples EOS for everybody, step 4 the stop token; other steps a plain token.
    h.step([&](int32_t) { return step == 3 ? kEos : step == 4 ? 9 : 7; });
  }
  CHECK(h.finished[1] == FinishReason::kStop && h.tokens[1].size() == 3 && h.tokens[1].back() == kEos);
  CHECK(h.finished[2] == FinishReason::kLength && h.tokens[2].size() == 4);  // EOS ignored
  CHECK(h.finished[3] == FinishReason::kStop && h.tokens[3].size() == 3);    // EOS also stops it
  CHECK(h.finished[4] == FinishReason::kLength && h.tokens[4].size() == 2);
  CHECK(h.scheduler.block_pool().num_free() == 64);
}

TEST(stop_token_ids_stop_requests) {
  Harness h(make_config(64));
  AddRequest r = make_request(1, 3, 10);
  r.stop_token_ids = {9};
  CHECK(h.add(r));
  int step = 0;
  while (h.scheduler.has_unfinished()) {
    ++step;
    h.step([&](int32_t) { return step == 2 ? 9 : 7; });
  }
  CHECK(h.finished[1] == FinishReason::kStop && (h.tokens[1] == std::vector<int32_t>{7, 9}));
}

TEST(requests_that_can_never_fit_are_rejected) {
  EngineConfig c = make_config(8);  // 32 tokens of KV
  c.max_model_len = 24;
  Scheduler s(c);
  auto too_long = s.add_request(make_request(1, 20, 10), 0);
  CHECK(too_long && too_long->status_code == kStatusResourceExhausted);
  CHECK(too_long->message.find("30 tokens") != std::string::npos);
  Scheduler roomy([&] {
    EngineConfig big = c;
    big.max_model_len = 1000;
    return big;
  }());
  auto no_kv = roomy.add_request(make_request(2, 30, 10), 0);
  CHECK(no_kv && no_kv->status_code == kStatusResourceExhausted && no_kv->message.find("40 tokens") != std::string::npos);
  auto empty = s.add_request(make_request(3, 0, 10), 0);
  CHECK(empty && empty->status_code == kStatusInvalidArgument);
  AddRequest negative = make_request(4, 3, 3);
  negative.prompt_token_ids[1] = -5;
  CHECK(s.add_request(negative, 0)->status_code == kStatusInvalidArgument);
  CHECK(!s.add_request(make_request(5, 3, 3), 0));
  CHECK(s.add_request(make_request(5, 3, 3), 0)->status_code == kStatusInvalidArgument);  // duplicate id
  CHECK(s.add_request(make_request(6, 3, 0), 0)->status_code == kStatusInvalidArgument);  // max_tokens 0
  s.check_invariants();
}

TEST(abort_frees_blocks_and_lists_the_slot_as_finished) {
  Harness h(make_config(32));
  CHECK(h.add(make_request(1, 10, 50)));
  CHECK(h.add(make_request(2, 10, 50)));
  CHECK(h.add(make_request(3, 10, 50)));
  h.step();
  h.step();
  const int32_t free_before = h.scheduler.block_pool().num_free();
  CHECK(h.scheduler.abort_request(2));
  CHECK(!h.scheduler.abort_request(2));  // unknown now
  CHECK(h.scheduler.block_pool().num_free() > free_before);
  h.collect();
  CHECK(h.finished[2] == FinishReason::kAbort);
  h.step();
  CHECK(h.plan.finished_slots.size() == 1);
  CHECK(h.scheduler.abort_request(1));
  CHECK(h.scheduler.abort_request(3));
  h.collect();
  CHECK(h.scheduler.block_pool().num_free() == 32 && !h.scheduler.has_unfinished());
  h.scheduler.check_invariants();
}

TEST(aborting_a_waiting_request_emits_abort) {
  Harness h(make_config(32, 1));
  CHECK(h.add(make_request(1, 4, 5)));
  CHECK(h.add(make_request(2, 4, 5)));
  h.step();
  CHECK(h.scheduler.num_waiting() == 1);
  CHECK(h.scheduler.abort_request(2));
  h.collect();
  CHECK(h.finished[2] == FinishReason::kAbort && h.tokens[2].empty());
  h.run_to_completion();
  CHECK(h.finished[1] == FinishReason::kLength);
}

TEST(running_out_of_blocks_preempts_the_latest_request_by_recompute) {
  // 6 blocks of 4 tokens: two requests that each need 5 blocks cannot both finish without preemption.
  Harness h(make_config(6, 4, 64));
  CHECK(h.add(make_request(1, 6, 14)));
  CHECK(h.add(make_request(2, 6, 14)));
  bool resent_with_outputs = false;
  int steps = 0;
  while (h.scheduler.has_unfinished() && steps++ < 1000) {
    h.step();
    for (const NewRequestData& nr : h.plan.new_requests) resent_with_outputs |= nr.token_ids.size() > 6;
  }
  CHECK(h.scheduler.num_preemptions() > 0);
  CHECK(resent_with_outputs);  // re-sent as a new request with prompt + generated tokens
  CHECK(h.finished[1] == FinishReason::kLength && h.tokens[1].size() == 14);
  CHECK(h.finished[2] == FinishReason::kLength && h.tokens[2].size() == 14);
  CHECK(h.scheduler.block_pool().num_free() == 6);
}

TEST(random_workloads_finish_every_request_and_return_every_block) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    const int32_t num_blocks = 8 + static_cast<int32_t>(rng() % 40);
    Harness h(make_config(num_blocks, 1 + static_cast<int32_t>(rng() % 6), 8 + static_cast<int32_t>(rng() % 60)));
    std::set<uint64_t> accepted;
    uint64_t next_id = 1;
    for (int iter = 0; iter < 400 || h.scheduler.has_unfinished(); ++iter) {
      CHECK(iter < 100000);
      if (iter >= 100000) break;
      if (iter < 400 && rng() % 3 == 0) {
        const auto prompt = 1 + static_cast<int32_t>(rng() % 40);
        const auto max_tokens = 1 + static_cast<int32_t>(rng() % 30);
        if (h.add(make_request(next_id, prompt, max_tokens))) accepted.insert(next_id);
        ++next_id;
      }
      if (iter < 400 && rng() % 25 == 0 && next_id > 1) h.scheduler.abort_request(1 + rng() % (next_id - 1));
      h.step([&](int32_t) { return rng() % 20 == 0 ? kEos : 5 + static_cast<int32_t>(rng() % 50); });
    }
    CHECK(h.finished.size() == accepted.size());
    for (uint64_t id : accepted) CHECK(h.finished.contains(id));
    CHECK(h.scheduler.block_pool().num_free() == num_blocks);
    h.scheduler.check_invariants();
  }
}

AddRequest prompt_of(uint64_t id, std::vector<int32_t> prompt, int32_t max_tokens) {
  AddRequest r;
  r.request_id = id;
  r.max_tokens = max_tokens;
  r.prompt_token_ids = std::move(prompt);
  return r;
}

std::vector<int32_t> iota_tokens(int32_t n, int32_t first = 100) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

const RequestOutput* final_output(const Harness& h, uint64_t id) {
  for (const RequestOutput& o : h.outputs) {
    if (o.request_id == id && o.finish_reason != FinishReason::kNone) return &o;
  }
  return nullptr;
}

TEST(a_request_sharing_a_prefix_reuses_the_cached_blocks) {
  Harness h(make_config(64, 8, 64));  // block size 4
  CHECK(h.add(prompt_of(1, iota_tokens(40), 3)));
  h.run_to_completion();
  CHECK(h.scheduler.block_pool().num_cached() >= 10);  // the finished request's full blocks stay cached
  std::vector<int32_t> second = iota_tokens(40);
  second.insert(second.end(), {7, 7, 7, 7, 7, 7});
  CHECK(h.add(prompt_of(2, second, 2)));
  CHECK(h.step());
  CHECK(h.plan.new_requests.size() == 1);
  const NewRequestData& nr = h.plan.new_requests[0];
  CHECK(nr.num_computed_tokens == 40 && h.plan.sched_start[0] == 40 && h.plan.sched_len[0] == 6);
  CHECK(nr.num_prompt_tokens == 46);
  h.run_to_completion();
  const RequestOutput* o = final_output(h, 2);
  CHECK(o != nullptr && o->num_cached_tokens == 40);
  const EngineStats st = h.scheduler.stats(0);
  CHECK(st.prefix_cache_hits == 40 && st.prefix_cache_queries == 86);
}

TEST(a_fully_cached_prompt_still_computes_its_last_token) {
  Harness h(make_config(64, 8, 64));
  CHECK(h.add(prompt_of(1, iota_tokens(40), 2)));
  h.run_to_completion();
  CHECK(h.add(prompt_of(2, iota_tokens(40), 2)));
  CHECK(h.step());
  // 40 tokens = 10 full blocks, but only 9 may be reused: the block holding the last prompt token is recomputed.
  CHECK(h.plan.new_requests[0].num_computed_tokens == 36 && h.plan.sched_len[0] == 4 && h.plan.sched_sample[0] == 1);
  h.run_to_completion();
  CHECK(final_output(h, 2)->num_cached_tokens == 36);
}

TEST(running_requests_share_blocks_with_reference_counts) {
  Harness h(make_config(64, 8, 64));
  CHECK(h.add(prompt_of(1, iota_tokens(17), 20)));
  CHECK(h.step());  // request 1's prompt is computed: its 4 full blocks are cached
  CHECK(h.add(prompt_of(2, iota_tokens(17), 20)));
  CHECK(h.step());
  const std::vector<int32_t>& shared = h.plan.new_requests[0].block_ids;
  for (size_t j = 0; j < 4; ++j) CHECK(h.scheduler.block_pool().ref_count(shared[j]) == 2);
  h.run_to_completion();
  CHECK(h.scheduler.block_pool().num_free() == 64);
}

TEST(cache_salt_separates_equal_prompts) {
  Harness h(make_config(64, 8, 64));
  AddRequest a = prompt_of(1, iota_tokens(20), 2);
  a.cache_salt = 1;
  CHECK(h.add(a));
  h.run_to_completion();
  AddRequest b = prompt_of(2, iota_tokens(20), 2);
  b.cache_salt = 2;
  CHECK(h.add(b));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 0);
  h.run_to_completion();
  AddRequest c = prompt_of(3, iota_tokens(20), 2);
  c.cache_salt = 1;
  CHECK(h.add(c));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 16);
}

TEST(prefix_caching_can_be_turned_off) {
  EngineConfig c = make_config(64, 8, 64);
  c.enable_prefix_caching = false;
  Harness h(c);
  CHECK(h.add(prompt_of(1, iota_tokens(20), 2)));
  h.run_to_completion();
  CHECK(h.add(prompt_of(2, iota_tokens(20), 2)));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 0);
  CHECK(h.scheduler.block_pool().num_cached() == 0 && h.scheduler.stats(0).prefix_cache_queries == 0);
}

TEST(long_prefill_token_threshold_caps_a_requests_chunk) {
  EngineConfig c = make_config(64, 8, 64);
  c.long_prefill_token_threshold = 8;
  Harness h(c);
  CHECK(h.add(prompt_of(1, iota_tokens(30), 2)));
  CHECK(h.add(prompt_of(2, iota_tokens(5, 900), 2)));
  CHECK(h.step());
  CHECK((h.plan.sched_len == std::vector<int32_t>{8, 5}));  // both fit the 64-token budget in one step
  std::vector<int32_t> chunks{8};
  for (int i = 0; i < 3; ++i) {
    CHECK(h.step());
    chunks.push_back(h.plan.sched_len[0]);  // request 1 runs first: it arrived first
  }
  CHECK((chunks == std::vector<int32_t>{8, 8, 8, 6}));
}

TEST(step_cost_model_learns_the_base_and_what_prefill_adds) {
  StepCostModel m;
  auto cost = [](int32_t tokens, double pairs) { return int64_t{80'000} + int64_t{1'000} * tokens + int64_t(2 * pairs); };
  m.observe({.decode_rows = 0, .prefill_tokens = 50, .prefill_pairs = 2'500}, cost(50, 2'500));  // kept for later
  for (int i = 0; i < 10; ++i) m.observe({.decode_rows = 8}, 80'000 + (i == 3 ? 900'000 : 0));  // one slow step
  CHECK(m.fitted() && m.base_ns() == 80'000);  // the median ignores the slow step
  CHECK(std::abs(m.per_token_ns() - 1'100) < 1e-6 && m.per_pair_ns() == 0);  // one shape: tokens alone
  for (const int32_t chunk : {20, 50, 100}) {
    for (const int32_t start : {0, 200, 500}) {
      const double pairs = attention_pairs(start, chunk);
      m.observe({.decode_rows = 8, .prefill_tokens = chunk, .prefill_pairs = pairs}, cost(chunk, pairs));
    }
  }
  CHECK(std::abs(m.per_token_ns() - 1'000) < 1e-3 && std::abs(m.per_pair_ns() - 2) < 1e-6);
  // 50 tokens from the start: 50 us + 2 ns x 50 x 50; deeper into the prompt the same time buys fewer tokens.
  CHECK(m.max_tokens_within(0, 55'000) == 50 && m.max_tokens_within(0, 54'999) == 49);
  const int32_t deep = m.max_tokens_within(500, 55'000);
  CHECK(deep == 26 && m.row_ns(500, deep) <= 55'000 && m.row_ns(500, deep + 1) > 55'000);
  CHECK(m.max_tokens_within(0, 0) == 0 && m.max_tokens_within(0, -5) == 0);
  // The prefill window survives a long stretch of decoding; the base follows the machine.
  for (int i = 0; i < 1000; ++i) m.observe({.decode_rows = 8}, 90'000);
  CHECK(m.fitted() && m.base_ns() == 90'000 && std::abs(m.per_pair_ns() - 2) < 0.5);
  // Ignored: empty steps and clock glitches.
  m.observe({}, 5);
  m.observe({.decode_rows = 8}, -1);
  CHECK(m.base_ns() == 90'000);
  // Without a base (too few decode-only steps) there is no estimate.
  StepCostModel young;
  young.observe({.decode_rows = 0, .prefill_tokens = 50, .prefill_pairs = 2'500}, 200'000);
  young.observe({.decode_rows = 2}, 80'000);
  young.observe({.decode_rows = 2}, 80'000);
  CHECK(!young.fitted() && young.max_tokens_within(0, 1e9) == 0);
  young.observe({.decode_rows = 2}, 80'000);
  CHECK(young.fitted());
  // Prefill that seems to cost nothing (or less than nothing) gives no estimate.
  StepCostModel free_prefill;
  for (int i = 0; i < 4; ++i) free_prefill.observe({.decode_rows = 4}, 100'000);
  free_prefill.observe({.decode_rows = 4, .prefill_tokens = 64, .prefill_pairs = 4'096}, 90'000);
  CHECK(!free_prefill.fitted());
}

TEST(step_cost_model_learns_what_each_decode_row_costs_from_the_steps_that_prefill) {
  // Decode-only steps were seen with one request running; then, under load, only steps that also prefill.
  StepCostModel m;
  auto cost = [](int32_t decodes, int32_t tokens) { return int64_t{50'000} + 2'000 * decodes + 1'000 * tokens; };
  for (int i = 0; i < 5; ++i) m.observe({.decode_rows = 1}, cost(1, 0));
  for (int i = 0; i < 20; ++i) {
    const int32_t decodes = 8 + (i * 7) % 41;
    const int32_t tokens = 16 + (i * 13) % 64;
    m.observe({.decode_rows = decodes, .prefill_tokens = tokens, .prefill_pairs = 1.0 * tokens * tokens,
               .prefill_context = 1.0 * tokens},
              cost(decodes, tokens));
  }
  CHECK(m.fitted() && m.base_ns() == 52'000 && m.base_decode_rows() == 1);
  CHECK(std::abs(m.per_decode_ns() - 2'000) < 1e-3 && std::abs(m.per_token_ns() - 1'000) < 1e-3);
  CHECK(m.per_pair_ns() < 1e-6 && m.per_context_ns() < 1e-3);
  CHECK(std::abs(m.base_ns(48) - cost(48, 0)) < 1);
  CHECK(m.base_ns(0) > 0);
  // Decode rows that never vary determine no decode term; it stays 0 (a steady batch: the model as without it).
  StepCostModel steady;
  for (int i = 0; i < 5; ++i) steady.observe({.decode_rows = 8}, cost(8, 0));
  for (int i = 0; i < 5; ++i) {
    steady.observe({.decode_rows = 8, .prefill_tokens = 10 * (i + 1), .prefill_pairs = 1.0, .prefill_context = 1.0},
                   cost(8, 10 * (i + 1)));
  }
  CHECK(steady.fitted() && steady.per_decode_ns() == 0 && steady.base_ns(40) == steady.base_ns());
}

TEST(step_cost_model_learns_what_a_rows_context_costs) {
  StepCostModel m;
  for (int i = 0; i < 4; ++i) m.observe({.decode_rows = 8}, 80'000);
  auto cost = [](int32_t tokens, double pairs, double context) {
    return int64_t{80'000} + int64_t{1'000} * tokens + static_cast<int64_t>(2 * pairs + 50 * context);
  };
  for (const int32_t chunk : {20, 50, 100}) {
    for (const int32_t start : {0, 200, 500, 1'500}) {
      const double pairs = attention_pairs(start, chunk);
      const double context = start + chunk;
      m.observe({.decode_rows = 8, .prefill_tokens = chunk, .prefill_pairs = pairs, .prefill_context = context},
                cost(chunk, pairs, context));
    }
  }
  CHECK(m.fitted() && std::abs(m.per_context_ns() - 50) < 1e-3);
  CHECK(std::abs(m.per_token_ns() - 1'000) < 1e-2 && std::abs(m.per_pair_ns() - 2) < 1e-5);
  // Deep into a prompt, the context alone can use up the time: 1,500 x 50 ns = 75 us of 80.
  const int32_t deep = m.max_tokens_within(1'500, 80'000);
  CHECK(deep > 0 && m.row_ns(1'500, deep) <= 80'000 && m.row_ns(1'500, deep + 1) > 80'000);
  CHECK(m.max_tokens_within(2'000, 80'000) == 0);
  // A context term that comes out negative (here: none in the data, and noise against it) is left out.
  StepCostModel plain;
  for (int i = 0; i < 4; ++i) plain.observe({.decode_rows = 8}, 80'000);
  for (const int32_t chunk : {20, 50, 100}) {
    for (const int32_t start : {0, 200, 500}) {
      const double pairs = attention_pairs(start, chunk);
      plain.observe({.decode_rows = 8, .prefill_tokens = chunk, .prefill_pairs = pairs, .prefill_context = 1.0 * start},
                    80'000 + 1'000 * chunk + static_cast<int64_t>(2 * pairs) - 10 * start);
    }
  }
  CHECK(plain.fitted() && plain.per_context_ns() == 0 && plain.per_token_ns() > 0);
}

namespace {

// Runs steps through the harness and tells the scheduler each one's time by a known cost: a fixed part, plus per
// prefill token, per prefill attention pair and per context token of prefill rows (decodes add nothing).
struct TimedHarness : Harness {
  double fixed_ns;
  double per_token_ns;
  double per_pair_ns;
  double per_context_ns = 0;
  double per_decode_ns = 0;  // per one-token row
  double last_ns = 0;  // the last timed step's cost
  double last_decode_ns = 0;  // what a step of only its decodes would have cost
  TimedHarness(EngineConfig c, double fixed, double per_token, double per_pair)
      : Harness(c), fixed_ns(fixed), per_token_ns(per_token), per_pair_ns(per_pair) {}

  std::vector<int32_t> timed_step() {
    const double budget = scheduler.prefill_time_budget();
    const StepCostModel model = scheduler.step_cost();
    if (!step()) return {};
    double true_ns = fixed_ns;
    double prefill_ns = 0;
    int prefill_rows = 0;
    int32_t prefill_tokens = 0;
    for (size_t i = 0; i < plan.sched_len.size(); ++i) {
      if (plan.sched_len[i] <= 1) {
        true_ns += per_decode_ns;
        continue;
      }
      ++prefill_rows;
      prefill_tokens += plan.sched_len[i];
      true_ns += per_token_ns * plan.sched_len[i] + per_pair_ns * attention_pairs(plan.sched_start[i], plan.sched_len[i]) +
                 per_context_ns * (plan.sched_start[i] + plan.sched_len[i]);
      if (model.fitted()) prefill_ns += model.row_ns(plan.sched_start[i], plan.sched_len[i]);
    }
    // The guard's promise: prefill rows within its time budget, or one row of at most a quarter block (progress).
    CHECK(prefill_ns <= budget * (1 + 1e-9) ||
          (prefill_rows == 1 && prefill_tokens <= std::max(1, config.block_size / 4)));
    last_ns = true_ns;
    last_decode_ns = fixed_ns + per_decode_ns * static_cast<double>(plan.sched_len.size() - prefill_rows);
    scheduler.observe_step_time(static_cast<int64_t>(true_ns));
    return plan.sched_len;
  }

  // Two short requests decode; then a long prompt arrives: the chunks it gets while they keep decoding.
  std::vector<int32_t> chunks_of_a_long_prompt(int32_t prompt_len) {
    CHECK(add(prompt_of(1, iota_tokens(20), 400)));
    CHECK(add(prompt_of(2, iota_tokens(30, 500), 400)));
    CHECK((timed_step() == std::vector<int32_t>{20, 30}));  // nothing decodes yet: no guard
    for (int i = 0; i < 6; ++i) CHECK((timed_step() == std::vector<int32_t>{1, 1}));
    CHECK(add(prompt_of(3, iota_tokens(prompt_len, 1000), 4)));
    std::vector<int32_t> chunks;
    while (chunks.empty() || plan.sched_sample.back() == 0) {
      const std::vector<int32_t> lens = timed_step();
      CHECK(lens.size() == 3 && lens[0] == 1 && lens[1] == 1);  // the decodes run in every step
      chunks.push_back(lens[2]);
    }
    CHECK(std::accumulate(chunks.begin(), chunks.end(), 0) == prompt_len);
    run_to_completion();
    CHECK(tokens[3].size() == 4 && scheduler.block_pool().num_free() == config.num_blocks);
    return chunks;
  }
};

EngineConfig guarded_config(float slowdown) {
  EngineConfig c = make_config(512, 8, 256);
  c.max_step_slowdown = slowdown;
  return c;
}

}  // namespace

TEST(decode_latency_guard_cuts_prefill_chunks_while_requests_decode) {
  // Unguarded: the budget less the two decodes.
  CHECK((TimedHarness(guarded_config(0.0f), 80'000, 1'000, 0).chunks_of_a_long_prompt(600) ==
         std::vector<int32_t>{254, 254, 92}));
  // Guarded at 2x: a step may add what a decode-only step costs, 80 us = 80 prompt tokens.
  const std::vector<int32_t> guarded = TimedHarness(guarded_config(2.0f), 80'000, 1'000, 0).chunks_of_a_long_prompt(600);
  CHECK(guarded.size() == 8 && guarded.front() == 80 && guarded.back() == 600 - 7 * 80);
  // At 3x, twice that.
  const std::vector<int32_t> looser = TimedHarness(guarded_config(3.0f), 80'000, 1'000, 0).chunks_of_a_long_prompt(600);
  CHECK(looser.size() == 4 && looser.front() == 160);
}

TEST(the_guard_keeps_steps_within_the_slowdown_when_a_rows_context_costs) {
  // Decode-only steps take 80 us; a prefill row also pays 20 ns per context token (reading its KV once per layer).
  TimedHarness h(guarded_config(2.0f), 80'000, 1'000, 1);
  h.per_context_ns = 20;
  CHECK(h.add(prompt_of(1, iota_tokens(20), 600)));
  CHECK(h.add(prompt_of(2, iota_tokens(30, 500), 600)));
  for (int i = 0; i < 7; ++i) CHECK(!h.timed_step().empty());
  CHECK(h.add(prompt_of(3, iota_tokens(1'200, 1000), 4)));
  int guarded_steps = 0;
  int over = 0;
  while (h.plan.sched_sample.empty() || h.plan.sched_sample.back() == 0 || guarded_steps == 0) {
    const std::vector<int32_t> lens = h.timed_step();
    CHECK(lens.size() == 3);
    ++guarded_steps;
    // Once the model has seen a few such steps, a step stays within 2 x 80 us (or is the guaranteed quarter block).
    if (guarded_steps > 8 && h.last_ns > 160'000 * 1.001 && lens[2] > std::max(1, h.config.block_size / 4)) ++over;
  }
  CHECK(over == 0 && guarded_steps > 10);
  CHECK(std::abs(h.scheduler.step_cost().per_context_ns() - 20) < 1);
  h.run_to_completion();
}

TEST(under_load_the_guard_charges_decodes_to_the_decodes_and_the_waiting_prompts_keep_flowing) {
  // One request decodes alone (the decode-only steps the base is learnt from), then 30 prompts arrive at once and
  // every later step prefills beside a growing batch: each decode row costs 4 us on top of a 50 us step.
  EngineConfig config = make_config(1'024, 64, 512, 16);
  config.max_step_slowdown = 2.0f;
  TimedHarness h(config, 50'000, 1'000, 0);
  h.per_decode_ns = 4'000;
  CHECK(h.add(prompt_of(1, iota_tokens(8), 400)));
  for (int i = 0; i < 8; ++i) CHECK(!h.timed_step().empty());
  for (uint64_t id = 2; id <= 48; ++id) CHECK(h.add(prompt_of(id, iota_tokens(64, 100 * static_cast<int32_t>(id)), 50)));
  int steps = 0;
  int over = 0;
  while (h.tokens.size() < 48) {
    CHECK(!h.timed_step().empty());
    ++steps;
    // The guard's promise, against the true cost: at most 2x what the step's decodes alone take (after a few steps
    // to learn the decode term), unless the step is the guaranteed minimum of prefill.
    if (steps > 6 && h.last_ns > 2 * h.last_decode_ns * 1.001) ++over;
  }
  // 3,008 prompt tokens, 26 steps: a step may add what its decodes take, 54 us with one, 100+ us with a dozen. When
  // the decodes' growth was charged to the prefill tokens beside them (no decode term), this took 161 steps.
  CHECK(steps <= 40);
  CHECK(over == 0);
  // Within 1%: a one-token prompt row here counts as a decode (the scheduler counts it as prefill).
  CHECK(std::abs(h.scheduler.step_cost().per_decode_ns() - 4'000) < 40);
  h.run_to_completion();
}

TEST(prompts_arriving_together_share_the_guards_time) {
  TimedHarness h(guarded_config(2.0f), 80'000, 1'000, 0);
  CHECK(h.add(prompt_of(1, iota_tokens(20), 100)));
  CHECK(h.add(prompt_of(2, iota_tokens(30, 500), 100)));
  for (int i = 0; i < 6; ++i) CHECK(!h.timed_step().empty());
  CHECK(h.add(prompt_of(3, iota_tokens(100, 1000), 2)));
  CHECK(h.add(prompt_of(4, iota_tokens(100, 2000), 2)));
  CHECK((h.timed_step() == std::vector<int32_t>{1, 1, 80}));  // the first prompt takes all 80 tokens' worth
  CHECK((h.timed_step() == std::vector<int32_t>{1, 1, 20, 60}));  // its rest, then the second one in what is left
  h.run_to_completion();
  CHECK(h.tokens[3].size() == 2 && h.tokens[4].size() == 2);
}

TEST(the_guard_gives_smaller_chunks_deeper_into_a_prompt_when_attention_costs) {
  TimedHarness h(guarded_config(2.0f), 80'000, 1'000, 5);
  const std::vector<int32_t> chunks = h.chunks_of_a_long_prompt(1000);
  CHECK(chunks.size() > 10 && chunks.front() > 2 * chunks[chunks.size() - 2]);
  for (size_t i = 1; i + 1 < chunks.size(); ++i) CHECK(chunks[i] <= chunks[i - 1]);
}

TEST(the_guard_always_leaves_a_quarter_block_of_prefill_and_stays_off_without_decodes) {
  // No slowdown allowed: still a quarter of a block of prompt per step (blocks of 16 here: 4 tokens).
  EngineConfig config = make_config(512, 8, 256, 16);
  config.max_step_slowdown = 1.0f;
  TimedHarness h(config, 50'000, 2'000, 0);
  CHECK(h.add(prompt_of(1, iota_tokens(20), 100)));
  for (int i = 0; i < 5; ++i) CHECK(!h.timed_step().empty());
  CHECK(h.scheduler.step_cost().fitted() && h.scheduler.prefill_time_budget() == 0);
  CHECK(h.add(prompt_of(2, iota_tokens(40, 300), 2)));
  CHECK((h.timed_step() == std::vector<int32_t>{1, 4}));
  CHECK((h.timed_step() == std::vector<int32_t>{1, 4}));
  h.run_to_completion();
  CHECK(h.tokens[2].size() == 2);
  // Once nothing decodes, a prompt gets the whole budget again.
  CHECK(h.add(prompt_of(3, iota_tokens(200, 600), 2)));
  CHECK((h.timed_step() == std::vector<int32_t>{200}));
  h.run_to_completion();
}

TEST(prefill_chunks_report_progress_without_tokens) {
  Harness h(make_config(64, 8, 16));
  CHECK(h.add(prompt_of(1, iota_tokens(40), 2)));
  CHECK(h.step());
  CHECK(h.outputs.size() == 1 && h.outputs[0].new_token_ids.empty());
  CHECK(h.outputs[0].num_scheduled_tokens == 16 && h.outputs[0].num_computed_tokens == 16);
  CHECK(h.outputs[0].finish_reason == FinishReason::kNone);
  h.step();
  h.step();
  CHECK(h.outputs.size() == 1 && h.outputs[0].new_token_ids.size() == 1 && h.outputs[0].num_computed_tokens == 40);
  CHECK(h.outputs[0].num_scheduled_tokens == 8);
}

TEST(lower_priority_value_runs_first_and_fcfs_within_a_priority) {
  Harness h(make_config(64, 1, 64));
  AddRequest low = make_request(1, 3, 2);
  low.priority = 5;
  AddRequest high_a = make_request(2, 3, 2);
  AddRequest high_b = make_request(3, 3, 2);
  for (const auto& r : {low, high_a, high_b}) CHECK(h.add(r));
  std::vector<uint64_t> order;
  while (h.scheduler.has_unfinished()) {
    h.step();
    for (const RequestOutput& o : h.outputs) {
      if (o.finish_reason != FinishReason::kNone) order.push_back(o.request_id);
    }
  }
  CHECK((order == std::vector<uint64_t>{2, 3, 1}));
}

namespace {

// Steps 1 ms apart; before each step a new priority-0 request (3-token prompt, 2 tokens) arrives, so better work never
// runs out. Returns the step in which request `low` finished, or -1 if it was still unfinished after `steps` steps.
int serve_low_priority_under_a_stream(Harness& h, uint64_t low, int steps) {
  constexpr int64_t kMs = 1'000'000;
  for (int step = 0; step < steps; ++step) {
    h.now += kMs;
    CHECK(h.add(make_request(1000 + static_cast<uint64_t>(step), 3, 2)));
    h.step();
    if (h.finished.contains(low)) return step;
  }
  return -1;
}

}  // namespace

TEST(without_aging_a_stream_of_better_requests_starves_a_low_priority_one) {
  Harness h(make_config(256, 1, 64));
  AddRequest low = make_request(1, 3, 2);
  low.priority = 3;
  CHECK(h.add(low));
  CHECK(serve_low_priority_under_a_stream(h, 1, 300) == -1);
  CHECK(h.scheduler.num_waiting() > 100);  // the better ones pile up too: the stream outpaces one seat
}

TEST(aging_serves_a_low_priority_request_despite_a_stream_of_better_ones) {
  EngineConfig c = make_config(256, 1, 64);
  c.priority_aging_ms = 10;
  Harness h(c);
  AddRequest low = make_request(1, 3, 2);
  low.priority = 3;
  CHECK(h.add(low));
  // Its effective priority reaches 0 after 3 x 10 ms: only the ~30 better requests that arrived before then run
  // first (two steps each), every later one waits behind it.
  const int finished_at = serve_low_priority_under_a_stream(h, 1, 300);
  CHECK(finished_at > 0 && finished_at <= 2 * 30 + 4);
  CHECK(h.finished[1] == FinishReason::kLength && h.tokens[1].size() == 2);
}

TEST(aging_lets_better_requests_overtake_only_within_the_priority_gap) {
  EngineConfig c = make_config(256, 1, 64);
  c.priority_aging_ms = 10;
  Harness h(c);
  constexpr int64_t kMs = 1'000'000;
  auto add_at = [&](uint64_t id, int32_t priority, int64_t at_ms) {
    AddRequest r = make_request(id, 3, 2);
    r.priority = priority;
    h.now = at_ms * kMs - 1;  // add() advances the clock by one tick
    CHECK(h.add(r));
  };
  add_at(1, 0, 0);   // holds the only seat while the others queue
  add_at(2, 2, 1);   // effective rank 2 x 10 + 1 = 21 ms
  add_at(3, 0, 15);  // arrived within the gap: overtakes request 2
  add_at(4, 0, 25);  // arrived after it: waits behind request 2
  add_at(5, 2, 26);  // same priority as request 2, later: FCFS
  std::vector<uint64_t> order;
  while (h.scheduler.has_unfinished()) {
    h.step();
    for (const RequestOutput& o : h.outputs) {
      if (o.finish_reason != FinishReason::kNone) order.push_back(o.request_id);
    }
  }
  CHECK((order == std::vector<uint64_t>{1, 3, 2, 4, 5}));
}

TEST(preemption_picks_the_lowest_priority_latest_arrival) {
  // 12 blocks of 4 tokens; three requests grow until someone must yield.
  Harness h(make_config(12, 4, 64));
  AddRequest a = make_request(1, 8, 14);
  AddRequest b = make_request(2, 8, 14);
  b.priority = 1;  // lowest priority: the first victim although it arrived before c
  AddRequest c = make_request(3, 8, 14);
  for (const auto& r : {a, b, c}) CHECK(h.add(r));
  std::map<uint64_t, uint32_t> preemptions;
  int steps = 0;
  while (h.scheduler.has_unfinished() && steps++ < 1000) {
    h.step();
    for (const RequestOutput& o : h.outputs) preemptions[o.request_id] = std::max(preemptions[o.request_id], o.num_preemptions);
    if (h.scheduler.num_preemptions() == 1) {
      CHECK(preemptions[1] == 0 && preemptions[3] == 0);
    }
  }
  CHECK(h.scheduler.num_preemptions() > 0 && preemptions[1] == 0);
  for (uint64_t id = 1; id <= 3; ++id) CHECK(h.finished[id] == FinishReason::kLength && h.tokens[id].size() == 14);
  CHECK(h.scheduler.block_pool().num_free() == 12);
}

TEST(preempted_requests_resume_with_unchanged_output) {
  // Deterministic tokens (last token + 1): the output of a preempted request must equal an unconstrained run.
  auto run = [](int32_t num_blocks) {
    Harness h(make_config(num_blocks, 4, 64));
    for (uint64_t id = 1; id <= 3; ++id) CHECK(h.add(make_request(id, 6 + static_cast<int32_t>(id), 16)));
    int steps = 0;
    while (h.scheduler.has_unfinished() && steps++ < 2000) {
      h.step([&](int32_t slot) {  // a function of every token the worker holds for the slot, like a model
        const auto& t = h.worker.tokens_of(slot);
        return 10 + std::accumulate(t.begin(), t.end(), 0) % 997;
      });
    }
    return std::make_pair(h.tokens, h.scheduler.num_preemptions());
  };
  const auto [roomy, roomy_preemptions] = run(64);
  const auto [tight, tight_preemptions] = run(9);
  CHECK(roomy_preemptions == 0 && tight_preemptions > 0);
  CHECK(roomy == tight);
}

TEST(min_tokens_defers_eos) {
  Harness h(make_config(64));
  AddRequest r = make_request(1, 3, 10);
  r.sampling.min_tokens = 3;
  CHECK(h.add(r));
  h.run_to_completion();  // the worker below always answers EOS
  Harness g(make_config(64));
  CHECK(g.add(r));
  while (g.scheduler.has_unfinished()) g.step([](int32_t) { return kEos; });
  CHECK(g.finished[1] == FinishReason::kStop && g.tokens[1].size() == 3);
}

TEST(steady_state_decode_steps_do_not_allocate) {
  EngineConfig c = make_config(512, 16, 256, 16);
  Scheduler s(c);
  for (uint64_t id = 0; id < 16; ++id) {
    AddRequest r = make_request(id, 20 + static_cast<int32_t>(id), 400);
    r.prompt_token_ids[0] = static_cast<int32_t>(id);  // distinct prompts
    r.ignore_eos = true;
    CHECK(!s.add_request(r, 0));
  }
  StepPlan plan;
  StepResult result;
  auto one_step = [&](bool count) -> int64_t {
    int64_t allocations = 0;
    const int64_t before = g_allocations.load();
    CHECK(s.schedule(plan, 0));
    allocations += g_allocations.load() - before;
    result.step_id = plan.step_id;
    result.slots.clear();
    result.token_ids.clear();
    result.logprobs.clear();
    for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
      if (!plan.sched_sample[i]) continue;
      result.slots.push_back(plan.sched_slots[i]);
      result.token_ids.push_back(7);
      result.logprobs.push_back(-1.0f);
    }
    const int64_t mid = g_allocations.load();
    s.update(result, 0);
    s.clear_outputs();
    allocations += g_allocations.load() - mid;
    return count ? allocations : 0;
  };
  for (int i = 0; i < 64; ++i) one_step(false);  // prefill, then decode until every buffer reached its high water
  int64_t allocations = 0;
  for (int i = 0; i < 200; ++i) allocations += one_step(true);  // crosses many block boundaries
  CHECK(allocations == 0);
  s.check_invariants();
}

TEST(a_result_that_does_not_match_the_plan_is_rejected_and_changes_nothing) {
  Scheduler s(make_config(64));
  CHECK(!s.add_request(make_request(1, 3, 4), 0) && !s.add_request(make_request(2, 5, 4), 0));
  StepPlan plan;
  CHECK(s.schedule(plan, 0) && plan.sched_slots.size() == 2);
  const int32_t a = plan.sched_slots[0];
  const int32_t b = plan.sched_slots[1];
  const uint64_t step = plan.step_id;
  CHECK_THROWS(std::runtime_error, s.update(StepResult{step + 1, {a, b}, {7, 8}, {0.0f, 0.0f}}, 0));  // wrong step
  CHECK_THROWS(std::runtime_error, s.update(StepResult{step, {a}, {7}, {0.0f}}, 0));                // a row missing
  CHECK_THROWS(std::runtime_error, s.update(StepResult{step, {a, a}, {7, 8}, {0.0f, 0.0f}}, 0));    // repeated
  CHECK_THROWS(std::runtime_error, s.update(StepResult{step, {a, 5}, {7, 8}, {0.0f, 0.0f}}, 0));    // not sampled
  CHECK_THROWS(std::runtime_error, s.update(StepResult{step, {a, -1}, {7, 8}, {0.0f, 0.0f}}, 0));   // out of range
  std::vector<RequestOutput> out;
  s.take_outputs(out);
  CHECK(out.empty());
  s.update(StepResult{step, {b, a}, {8, 7}, {0.0f, 0.0f}}, 0);  // any row order
  s.take_outputs(out);
  CHECK(out.size() == 2 && out[0].request_id == 1 && out[0].new_token_ids == std::vector<int32_t>{7});
  CHECK(out[1].request_id == 2 && out[1].new_token_ids == std::vector<int32_t>{8});
  s.check_invariants();
}

TEST(rows_of_a_mixed_step_in_any_order_reach_their_requests) {
  // Entries that sample on both sides of a prefill chunk that does not: rows are matched to the sampled ones only.
  EngineConfig c = make_config(64, 8, 20);
  c.long_prefill_token_threshold = 8;
  for (const bool reversed : {false, true}) {
    Scheduler s(c);
    CHECK(!s.add_request(make_request(1, 3, 4), 0) && !s.add_request(make_request(2, 30, 4), 0) &&
          !s.add_request(make_request(3, 2, 4), 0));
    StepPlan plan;
    CHECK(s.schedule(plan, 0));
    CHECK((plan.sched_len == std::vector<int32_t>{3, 8, 2}));
    CHECK((plan.sched_sample == std::vector<uint8_t>{1, 0, 1}));
    const int32_t first = plan.sched_slots[0];
    const int32_t last = plan.sched_slots[2];
    StepResult result = reversed ? StepResult{plan.step_id, {last, first}, {9, 7}, {-0.9f, -0.7f}}
                                 : StepResult{plan.step_id, {first, last}, {7, 9}, {-0.7f, -0.9f}};
    s.update(result, 0);
    std::vector<RequestOutput> out;
    s.take_outputs(out);
    CHECK(out.size() == 3);
    CHECK(out[0].request_id == 1 && out[0].new_token_ids == std::vector<int32_t>{7} && out[0].logprobs[0] == -0.7f);
    CHECK(out[1].request_id == 2 && out[1].new_token_ids.empty() && out[1].num_computed_tokens == 8);
    CHECK(out[2].request_id == 3 && out[2].new_token_ids == std::vector<int32_t>{9} && out[2].logprobs[0] == -0.9f);
    s.check_invariants();
  }
}

TEST(top_logprobs_reach_each_output_up_to_its_own_num_logprobs) {
  Scheduler s(make_config(64));
  AddRequest wants_two = make_request(1, 3, 1);
  wants_two.sampling.num_logprobs = 2;
  AddRequest wants_none = make_request(2, 5, 1);
  CHECK(!s.add_request(wants_two, 0) && !s.add_request(wants_none, 0));
  StepPlan plan;
  CHECK(s.schedule(plan, 0) && plan.sched_slots.size() == 2);
  CHECK(plan.new_requests[0].sampling.num_logprobs == 2 && plan.new_requests[1].sampling.num_logprobs == 0);
  CHECK((plan.new_requests[0].suppress_token_ids == std::vector<int32_t>{kEos}));
  StepResult result{plan.step_id, {plan.sched_slots[0], plan.sched_slots[1]}, {7, 8}, {-0.1f, -0.2f}};
  result.num_top = 3;
  result.top_token_ids = {7, 4, 5, 8, -1, -1};
  result.top_logprobs = {-0.1f, -1.0f, -2.0f, -0.2f, 0.0f, 0.0f};
  s.update(result, 0);
  std::vector<RequestOutput> out;
  s.take_outputs(out);
  CHECK(out.size() == 2);
  CHECK(out[0].num_top == 2 && (out[0].top_token_ids == std::vector<int32_t>{7, 4}) && out[0].top_logprobs[1] == -1.0f);
  CHECK(out[1].num_top == 0 && out[1].top_token_ids.empty());
}

// ---- speculative decoding -------------------------------------------------------------------------------------

EngineConfig spec_config(int32_t num_blocks, int32_t k, int32_t max_seqs = 4, int32_t budget = 64) {
  EngineConfig c = make_config(num_blocks, max_seqs, budget);
  c.num_speculative_tokens = k;
  c.spec_max_batch = 0;
  c.spec_min_acceptance = 0.0f;
  return c;
}

// A deterministic "model": the next token is a function of every token so far.
int32_t model_next(const std::vector<int32_t>& t) { return 10 + std::accumulate(t.begin(), t.end(), 0) % 997; }

// Drafts that follow the model except where its token is a multiple of 3 (then they are off by one).
std::vector<int32_t> sometimes_wrong_drafts(std::vector<int32_t> ctx, int32_t max) {
  std::vector<int32_t> drafts;
  for (int32_t j = 0; j < max; ++j) {
    int32_t d = model_next(ctx);
    if (d % 3 == 0) d += 1;
    drafts.push_back(d);
    ctx.push_back(d);
  }
  return drafts;
}

TEST(speculation_gives_the_tokens_of_plain_decoding_with_and_without_preemption) {
  auto run = [](int32_t num_blocks, int32_t k) {
    Harness h(spec_config(num_blocks, k));
    h.worker.proposer = sometimes_wrong_drafts;
    for (uint64_t id = 1; id <= 3; ++id) CHECK(h.add(make_request(id, 6 + static_cast<int32_t>(id), 20)));
    int steps = 0;
    while (h.scheduler.has_unfinished() && steps++ < 2000) {
      h.step([&](int32_t slot) { return model_next(h.worker.tokens_of(slot)); });
    }
    CHECK(!h.scheduler.has_unfinished());
    CHECK(h.scheduler.block_pool().num_free() == num_blocks);  // no leak
    const EngineStats st = h.scheduler.stats(0);
    return std::make_tuple(h.tokens, h.scheduler.num_preemptions(), st.spec_accepted_tokens, steps);
  };
  const auto [plain, plain_preempt, plain_accepted, plain_steps] = run(64, 0);
  const auto [spec, spec_preempt, spec_accepted, spec_steps] = run(64, 4);
  const auto [tight, tight_preempt, tight_accepted, tight_steps] = run(12, 4);
  CHECK(plain_accepted == 0 && spec_accepted > 0 && tight_accepted > 0);
  CHECK(spec_steps < plain_steps);
  CHECK(tight_preempt > 0);
  CHECK(spec == plain);
  CHECK(tight == plain);
}

TEST(lookahead_slots_are_reserved_and_counted_against_the_budget) {
  Harness h(spec_config(64, 4, 4, 64));
  CHECK(h.add(make_request(1, 4, 50)));
  h.step();  // prefill: no lookahead on a prompt chunk
  CHECK(h.plan.sched_lookahead.size() == 1 && h.plan.sched_lookahead[0] == 0);
  CHECK(h.scheduler.schedule(h.plan, ++h.now));
  CHECK(h.plan.sched_lookahead[0] == 4 && h.plan.sched_len[0] == 1);
  CHECK(h.scheduler.last_step_tokens() == 5);
  // positions 4..8 need 3 blocks of 4: one was appended for the lookahead
  CHECK(h.plan.block_appends.size() == 1 && h.plan.block_appends[0].block_ids.size() == 2);
  h.scheduler.update(h.worker.execute(h.plan, [](int32_t) { return 7; }), ++h.now);  // no drafts: 1 token
  h.collect();
  h.scheduler.check_invariants();
  // Budget: 3 tokens leave room for 2 lookahead slots.
  Harness b(spec_config(64, 4, 4, 3));
  CHECK(b.add(make_request(1, 3, 50)));
  b.step();
  CHECK(b.scheduler.schedule(b.plan, ++b.now) && b.plan.sched_lookahead[0] == 2);
  CHECK(b.scheduler.last_step_tokens() == 3);
}

TEST(rejected_lookahead_blocks_go_back_to_the_pool_and_the_workers_trim_them) {
  Harness h(spec_config(16, 4));
  h.worker.proposer = [](const std::vector<int32_t>&, int32_t max) { return std::vector<int32_t>(size_t(max), 999); };
  CHECK(h.add(make_request(1, 4, 50)));
  h.step();  // prefill: 4 prompt tokens + 1 sampled
  CHECK(h.scheduler.block_pool().num_free() == 15);
  h.step();  // decode with 4 lookahead slots (3 blocks), all rejected: 6 tokens need 2 blocks
  CHECK(h.plan.sched_lookahead[0] == 4 && h.plan.block_appends[0].block_ids.size() == 2);
  CHECK(h.scheduler.block_pool().num_free() == 14);
  CHECK(h.tokens[1].size() == 2);
  h.step();  // the next plan tells the workers to drop the block
  CHECK(h.plan.trim_slots.size() == 1 && h.plan.trim_num_blocks[0] == 2);
  const EngineStats st = h.scheduler.stats(0);
  CHECK(st.spec_proposed_tokens == 8 && st.spec_accepted_tokens == 0 && st.spec_verify_rows == 2);
}

TEST(stop_rules_apply_token_by_token_to_accepted_drafts) {
  // The model answers 7, 7, EOS, 7, ... by output count; perfect drafts get all of them accepted in one step.
  auto model = [](size_t outputs) { return outputs == 2 ? kEos : 7; };
  Harness h(spec_config(64, 8));
  h.worker.proposer = [&](const std::vector<int32_t>& t, int32_t max) {
    std::vector<int32_t> d;
    for (int32_t j = 0; j < max; ++j) d.push_back(model(t.size() - 4 + static_cast<size_t>(j)));
    return d;
  };
  CHECK(h.add(make_request(1, 4, 50)));
  for (int i = 0; i < 10 && h.scheduler.has_unfinished(); ++i) {
    h.step([&](int32_t slot) { return model(h.worker.tokens_of(slot).size() - 4); });
  }
  CHECK(h.scheduler.stats(0).num_steps == 2);  // prefill, then one step gave 7, 7, EOS (and dropped the rest)
  CHECK(h.finished[1] == FinishReason::kStop && h.tokens[1] == (std::vector<int32_t>{7, 7, kEos}));
  CHECK(h.scheduler.block_pool().num_free() == 64);
  // max_tokens caps the lookahead: 3 tokens in all, so the decode step may verify at most 1 draft.
  Harness g(spec_config(64, 8));
  g.worker.proposer = [](const std::vector<int32_t>&, int32_t max) { return std::vector<int32_t>(size_t(max), 7); };
  CHECK(g.add(make_request(1, 4, 3)));
  g.step();
  CHECK(g.scheduler.schedule(g.plan, ++g.now) && g.plan.sched_lookahead[0] == 1);
  g.scheduler.update(g.worker.execute(g.plan, [](int32_t) { return 7; }), ++g.now);
  g.collect();
  CHECK(g.finished[1] == FinishReason::kLength && g.tokens[1].size() == 3);
}

TEST(speculation_is_off_for_large_batches_and_backs_off_on_low_acceptance) {
  EngineConfig c = spec_config(256, 4, 8);
  c.spec_max_batch = 2;
  Harness h(c);
  for (uint64_t id = 1; id <= 3; ++id) CHECK(h.add(make_request(id, 4, 40)));
  h.step();
  CHECK(h.scheduler.schedule(h.plan, ++h.now));
  for (int32_t k : h.plan.sched_lookahead) CHECK(k == 0);  // 3 running > spec_max_batch
  h.scheduler.update(h.worker.execute(h.plan, [](int32_t) { return 7; }), ++h.now);

  EngineConfig d = spec_config(256, 4, 8);
  d.spec_min_acceptance = 0.5f;
  d.spec_backoff_steps = 5;
  Harness g(d);
  g.worker.proposer = [](const std::vector<int32_t>&, int32_t max) { return std::vector<int32_t>(size_t(max), 999); };
  CHECK(g.add(make_request(1, 4, 200)));
  g.step();
  std::vector<int32_t> lookaheads;
  for (int i = 0; i < 12; ++i) {
    g.step();
    lookaheads.push_back(g.plan.sched_lookahead[0]);
  }
  // Acceptance 0 drags the average under 0.5 after 3 verifications, then 5 steps without speculation.
  CHECK(lookaheads == (std::vector<int32_t>{4, 4, 4, 0, 0, 0, 0, 0, 4, 4, 4, 0}));
}

TEST(a_result_with_more_tokens_than_its_lookahead_allows_is_rejected) {
  Scheduler s(spec_config(64, 2));
  CHECK(!s.add_request(make_request(1, 3, 20), 0));
  StepPlan plan;
  CHECK(s.schedule(plan, 0));
  s.update(StepResult{plan.step_id, {plan.sched_slots[0]}, {7}, {0.0f}}, 0);
  s.clear_outputs();
  CHECK(s.schedule(plan, 0) && plan.sched_lookahead[0] == 2);
  const int32_t slot = plan.sched_slots[0];
  const uint64_t step = plan.step_id;
  auto result = [&](std::vector<int32_t> tokens, int32_t proposed) {
    StepResult r{step, {slot}, tokens, std::vector<float>(tokens.size(), 0.0f)};
    r.token_counts = {static_cast<int32_t>(tokens.size())};
    r.num_proposed = {proposed};
    return r;
  };
  CHECK_THROWS(std::runtime_error, s.update(result({7, 7, 7, 7}, 2), 0));  // 3 accepted of 2 proposed
  CHECK_THROWS(std::runtime_error, s.update(result({7, 7}, 0), 0));        // accepted without a proposal
  CHECK_THROWS(std::runtime_error, s.update(result({7}, 3), 0));           // more proposed than reserved
  s.update(result({7, 8, 9}, 2), 0);
  std::vector<RequestOutput> out;
  s.take_outputs(out);
  CHECK(out.size() == 3 && out[0].num_spec_proposed_tokens == 2 && out[0].num_spec_accepted_tokens == 2);
  CHECK(out[0].num_scheduled_tokens == 3 && out[1].num_scheduled_tokens == 0 && out[2].new_token_ids[0] == 9);
  s.check_invariants();
}

TEST(steady_state_speculative_steps_do_not_allocate) {
  EngineConfig c = make_config(1024, 16, 256, 16);
  c.num_speculative_tokens = 4;
  c.spec_max_batch = 0;
  Scheduler s(c);
  for (uint64_t id = 0; id < 16; ++id) {
    AddRequest r = make_request(id, 20 + static_cast<int32_t>(id), 1000);
    r.prompt_token_ids[0] = static_cast<int32_t>(id);
    r.ignore_eos = true;
    CHECK(!s.add_request(r, 0));
  }
  StepPlan plan;
  StepResult result;
  auto one_step = [&]() -> int64_t {
    const int64_t before = g_allocations.load();
    CHECK(s.schedule(plan, 0));
    int64_t allocations = g_allocations.load() - before;
    result.step_id = plan.step_id;
    result.slots.clear();
    result.token_ids.clear();
    result.logprobs.clear();
    result.token_counts.clear();
    result.num_proposed.clear();
    for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
      if (!plan.sched_sample[i]) continue;
      const int32_t k = plan.sched_lookahead[i];
      const int32_t n = 1 + std::min(k, static_cast<int32_t>(i % 3));  // varied acceptance
      result.slots.push_back(plan.sched_slots[i]);
      for (int32_t j = 0; j < n; ++j) {
        result.token_ids.push_back(7);
        result.logprobs.push_back(-1.0f);
      }
      result.token_counts.push_back(n);
      result.num_proposed.push_back(k);
    }
    const int64_t mid = g_allocations.load();
    s.update(result, 0);
    s.clear_outputs();
    return allocations + g_allocations.load() - mid;
  };
  for (int i = 0; i < 64; ++i) one_step();
  int64_t allocations = 0;
  for (int i = 0; i < 150; ++i) allocations += one_step();
  CHECK(allocations == 0);
  s.check_invariants();
}

TEST_MAIN()
