// The engine step loop: drain the request ring -> schedule -> write a StepPlan -> emit the previous step's StepEvents
// record (while the workers compute) -> wait for the StepResult -> update. When nothing is runnable the pending
// events go out at once. All of it runs in C++ without the GIL; Python only hosts the process.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "ringserve/records.h"
#include "ringserve/scheduler.h"
#include "ringserve/shm_ring.h"

namespace ringserve {

// A worker died, reported WorkerFailed, broke the protocol, or let a step outlast step_timeout_s. run() emits
// EngineFailed with this reason (any other exception: kEngineFailed), then throws it.
class WorkerFailure : public std::runtime_error {
 public:
  WorkerFailure(FailureReason reason, const std::string& message) : std::runtime_error(message), reason_(reason) {}
  FailureReason reason() const noexcept { return reason_; }

 private:
  FailureReason reason_;
};

class Engine {
 public:
  // Attaches to the four rings: reads `request_ring` and `result_ring` (reader 0), writes the others.
  Engine(EngineConfig config, const std::string& request_ring, const std::string& event_ring,
         const std::string& step_ring, const std::string& result_ring, std::vector<pid_t> worker_pids);

  // Waits for the workers' WorkerReady (unless config.num_blocks > 0), emits EngineReady, then runs the step loop
  // until a Shutdown record arrives or stop() is called; always sends WorkerShutdown before returning.
  // Throws WorkerFailure after emitting EngineFailed when a worker dies or fails, or a step outlasts step_timeout_s.
  void run();
  // Thread- and async-signal-safe: an atomic store and futex wakes.
  void stop() noexcept;
  // Polled about every 100 ms from run(); returning true stops the loop (used to deliver Python signals).
  void set_interrupt_check(std::function<bool()> check) { interrupt_check_ = std::move(check); }

  const EngineConfig& config() const { return config_; }

 private:
  bool await_workers_ready();
  bool handle_request(const ByteBuffer& record);  // false on Shutdown
  bool drain_requests();                          // false on Shutdown or stop
  bool wait_for_requests();                       // idle: sleeps on the request ring; false on Shutdown or stop
  bool await_result(StepResult& result);          // false on stop; WorkerFailure past step_timeout_s
  void check_result_ring_while_idle();
  void housekeeping(bool force);                  // worker liveness + interrupt check, rate limited
  [[noreturn]] void worker_died(pid_t pid);       // prefers rank 0's WorkerFailed reason, if one is on its way
  void emit(const ByteBuffer& record);            // waits for space: the event ring never drops a record
  template <class Record>
  void emit_record(const Record& r) {
    encode(r, event_buffer_);
    emit(event_buffer_);
  }
  void flush_outputs();
  EngineStats current_stats(uint64_t query_id) const;
  void maybe_emit_stats(bool force);  // unsolicited EngineStats, at most every stats_interval_ms unless forced
  void send_worker_shutdown() noexcept;
  bool stopping() const { return stop_.load(std::memory_order_acquire); }
  bool write_step_record(const ByteBuffer& record);  // waits for space; false on stop
  void emit_kv_pins();  // KvPinned events of finished prefill-only requests
  bool send_plan();     // the last schedule()'s KvPulls and StepPlan; false on stop

  EngineConfig config_;
  std::vector<pid_t> worker_pids_;
  RingReader requests_;
  RingWriter events_;
  RingWriter steps_;
  RingReader results_;
  std::atomic<bool> stop_{false};
  std::function<bool()> interrupt_check_;
  std::optional<Scheduler> scheduler_;
  std::chrono::steady_clock::time_point last_housekeeping_{};

  // Reused across steps so the hot loop does not allocate buffers.
  ByteBuffer in_buffer_;
  ByteBuffer plan_buffer_;
  ByteBuffer event_buffer_;
  StepPlan plan_;
  int64_t last_step_time_ns_ = 0;
  uint64_t outputs_step_id_ = 0;  // StepEvents.step_id of the pending outputs: the step whose update made them
  std::chrono::steady_clock::time_point last_stats_{};
  // KvRequestOptions wait here for the AddRequest that follows them (disaggregation, issue #8).
  std::unordered_map<uint64_t, KvRequestOptions> pending_kv_;
};

int64_t realtime_ns();

}  // namespace ringserve
