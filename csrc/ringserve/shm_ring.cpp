#include "ringserve/shm_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <system_error>

#include "ringserve/process.h"
#include "ringserve/unique_fd.h"

namespace ringserve {
namespace {

// How long a waiting side spins before it sleeps on the futex. Long enough to cover a peer's turnaround in a
// ping-pong (a Python call included), short enough that a waiter costs nothing measurable once traffic stops.
constexpr auto kSpinTime = std::chrono::microseconds(20);
// Keeps deadline arithmetic far away from overflow for "wait forever"-style timeouts.
constexpr std::chrono::nanoseconds kMaxTimeout = std::chrono::hours(24 * 365);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until ready() or the deadline or *cancel; reads the clock only every 64 polls (a clock read costs more than
// a poll).
template <class Ready>
bool spin_until(Ready ready, std::chrono::steady_clock::time_point until, const std::atomic<bool>* cancel) {
  for (uint32_t i = 1;; ++i) {
    cpu_relax();
    if (ready()) return true;
    if (i % 64 == 0) {
      // relaxed: a late look at the flag only delays the return by one round.
      if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) return false;
      if (std::chrono::steady_clock::now() >= until) return false;
    }
  }
}

constexpr uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Shared (not FUTEX_PRIVATE): the sleeping and waking threads live in different processes.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto ns = std::max<int64_t>(timeout.count(), 0);
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  // EAGAIN (word changed), EINTR (signal) and ETIMEDOUT are all "go look again" for the callers.
  ::syscall(SYS_futex, static_cast<void*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word, int count) {
  ::syscall(SYS_futex, static_cast<void*>(&word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

std::string normalize_name(const std::string& name) {
  if (name.empty() || name == "/") throw std::invalid_argument("shared-memory ring name is empty");
  std::string n = name[0] == '/' ? name : "/" + name;
  if (n.find('/', 1) != std::string::npos) throw std::invalid_argument("ring name must not contain '/': " + name);
  return n;
}

struct UnlinkOnFailure {
  const std::string& name;
  bool armed = true;
  ~UnlinkOnFailure() {
    if (armed) ::shm_unlink(name.c_str());
  }
};

struct Mapping {
  void* base;
  size_t bytes;
};

Mapping map_segment(int fd, size_t bytes, const std::string& name) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw_errno("mmap of ring " + name);
  return {base, bytes};
}

}  // namespace

// ---- ShmRing --------------------------------------------------------------------------------------------------------

ShmRing::ShmRing(Key, std::string name, void* base, size_t mapped_bytes)
    : name_(std::move(name)),
      base_(base),
      mapped_bytes_(mapped_bytes),
      header_(std::launder(static_cast<RingHeader*>(base))),
      data_(static_cast<uint8_t*>(base) + kRingHeaderBytes) {}

ShmRing::~ShmRing() { ::munmap(base_, mapped_bytes_); }

std::shared_ptr<ShmRing> ShmRing::create(const std::string& name, uint64_t capacity, uint32_t num_readers) {
  const std::string n = normalize_name(name);
  if (capacity < kMinRingCapacity || capacity > kMaxRingCapacity || (capacity & (capacity - 1)) != 0) {
    throw std::invalid_argument("ring capacity must be a power of two between 64 and 2^32 bytes, got " +
                                std::to_string(capacity));
  }
  if (num_readers < 1 || num_readers > kMaxRingReaders) {
    throw std::invalid_argument("num_readers must be 1.." + std::to_string(kMaxRingReaders) + ", got " +
                                std::to_string(num_readers));
  }
  UniqueFd fd(::shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd) throw_errno("shm_open(O_CREAT|O_EXCL) of ring " + n);
  // Until the ring is fully initialized, a failure must not leave the name behind.
  UnlinkOnFailure unlink_on_failure{n};
  const size_t bytes = kRingHeaderBytes + capacity;
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) throw_errno("ftruncate of ring " + n);
  const Mapping m = map_segment(fd.get(), bytes, n);
  auto ring = std::make_shared<ShmRing>(Key{}, n, m.base, m.bytes);
  // The fresh segment is zero-filled; construct the header objects in place before using their atomics.
  RingHeader* h = std::construct_at(static_cast<RingHeader*>(m.base));
  ring->header_ = h;
  h->layout_version = kRingLayoutVersion;
  h->num_readers = num_readers;
  h->capacity = capacity;
  h->creator_pid = static_cast<int32_t>(::getpid());
  // release: a process that sees the magic (acquire in attach) also sees every header field above.
  h->magic.store(kRingMagic, std::memory_order_release);
  unlink_on_failure.armed = false;
  return ring;
}

std::shared_ptr<ShmRing> ShmRing::attach(const std::string& name) {
  const std::string n = normalize_name(name);
  UniqueFd fd(::shm_open(n.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!fd) throw_errno("shm_open of ring " + n);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_errno("fstat of ring " + n);
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes < kRingHeaderBytes + kMinRingCapacity) throw std::runtime_error("ring " + n + " is too small");
  const Mapping m = map_segment(fd.get(), bytes, n);
  auto ring = std::make_shared<ShmRing>(Key{}, n, m.base, m.bytes);  // owns the mapping from here on
  const RingHeader& h = ring->header();
  // acquire: pairs with create()'s release so the fields below are initialized.
  if (h.magic.load(std::memory_order_acquire) != kRingMagic) {
    throw std::runtime_error("ring " + n + " has no RingServe header (bad magic or not initialized yet)");
  }
  if (h.layout_version != kRingLayoutVersion) {
    throw std::runtime_error("ring " + n + " has layout version " + std::to_string(h.layout_version) + ", expected " +
                             std::to_string(kRingLayoutVersion));
  }
  if (h.capacity + kRingHeaderBytes != bytes || (h.capacity & (h.capacity - 1)) != 0 || h.num_readers < 1 ||
      h.num_readers > kMaxRingReaders) {
    throw std::runtime_error("ring " + n + " has an inconsistent header");
  }
  return ring;
}

void ShmRing::unlink() const {
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) throw_errno("shm_unlink of ring " + name_);
}

void ShmRing::wake_readers() const {
  // seq_cst RMW: a reader that loads data_seq after this sees the caller's earlier stores (e.g. its cancel flag).
  header_->data_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(header_->data_seq, INT_MAX);
}

void ShmRing::wake_writer() const {
  // Same reasoning as wake_readers.
  header_->space_seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(header_->space_seq, INT_MAX);
}

// ---- RingWriter -----------------------------------------------------------------------------------------------------

RingWriter::RingWriter(std::shared_ptr<ShmRing> ring)
    : ring_(std::move(ring)),
      header_(ring_->header()),
      data_(ring_->data()),
      capacity_(ring_->capacity()),
      // acquire: continue after whatever a previous writer published.
      position_(header_.write_index.load(std::memory_order_acquire)),
      cached_min_read_(position_ - capacity_) {
  // relaxed: informational only (liveness diagnostics); nothing is published through it.
  header_.writer_pid.store(static_cast<int32_t>(::getpid()), std::memory_order_relaxed);
}

bool RingWriter::has_space(uint64_t needed) {
  if (capacity_ - (position_ - cached_min_read_) >= needed) return true;
  uint64_t min_read = position_;
  for (uint32_t i = 0; i < ring_->num_readers(); ++i) {
    // acquire: pairs with the reader's release store, so its copy-out of those bytes is complete before we reuse them.
    min_read = std::min(min_read, header_.readers[i].read_index.load(std::memory_order_acquire));
  }
  cached_min_read_ = min_read;
  return capacity_ - (position_ - cached_min_read_) >= needed;
}

bool RingWriter::try_write(std::span<const uint8_t> record) {
  if (record.size() > ring_->max_record_size()) {
    throw std::invalid_argument("record of " + std::to_string(record.size()) + " bytes exceeds the max record size " +
                                std::to_string(ring_->max_record_size()) + " of ring " + ring_->name());
  }
  const uint64_t frame = align8(sizeof(FrameHeader) + record.size());
  uint64_t offset = position_ & (capacity_ - 1);
  const uint64_t room_to_end = capacity_ - offset;
  const uint64_t needed = frame <= room_to_end ? frame : room_to_end + frame;
  if (!has_space(needed)) return false;

  if (frame > room_to_end) {
    // room_to_end >= 8 because offsets are 8-aligned, so the padding frame header always fits.
    const FrameHeader pad{static_cast<uint32_t>(room_to_end), kPaddingFrame};
    std::memcpy(data_ + offset, &pad, sizeof(pad));
    position_ += room_to_end;
    offset = 0;
  }
  const FrameHeader fh{static_cast<uint32_t>(frame), static_cast<uint32_t>(record.size())};
  std::memcpy(data_ + offset, &fh, sizeof(fh));
  if (!record.empty()) std::memcpy(data_ + offset + sizeof(fh), record.data(), record.size());
  position_ += frame;
  // release: the frame bytes written above are visible to a reader that acquires the new index.
  header_.write_index.store(position_, std::memory_order_release);
  // seq_cst fence (Dekker, writer half): orders the index store before the sleeping_readers load; a reader fences
  // between announcing itself and re-checking the index, so either it sees our index or we see its announcement.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // relaxed: the fence above provides the ordering.
  if (header_.sleeping_readers.load(std::memory_order_relaxed) != 0) ring_->wake_readers();
  return true;
}

bool RingWriter::write(std::span<const uint8_t> record, std::chrono::nanoseconds timeout,
                       const std::atomic<bool>* cancel) {
  if (try_write(record)) return true;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::min(timeout, kMaxTimeout);
  if (spin_until([&] { return try_write(record); }, std::min(start + kSpinTime, deadline), cancel)) return true;
  while (true) {
    // acquire: a wake_writer() that bumped the word after setting *cancel makes that store visible below.
    const uint32_t seq = header_.space_seq.load(std::memory_order_acquire);
    if (cancel != nullptr && cancel->load(std::memory_order_acquire)) return false;
    // seq_cst store + fence (Dekker, writer-sleep half): announce before re-checking the readers' indices; a reader
    // fences between publishing its index and loading writer_sleeping.
    header_.writer_sleeping.store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (try_write(record)) {
      // relaxed: a stale 1 only costs a reader one spurious wake.
      header_.writer_sleeping.store(0, std::memory_order_relaxed);
      return true;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      header_.writer_sleeping.store(0, std::memory_order_relaxed);
      return false;
    }
    futex_wait(header_.space_seq, seq, deadline - now);
    header_.writer_sleeping.store(0, std::memory_order_relaxed);
    if (try_write(record)) return true;
  }
}

// ---- RingReader -----------------------------------------------------------------------------------------------------

RingReader::RingReader(std::shared_ptr<ShmRing> ring, uint32_t reader_index)
    : ring_(std::move(ring)),
      header_(ring_->header()),
      data_(ring_->data()),
      capacity_(ring_->capacity()),
      index_(reader_index),
      position_(0),
      published_(0),
      cached_end_(0) {
  if (reader_index >= ring_->num_readers()) {
    throw std::invalid_argument("reader_index " + std::to_string(reader_index) + " out of range: ring " +
                                ring_->name() + " has " + std::to_string(ring_->num_readers()) + " readers");
  }
  // acquire: resume where a previous reader with this index stopped.
  position_ = published_ = cached_end_ = header_.readers[index_].read_index.load(std::memory_order_acquire);
}

bool RingReader::has_data() const {
  // relaxed: only a hint; peek() re-loads with acquire before touching the bytes.
  return header_.write_index.load(std::memory_order_relaxed) != position_;
}

void RingReader::publish_position() {
  published_ = position_;
  // release: our copy-out of the consumed bytes happens-before the writer (acquire in has_space) reuses them.
  header_.readers[index_].read_index.store(position_, std::memory_order_release);
  // seq_cst fence (Dekker, reader half of the space handshake): the index store is ordered before the
  // writer_sleeping load; the writer fences between announcing its sleep and re-checking our index.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // relaxed: ordered by the fence.
  if (header_.writer_sleeping.load(std::memory_order_relaxed) != 0) ring_->wake_writer();
}

std::optional<std::span<const uint8_t>> RingReader::peek() {
  auto corrupt = [&](const char* why) {
    throw std::runtime_error(std::string("ring ") + ring_->name() + " is corrupt: " + why);
  };
  while (true) {
    if (position_ == cached_end_) {
      // acquire: pairs with the writer's release store; the frames before the loaded index are fully written.
      // Loading write_index only when the frames seen so far are used up keeps its cache line from bouncing
      // between writer and reader on every record.
      cached_end_ = header_.write_index.load(std::memory_order_acquire);
      if (cached_end_ - position_ > capacity_) corrupt("write index is more than a capacity ahead of the read index");
      if (position_ == cached_end_) {
        if (published_ != position_) publish_position();  // consumed only padding since the last publication
        return std::nullopt;
      }
    }
    const uint64_t offset = position_ & (capacity_ - 1);
    FrameHeader fh;
    std::memcpy(&fh, data_ + offset, sizeof(fh));
    // Validate before trusting the sizes, so a corrupt segment cannot make us read out of bounds.
    if (fh.size < sizeof(FrameHeader) || fh.size % 8 != 0 || fh.size > capacity_ - offset ||
        fh.size > cached_end_ - position_) {
      corrupt("bad frame size");
    }
    if (fh.payload_len == kPaddingFrame) {
      position_ += fh.size;
      continue;
    }
    if (fh.payload_len > fh.size - sizeof(FrameHeader)) corrupt("payload larger than its frame");
    pending_frame_ = fh.size;
    return std::span<const uint8_t>(data_ + offset + sizeof(FrameHeader), fh.payload_len);
  }
}

void RingReader::release() {
  if (pending_frame_ == 0) return;
  position_ += pending_frame_;
  pending_frame_ = 0;
  // Publishing after every record would move read_index's cache line to the writer once per record. Publish when
  // the records seen are used up (always before this reader can sleep) or once a quarter of the ring is consumed
  // unpublished, so a writer waiting for space never waits on more than that.
  if (position_ == cached_end_ || position_ - published_ >= capacity_ / 4) publish_position();
}

bool RingReader::try_read(std::vector<uint8_t>& out) {
  const auto record = peek();
  if (!record) return false;
  out.assign(record->begin(), record->end());
  release();
  return true;
}

bool RingReader::wait(std::chrono::nanoseconds timeout, const std::atomic<bool>* cancel) {
  if (has_data()) return true;
  if (published_ != position_) publish_position();  // never sleep while holding consumed bytes back from the writer
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::min(timeout, kMaxTimeout);
  if (spin_until([&] { return has_data(); }, std::min(start + kSpinTime, deadline), cancel)) return true;
  while (true) {
    // acquire: a wake_readers() that bumped the word after setting *cancel makes that store visible below.
    const uint32_t seq = header_.data_seq.load(std::memory_order_acquire);
    if (cancel != nullptr && cancel->load(std::memory_order_acquire)) return false;
    // seq_cst RMW + fence (Dekker, reader half): announce the sleep before re-checking write_index; the writer
    // fences between storing write_index and loading sleeping_readers.
    header_.sleeping_readers.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const bool ready = has_data();
    const auto now = std::chrono::steady_clock::now();
    if (!ready && now < deadline) futex_wait(header_.data_seq, seq, deadline - now);
    // relaxed: a late decrement only costs the writer one extra wake syscall.
    header_.sleeping_readers.fetch_sub(1, std::memory_order_relaxed);
    if (ready || has_data()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
  }
}

bool RingReader::read(std::vector<uint8_t>& out, std::chrono::nanoseconds timeout, const std::atomic<bool>* cancel) {
  if (try_read(out)) return true;  // before reading the clock: the common case when records are flowing
  const auto deadline = std::chrono::steady_clock::now() + std::min(timeout, kMaxTimeout);
  while (true) {
    // wait() can report bytes that turn out to be only a padding frame: loop until a record or the deadline.
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero() || !wait(left, cancel)) return false;
    if (try_read(out)) return true;
  }
}

// ---- stale segments -------------------------------------------------------------------------------------------------

std::vector<std::string> reclaim_stale_segments() {
  std::vector<std::string> reclaimed;
  constexpr std::string_view kPrefix = "ringserve-";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(kPrefix)) continue;
    const size_t dash = file.find('-', kPrefix.size());
    if (dash == std::string::npos || dash == kPrefix.size() || dash - kPrefix.size() > 9) continue;
    const std::string pid_text = file.substr(kPrefix.size(), dash - kPrefix.size());
    if (!std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (is_process_alive(static_cast<pid_t>(std::stol(pid_text)))) continue;
    const std::string name = "/" + file;
    if (::shm_unlink(name.c_str()) == 0) reclaimed.push_back(name);
  }
  return reclaimed;
}

}  // namespace ringserve
