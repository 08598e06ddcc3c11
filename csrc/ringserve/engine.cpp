#include "ringserve/engine.h"

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <variant>

#include "ringserve/process.h"

namespace ringserve {
namespace {

using namespace std::chrono_literals;

// How long a blocking wait lasts before the loop re-checks the stop flag and worker liveness.
constexpr auto kPollInterval = 100ms;
constexpr auto kDeathGrace = 3s;  // how long a dead worker's siblings get to report why
constexpr size_t kMaxFailureMessage = 1024;

}  // namespace

int64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

Engine::Engine(EngineConfig config, const std::string& request_ring, const std::string& event_ring,
               const std::string& step_ring, const std::string& result_ring, std::vector<pid_t> worker_pids)
    : config_(std::move(config)),
      worker_pids_(std::move(worker_pids)),
      requests_(ShmRing::attach(request_ring), 0),
      events_(ShmRing::attach(event_ring)),
      steps_(ShmRing::attach(step_ring)),
      results_(ShmRing::attach(result_ring), 0) {
  if (config_.block_size <= 0 || config_.max_num_seqs <= 0 || config_.max_num_batched_tokens <= 0 ||
      config_.num_blocks < 0 || config_.max_model_len < 0) {
    throw std::invalid_argument("EngineConfig: block_size, max_num_seqs and max_num_batched_tokens must be > 0");
  }
  if (!(config_.step_timeout_s >= 0 && std::isfinite(config_.step_timeout_s))) {
    throw std::invalid_argument("EngineConfig: step_timeout_s must be >= 0 seconds (0 = no limit)");
  }
  // A segment's name is only the rendezvous. The frontend mapped these rings when it created them and the engine
  // has now attached, so nothing needs the names any more: without them, the memory goes back to the system when
  // the last process holding a mapping exits, however it exits.
  requests_.ring()->unlink();
  events_.ring()->unlink();
}

void Engine::stop() noexcept {
  // release: a waiter that observes a bumped futex word (acquire) then sees this flag.
  stop_.store(true, std::memory_order_release);
  requests_.ring()->wake_readers();
  results_.ring()->wake_readers();
  events_.ring()->wake_writer();
  steps_.ring()->wake_writer();
}

void Engine::housekeeping(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_housekeeping_ < kPollInterval) return;
  last_housekeeping_ = now;
  for (const pid_t pid : worker_pids_) {
    if (!is_process_alive(pid)) worker_died(pid);
  }
  // Pinned blocks whose decode side never released them (it died, or the router gave up) go back to the pool.
  if (scheduler_ && scheduler_->num_pinned_requests() > 0) scheduler_->expire_pinned(realtime_ns());
  if (interrupt_check_ && interrupt_check_()) stop();
}

void Engine::emit(const ByteBuffer& record) {
  // Never drop: wait for the frontend to make room, unless we are shutting down anyway.
  while (!events_.write(record, kPollInterval, &stop_)) {
    if (stopping()) return;
    housekeeping(false);
  }
}

void Engine::send_worker_shutdown() noexcept {
  try {
    encode(WorkerShutdown{}, plan_buffer_);
    // No cancel flag: stop() has usually been called, and the workers must still hear about it.
    steps_.write(plan_buffer_, 1s);
  } catch (...) {  // best effort: the workers may be gone already
  }
}

namespace {

WorkerResult decode_from_worker(const ByteBuffer& record) {
  try {
    return decode_worker_result(record);
  } catch (const RecordError& e) {
    throw WorkerFailure(FailureReason::kEngineFailed,
                        std::string("malformed record on the result ring: ") + e.what());
  }
}

[[noreturn]] void throw_worker_failed(const WorkerFailed& f) {
  throw WorkerFailure(FailureReason::kWorkerDied, "worker rank " + std::to_string(f.rank) + " failed: " + f.message);
}

}  // namespace

