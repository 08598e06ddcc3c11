// Bridges a ring to an event loop: a native thread is the ring's reader, moves records into an in-process queue and
// signals an eventfd, so an asyncio loop can `add_reader(fileno(), ...)` and never block on the ring itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ringserve/shm_ring.h"
#include "ringserve/unique_fd.h"

namespace ringserve {

class RingNotifier {
 public:
  RingNotifier(std::shared_ptr<ShmRing> ring, uint32_t reader_index);
  RingNotifier(const RingNotifier&) = delete;
  RingNotifier& operator=(const RingNotifier&) = delete;
  ~RingNotifier();

  // The eventfd (EFD_NONBLOCK|EFD_CLOEXEC); readable while records are queued. -1 after close().
  int fileno() const { return event_fd_.get(); }
  // Every queued record, oldest first; never blocks. Clears the eventfd. Rethrows a ring error from the thread.
  std::vector<std::vector<uint8_t>> drain();
  // Stops and joins the thread, then closes the eventfd (remove it from the event loop first). Idempotent.
  void close();

 private:
  void run();
  void signal();

  RingReader reader_;
  UniqueFd event_fd_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<std::vector<uint8_t>> queue_;  // guarded by mutex_
  std::exception_ptr error_;                 // guarded by mutex_
  std::thread thread_;                       // last member: starts once everything it touches exists
};

}  // namespace ringserve
