// A shared-memory ring: one writer, N readers (SPSC is N = 1), variable-length records.
//
// Segment layout: a 4 KiB header page (RingHeader) followed by `capacity` data bytes (a power of two).
// Positions are monotonically increasing u64 byte counters; the data offset is `position & (capacity - 1)`.
// Every record travels in a frame: FrameHeader{u32 size, u32 payload_len} + payload, zero-padded to 8 bytes.
// Wrap-around: a frame never straddles the end of the data area. When the bytes left before the end are too few,
// the writer fills them with one padding frame (payload_len == kPaddingFrame) and starts the record at offset 0;
// readers skip padding frames. Hence the largest record is capacity / 2 - 8 bytes (max_record_size()): it must fit
// after a worst-case padding frame.
//
// Broadcast: every reader has its own read index and sees every record; the writer never overwrites bytes that the
// slowest reader has not consumed, so all `num_readers` readers must keep reading or the writer blocks.
//
// Index traffic: a reader loads write_index only when it has used up the records it saw, and publishes its read index
// when it has caught up (always before it can sleep) or after consuming a quarter of the ring, so the two indices'
// cache lines do not travel between the cores once per record.
//
// Waiting: a reader spins briefly, then sleeps on a shared futex word in the segment (data_seq) with a timeout; the
// writer issues FUTEX_WAKE only when some reader announced that it sleeps. A writer waiting for space sleeps on
// space_seq the same way and readers wake it only when it announced it sleeps. Both are Dekker-style handshakes:
// each side stores its own word, executes a seq_cst fence, then loads the other side's word, so at least one side
// sees the other and no wake-up is lost.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ringserve {

inline constexpr uint32_t kMaxRingReaders = 8;
inline constexpr uint64_t kRingMagic = 0x474e4952'56525352ull;  // "RSRVRING"
inline constexpr uint32_t kRingLayoutVersion = 1;
inline constexpr size_t kCacheLine = 64;
inline constexpr size_t kRingHeaderBytes = 4096;
inline constexpr uint64_t kMinRingCapacity = 64;
inline constexpr uint64_t kMaxRingCapacity = uint64_t{1} << 32;

struct FrameHeader {
  uint32_t size;         // whole frame, header and padding included; multiple of 8
  uint32_t payload_len;  // record bytes, or kPaddingFrame
};
inline constexpr uint32_t kPaddingFrame = 0xFFFFFFFFu;

// The header page. Each index lives on its own cache line because exactly one side writes it (no false sharing).
struct RingHeader {
  std::atomic<uint64_t> magic;  // stored last by create() with release; attach() trusts nothing before seeing it
  uint32_t layout_version;
  uint32_t num_readers;
  uint64_t capacity;
  int32_t creator_pid;
  std::atomic<int32_t> writer_pid;  // pid of the process that last constructed a RingWriter (0 = none yet)

  alignas(kCacheLine) std::atomic<uint64_t> write_index;  // written by the writer only

  alignas(kCacheLine) std::atomic<uint32_t> data_seq;  // futex word readers sleep on; bumped before each wake
  std::atomic<uint32_t> sleeping_readers;             // readers inside the futex sleep path

  alignas(kCacheLine) std::atomic<uint32_t> space_seq;  // futex word the writer sleeps on while the ring is full
  std::atomic<uint32_t> writer_sleeping;

  struct alignas(kCacheLine) ReaderIndex {
    std::atomic<uint64_t> read_index;  // written by its reader only
  };
  ReaderIndex readers[kMaxRingReaders];
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "futex words must be plain 32-bit words");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics shared between processes must be lock-free");

class ShmRing {
  struct Key {
    explicit Key() = default;
  };

 public:
  // Creates a new segment (O_CREAT|O_EXCL, mode 0600). `name` gets a leading '/' if it lacks one.
  static std::shared_ptr<ShmRing> create(const std::string& name, uint64_t capacity, uint32_t num_readers = 1);
  static std::shared_ptr<ShmRing> attach(const std::string& name);

  ShmRing(Key, std::string name, void* base, size_t mapped_bytes);
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;
  ~ShmRing();

  const std::string& name() const { return name_; }
  uint64_t capacity() const { return header_->capacity; }
  uint32_t num_readers() const { return header_->num_readers; }
  size_t max_record_size() const { return static_cast<size_t>(header_->capacity / 2 - sizeof(FrameHeader)); }
  // Removes the name; mappings (here and in other processes) stay valid until unmapped.
  void unlink() const;
  // Wakes every sleeping reader / the sleeping writer, e.g. so it notices a cancel flag.
  void wake_readers() const;
  void wake_writer() const;

  RingHeader& header() const { return *header_; }
  uint8_t* data() const { return data_; }

 private:
  std::string name_;
  void* base_;
  size_t mapped_bytes_;
  RingHeader* header_;
  uint8_t* data_;
};

class RingWriter {
 public:
  explicit RingWriter(std::shared_ptr<ShmRing> ring);

  // Never blocks; false when the slowest reader has not freed enough bytes. Throws std::invalid_argument for a
  // record larger than max_record_size().
  bool try_write(std::span<const uint8_t> record);
  // Waits up to `timeout` for space (spin, then futex sleep); false on timeout or when *cancel becomes true.
  bool write(std::span<const uint8_t> record, std::chrono::nanoseconds timeout,
             const std::atomic<bool>* cancel = nullptr);

  const std::shared_ptr<ShmRing>& ring() const { return ring_; }

 private:
  bool has_space(uint64_t needed);

  std::shared_ptr<ShmRing> ring_;
  RingHeader& header_;
  uint8_t* data_;
  uint64_t capacity_;
  uint64_t position_;          // local copy of write_index: this is the only writer
  uint64_t cached_min_read_;   // lower bound of every reader's index; refreshed only when space looks short
};

class RingReader {
 public:
  RingReader(std::shared_ptr<ShmRing> ring, uint32_t reader_index);

  // Copies the next record into `out` (replacing its contents). Throws std::runtime_error on a corrupt frame.
  bool try_read(std::vector<uint8_t>& out);
  // Waits up to `timeout` (spin, then futex sleep); false on timeout or when *cancel becomes true.
  bool read(std::vector<uint8_t>& out, std::chrono::nanoseconds timeout, const std::atomic<bool>* cancel = nullptr);
  // Waits until the writer has published bytes this reader has not consumed (a record, or padding before one);
  // false on timeout or cancel. Consumes nothing.
  bool wait(std::chrono::nanoseconds timeout, const std::atomic<bool>* cancel = nullptr);
  bool has_data() const;

  // Zero-copy access: the next record in place in the ring, or an empty optional when none is readable. The bytes
  // stay valid (the writer cannot reuse them) until release(), which consumes the record.
  std::optional<std::span<const uint8_t>> peek();
  void release();

  const std::shared_ptr<ShmRing>& ring() const { return ring_; }
  uint32_t reader_index() const { return index_; }

 private:
  void publish_position();

  std::shared_ptr<ShmRing> ring_;
  RingHeader& header_;
  uint8_t* data_;
  uint64_t capacity_;
  uint32_t index_;
  uint64_t position_;           // this reader's consumed bytes; only this reader advances it
  uint64_t published_;          // the value last stored to read_index
  uint64_t cached_end_;         // write_index as last loaded: frames before it are complete
  uint64_t pending_frame_ = 0;  // size of the frame peek() returned, 0 when none
};

// Unlinks /dev/shm/ringserve-<pid>-* segments whose creator pid is dead; returns their names ("/ringserve-...").
std::vector<std::string> reclaim_stale_segments();

}  // namespace ringserve
