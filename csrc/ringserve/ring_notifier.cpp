#include "ringserve/ring_notifier.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <system_error>

namespace ringserve {
namespace {
constexpr auto kPollTimeout = std::chrono::milliseconds(500);
}

RingNotifier::RingNotifier(std::shared_ptr<ShmRing> ring, uint32_t reader_index)
    : reader_(std::move(ring), reader_index), event_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (!event_fd_) throw std::system_error(errno, std::generic_category(), "eventfd");
  thread_ = std::thread([this] { run(); });
}

RingNotifier::~RingNotifier() { close(); }

void RingNotifier::close() {
  if (thread_.joinable()) {
    // release: pairs with the reader's acquire load of the cancel flag after it reads data_seq.
    stop_.store(true, std::memory_order_release);
    reader_.ring()->wake_readers();
    thread_.join();
  }
  event_fd_.reset();
}

void RingNotifier::signal() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero (saturated): the loop will wake anyway.
  [[maybe_unused]] const auto n = ::write(event_fd_.get(), &one, sizeof(one));
}

void RingNotifier::run() {
  std::vector<uint8_t> record;
  // acquire: see close()'s request to stop.
  while (!stop_.load(std::memory_order_acquire)) {
    try {
      if (!reader_.read(record, kPollTimeout, &stop_)) continue;
      std::lock_guard lock(mutex_);
      // Take everything already in the ring under one lock and one eventfd signal.
      do {
        queue_.push_back(std::move(record));
        record = {};
      } while (reader_.try_read(record));
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      signal();
      return;
    }
    signal();
  }
}

std::vector<std::vector<uint8_t>> RingNotifier::drain() {
  if (event_fd_) {
    // Reset the eventfd before taking the queue: a record queued after the swap signals it again, so none is missed.
    uint64_t count = 0;
    [[maybe_unused]] const auto n = ::read(event_fd_.get(), &count, sizeof(count));
  }
  std::vector<std::vector<uint8_t>> records;
  std::lock_guard lock(mutex_);
  records.swap(queue_);
  if (records.empty() && error_) std::rethrow_exception(error_);
  return records;
}

}  // namespace ringserve
