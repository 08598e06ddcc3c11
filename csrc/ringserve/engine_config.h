// EngineConfig: the engine's settings as the scheduler and the step loop read them (bound to Python as
// _core.EngineConfig), and the one check of their ranges.
#pragma once

#include <cstdint>
#include <vector>

namespace ringserve {

struct EngineConfig {
  int32_t block_size = 16;
  int32_t num_blocks = 0;  // 0 = take num_kv_blocks from the worker's WorkerReady
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;
  int32_t max_model_len = 0;  // 0 = as many tokens as the KV pool holds
  std::vector<int32_t> eos_token_ids;
  bool enable_prefix_caching = true;
  int32_t long_prefill_token_threshold = 0;  // 0 = no per-request cap on a step's prefill chunk
  int32_t stats_interval_ms = 100;           // unsolicited EngineStats at most this often while busy
  // Aging: a request's effective priority value drops by one for every priority_aging_ms it has waited since it
  // arrived, so later arrivals of a better priority stop overtaking it after a bounded time (0 = strict priority).
  int32_t priority_aging_ms = 0;
  // Speculative decoding: a decoding request may get up to num_speculative_tokens lookahead slots per step (0 = off,
  // at most kMaxLookaheadSlots); the workers propose and verify that many draft tokens in the same step. Policy:
  // no speculation in a step where more than spec_max_batch requests run (0 = no limit: a large batch is already
  // compute bound, verifying drafts would cost throughput), and a request whose recent acceptance rate (moving
  // average) drops below spec_min_acceptance decodes without it for spec_backoff_steps steps, then tries again.
  int32_t num_speculative_tokens = 0;
  int32_t spec_max_batch = 16;
  float spec_min_acceptance = 0.25f;
  int32_t spec_backoff_steps = 16;
  // Decode-latency guard: while requests decode, the prefill chunks of a step are cut so that its estimated time
  // stays within max_step_slowdown x that of a step with only those decodes (0 = off; otherwise >= 1). Step times
  // are learnt online (StepCostModel: a decode-only step's time, and what prefill tokens and attention pairs add) from
  // what the engine reports through observe_step_time(); until it has seen both kinds of steps, only the token budget
  // applies. The first prefill row of a step always gets at least block_size tokens, so prompts make progress.
  float max_step_slowdown = 0.0f;
  // Async scheduling: while a step runs, the engine plans the next one (Scheduler::schedule_ahead) and the workers
  // read it as soon as they finish, counting the running step's tokens as computed and its sampled tokens as pending
  // (the workers fill those in from what they sampled). Never with speculation, and never a step that could preempt.
  bool async_scheduling = false;
  // Step watchdog (the engine loop, not the scheduler): a step whose result has not come back this many seconds
  // after the engine began waiting for it fails the engine as a dead rank would (0 = wait for ever). Liveness checks
  // cannot see a rank that is alive but stuck (deadlocked, stopped, waiting on a peer that is); this can. The wait
  // for WorkerReady (loading, warm-up, graph capture) is not a step and has no such limit.
  double step_timeout_s = 0.0;
};

// Throws std::invalid_argument naming the first setting out of range (num_blocks must be known by now), and fills in
// max_model_len's default (the whole KV pool).
void check_scheduler_config(EngineConfig& config);

}  // namespace ringserve
