// The kernels' worker pool: every item once for any thread count, exceptions, nested and concurrent calls, a helper
// held back (as a descheduled one would be) not holding up the call, a held caller's range taken from its back by the
// helpers, and a forked child. Run under TSan too.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/worker_pool.h"
#include "tests/check.h"

using namespace ringserve::kernels;

namespace {

struct Visits {
  explicit Visits(std::size_t count) : counts(count) {}
  std::vector<std::atomic<int>> counts;
  bool each_once() const {
    for (const auto& c : counts) {
      if (c.load() != 1) return false;
    }
    return true;
  }
};

template <class Fn>
void run_items(WorkerPool& pool, std::size_t count, std::size_t chunk, int threads, Fn& fn) {
  pool.run(count, chunk, threads,
           [](void* context, std::size_t first, std::size_t last) {
             for (std::size_t i = first; i < last; ++i) (*static_cast<Fn*>(context))(i);
           },
           &fn);
}

// Waits up to 10 s for flag; false if it never came (the test then fails instead of hanging).
bool wait_for(const std::atomic<bool>& flag) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!flag.load()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

}  // namespace

TEST(every_item_runs_exactly_once_for_one_to_four_threads) {
  for (int threads = 1; threads <= 4; ++threads) {
    for (std::size_t count : {0, 1, 2, 3, 7, 64, 1000, 10007}) {
      Visits a(count), b(count);
      for_each_item(count, threads, true, [&](std::size_t i) { a.counts[i].fetch_add(1); });
      for_each_item_dynamic(count, threads, true, [&](std::size_t i) { b.counts[i].fetch_add(1); });
      CHECK(a.each_once());
      CHECK(b.each_once());
    }
  }
}

TEST(uneven_chunks_cover_the_tail) {
  WorkerPool pool;
  for (std::size_t chunk : {1, 3, 64, 5000}) {
    Visits v(1001);
    auto visit = [&](std::size_t i) { v.counts[i].fetch_add(1); };
    run_items(pool, 1001, chunk, 3, visit);
    CHECK(v.each_once());
  }
  CHECK(pool.helper_count() == 2);
}

TEST(a_chunk_that_throws_reaches_the_caller_and_the_pool_keeps_working) {
  for (int threads = 1; threads <= 4; ++threads) {
    bool thrown = false;
    try {
      for_each_item_dynamic(100, threads, true, [](std::size_t i) {
        if (i == 37) throw std::runtime_error("item 37");
      });
    } catch (const std::runtime_error& e) {
      thrown = std::string(e.what()) == "item 37";
    }
    CHECK(thrown);
    Visits v(100);
    for_each_item(100, threads, true, [&](std::size_t i) { v.counts[i].fetch_add(1); });
    CHECK(v.each_once());
  }
}

TEST(a_held_back_helper_does_not_hold_up_the_call) {
  std::atomic<bool> hold{false}, held{false}, release{false};
  WorkerPool pool([&](int) {
    if (!hold.load()) return;
    held.store(true);
    wait_for(release);
  });
  Visits warm(64);  // starts the helper
  auto visit_warm = [&](std::size_t i) { warm.counts[i].fetch_add(1); };
  run_items(pool, 64, 1, 2, visit_warm);
  CHECK(warm.each_once());

  hold.store(true);
  Visits v(64);
  std::atomic<int> on_helper{0};
  const std::thread::id caller = std::this_thread::get_id();
  bool helper_was_held = true;
  auto visit = [&](std::size_t i) {
    if (i == 0) helper_was_held = wait_for(held);  // the helper woke for this job and is stuck before claiming
    if (std::this_thread::get_id() != caller) on_helper.fetch_add(1);
    v.counts[i].fetch_add(1);
  };
  run_items(pool, 64, 1, 2, visit);  // returns with the helper still held
  CHECK(helper_was_held);
  CHECK(v.each_once());
  CHECK(on_helper.load() == 0);

  hold.store(false);
  release.store(true);  // it wakes late, finds nothing to claim and goes back to sleep
  for (int round = 0; round < 20; ++round) {
    Visits again(257);
    auto visit_again = [&](std::size_t i) { again.counts[i].fetch_add(1); };
    run_items(pool, 257, 2, 2, visit_again);
    CHECK(again.each_once());
  }
}

