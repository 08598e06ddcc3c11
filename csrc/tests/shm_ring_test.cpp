#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <system_error>
#include <thread>

#include "check.h"
#include "ringserve/ring_notifier.h"
#include "ringserve/shm_ring.h"

using namespace ringserve;
using namespace std::chrono_literals;

namespace {

std::string unique_name(const char* what) {
  static int counter = 0;
  return "/ringserve-test-" + std::to_string(::getpid()) + "-" + what + "-" + std::to_string(counter++);
}

// Creates a ring and unlinks its name when the test ends.
struct TestRing {
  std::shared_ptr<ShmRing> ring;
  TestRing(const char* what, uint64_t capacity, uint32_t readers = 1)
      : ring(ShmRing::create(unique_name(what), capacity, readers)) {}
  ~TestRing() { ring->unlink(); }
};

// Record i: 4-byte sequence number followed by (i * 7) % max_extra bytes of a pattern derived from i.
std::vector<uint8_t> make_record(uint32_t i, size_t max_extra) {
  std::vector<uint8_t> r(4 + (i * 7u) % (max_extra + 1));
  std::memcpy(r.data(), &i, 4);
  for (size_t k = 4; k < r.size(); ++k) r[k] = static_cast<uint8_t>(i * 31u + k);
  return r;
}

bool is_record(const std::vector<uint8_t>& r, uint32_t i, size_t max_extra) { return r == make_record(i, max_extra); }

}  // namespace

