#include "kernels/worker_pool.h"

#include "kernels/parallel.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

namespace ringserve::kernels {
namespace {

constexpr int kMaxHelpers = 255;
// How long a helper spins for the next job before it sleeps, and the caller for the last chunks before it sleeps:
// a step's kernels follow each other within tens of microseconds, while a futex wake costs about as much.
constexpr auto kHelperSpin = std::chrono::microseconds(50);
constexpr auto kCallerSpin = std::chrono::microseconds(20);

void pause_briefly() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until done() or `limit` has passed; true when done().
template <class Done>
bool spin_until(Done done, std::chrono::microseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      pause_briefly();
    }
    if (std::chrono::steady_clock::now() >= end) return done();
  }
}

// Sleeps while `word` holds `expected` (the kernel compares atomically, so a change just before is not missed), and
// wakes up to `count` sleepers. Raw futexes: libstdc++ 12's atomic::wait/notify_all lost wake-ups here.
void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<std::uint32_t>& word, int count) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

thread_local bool in_job = false;  // this thread is running a chunk (a nested call then runs in order)

constexpr std::uint64_t pack(std::uint32_t end, std::uint32_t next) {
  return std::uint64_t{end} << 32 | next;
}

}  // namespace

WorkerPool::WorkerPool(std::function<void(int)> before_claim)
    : ranges_(std::make_unique<Range[]>(kMaxHelpers + 1)), before_claim_(std::move(before_claim)) {}

WorkerPool::~WorkerPool() {
  stop_.store(true, std::memory_order_seq_cst);
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(epoch_, kMaxHelpers);
  for (std::thread& t : helpers_) t.join();
}

int WorkerPool::helper_count() const { return started_.load(std::memory_order_relaxed); }

void WorkerPool::add_helpers(int wanted) {
  while (static_cast<int>(helpers_.size()) < wanted) {
    const int helper = static_cast<int>(helpers_.size());
    // The epoch now, before the job that wants it is published: a helper that starts late still sees that job (and
    // a shutdown) as a change.
    const std::uint32_t seen = epoch_.load(std::memory_order_relaxed);
    helpers_.emplace_back([this, helper, seen] { helper_loop(helper, seen); });
    pthread_setname_np(helpers_.back().native_handle(), "ringserve-pool");
    started_.store(static_cast<int>(helpers_.size()), std::memory_order_relaxed);
  }
}

void WorkerPool::run(std::size_t count, std::size_t chunk, int threads, ChunkBody body, void* context) {
  chunk = std::max<std::size_t>(chunk, 1);
  // Chunk indices are 32-bit: a (theoretical) job of more chunks takes larger ones.
  chunk = std::max(chunk, count / std::numeric_limits<std::uint32_t>::max() + 1);
  const std::size_t chunks = (count + chunk - 1) / chunk;
  const int helpers = std::min({threads - 1, kMaxHelpers, static_cast<int>(std::min<std::size_t>(chunks, 256)) - 1});
  std::unique_lock<std::mutex> lock(run_mutex_, std::defer_lock);
  if (in_job || helpers < 1 || !lock.try_lock()) {
    body(context, 0, count);
    return;
  }
  add_helpers(helpers);
  body_ = body;
  context_ = context;
  count_ = count;
  chunk_ = chunk;
  chunk_count_ = static_cast<std::uint32_t>(chunks);
  failed_.store(false, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  helpers_wanted_.store(helpers, std::memory_order_relaxed);
  const auto threads_used = static_cast<std::uint32_t>(helpers + 1);
  ranges_used_.store(threads_used, std::memory_order_relaxed);
  // Release: a thread whose claim reads one of these values (or a later CAS of it) sees the job written above.
  for (std::uint32_t t = 0; t < threads_used; ++t) {
    ranges_[t].word.store(pack(static_cast<std::uint32_t>(chunks * (t + 1) / threads_used),
                               static_cast<std::uint32_t>(chunks * t / threads_used)),
                          std::memory_order_release);
  }
  // seq_cst with the helpers' sleepers_ increment then epoch_ load: either they see the new epoch or we see them.
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(epoch_, kMaxHelpers);

  drain(0);
  const auto total = static_cast<std::uint32_t>(chunks);
  // Acquire: pairs with each thread's release increment, so the chunks' writes are visible when we return.
  if (!spin_until([&] { return done_.load(std::memory_order_acquire) == total; }, kCallerSpin)) {
    // seq_cst with the helpers' increment then caller_sleeping_ load: either we see the last increment or they wake us.
    caller_sleeping_.store(true, std::memory_order_seq_cst);
    for (std::uint32_t seen = done_.load(std::memory_order_seq_cst); seen != total;
         seen = done_.load(std::memory_order_seq_cst)) {
      futex_wait(done_, seen);
    }
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }
  if (failed_.load(std::memory_order_acquire)) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> guard(error_mutex_);
      error = std::exchange(error_, nullptr);
    }
    std::rethrow_exception(error);
  }
}

