// Queue order (priority, FCFS, aging), preemption order, and the queues and table on their own.
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

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

// ---- RequestQueues, BatchSlots and RequestTable on their own ----------------------------------------------------

namespace {

int32_t add_with_priority(RequestTable& table, RequestQueues& queues, uint64_t id, int32_t priority, int64_t now) {
  const EngineConfig c = table_config(64);
  AddRequest r = make_request(id, 3, 2);
  r.priority = priority;
  const int32_t index = table.add(r, c, nullptr, now);
  queues.stamp_arrival(table.details(index), priority, now);
  queues.insert_waiting(table, index);
  return index;
}

}  // namespace

TEST(request_queues_order_by_priority_then_arrival) {
  RequestTable table;
  RequestQueues queues(0, 8);
  const int32_t a = add_with_priority(table, queues, 1, 1, 0);
  const int32_t b = add_with_priority(table, queues, 2, 0, 0);
  const int32_t c = add_with_priority(table, queues, 3, 1, 0);
  const int32_t d = add_with_priority(table, queues, 4, -1, 0);
  // The next to admit is at the back.
  CHECK((queues.waiting() == std::vector<int32_t>{c, a, b, d}));
  for (const int32_t i : {b, d, c, a}) queues.insert_running(table, i);
  CHECK((queues.running() == std::vector<int32_t>{d, b, a, c}));
  queues.check_order(table);
  queues.erase(b, RequestStatus::kRunning);
  queues.erase(c, RequestStatus::kWaiting);
  CHECK((queues.running() == std::vector<int32_t>{d, a, c}) && (queues.waiting() == std::vector<int32_t>{a, b, d}));
  std::swap(queues.running()[0], queues.running()[1]);
  CHECK(throws<std::logic_error>([&] { queues.check_order(table); }));
}

TEST(request_queues_age_the_rank_and_saturate_extreme_priorities) {
  RequestTable table;
  RequestQueues queues(10, 8);  // one priority level per 10 ms waited
  const int32_t early_low = add_with_priority(table, queues, 1, 1, 0);
  const int32_t later_high = add_with_priority(table, queues, 2, 0, 15'000'000);  // 15 ms later: behind
  const int32_t soon_high = add_with_priority(table, queues, 3, 0, 5'000'000);    // clock stays at 15 ms: behind too
  CHECK(RequestQueues::runs_before(table, early_low, later_high));
  CHECK(RequestQueues::runs_before(table, early_low, soon_high));
  CHECK(RequestQueues::runs_before(table, later_high, soon_high));  // equal ranks: FCFS
  CHECK(table.details(early_low).rank == 10'000'000 && table.details(later_high).rank == 15'000'000);
  queues.check_order(table);
  // priority x aging overflows: the rank saturates, keeping the order.
  RequestQueues extreme(std::numeric_limits<int32_t>::max(), 8);
  const int32_t huge = add_with_priority(table, extreme, 4, std::numeric_limits<int32_t>::max(), 1);
  const int32_t tiny = add_with_priority(table, extreme, 5, std::numeric_limits<int32_t>::min(), 1);
  const int32_t zero = add_with_priority(table, extreme, 6, 0, 1);
  CHECK(table.details(huge).rank == std::numeric_limits<int64_t>::max());
  CHECK(table.details(tiny).rank == std::numeric_limits<int64_t>::min());
  CHECK((extreme.waiting() == std::vector<int32_t>{huge, zero, tiny}));
}

TEST(batch_slots_hand_out_the_lowest_first_and_track_owners) {
  BatchSlots slots(3);
  CHECK(slots.take(10) == 0 && slots.take(11) == 1 && slots.num_free() == 1);
  CHECK(slots.owner(0) == 10 && slots.owner(1) == 11 && slots.owner(2) == -1);
  slots.give_back(0);
  CHECK(slots.owner(0) == -1 && slots.num_free() == 2);
  CHECK(slots.take(12) == 0);  // the slot given back last is handed out next
}

TEST(request_table_reuses_freed_entries_and_forgets_their_ids) {
  const EngineConfig c = table_config(64);
  RequestTable table;
  const int32_t a = table.add(make_request(1, 3, 2), c, nullptr, 5);
  const int32_t b = table.add(make_request(2, 3, 2), c, nullptr, 6);
  CHECK(a != b && table.find(1) == a && table.find(2) == b && table.num_live() == 2);
  CHECK(table.state(a).status == RequestStatus::kWaiting && table.state(a).arrival_time_ns == 5);
  table.remove(a);
  CHECK(table.find(1) == -1 && table.state(a).status == RequestStatus::kFree && table.num_live() == 1);
  CHECK(table.add(make_request(3, 3, 2), c, nullptr, 7) == a && table.size() == 2);
}

TEST(request_table_keeps_the_stop_ids_in_the_hot_line_and_the_rest_in_the_details) {
  EngineConfig c = table_config(64);
  c.eos_token_ids = {2, 3};
  RequestTable table;
  AddRequest r = make_request(1, 3, 8);
  r.stop_token_ids = {5, 6};
  r.sampling.min_tokens = 2;
  const int32_t i = table.add(r, c, nullptr, 0);
  const RequestState& s = table.state(i);
  const RequestDetails& d = table.details(i);
  CHECK(s.num_stop_ids == 4 && s.stop_ids[0] == 2 && s.stop_ids[1] == 3);
  CHECK((d.suppress_token_ids == std::vector<int32_t>{2, 3, 5, 6}));
  CHECK(s.stop_check_from == 5 && s.length_limit == 11);
  RequestState t = table.state(i);
  t.token_ids.push_back(6);  // 4 tokens: below min_tokens, only length applies
  CHECK(stop_reason(t, &d, 6) == FinishReason::kNone);
  t.token_ids.push_back(6);
  CHECK(stop_reason(t, &d, 6) == FinishReason::kStop);  // found in the details
  CHECK(stop_reason(t, &d, 2) == FinishReason::kStop);  // found in the hot line
  CHECK(stop_reason(t, &d, 9) == FinishReason::kNone);
  r.ignore_eos = true;
  r.request_id = 2;
  const int32_t j = table.add(r, c, nullptr, 0);
  CHECK(table.state(j).num_stop_ids == 2 && table.state(j).stop_ids[0] == 5);
}

TEST(request_table_check_names_what_is_wrong) {
  EngineConfig c = table_config(8);  // 32 tokens of KV, and so max_model_len 32
  RequestTable table;
  const auto message = [&](const AddRequest& r, size_t max_plan_bytes = SIZE_MAX) {
    const auto rejected = table.check(r, nullptr, c, max_plan_bytes);
    return rejected ? rejected->message : std::string();
  };
  CHECK(message(make_request(1, 3, 2)).empty());
  CHECK(message(make_request(1, 0, 2)) == "prompt is empty");
  CHECK(message(make_request(1, 3, 0)).find("max_tokens") != std::string::npos);
  CHECK(message(make_request(1, 30, 8)).find("but max_model_len is 32") != std::string::npos);
  c.max_model_len = 100;
  CHECK(message(make_request(1, 30, 8)).find("KV cache holds only 32 tokens") != std::string::npos);
  CHECK(message(make_request(1, 3, 2), 100).find("record limit") != std::string::npos);
  table.add(make_request(1, 3, 2), c, nullptr, 0);
  CHECK(message(make_request(1, 3, 2)).find("already active") != std::string::npos);
}

TEST_MAIN()
