// Speculative decoding: lookahead slots, verification, trims, backoff, and SpeculationPolicy on its own.
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;


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

// ---- SpeculationPolicy on its own ------------------------------------------------------------------------------

TEST(speculation_policy_limits_the_batch_and_the_lookahead) {
  EngineConfig c = make_config(64);
  c.num_speculative_tokens = 4;
  c.spec_max_batch = 2;
  SpeculationPolicy policy(c);
  CHECK(policy.enabled() && policy.begin_step(2) && policy.this_step());
  CHECK(!policy.begin_step(3) && !policy.this_step());
  RequestState r;
  RequestDetails d;
  r.token_ids = {1, 2, 3};
  r.length_limit = 100;
  CHECK(policy.lookahead_for(r, d, 64) == 4);
  CHECK(policy.lookahead_for(r, d, 3) == 3);  // the step's budget
  r.length_limit = 5;
  CHECK(policy.lookahead_for(r, d, 64) == 1);  // at most up to the length limit
  r.length_limit = 4;
  CHECK(policy.lookahead_for(r, d, 64) == 0);
  c.num_speculative_tokens = 0;
  SpeculationPolicy off(c);
  CHECK(!off.enabled() && !off.begin_step(1));
  c.num_speculative_tokens = 4;
  c.spec_max_batch = 0;
  CHECK(SpeculationPolicy(c).begin_step(100000));  // no batch limit
}

TEST(speculation_policy_backs_off_when_acceptance_drops_and_starts_afresh) {
  EngineConfig c = make_config(64);
  c.num_speculative_tokens = 4;
  c.spec_min_acceptance = 0.5f;
  c.spec_backoff_steps = 2;
  SpeculationPolicy policy(c);
  RequestState r;
  RequestDetails d;
  r.token_ids = {1};
  r.length_limit = 100;
  policy.record_verification(d, 4, 4);
  CHECK(d.spec_acceptance == 1.0f && d.spec_backoff == 0);
  policy.record_verification(d, 4, 0);  // 0.75
  policy.record_verification(d, 4, 0);  // 0.5625
  CHECK(d.spec_backoff == 0 && std::abs(d.spec_acceptance - 0.5625f) < 1e-6f);
  policy.record_verification(d, 4, 0);  // 0.42: below the floor
  CHECK(d.spec_backoff == 2 && d.spec_acceptance == 1.0f);
  CHECK(policy.lookahead_for(r, d, 64) == 0 && policy.lookahead_for(r, d, 64) == 0);
  CHECK(policy.lookahead_for(r, d, 64) == 4);
  CHECK(d.spec_proposed_tokens == 16 && d.spec_accepted_tokens == 4);
  CHECK(policy.proposed_tokens() == 16 && policy.accepted_tokens() == 4 && policy.verify_rows() == 4);
}

TEST_MAIN()