void Engine::worker_died(pid_t pid) {
  // A rank that fails (a bad shard split, a broken file) exits at once, while rank 0, the result ring's only
  // writer, may still be formatting the reason. Give its WorkerFailed a moment so the caller hears why, not just
  // that a process died. Anything else on the ring is moot: the engine is failing.
  const auto deadline = std::chrono::steady_clock::now() + kDeathGrace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (!results_.read(in_buffer_, kPollInterval, &stop_)) {
      if (stopping() || std::ranges::none_of(worker_pids_, is_process_alive)) break;
      continue;
    }
    WorkerResult record;
    try {
      record = decode_worker_result(in_buffer_);
    } catch (const RecordError&) {
      continue;
    }
    if (const auto* failed = std::get_if<WorkerFailed>(&record)) throw_worker_failed(*failed);
  }
  const auto rank = std::ranges::find(worker_pids_, pid) - worker_pids_.begin();
  const std::string how = describe_child_exit(pid);
  throw WorkerFailure(FailureReason::kWorkerDied, "worker " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                                                      ") died" + (how.empty() ? "" : " (" + how + ")"));
}

bool Engine::await_workers_ready() {
  int64_t num_blocks = config_.num_blocks;  // the host may size the pool itself
  while (num_blocks <= 0) {
    if (results_.read(in_buffer_, kPollInterval, &stop_)) {
      const WorkerResult record = decode_from_worker(in_buffer_);
      if (const auto* ready = std::get_if<WorkerReady>(&record)) {
        if (ready->num_kv_blocks == 0) {
          throw WorkerFailure(FailureReason::kEngineFailed, "worker reported 0 KV blocks");
        }
        num_blocks = ready->num_kv_blocks;
      } else if (const auto* failed = std::get_if<WorkerFailed>(&record)) {
        throw_worker_failed(*failed);
      } else {
        throw WorkerFailure(FailureReason::kEngineFailed, "StepResult received before WorkerReady");
      }
      continue;
    }
    if (stopping()) return false;
    housekeeping(true);
  }
  if (config_.num_blocks <= 0) {
    // Every rank attached the step ring before joining the process group, and rank 0 reports ready only after
    // that group formed: the names of the step and result rings have served their purpose (see the constructor).
    steps_.ring()->unlink();
    results_.ring()->unlink();
  }
  EngineConfig config = config_;
  config.num_blocks = static_cast<int32_t>(num_blocks);
  scheduler_.emplace(std::move(config), steps_.ring()->max_record_size());
  return true;
}

bool Engine::handle_request(const ByteBuffer& record) {
  RequestRecord request;
  try {
    request = decode_request_record(record);
  } catch (const RecordError& e) {
    // Reported to the sender, never a crash; request id 0 because the id could not be read.
    std::fprintf(stderr, "ringserve engine: dropped malformed request record: %s\n", e.what());
    emit_record(RequestRejected{0, kStatusInvalidArgument, std::string("malformed request record: ") + e.what()});
    return true;
  }
  if (auto* add = std::get_if<AddRequest>(&request)) {
    const auto kv = pending_kv_.find(add->request_id);
    const KvRequestOptions* options = kv != pending_kv_.end() ? &kv->second : nullptr;
    if (auto rejected = scheduler_->add_request(*add, realtime_ns(), options)) emit_record(*rejected);
    if (options != nullptr) pending_kv_.erase(kv);
  } else if (auto* kv = std::get_if<KvRequestOptions>(&request)) {
    pending_kv_.insert_or_assign(kv->request_id, std::move(*kv));
  } else if (const auto* release = std::get_if<ReleaseKv>(&request)) {
    scheduler_->release_pinned(release->request_id);  // unknown: expired or released already
  } else if (const auto* abort = std::get_if<AbortRequest>(&request)) {
    // Options whose AddRequest never came (the frontend could not write it) are dropped with the request.
    pending_kv_.erase(abort->request_id);
    scheduler_->abort_request(abort->request_id);  // unknown id: already finished, nothing to do
  } else if (const auto* query = std::get_if<StatsQuery>(&request)) {
    emit_record(current_stats(query->query_id));
  } else {
    return false;  // Shutdown
  }
  return true;
}

bool Engine::drain_requests() {
  while (!stopping() && requests_.try_read(in_buffer_)) {
    if (!handle_request(in_buffer_)) return false;
  }
  housekeeping(false);
  return !stopping();
}

