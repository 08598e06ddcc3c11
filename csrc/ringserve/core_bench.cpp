#include "ringserve/core_bench.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>

#include "ringserve/engine.h"
#include "ringserve/records.h"
#include "ringserve/scheduler.h"
#include "ringserve/shm_ring.h"

namespace ringserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int32_t kFakeToken = 100;  // never an EOS id: the benchmark's requests never stop early

AddRequest bench_request(uint64_t id, int32_t prompt_len, int32_t max_tokens) {
  AddRequest r;
  r.request_id = id;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.prompt_token_ids.resize(static_cast<size_t>(prompt_len));
  for (int32_t j = 0; j < prompt_len; ++j) {
    r.prompt_token_ids[static_cast<size_t>(j)] = static_cast<int32_t>((id * 7919 + static_cast<uint64_t>(j)) % 49000);
  }
  return r;
}

// The fake worker's answer: one token per sampled slot.
void fake_result(const StepPlan& plan, StepResult& result) {
  result.step_id = plan.step_id;
  result.slots.clear();
  result.token_ids.clear();
  result.logprobs.clear();
  for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
    if (!plan.sched_sample[i]) continue;
    result.slots.push_back(plan.sched_slots[i]);
    result.token_ids.push_back(kFakeToken);
    result.logprobs.push_back(-0.5f);
  }
}

// Writes and reads back a ring's whole capacity once, so the timed steps do not pay its first-touch page faults (a
// long-running server wrapped its rings long ago).
void touch_ring_pages(const std::shared_ptr<ShmRing>& ring) {
  RingWriter writer(ring);
  RingReader reader(ring, 0);
  const ByteBuffer record(ring->max_record_size() / 2, 0);
  ByteBuffer back;
  for (size_t written = 0; written < 2 * ring->capacity(); written += record.size()) {
    if (!writer.try_write(record) || !reader.try_read(back)) throw std::runtime_error("touch_ring_pages: ring busy");
  }
}

bool all_decoding(const StepPlan& plan, int32_t num_running) {
  if (static_cast<int32_t>(plan.sched_len.size()) != num_running) return false;
  for (const int32_t n : plan.sched_len) {
    if (n != 1) return false;
  }
  return true;
}

}  // namespace

std::vector<int64_t> bench_scheduler_steps(int32_t num_running, int32_t prompt_len, int32_t block_size,
                                           int32_t num_steps, bool enable_prefix_caching) {
  if (num_running <= 0 || prompt_len <= 0 || block_size <= 0 || num_steps <= 0) {
    throw std::invalid_argument("bench_scheduler_steps: every argument must be > 0");
  }
  const int32_t warmup = 64;
  const int32_t max_tokens = num_steps + warmup + 256;
  EngineConfig config;
  config.block_size = block_size;
  config.enable_prefix_caching = enable_prefix_caching;
  config.max_num_seqs = num_running;
  config.max_num_batched_tokens = 8192;
  config.num_blocks = num_running * ((prompt_len + max_tokens + block_size - 1) / block_size + 1);
  Scheduler scheduler(config);
  StepPlan plan;
  StepResult result;
  // The requests arrive in block_size waves, one per step, as a steady stream of arrivals would spread them: a
  // request completes a block (one allocation and one prefix-cache registration) every block_size steps, so each
  // step then does that work for about num_running / block_size requests. (Arriving all at once, they would be
  // admitted max_num_batched_tokens / prompt_len at a time, and how many steps have such work, and how much, would
  // depend on num_running: the median step would do none at 256 running and some at 1,024.)
  int32_t arrived = 0;
  int32_t decode_steps = 0;
  for (int32_t wave = 0; decode_steps < warmup; ++wave) {
    const int32_t until = wave < block_size ? static_cast<int32_t>(int64_t{num_running} * (wave + 1) / block_size)
                                            : num_running;
    for (; arrived < until; ++arrived) {
      if (scheduler.add_request(bench_request(static_cast<uint64_t>(arrived), prompt_len, max_tokens), 0)) {
        throw std::runtime_error("bench_scheduler_steps: request rejected");
      }
    }
    // Prefill until every request decodes, then warm up (reaches every buffer's high-water mark).
    if (!scheduler.schedule(plan, 0)) throw std::runtime_error("bench_scheduler_steps: nothing scheduled");
    if (all_decoding(plan, num_running)) ++decode_steps;
    fake_result(plan, result);
    scheduler.update(result, 0);
    scheduler.clear_outputs();
  }
  std::vector<int64_t> ns;
  ns.reserve(static_cast<size_t>(num_steps));
  for (int32_t s = 0; s < num_steps; ++s) {
    const auto t0 = Clock::now();
    scheduler.schedule(plan, 0);
    const auto t1 = Clock::now();
    fake_result(plan, result);  // the worker's part, not timed
    const auto t2 = Clock::now();
    scheduler.update(result, 0);
    scheduler.clear_outputs();
    const auto t3 = Clock::now();
    ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>((t1 - t0) + (t3 - t2)).count());
  }
  return ns;
}

