// Benchmark entry points that measure the real scheduler and engine loop (driven by benchmarks/*.py).
#pragma once

#include <cstdint>
#include <vector>

namespace ringserve {

// Adds `num_running` requests with distinct `prompt_len`-token prompts, spread over `block_size` arrival waves (so
// about num_running / block_size of them complete a KV block in every step, as under a steady stream of arrivals),
// steps until all of them decode, then times `num_steps` steady-state steps: schedule() + update() with a fake
// one-token result. Returns ns per step.
std::vector<int64_t> bench_scheduler_steps(int32_t num_running, int32_t prompt_len, int32_t block_size,
                                           int32_t num_steps, bool enable_prefix_caching = true);

struct EngineLoopTiming {
  double us_per_step = 0;
  int64_t steps = 0;
};

// The whole step loop: real rings and Engine::run() in a thread, a C++ null worker that decodes each StepPlan and
// answers one token per sampled slot, and a frontend thread that feeds requests and drains the event ring.
// Times `num_steps` steady-state decode steps at `num_running` running requests.
EngineLoopTiming bench_engine_loop(int32_t num_running, int32_t prompt_len, int32_t num_steps);

}  // namespace ringserve