void Engine::check_result_ring_while_idle() {
  while (results_.try_read(in_buffer_)) {
    const WorkerResult record = decode_from_worker(in_buffer_);
    if (const auto* failed = std::get_if<WorkerFailed>(&record)) throw_worker_failed(*failed);
    if (std::holds_alternative<StepResult>(record)) {
      throw WorkerFailure(FailureReason::kEngineFailed, "StepResult received with no step in flight");
    }
  }
}

bool Engine::wait_for_requests() {
  // Idle: no step to run, so sleep on the request ring's futex (no CPU) and wake up every 100 ms to check liveness.
  while (true) {
    if (requests_.read(in_buffer_, kPollInterval, &stop_)) return handle_request(in_buffer_);
    if (stopping()) return false;
    check_result_ring_while_idle();
    housekeeping(false);
  }
}

bool Engine::await_result(StepResult& result) {
  // The step watchdog. housekeeping() sees a rank that died; a rank that runs but never finishes the step (a
  // deadlock, SIGSTOP, a collective waiting on a peer that is stuck) only shows as a result that does not come.
  // The clock starts here, after the plan went out and the previous step's events were emitted, so a slow frontend
  // does not count against the workers.
  const auto waiting_since = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(config_.step_timeout_s);
  while (true) {
    if (results_.read(in_buffer_, kPollInterval, &stop_)) {
      try {
        if (decode_step_result_into(in_buffer_, result)) return true;  // reuses result's arrays: no allocation
      } catch (const RecordError& e) {
        throw WorkerFailure(FailureReason::kEngineFailed,
                            std::string("malformed record on the result ring: ") + e.what());
      }
      const WorkerResult record = decode_from_worker(in_buffer_);
      if (const auto* failed = std::get_if<WorkerFailed>(&record)) throw_worker_failed(*failed);
      continue;  // a late WorkerReady carries nothing for a running engine
    }
    if (stopping()) return false;
    housekeeping(false);
    if (config_.step_timeout_s > 0 && std::chrono::steady_clock::now() - waiting_since > limit) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", config_.step_timeout_s);
      throw WorkerFailure(FailureReason::kStepTimeout,
                          std::string("no step result within --step-timeout ") + seconds +
                              " s: a rank is alive but stuck (deadlocked, stopped, or waiting on a peer that is)");
    }
  }
}

void Engine::emit_kv_pins() {
  for (const KvPinned& pin : scheduler_->kv_pins()) emit_record(pin);
  scheduler_->clear_kv_pins();
}

bool Engine::write_step_record(const ByteBuffer& record) {
  while (!steps_.write(record, kPollInterval, &stop_)) {
    if (stopping()) return false;
    housekeeping(false);
  }
  return true;
}

bool Engine::send_plan() {
  for (const KvPull& pull : scheduler_->kv_pulls()) {  // the workers pull these before running the plan
    encode(pull, plan_buffer_);
    if (!write_step_record(plan_buffer_)) return false;
  }
  encode(plan_, plan_buffer_);
  return write_step_record(plan_buffer_);
}

void Engine::flush_outputs() {
  emit_kv_pins();  // before the final outputs of the same requests, so a frontend has the handle when they end
  const std::span<const PackedOutput> outputs = scheduler_->outputs();
  if (outputs.empty()) return;
  const std::span<const int32_t> top_ids = scheduler_->output_top_token_ids();
  const std::span<const float> top_logprobs = scheduler_->output_top_logprobs();
  // One StepEvents per step; split only if it would not fit in one ring record.
  const size_t limit = events_.ring()->max_record_size();
  constexpr size_t kFixedBytes = 40;  // header, step_id, emit_time, output count, up to 7 bytes of padding
  const uint64_t step_id = outputs_step_id_;  // the step the pending outputs came from (the next one may be running)
  const int64_t emit_time = realtime_ns();
  size_t first = 0;
  size_t first_top = 0;  // side-array entries of outputs[first, i)
  size_t top = 0;
  size_t bytes = kFixedBytes;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const size_t b = encoded_size_bound(outputs[i]);
    if (i > first && bytes + b > limit) {
      encode_step_events(step_id, emit_time, outputs.subspan(first, i - first),
                         top_ids.subspan(first_top, top - first_top), top_logprobs.subspan(first_top, top - first_top),
                         event_buffer_);
      emit(event_buffer_);
      first = i;
      first_top = top;
      bytes = kFixedBytes;
    }
    bytes += b;
    top += outputs[i].num_top;
  }
  encode_step_events(step_id, emit_time, outputs.subspan(first), top_ids.subspan(first_top),
                     top_logprobs.subspan(first_top), event_buffer_);
  emit(event_buffer_);
  scheduler_->clear_outputs();
}