EngineLoopTiming bench_engine_loop(int32_t num_running, int32_t prompt_len, int32_t num_steps) {
  if (num_running <= 0 || prompt_len <= 0 || num_steps <= 0) {
    throw std::invalid_argument("bench_engine_loop: every argument must be > 0");
  }
  std::mt19937_64 rng(std::random_device{}());
  const std::string base = "/ringserve-" + std::to_string(::getpid()) + "-" + std::to_string(rng() % 1000000007ull);
  auto req = ShmRing::create(base + "-req", 1u << 22, 1);
  auto evt = ShmRing::create(base + "-evt", 1u << 24, 1);
  auto step = ShmRing::create(base + "-step", 1u << 24, 1);
  auto res = ShmRing::create(base + "-res", 1u << 22, 1);
  struct Unlink {
    std::vector<std::shared_ptr<ShmRing>> rings;
    ~Unlink() {
      for (auto& r : rings) r->unlink();
    }
  } unlink{{req, evt, step, res}};
  for (const auto& ring : unlink.rings) touch_ring_pages(ring);

  const int32_t warmup = 64;
  const int32_t max_tokens = num_steps + warmup + 512;
  EngineConfig config;
  config.max_num_seqs = num_running;
  config.max_num_batched_tokens = 8192;
  config.num_blocks = num_running * ((prompt_len + max_tokens + config.block_size - 1) / config.block_size + 1);
  Engine engine(config, req->name(), evt->name(), step->name(), res->name(), {});

  std::atomic<bool> done{false};
  EngineLoopTiming timing;
  std::string worker_error;
  std::thread worker([&] {
    try {
      // The creator's mappings, not the names: the engine unlinks every name once its peers are known to hold them.
      RingReader plans(step, 0);
      RingWriter results(res);
      ByteBuffer in, out;
      StepResult result;
      int32_t decode_steps = 0;
      Clock::time_point start;
      while (true) {
        if (!plans.read(in, std::chrono::seconds(10))) throw std::runtime_error("no plan within 10 s");
        WorkerCommand command = decode_worker_command(in);  // the worker's input preparation
        const auto* plan = std::get_if<StepPlan>(&command);
        if (plan == nullptr) return;  // WorkerShutdown
        if (all_decoding(*plan, num_running)) {
          if (decode_steps == warmup) start = Clock::now();
          if (decode_steps == warmup + num_steps) {
            timing.us_per_step =
                std::chrono::duration<double, std::micro>(Clock::now() - start).count() / num_steps;
            timing.steps = num_steps;
            done.store(true, std::memory_order_release);
          }
          ++decode_steps;
        }
        fake_result(*plan, result);
        encode(result, out);
        if (!results.write(out, std::chrono::seconds(10))) throw std::runtime_error("result ring full for 10 s");
      }
    } catch (const std::exception& e) {
      worker_error = e.what();
      done.store(true, std::memory_order_release);
      engine.stop();
    }
  });
  std::thread frontend([&] {
    RingWriter requests(req);
    RingReader events(evt, 0);
    ByteBuffer buf;
    for (int32_t i = 0; i < num_running; ++i) {
      encode(bench_request(static_cast<uint64_t>(i + 1), prompt_len, max_tokens), buf);
      requests.write(buf, std::chrono::seconds(10));
    }
    // Drain events like a frontend's notifier thread would, until the worker has its figure.
    while (!done.load(std::memory_order_acquire)) events.read(buf, std::chrono::milliseconds(10));
    encode(Shutdown{}, buf);
    requests.write(buf, std::chrono::seconds(10));
    while (events.read(buf, std::chrono::milliseconds(200))) {
    }
  });
  engine.run();
  frontend.join();
  worker.join();
  if (!worker_error.empty()) throw std::runtime_error("bench_engine_loop worker: " + worker_error);
  return timing;
}

}  // namespace ringserve
