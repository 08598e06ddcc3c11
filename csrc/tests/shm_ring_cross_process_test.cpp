// Many writers and readers at once: several rings (SPSC and broadcast, tiny to roomy), each written by its own process
// and read by one process per reader index, records of random sizes up to the ring's maximum, each carrying its ring,
// sequence number, size and a checksum. Every reader checks that nothing is lost, duplicated, reordered or damaged.
//
// The same workload also runs with threads instead of processes: ThreadSanitizer cannot follow memory shared between
// processes, so the threaded run is the one that lets it check the ring's ordering; the forked run checks the real
// deployment (separate mappings, futex words shared across address spaces). Children are single-threaded and fork
// happens before this binary starts any thread, which is what TSan supports.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "ringserve/shm_ring.h"

using namespace ringserve;
using namespace std::chrono_literals;

namespace {

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr uint32_t kRecordsPerRing = 6000;
#else
constexpr uint32_t kRecordsPerRing = 30000;
#endif

struct RingSpec {
  uint64_t capacity;
  uint32_t readers;
};
// A 256-byte ring wraps on nearly every record and is full most of the time; the larger ones let bursts build up.
constexpr RingSpec kRings[] = {{256, 1}, {4096, 3}, {8192, 1}, {1 << 16, 2}};

struct RecordHead {
  uint32_t ring;
  uint32_t size;  // whole record
  uint64_t seq;
  uint64_t checksum;  // of the payload after this head
};

uint64_t mix(uint64_t x) {  // splitmix64: a cheap, well-spread hash for sizes and payload bytes
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Mostly small records, some medium, a few of the largest size the ring accepts.
size_t record_size(uint32_t ring, uint64_t seq, size_t max_size) {
  const uint64_t h = mix((uint64_t{ring} << 48) ^ seq);
  const size_t head = sizeof(RecordHead);
  const uint64_t pick = h % 100;
  if (pick < 5) return max_size;
  const size_t limit = pick < 30 ? max_size : std::min<size_t>(max_size, head + 48);
  return head + (h >> 8) % (limit - head + 1);
}

uint64_t checksum(const uint8_t* p, size_t n) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

void fill_record(std::vector<uint8_t>& out, uint32_t ring, uint64_t seq, size_t max_size) {
  out.resize(record_size(ring, seq, max_size));
  const uint64_t seed = mix(seq * 31 + ring);
  for (size_t i = sizeof(RecordHead); i < out.size(); ++i) out[i] = static_cast<uint8_t>((seed >> (i % 8 * 8)) ^ i);
  const RecordHead head{ring, static_cast<uint32_t>(out.size()), seq,
                        checksum(out.data() + sizeof(RecordHead), out.size() - sizeof(RecordHead))};
  std::memcpy(out.data(), &head, sizeof(head));
}

enum Failure : int { kOk = 0, kTimeout = 10, kWrongSequence = 11, kWrongSize = 12, kDamaged = 13, kException = 14 };

// Occasional pauses so that both sides also go through their futex sleeps (empty ring, full ring).
void maybe_pause(uint64_t seq, uint32_t salt) {
  if (mix(seq ^ (uint64_t{salt} << 40)) % 1500 == 0) std::this_thread::sleep_for(200us);
}

int write_all(const std::string& name, uint32_t ring_index) {
  try {
    auto ring = ShmRing::attach(name);
    RingWriter writer(ring);
    std::vector<uint8_t> record;
    for (uint64_t seq = 0; seq < kRecordsPerRing; ++seq) {
      fill_record(record, ring_index, seq, ring->max_record_size());
      if (!writer.write(record, 30s)) return kTimeout;
      maybe_pause(seq, ring_index * 100);
    }
    return kOk;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "writer of ring %u: %s\n", ring_index, e.what());
    return kException;
  }
}

int read_all(const std::string& name, uint32_t ring_index, uint32_t reader_index) {
  try {
    auto ring = ShmRing::attach(name);
    RingReader reader(ring, reader_index);
    std::vector<uint8_t> record;
    for (uint64_t seq = 0; seq < kRecordsPerRing; ++seq) {
      if (!reader.read(record, 30s)) return kTimeout;
      RecordHead head{};
      if (record.size() < sizeof(head)) return kWrongSize;
      std::memcpy(&head, record.data(), sizeof(head));
      if (head.ring != ring_index || head.seq != seq) {
        std::fprintf(stderr, "ring %u reader %u: got record %llu of ring %u where %llu was due\n", ring_index,
                     reader_index, static_cast<unsigned long long>(head.seq), head.ring,
                     static_cast<unsigned long long>(seq));
        return kWrongSequence;
      }
      if (head.size != record.size() || record.size() != record_size(ring_index, seq, ring->max_record_size())) {
        return kWrongSize;
      }
      if (head.checksum != checksum(record.data() + sizeof(head), record.size() - sizeof(head))) return kDamaged;
      maybe_pause(seq, ring_index * 100 + reader_index + 1);
    }
    std::vector<uint8_t> extra;
    if (reader.try_read(extra)) return kWrongSequence;  // a duplicate or a record nobody wrote
    return kOk;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reader %u of ring %u: %s\n", reader_index, ring_index, e.what());
    return kException;
  }
}

struct Rings {
  std::vector<std::shared_ptr<ShmRing>> rings;
  Rings() {
    for (size_t i = 0; i < std::size(kRings); ++i) {
      rings.push_back(ShmRing::create("/ringserve-test-" + std::to_string(::getpid()) + "-many-" + std::to_string(i),
                                      kRings[i].capacity, kRings[i].readers));
    }
  }
  ~Rings() {
    for (auto& r : rings) r->unlink();
  }
};

// Starts every writer and reader through `start` (on a forked process or a thread).
void run_everyone(const Rings& rings, const std::function<void(std::function<int()>)>& start) {
  for (uint32_t i = 0; i < rings.rings.size(); ++i) {
    const std::string name = rings.rings[i]->name();
    for (uint32_t r = 0; r < kRings[i].readers; ++r) start([name, i, r] { return read_all(name, i, r); });
    start([name, i] { return write_all(name, i); });
  }
}

}  // namespace

// First: fork before this process has started any thread.
TEST(many_writers_and_readers_in_separate_processes_lose_duplicate_and_reorder_nothing) {
  Rings rings;
  std::vector<pid_t> children;
  run_everyone(rings, [&](std::function<int()> body) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(body());
    children.push_back(pid);
  });
  // Reap with a deadline so a lost wake-up fails the test instead of hanging it.
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  size_t ok = 0;
  std::vector<pid_t> pending = children;
  while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(5ms);
      continue;
    }
    std::erase(pending, pid);
    if (WIFEXITED(status) && WEXITSTATUS(status) == kOk) {
      ++ok;
    } else {
      std::fprintf(stderr, "  child %d ended with status %d\n", pid, status);
    }
  }
  for (pid_t pid : pending) ::kill(pid, SIGKILL);
  for (pid_t pid : pending) ::waitpid(pid, nullptr, 0);
  CHECK(pending.empty());
  CHECK(ok == children.size());
}

TEST(many_writers_and_readers_on_threads_lose_duplicate_and_reorder_nothing) {
  Rings rings;
  std::vector<std::thread> threads;
  std::vector<int> codes(64, -1);
  size_t next = 0;
  run_everyone(rings, [&](std::function<int()> body) {
    const size_t slot = next++;
    threads.emplace_back([&codes, slot, body = std::move(body)] { codes[slot] = body(); });
  });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < next; ++i) CHECK(codes[i] == kOk);
}

TEST_MAIN()