// First: fork is cleanest before any test has started threads.
TEST(records_cross_processes_through_fork) {
  TestRing t("fork", 4096);
  constexpr uint32_t kCount = 20000;
  const pid_t child = ::fork();
  if (child == 0) {
    auto ring = ShmRing::attach(t.ring->name());
    RingWriter writer(ring);
    for (uint32_t i = 0; i < kCount; ++i) {
      if (!writer.write(make_record(i, 100), 10s)) ::_exit(2);
    }
    ::_exit(0);
  }
  RingReader reader(t.ring, 0);
  std::vector<uint8_t> rec;
  bool in_order = true;
  for (uint32_t i = 0; i < kCount; ++i) {
    if (!reader.read(rec, 10s) || !is_record(rec, i, 100)) {
      in_order = false;
      break;
    }
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(in_order);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(stale_segments_of_dead_creators_are_reclaimed) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // reaped: the pid no longer exists
  const std::string stale = "/ringserve-" + std::to_string(child) + "-0123456789abcdef-req";
  const std::string live = "/ringserve-" + std::to_string(::getpid()) + "-0123456789abcdef-req";
  auto a = ShmRing::create(stale, 64);
  auto b = ShmRing::create(live, 64);
  const auto reclaimed = reclaim_stale_segments();
  CHECK(std::count(reclaimed.begin(), reclaimed.end(), stale) == 1);
  CHECK(std::count(reclaimed.begin(), reclaimed.end(), live) == 0);
  CHECK_THROWS(std::system_error, ShmRing::attach(stale));
  auto again = ShmRing::attach(live);
  CHECK(again->capacity() == 64);
  b->unlink();
}

TEST(create_attach_and_header_fields) {
  TestRing t("attach", 1024, 3);
  CHECK_THROWS(std::system_error, ShmRing::create(t.ring->name(), 1024));  // O_EXCL
  auto other = ShmRing::attach(t.ring->name());
  CHECK(other->capacity() == 1024 && other->num_readers() == 3);
  CHECK(other->max_record_size() == 512 - 8);
  CHECK(other->header().creator_pid == ::getpid());
  CHECK_THROWS(std::invalid_argument, ShmRing::create(unique_name("bad"), 1000));
  CHECK_THROWS(std::invalid_argument, ShmRing::create(unique_name("bad"), 1024, 9));
  CHECK_THROWS(std::invalid_argument, RingReader(t.ring, 3));
  CHECK_THROWS(std::system_error, ShmRing::attach(unique_name("missing")));
}

TEST(oversized_records_are_refused_and_the_largest_fits_after_a_wrap) {
  TestRing t("max", 64);
  RingWriter w(t.ring);
  RingReader r(t.ring, 0);
  std::vector<uint8_t> big(t.ring->max_record_size() + 1);
  CHECK_THROWS(std::invalid_argument, w.try_write(big));
  std::vector<uint8_t> out;
  // Move the position to offset 8 so the next max-size frame needs a padding frame.
  CHECK(w.try_write(std::vector<uint8_t>{}));
  CHECK(r.try_read(out) && out.empty());
  big.pop_back();
  for (int i = 0; i < 10; ++i) {
    std::fill(big.begin(), big.end(), static_cast<uint8_t>(i));
    CHECK(w.try_write(big));
    CHECK(r.try_read(out) && out == big);
  }
}

TEST(wrap_around_keeps_records_intact) {
  TestRing t("wrap", 256);
  RingWriter w(t.ring);
  RingReader r(t.ring, 0);
  std::vector<uint8_t> out;
  uint32_t next_write = 0;
  uint32_t next_read = 0;
  std::mt19937 rng(1);
  while (next_read < 5000) {
    // Write a random burst until full, then read a random burst.
    for (int k = rng() % 6; k >= 0 && w.try_write(make_record(next_write, 100)); --k) ++next_write;
    for (int k = rng() % 6; k >= 0 && r.try_read(out); --k) {
      CHECK(is_record(out, next_read, 100));
      ++next_read;
    }
  }
  CHECK(next_write >= next_read);
}

TEST(full_ring_refuses_until_the_reader_consumes) {
  TestRing t("full", 128);
  RingWriter w(t.ring);
  RingReader r(t.ring, 0);
  const std::vector<uint8_t> rec(24, 1);  // 32-byte frames: exactly 4 fit
  int written = 0;
  while (w.try_write(rec)) ++written;
  CHECK(written == 4);
  CHECK(!w.write(rec, 20ms));  // times out instead of overwriting
  std::vector<uint8_t> out;
  CHECK(r.try_read(out));
  CHECK(w.try_write(rec));
  CHECK(!w.try_write(rec));
}

TEST(broadcast_reaches_every_reader_and_never_overwrites_unread_data) {
  TestRing t("bcast", 256, 3);
  RingWriter w(t.ring);
  RingReader r0(t.ring, 0), r1(t.ring, 1), r2(t.ring, 2);
  uint32_t written = 0;
  while (w.try_write(make_record(written, 20))) ++written;
  CHECK(written > 3);
  std::vector<uint8_t> out;
  for (uint32_t i = 0; i < written; ++i) CHECK(r0.try_read(out) && is_record(out, i, 20));
  CHECK(!r0.try_read(out));
  // Reader 0 is done, but readers 1 and 2 have not read anything: still full.
  CHECK(!w.try_write(make_record(written, 20)));
  for (uint32_t i = 0; i < written; ++i) CHECK(r1.try_read(out) && is_record(out, i, 20));
  CHECK(!w.try_write(make_record(written, 20)));
  for (uint32_t i = 0; i < written; ++i) CHECK(r2.try_read(out) && is_record(out, i, 20));
  CHECK(w.try_write(make_record(written, 20)));  // room freed once the slowest reader caught up
  for (RingReader* r : {&r0, &r1, &r2}) CHECK(r->try_read(out) && is_record(out, written, 20));
}

TEST(threads_stream_records_with_futex_sleeps) {
  TestRing t("stress", 1024, 3);
  constexpr uint32_t kCount = 50000;
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (uint32_t idx = 0; idx < 3; ++idx) {
    readers.emplace_back([&, idx] {
      RingReader r(t.ring, idx);
      std::vector<uint8_t> out;
      std::mt19937 rng(idx);
      for (uint32_t i = 0; i < kCount; ++i) {
        if (!r.read(out, 10s) || !is_record(out, i, 200)) {
          ++bad;
          return;
        }
        if (rng() % 4096 == 0) std::this_thread::sleep_for(1ms);  // let the writer fill up and sleep
      }
    });
  }
  RingWriter w(t.ring);
  std::mt19937 rng(99);
  for (uint32_t i = 0; i < kCount; ++i) {
    if (!w.write(make_record(i, 200), 10s)) {
      ++bad;
      break;
    }
    if (rng() % 4096 == 0) std::this_thread::sleep_for(1ms);  // let the readers go idle and sleep
  }
  for (auto& th : readers) th.join();
  CHECK(bad.load() == 0);
}

TEST(cancel_wakes_a_sleeping_reader) {
  TestRing t("cancel", 256);
  std::atomic<bool> cancel{false};
  std::atomic<bool> returned{false};
  std::thread th([&] {
    RingReader r(t.ring, 0);
    std::vector<uint8_t> out;
    const bool got = r.read(out, 60s, &cancel);
    returned.store(!got);
  });
  std::this_thread::sleep_for(50ms);
  cancel.store(true);
  t.ring->wake_readers();
  th.join();  // would hang for 60 s if the wake were lost
  CHECK(returned.load());
}

TEST(peeked_record_stays_in_place_until_released) {
  TestRing t("peek", 128);
  RingWriter w(t.ring);
  RingReader r(t.ring, 0);
  CHECK(!r.peek().has_value());
  const std::vector<uint8_t> rec(24, 7);  // 32-byte frames: 4 fill the ring
  while (w.try_write(rec)) {
  }
  const auto first = r.peek();
  CHECK(first.has_value() && std::equal(first->begin(), first->end(), rec.begin(), rec.end()));
  CHECK(!w.try_write(rec));  // a peeked record is not consumed: its bytes cannot be reused yet
  const auto again = r.peek();
  CHECK(again.has_value() && again->data() == first->data());
  r.release();
  // Consumed records are published to the writer once the reader has caught up with what it saw.
  int consumed = 1;
  while (r.peek()) {
    r.release();
    ++consumed;
  }
  CHECK(consumed == 4);
  for (int i = 0; i < 4; ++i) CHECK(w.try_write(rec));
}

TEST(wait_reports_data_without_consuming_it) {
  TestRing t("wait", 256);
  RingWriter w(t.ring);
  RingReader r(t.ring, 0);
  CHECK(!r.wait(20ms));
  std::thread late([&] {
    std::this_thread::sleep_for(30ms);  // the reader is asleep on the futex by now
    w.try_write(std::vector<uint8_t>{1, 2, 3});
  });
  CHECK(r.wait(10s));
  late.join();
  CHECK(r.wait(0ms));  // still there: wait() consumed nothing
  std::vector<uint8_t> out;
  CHECK(r.try_read(out) && out == std::vector<uint8_t>({1, 2, 3}));
}

TEST(reader_times_out_on_an_empty_ring) {
  TestRing t("timeout", 256);
  RingReader r(t.ring, 0);
  std::vector<uint8_t> out;
  CHECK(!r.read(out, 30ms));
  CHECK(!r.try_read(out));
}

TEST(notifier_queues_records_and_signals_its_eventfd) {
  TestRing t("notify", 1024);
  RingNotifier notifier(t.ring, 0);
  CHECK(notifier.drain().empty());
  constexpr uint32_t kCount = 3000;
  std::thread producer([&] {
    RingWriter w(t.ring);
    for (uint32_t i = 0; i < kCount; ++i) {
      if (!w.write(make_record(i, 60), 10s)) return;
      if (i % 500 == 0) std::this_thread::sleep_for(2ms);  // let the notifier thread sleep on the futex
    }
  });
  uint32_t next = 0;
  bool in_order = true;
  while (next < kCount && in_order) {
    pollfd pfd{notifier.fileno(), POLLIN, 0};
    if (::poll(&pfd, 1, 10000) != 1) break;
    for (const auto& rec : notifier.drain()) in_order &= is_record(rec, next++, 60);
  }
  producer.join();
  CHECK(in_order && next == kCount);
  notifier.close();
  CHECK(notifier.fileno() == -1);
}

TEST_MAIN()
