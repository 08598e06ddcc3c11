// The native halves of benchmarks/ring.py: each runs in its own process on rings the script created, so the figures
// are the rings' own cost (RingWriter/RingReader, copy-out included) without Python call overhead.
//
// Every benchmark record starts with its u64 sequence number; the receiving side checks it, so a lost, duplicated or
// reordered record fails the benchmark instead of flattering it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringserve/shm_ring.h"

namespace ringserve {

struct RingThroughput {
  uint64_t records = 0;
  uint64_t bytes = 0;        // record payload bytes received
  int64_t elapsed_ns = 0;    // first record received -> last record received
};

namespace bench_detail {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void stamp(std::vector<uint8_t>& record, uint64_t seq) { std::memcpy(record.data(), &seq, sizeof(seq)); }

inline uint64_t seq_of(const std::vector<uint8_t>& record) {
  if (record.size() < sizeof(uint64_t)) throw std::runtime_error("benchmark record shorter than its sequence number");
  uint64_t seq;
  std::memcpy(&seq, record.data(), sizeof(seq));
  return seq;
}

inline std::vector<uint8_t> pattern_record(size_t size) {
  std::vector<uint8_t> r(std::max(size, sizeof(uint64_t)));
  for (size_t i = 0; i < r.size(); ++i) r[i] = static_cast<uint8_t>(i * 131u + 7u);
  return r;
}

}  // namespace bench_detail

// Sends `count` records of `record_size` bytes on `out`, each only after the previous one came back on `in`;
// returns every round trip in ns. Throws when a reply is missing (peer gone) or out of sequence.
inline std::vector<int64_t> bench_ring_ping(const std::shared_ptr<ShmRing>& out, const std::shared_ptr<ShmRing>& in,
                                            size_t record_size, uint64_t count, std::chrono::nanoseconds timeout) {
  using namespace bench_detail;
  RingWriter writer(out);
  RingReader reader(in, 0);
  std::vector<uint8_t> record = pattern_record(record_size);
  std::vector<uint8_t> reply;
  std::vector<int64_t> rtt;
  rtt.reserve(count);
  for (uint64_t seq = 0; seq < count; ++seq) {
    stamp(record, seq);
    const int64_t start = now_ns();
    if (!writer.write(record, timeout)) throw std::runtime_error("ping: the request ring stayed full");
    if (!reader.read(reply, timeout)) throw std::runtime_error("ping: no reply (is the echo process alive?)");
    rtt.push_back(now_ns() - start);
    if (seq_of(reply) != seq || reply.size() != record.size()) throw std::runtime_error("ping: wrong reply");
  }
  return rtt;
}

// The other side of bench_ring_ping: sends every record it reads back unchanged. Returns the records echoed.
inline uint64_t bench_ring_echo(const std::shared_ptr<ShmRing>& in, const std::shared_ptr<ShmRing>& out, uint64_t count,
                                std::chrono::nanoseconds timeout) {
  RingReader reader(in, 0);
  RingWriter writer(out);
  std::vector<uint8_t> record;
  for (uint64_t i = 0; i < count; ++i) {
    if (!reader.read(record, timeout)) throw std::runtime_error("echo: no request (is the ping process alive?)");
    if (!writer.write(record, timeout)) throw std::runtime_error("echo: the reply ring stayed full");
  }
  return count;
}

// Writes `count` sequence-numbered records of `record_size` bytes as fast as the reader frees space; returns the
// elapsed ns.
inline int64_t bench_ring_produce(const std::shared_ptr<ShmRing>& ring, size_t record_size, uint64_t count,
                                  std::chrono::nanoseconds timeout) {
  using namespace bench_detail;
  RingWriter writer(ring);
  std::vector<uint8_t> record = pattern_record(record_size);
  const int64_t start = now_ns();
  for (uint64_t seq = 0; seq < count; ++seq) {
    stamp(record, seq);
    if (!writer.write(record, timeout)) throw std::runtime_error("produce: the ring stayed full (consumer gone?)");
  }
  return now_ns() - start;
}

// Reads `count` records (copying each out, as every consumer does) and checks their sequence.
inline RingThroughput bench_ring_consume(const std::shared_ptr<ShmRing>& ring, uint64_t count,
                                         std::chrono::nanoseconds timeout) {
  using namespace bench_detail;
  RingReader reader(ring, 0);
  std::vector<uint8_t> record;
  RingThroughput t;
  int64_t first = 0;
  for (uint64_t seq = 0; seq < count; ++seq) {
    if (!reader.read(record, timeout)) throw std::runtime_error("consume: no record (is the producer alive?)");
    if (seq == 0) first = now_ns();
    if (seq_of(record) != seq) throw std::runtime_error("consume: record out of sequence");
    t.bytes += record.size();
  }
  t.records = count;
  t.elapsed_ns = now_ns() - first;
  return t;
}

}  // namespace ringserve
