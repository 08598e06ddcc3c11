// The kernels' own helper threads. A job's chunks are dealt out as one contiguous range per thread (the caller and the
// helpers it wants); each thread claims its own range's chunks one at a time from the front, then takes the others'
// remaining chunks one at a time from their backs (work stealing), so a helper that the OS has descheduled, or that
// wakes late, holds up nobody: the others take its share. The caller returns once every claimed chunk has run; a
// helper that wakes late finds nothing left and goes back to sleep (there is no barrier it must join). Helpers spin
// briefly after a job, then sleep on a futex.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ringserve::kernels {

// body(context, first, last) runs items [first, last) of a job.
using ChunkBody = void (*)(void* context, std::size_t first, std::size_t last);

class WorkerPool {
 public:
  // `before_claim(helper)` runs on a helper each time it wakes for a job, before it claims anything (tests use it to
  // hold a helper back, as a descheduled thread would be).
  explicit WorkerPool(std::function<void(int)> before_claim = {});
  ~WorkerPool();  // stops and joins the helpers
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs body over [0, count) in chunks of `chunk` items on this thread and up to threads - 1 helpers; returns when
  // every item has run and rethrows the first exception a chunk threw (the chunks not yet started are skipped). A
  // call made while the pool runs another job (from a chunk, or from another thread) runs in order on its caller.
  void run(std::size_t count, std::size_t chunk, int threads, ChunkBody body, void* context);

  int helper_count() const;

 private:
  void helper_loop(int helper, std::uint32_t seen);
  // Claims and runs the current job's chunks until none is left: range `own`'s from the front, then the others'
  // from their backs.
  void drain(std::size_t own);
  void run_chunk(std::uint32_t index);
  void add_helpers(int wanted);

  // The current job, written by the caller before it publishes the job in `ranges_`: a thread reads it only after a
  // successful claim, which the caller waits for before it writes the next job's, so these need no atomics.
  ChunkBody body_ = nullptr;
  void* context_ = nullptr;
  std::size_t count_ = 0;
  std::size_t chunk_ = 1;
  std::uint32_t chunk_count_ = 0;

  // Each thread's range of chunks, end << 32 | next, on a cache line of its own (slot 0 the caller's, slot h + 1
  // helper h's): its owner claims chunk i by a CAS from (e, i) to (e, i + 1), another thread chunk e - 1 by a CAS from
  // (e, i) to (e - 1, i), both with i < e. Whatever job the word holds at that instant, the chunk is then ours and its
  // caller waits for it. Between jobs every range is empty (next == end).
  struct alignas(64) Range {
    std::atomic<std::uint64_t> word{0};
  };
  std::unique_ptr<Range[]> ranges_;
  alignas(64) std::atomic<std::uint32_t> ranges_used_{0};  // the current job's thread count (ranges 0 .. used - 1)
  alignas(64) std::atomic<std::uint32_t> done_{0};  // chunks of the current job finished (run or skipped)
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // the first exception; written under error_mutex_, read by the caller after the job
  std::mutex error_mutex_;

  alignas(64) std::atomic<std::uint32_t> epoch_{0};  // bumped per job (and on shutdown): what sleeping helpers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<int> helpers_wanted_{0};  // helpers 0 .. wanted - 1 take part in the current job
  std::atomic<bool> stop_{false};
  std::atomic<int> started_{0};  // helpers_.size(), readable outside run_mutex_

  std::mutex run_mutex_;  // one job at a time
  std::vector<std::thread> helpers_;
  std::function<void(int)> before_claim_;
};

// The process's pool (created on first use, recreated empty in a forked child, joined at exit).
WorkerPool& shared_pool();

}  // namespace ringserve::kernels
