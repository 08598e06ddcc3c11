// Async scheduling: the step after the one in flight is planned before its result arrives (Scheduler::schedule_ahead),
// with its sampled tokens pending. Outputs must equal those of the synchronous loop, and nothing may leak.
#include <deque>

#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

namespace {

AddRequest no_eos(AddRequest r) {
  r.ignore_eos = true;
  return r;
}

// A model whose next token depends only on the request's own tokens (as a real one does), so outputs do not depend
// on batching, slots or step boundaries. It says EOS now and then.
int32_t next_token(const std::vector<int32_t>& tokens) {
  uint32_t h = 2166136261u;
  for (const int32_t t : tokens) h = (h ^ static_cast<uint32_t>(t)) * 16777619u;
  const int32_t token = 3 + static_cast<int32_t>(h % 50);
  return token % 23 == 0 ? kEos : token;
}

// Plays Engine::run: with `async`, plans one step ahead whenever the scheduler lets it; the worker runs the plans in
// the order they were sent and answers the oldest.
struct Loop {
  Harness h;
  bool async;
  std::deque<StepPlan> sent;
  int ahead_steps = 0;  // steps planned ahead
  int dropped_rows = 0;

  Loop(EngineConfig c, bool async_) : h((c.async_scheduling = async_, c)), async(async_) {}

  // One iteration; false when nothing was scheduled (idle).
  bool step() {
    if (h.scheduler.num_steps_in_flight() == 0) {
      if (!h.scheduler.schedule(h.plan, ++h.now)) {
        h.collect();
        h.scheduler.check_invariants();
        return false;
      }
      sent.push_back(h.plan);
    }
    if (async && h.scheduler.schedule_ahead(h.plan, ++h.now)) {
      sent.push_back(h.plan);
      ++ahead_steps;
    }
    CHECK(h.scheduler.num_steps_in_flight() == static_cast<int32_t>(sent.size()));
    const StepPlan plan = std::move(sent.front());
    sent.pop_front();
    const auto token_for = [this](int32_t slot) { return next_token(h.worker.tokens_of(slot)); };
    h.scheduler.update(h.worker.execute(plan, token_for), ++h.now);
    h.collect();
    h.scheduler.check_invariants();
    return true;
  }

  void run_to_completion(int max_steps = 20000) {
    while ((h.scheduler.has_unfinished() || !sent.empty()) && max_steps-- > 0) step();
    CHECK(!h.scheduler.has_unfinished() && sent.empty());
    CHECK(h.scheduler.block_pool().num_free() == h.config.num_blocks);  // every block back (cached ones are free)
  }
};

}  // namespace

TEST(a_decode_is_planned_on_the_pending_token_and_the_worker_fills_it_in) {
  Loop loop(make_config(64, 8, 64), true);
  CHECK(loop.h.add(no_eos(make_request(1, 6, 3))));
  CHECK(loop.h.scheduler.schedule(loop.h.plan, 1));  // the prompt, sampling its first token
  loop.sent.push_back(loop.h.plan);
  StepPlan ahead;
  CHECK(loop.h.scheduler.schedule_ahead(ahead, 2));  // planned before that token is known
  CHECK(loop.h.scheduler.num_steps_in_flight() == 2);
  CHECK((ahead.sched_start == std::vector<int32_t>{6} && ahead.sched_len == std::vector<int32_t>{1}));
  CHECK(ahead.sched_sample == std::vector<uint8_t>{1});
  CHECK(!loop.h.scheduler.schedule_ahead(ahead, 3));  // never a third step in flight
  CHECK(throws<std::logic_error>([&] { loop.h.scheduler.abort_request(1); }));  // its token is on its way
  loop.sent.push_back(ahead);
  // The worker runs both plans in order, the second reading the token the first sampled.
  const auto token_for = [&](int32_t slot) { return next_token(loop.h.worker.tokens_of(slot)); };
  loop.h.scheduler.update(loop.h.worker.execute(loop.sent[0], token_for), 4);
  loop.h.collect();
  CHECK(loop.h.tokens[1].size() == 1);
  loop.h.scheduler.update(loop.h.worker.execute(loop.sent[1], token_for), 5);
  loop.h.collect();
  loop.sent.clear();
  CHECK(loop.h.tokens[1].size() == 2);
  loop.h.scheduler.check_invariants();
  loop.run_to_completion();
  std::vector<int32_t> expected = make_request(1, 6, 3).prompt_token_ids;
  for (int i = 0; i < 3; ++i) expected.push_back(next_token(expected));
  CHECK((loop.h.tokens[1] == std::vector<int32_t>(expected.begin() + 6, expected.end())));
}

TEST(a_request_that_finishes_in_the_step_in_flight_has_its_next_row_dropped_and_its_blocks_freed) {
  Loop loop(make_config(64, 8, 64), true);
  CHECK(loop.h.add(make_request(1, 8, 1)));   // ends with its first token
  CHECK(loop.h.add(no_eos(make_request(2, 8, 4))));
  CHECK(loop.step());  // step 1 (prompts), step 2 planned ahead with a row for each
  CHECK(loop.ahead_steps == 1 && loop.sent.size() == 1 && loop.sent.front().sched_slots.size() == 2);
  const int32_t slot1 = loop.sent.front().sched_slots[0];
  CHECK(loop.h.finished[1] == FinishReason::kLength && loop.h.tokens[1].size() == 1);
  CHECK(loop.step());  // step 2's row of request 1 is ignored; step 3 tells the worker to drop its slot
  CHECK(loop.h.tokens[1].size() == 1);
  CHECK(loop.h.tokens[2].size() == 2);
  bool slot_dropped = false;
  for (const StepPlan& p : loop.sent) slot_dropped |= std::ranges::count(p.finished_slots, slot1) == 1;
  CHECK(slot_dropped);
  loop.run_to_completion();
  CHECK(loop.h.tokens[2].size() == 4);
}