void WorkerPool::drain(std::size_t own) {
  // Chunks run here are added to done_ once, at the end: while this thread holds any, the job cannot end, so all its
  // claims are of one job (a late thread's first claim may be of the next job: that is then the job it helps with).
  std::uint32_t ran = 0;
  auto claim_all = [&](std::atomic<std::uint64_t>& word, bool front) {
    std::uint64_t seen = word.load(std::memory_order_acquire);
    for (;;) {
      const auto end = static_cast<std::uint32_t>(seen >> 32);
      const auto next = static_cast<std::uint32_t>(seen);
      if (next >= end) return;
      // Acquire on success: the job's fields, written before the caller's release store of this word, are visible.
      if (word.compare_exchange_weak(seen, front ? pack(end, next + 1) : pack(end - 1, next),
                                     std::memory_order_acquire, std::memory_order_acquire)) {
        run_chunk(front ? next : end - 1);
        ++ran;
        seen = word.load(std::memory_order_acquire);
      }
    }
  };
  claim_all(ranges_[own].word, true);
  // Then the others' ranges, each from its back. A stale count (a late thread's) only changes which empty ranges it
  // reads: the caller, which knows its job's, empties every range before it waits.
  const std::size_t used = std::max<std::uint32_t>(ranges_used_.load(std::memory_order_relaxed), 1);
  for (std::size_t k = 1; k <= used; ++k) {
    const std::size_t other = (own + k) % used;
    if (other != own) claim_all(ranges_[other].word, false);
  }
  if (ran == 0) return;
  const std::uint32_t total = chunk_count_;  // read before the increment: after it the job may be over
  const std::uint32_t finished = done_.fetch_add(ran, std::memory_order_seq_cst) + ran;
  // The caller may return (and start the next job) as soon as the count reaches the total: touch nothing of the job
  // after the increment; a stale wake-up below is harmless.
  if (finished == total && caller_sleeping_.load(std::memory_order_seq_cst)) futex_wake(done_, 1);
}

void WorkerPool::run_chunk(std::uint32_t index) {
  if (failed_.load(std::memory_order_relaxed)) return;  // a chunk threw: skip the rest
  const std::size_t first = std::size_t{index} * chunk_;
  const std::size_t last = std::min(count_, first + chunk_);
  in_job = true;
  try {
    body_(context_, first, last);
  } catch (...) {
    std::lock_guard<std::mutex> guard(error_mutex_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true, std::memory_order_release);
  }
  in_job = false;
}

void WorkerPool::helper_loop(int helper, std::uint32_t seen) {
  for (;;) {
    if (!spin_until([&] { return epoch_.load(std::memory_order_acquire) != seen; }, kHelperSpin)) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(epoch_, seen);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = epoch_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    if (helper >= helpers_wanted_.load(std::memory_order_relaxed)) continue;
    if (before_claim_) before_claim_(helper);
    drain(static_cast<std::size_t>(helper) + 1);
  }
}

namespace {

std::atomic<WorkerPool*> current_pool{nullptr};

// The pool is deleted (its helpers joined) at exit. A forked child has none of the parent's helper threads: it
// forgets the parent's pool (leaking its memory; its threads cannot be joined there) and makes its own on first use.
struct PoolOwner {
  PoolOwner() {
    pthread_atfork(nullptr, nullptr, [] { current_pool.store(nullptr, std::memory_order_relaxed); });
  }
  ~PoolOwner() { delete current_pool.exchange(nullptr); }
};

}  // namespace

WorkerPool& shared_pool() {
  static PoolOwner owner;
  WorkerPool* pool = current_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  auto* fresh = new WorkerPool();  // no threads yet: they start with the first job
  if (current_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *pool;
}

void run_chunks(std::size_t count, std::size_t chunk, int threads, void (*body)(void*, std::size_t, std::size_t),
                void* context) {
  shared_pool().run(count, chunk, threads, body, context);
}

}  // namespace ringserve::kernels
