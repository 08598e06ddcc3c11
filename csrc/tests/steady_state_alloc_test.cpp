// Steady-state decode steps, plain and speculative, do not touch the heap (operator new is counted here).
#include <atomic>
#include <cstdlib>
#include <new>

#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

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