EngineStats Engine::current_stats(uint64_t query_id) const {
  EngineStats s = scheduler_->stats(query_id);
  s.step_time_ns = last_step_time_ns_;
  return s;
}

void Engine::maybe_emit_stats(bool force) {
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_stats_ < std::chrono::milliseconds(config_.stats_interval_ms)) return;
  last_stats_ = now;
  emit_record(current_stats(0));
}

void Engine::run() {
  try {
    if (await_workers_ready()) {
      const EngineConfig& c = scheduler_->config();
      emit_record(EngineReady{static_cast<uint32_t>(c.num_blocks), static_cast<uint32_t>(c.block_size),
                              static_cast<uint32_t>(c.max_model_len)});
      StepResult result;
      bool busy = false;  // ran a step since the last idle stats report
      while (drain_requests()) {
        const auto step_start = std::chrono::steady_clock::now();
        // With async scheduling a step may still be in flight here (planned ahead last time round): then the next
        // one is planned on top of it, below, and this iteration waits for the older one's result.
        if (scheduler_->num_steps_in_flight() == 0) {
          if (!scheduler_->schedule(plan_, realtime_ns())) {
            flush_outputs();  // the last step's tokens, aborts while nothing runs
            if (busy && config_.stats_interval_ms > 0) maybe_emit_stats(true);  // once when turning idle
            busy = false;
            if (!wait_for_requests()) break;
            continue;
          }
          busy = true;
          if (!send_plan()) break;
        }
        // Async scheduling: plan the next step while the workers compute this one; they read it as soon as they
        // finish, so the engine's update and scheduling leave the workers' critical path.
        if (config_.async_scheduling && scheduler_->schedule_ahead(plan_, realtime_ns()) && !send_plan()) break;
        // The previous step's tokens go out while the workers compute this one: encoding events overlaps the
        // forward pass instead of delaying the next plan. (schedule() leaves the pending outputs alone.)
        flush_outputs();
        if (!await_result(result)) break;
        try {
          scheduler_->update(result, realtime_ns());
        } catch (const std::runtime_error& e) {
          throw WorkerFailure(FailureReason::kEngineFailed,
                              std::string("worker broke the step protocol: ") + e.what());
        }
        outputs_step_id_ = result.step_id;  // not num_steps(): a step planned ahead may have been sent since
        last_step_time_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - step_start).count();
        scheduler_->observe_step_time(last_step_time_ns_);  // the decode-latency guard's cost model
        if (config_.stats_interval_ms > 0) maybe_emit_stats(false);
      }
      if (!stopping()) flush_outputs();  // Shutdown: the last step's outputs still reach the frontend
    }
  } catch (const std::exception& e) {
    // Fatal: tell the frontend so it fails every in-flight request, stop the workers, then surface the error.
    std::string message = e.what();
    if (message.size() > kMaxFailureMessage) message.resize(kMaxFailureMessage);
    const auto* failure = dynamic_cast<const WorkerFailure*>(&e);
    try {
      encode(EngineFailed{message, failure != nullptr ? failure->reason() : FailureReason::kEngineFailed},
             event_buffer_);
      events_.write(event_buffer_, 1s);  // best effort: the frontend may be gone too
    } catch (...) {
    }
    send_worker_shutdown();
    throw;
  }
  send_worker_shutdown();
}

}  // namespace ringserve