TEST(each_thread_starts_on_its_own_range_and_then_takes_the_others_from_their_backs) {
  std::atomic<bool> caller_started{false};
  WorkerPool pool([&](int) { wait_for(caller_started); });  // no helper claims before the caller has its first item
  for (int threads = 2; threads <= 4; ++threads) {
    caller_started.store(false);
    constexpr std::size_t kItems = 64;
    Visits v(kItems);
    std::mutex order_mutex;
    std::vector<std::size_t> on_helpers;  // items the helpers ran, in the order they ran them
    std::atomic<std::size_t> helper_items{0};
    const std::thread::id caller = std::this_thread::get_id();
    bool rest_taken = true;
    auto visit = [&](std::size_t i) {
      if (std::this_thread::get_id() == caller) {
        // The caller holds its first item until the helpers have run every other one: its own range's rest too.
        if (i == 0) {
          caller_started.store(true);
          const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (helper_items.load() < kItems - 1 && std::chrono::steady_clock::now() < end) std::this_thread::yield();
          rest_taken = helper_items.load() == kItems - 1;
        }
      } else {
        std::lock_guard<std::mutex> guard(order_mutex);
        on_helpers.push_back(i);
        helper_items.fetch_add(1);
      }
      v.counts[i].fetch_add(1);
    };
    run_items(pool, kItems, 1, threads, visit);
    CHECK(v.each_once());
    CHECK(rest_taken);
    // The caller's range is [0, 64 / threads): the helpers took all of it but item 0; one helper takes it from the
    // back, in descending order (several may record theirs out of order).
    const std::size_t caller_end = kItems / static_cast<std::size_t>(threads);
    std::vector<std::size_t> taken;
    for (const std::size_t i : on_helpers) {
      if (i < caller_end) taken.push_back(i);
    }
    CHECK(taken.size() == caller_end - 1);
    if (threads == 2) {
      for (std::size_t k = 0; k < taken.size(); ++k) CHECK(taken[k] == caller_end - 1 - k);
    }
  }
}

TEST(a_call_inside_a_chunk_runs_in_order_on_its_thread) {
  Visits v(16 * 16);
  for_each_item_dynamic(16, 2, true, [&](std::size_t outer) {
    for_each_item(16, 2, true, [&](std::size_t inner) { v.counts[outer * 16 + inner].fetch_add(1); });
  });
  CHECK(v.each_once());
}

TEST(calls_from_several_threads_each_finish) {
  std::vector<std::unique_ptr<Visits>> visits;
  for (int t = 0; t < 3; ++t) visits.push_back(std::make_unique<Visits>(5000));
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&, t] {
      for (int round = 0; round < 10; ++round) {
        for_each_item(500, 2, true, [&](std::size_t i) { visits[t]->counts[round * 500 + i].fetch_add(1); });
      }
    });
  }
  for (std::thread& c : callers) c.join();
  for (const auto& v : visits) CHECK(v->each_once());
}

TEST(a_pool_with_sleeping_helpers_shuts_down) {
  for (int round = 0; round < 5; ++round) {
    WorkerPool pool;
    Visits v(100);
    auto visit = [&](std::size_t i) { v.counts[i].fetch_add(1); };
    run_items(pool, 100, 1, 4, visit);
    CHECK(v.each_once());
    std::this_thread::sleep_for(std::chrono::milliseconds(round));  // helpers spinning, then asleep
  }
}

#if !defined(__SANITIZE_THREAD__)  // TSan does not support starting threads in a child of a multi-threaded process
TEST(a_forked_child_gets_its_own_pool) {
  for_each_item(1000, 2, true, [](std::size_t) {});  // the parent's helpers exist
  const pid_t child = fork();
  if (child == 0) {
    Visits v(1000);
    for_each_item(1000, 2, true, [&](std::size_t i) { v.counts[i].fetch_add(1); });
    _exit(v.each_once() ? 0 : 1);
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}
#endif

TEST_MAIN()
