// The step loop: budgets, admission, stop rules, rejection, abort, preemption, random workloads.
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

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


TEST(engine_config_out_of_range_is_refused_with_the_setting_named) {
  const auto refusal = [](const std::function<void(EngineConfig&)>& change) {
    EngineConfig c = make_config(16);
    change(c);
    try {
      Scheduler s(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(refusal([](EngineConfig&) {}).empty());
  CHECK(refusal([](EngineConfig& c) { c.block_size = 0; }) == "block_size must be > 0");
  CHECK(refusal([](EngineConfig& c) { c.max_num_seqs = -1; }) == "max_num_seqs must be > 0");
  CHECK(refusal([](EngineConfig& c) { c.max_num_batched_tokens = 0; }) == "max_num_batched_tokens must be > 0");
  CHECK(refusal([](EngineConfig& c) { c.num_blocks = 0; }) == "num_blocks must be > 0");
  CHECK(refusal([](EngineConfig& c) { c.long_prefill_token_threshold = -1; }).find("long_prefill") == 0);
  CHECK(refusal([](EngineConfig& c) { c.priority_aging_ms = -1; }).find("priority_aging_ms") == 0);
  CHECK(refusal([](EngineConfig& c) { c.num_speculative_tokens = kMaxLookaheadSlots + 1; }) ==
        "num_speculative_tokens must be in [0, 64]");
  CHECK(refusal([](EngineConfig& c) { c.spec_max_batch = -1; }).find("spec_max_batch") == 0);
  CHECK(refusal([](EngineConfig& c) { c.spec_backoff_steps = -1; }).find("spec_backoff_steps") == 0);
  CHECK(refusal([](EngineConfig& c) { c.max_step_slowdown = 0.5f; }).find("max_step_slowdown") == 0);
  EngineConfig c = make_config(16);  // block size 4
  check_scheduler_config(c);
  CHECK(c.max_model_len == 64);  // the whole KV pool by default
}

TEST_MAIN()
