// Matching and checking a StepResult against the plan, and the outputs it gives.
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

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

// ---- InFlightStep and StepOutputs on their own -----------------------------------------------------------------

namespace {

// Four entries in slots 3, 1, 0, 2; the second is a prefill chunk that does not sample; the last has 2 lookahead slots.
InFlightStep four_entries(StepPlan& plan) {
  InFlightStep step(4);
  step.push(10, 3, 5, 1, 6, 0);
  step.push(11, 1, 0, 4, 9, 0);
  step.push(12, 0, 7, 1, 8, 0);
  step.push(13, 2, 3, 1, 4, 2);
  CHECK(step.write_entries(plan, true) == 3);
  step.send(7, 3);
  return step;
}

StepResult rows(uint64_t step, std::vector<int32_t> slots) {
  StepResult r;
  r.step_id = step;
  r.slots = std::move(slots);
  r.token_ids.assign(r.slots.size(), 5);
  r.logprobs.assign(r.slots.size(), -1.0f);
  return r;
}

}  // namespace

TEST(in_flight_step_writes_the_plan_and_pads_the_index_for_prefetching) {
  StepPlan plan;
  const InFlightStep step = four_entries(plan);
  CHECK((plan.sched_slots == std::vector<int32_t>{3, 1, 0, 2}) && (plan.sched_start == std::vector<int32_t>{5, 0, 7, 3}));
  CHECK((plan.sched_len == std::vector<int32_t>{1, 4, 1, 1}) && (plan.sched_lookahead == std::vector<int32_t>{0, 0, 0, 2}));
  CHECK((plan.sched_sample == std::vector<uint8_t>{1, 0, 1, 1}));
  for (size_t k = 4; k < 4 + 2 * kPrefetchAhead; ++k) CHECK(step.index()[k] == 13);
  InFlightStep plain(2);
  plain.push(1, 0, 0, 1, 1, 0);
  plain.write_entries(plan, false);
  CHECK(plan.sched_lookahead.empty());
  plain.push(2, 1, 0, 1, 1, 0);
  CHECK(throws<std::logic_error>([&] { plain.push(3, 2, 0, 1, 1, 0); }));  // a third entry in a plan of at most 2
}

TEST(in_flight_step_matches_rows_in_plan_order_or_through_their_slots) {
  StepPlan plan;
  InFlightStep step = four_entries(plan);
  step.check_result_header(rows(7, {3, 0, 2}));
  CHECK(step.match_result_rows(rows(7, {3, 0, 2}), true));
  CHECK(step.result_row()[0] == 0 && step.result_row()[1] == -1 && step.result_row()[2] == 1 && step.result_row()[3] == 2);
  CHECK(!step.match_result_rows(rows(7, {2, 3, 0}), true));
  CHECK(step.result_row()[0] == 1 && step.result_row()[1] == -1 && step.result_row()[2] == 2 && step.result_row()[3] == 0);
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{3, 1, 2}, {3, 3, 2}, {3, 9, 2}, {-1, 0, 2}}) {
    CHECK(throws<std::runtime_error>([&] { step.match_result_rows(rows(7, bad), true); }));
  }
  for (const StepResult& bad : {rows(8, {3, 0, 2}), rows(7, {3, 0})}) {
    CHECK(throws<std::runtime_error>([&] { step.check_result_header(bad); }));
  }
}

TEST(in_flight_step_checks_token_counts_against_each_rows_lookahead) {
  StepPlan plan;
  InFlightStep step = four_entries(plan);
  StepResult r = rows(7, {3, 0, 2});
  r.token_counts = {1, 1, 3};
  r.num_proposed = {0, 0, 2};
  r.token_ids.assign(5, 5);
  r.logprobs.assign(5, -1.0f);
  CHECK(step.match_result_rows(r, true));
  step.check_result_counts(r);  // the last row: 2 drafts accepted + its own token
  CHECK(step.row_offset(0) == 0 && step.row_offset(2) == 2 && step.row_offset(3) == 5);
  const auto rejects = [&](const StepResult& bad) {
    return throws<std::runtime_error>([&] { step.check_result_counts(bad); });
  };
  StepResult too_many = r;
  too_many.token_counts = {1, 1, 4};
  too_many.token_ids.assign(6, 5);
  too_many.logprobs.assign(6, -1.0f);
  CHECK(rejects(too_many));  // more tokens than drafts + 1
  StepResult drafts_without_slots = r;
  drafts_without_slots.num_proposed = {1, 0, 2};
  CHECK(rejects(drafts_without_slots));  // the first row had no lookahead
  StepResult short_logprobs = r;
  short_logprobs.logprobs.pop_back();
  CHECK(rejects(short_logprobs));
  StepResult bad_top = r;
  bad_top.num_top = 2;
  CHECK(rejects(bad_top));
}

TEST(step_outputs_keep_their_storage_and_unpack_top_logprobs_in_order) {
  StepOutputs outputs(2);
  RequestState r;
  r.request_id = 9;
  r.num_prompt_tokens = 3;
  r.token_ids = {1, 2, 3, 4};
  PackedOutput* out = outputs.reserve(2);
  *out++ = make_output(r, FinishReason::kNone, 1, true, 4, -0.5f);
  outputs.commit(out);
  PackedOutput& last = outputs.append();
  last = make_output(r, FinishReason::kStop, 0, true, 5, -0.25f);
  const std::vector<int32_t> ids = {7, 8};
  const std::vector<float> logprobs = {-0.1f, -0.2f};
  outputs.add_top(last, ids, logprobs);
  CHECK(outputs.outputs().size() == 2 && outputs.top_token_ids().size() == 2);
  const PackedOutput* storage = outputs.outputs().data();
  std::vector<RequestOutput> unpacked;
  outputs.take(unpacked);
  CHECK(unpacked.size() == 2 && outputs.outputs().empty() && outputs.top_token_ids().empty());
  CHECK(unpacked[0].new_token_ids == std::vector<int32_t>{4} && unpacked[0].num_computed_tokens == 3);
  CHECK(unpacked[1].finish_reason == FinishReason::kStop && unpacked[1].top_token_ids == ids);
  CHECK(outputs.reserve(2) == storage);  // the high-water mark is kept
}

TEST_MAIN()