TEST(no_step_is_planned_ahead_when_it_could_preempt_or_speculate) {
  // 4 blocks of 4 tokens: the worst case of a step (64 / 4 + 1 running + 1 blocks) never fits.
  Loop tight(make_config(4, 8, 64), true);
  CHECK(tight.h.add(make_request(1, 4, 6)));
  tight.run_to_completion();
  CHECK(tight.ahead_steps == 0 && tight.h.tokens[1].size() == 6);

  EngineConfig spec = make_config(64, 8, 64);
  spec.num_speculative_tokens = 2;
  Loop speculating(spec, true);
  CHECK(speculating.h.add(make_request(1, 4, 6)));
  speculating.run_to_completion();
  CHECK(speculating.ahead_steps == 0 && speculating.h.tokens[1].size() == 6);
}

TEST(an_abort_while_a_step_is_in_flight_drops_its_row_and_frees_everything) {
  Loop loop(make_config(64, 8, 64), true);
  CHECK(loop.h.add(no_eos(make_request(1, 10, 50))));
  CHECK(loop.h.add(no_eos(make_request(2, 10, 50))));
  for (int i = 0; i < 3; ++i) CHECK(loop.step());
  CHECK(loop.h.scheduler.num_steps_in_flight() == 1);  // planned ahead, its result not yet applied
  CHECK(loop.h.scheduler.abort_request(1));
  loop.h.collect();
  CHECK(loop.h.finished[1] == FinishReason::kAbort);
  const size_t before = loop.h.tokens[1].size();
  loop.h.scheduler.check_invariants();
  loop.run_to_completion();
  CHECK(loop.h.tokens[1].size() == before);  // nothing after the abort
  CHECK(loop.h.tokens[2].size() == 50 && loop.h.finished[2] == FinishReason::kLength);
}

// Random workloads: shared prefixes (prefix cache), chunked prompts, EOS and stop ids, max_tokens, a pool small
// enough to preempt, random aborts. The requests that were not aborted end with the same tokens and reasons as in
// the synchronous loop, and every block comes back.
TEST(random_workloads_give_the_same_outputs_with_and_without_async_scheduling) {
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    std::map<uint64_t, std::vector<int32_t>> tokens[2];
    std::map<uint64_t, FinishReason> reasons[2];
    std::set<uint64_t> aborted;
    int ahead = 0;
    for (const bool async : {false, true}) {
      std::mt19937 rng(seed);
      const int32_t blocks = seed % 3 == 0 ? 24 : 200;  // small pools preempt and refuse to plan ahead
      Loop loop(make_config(blocks, 6, 32, 4), async);
      const std::vector<int32_t> shared = iota_tokens(12, 500);
      uint64_t next_id = 1;
      int iteration = 0;
      while (next_id <= 30 || loop.h.scheduler.has_unfinished() || !loop.sent.empty()) {
        ++iteration;
        // Arrivals and aborts at the same iterations in both runs (the abort lands at a different point of a
        // request's life, so aborted requests are not compared).
        if (next_id <= 30 && rng() % 3 == 0) {
          std::vector<int32_t> prompt = rng() % 2 == 0 ? shared : std::vector<int32_t>{};
          const int32_t extra = 1 + static_cast<int32_t>(rng() % 40);
          for (int32_t i = 0; i < extra; ++i) prompt.push_back(200 + static_cast<int32_t>(rng() % 300));
          AddRequest r = prompt_of(next_id, prompt, 1 + static_cast<int32_t>(rng() % 12));
          if (rng() % 4 == 0) r.stop_token_ids = {7, 11};
          if (rng() % 5 == 0) r.sampling.min_tokens = std::min(2, r.max_tokens);
          CHECK(loop.h.add(r));
          ++next_id;
        }
        if (rng() % 17 == 0 && next_id > 1) {
          const uint64_t victim = 1 + rng() % (next_id - 1);
          if (!loop.h.finished.contains(victim) && loop.h.scheduler.abort_request(victim)) aborted.insert(victim);
          loop.h.collect();
        }
        loop.step();
        CHECK(iteration < 20000);
      }
      loop.run_to_completion();
      tokens[async] = loop.h.tokens;
      reasons[async] = loop.h.finished;
      ahead = loop.ahead_steps;
      CHECK(loop.h.finished.size() == 30);
    }
    if (seed % 3 != 0) CHECK(ahead > 0);
    for (uint64_t id = 1; id <= 30; ++id) {
      if (aborted.contains(id)) continue;
      CHECK(tokens[0][id] == tokens[1][id]);
      CHECK(reasons[0][id] == reasons[1][id]);
    }
  }
}

TEST_MAIN()
