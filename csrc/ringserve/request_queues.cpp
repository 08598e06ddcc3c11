#include "ringserve/request_queues.h"

#include <limits>
#include <stdexcept>

namespace ringserve {

RequestQueues::RequestQueues(int32_t priority_aging_ms, int32_t max_num_seqs)
    : priority_aging_ms_(priority_aging_ms) {
  running_.reserve(static_cast<size_t>(max_num_seqs));
}

void RequestQueues::stamp_arrival(RequestDetails& d, int32_t priority, int64_t now_ns) {
  d.arrival_seq = next_arrival_seq_++;
  if (priority_aging_ms_ == 0) {
    d.rank = priority;
    return;
  }
  // Comparing priority - waited / A across requests at any instant equals comparing priority x A + arrival, a key
  // fixed at arrival: the sorted queues stay sorted as time passes. Saturating, for extreme priorities.
  arrival_clock_ = std::max(arrival_clock_, now_ns);
  const int64_t aging_ns = int64_t{priority_aging_ms_} * 1'000'000;
  int64_t rank;
  if (__builtin_mul_overflow(int64_t{priority}, aging_ns, &rank) ||
      __builtin_add_overflow(rank, arrival_clock_, &rank)) {
    rank = priority < 0 ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int64_t>::max();
  }
  d.rank = rank;
}

void RequestQueues::insert_waiting(const RequestTable& table, int32_t index) {
  // waiting_ is sorted last-to-run first, so the next to admit is waiting_.back().
  const auto at = std::partition_point(waiting_.begin(), waiting_.end(),
                                       [&](int32_t w) { return runs_before(table, index, w); });
  waiting_.insert(at, index);
}

void RequestQueues::insert_running(const RequestTable& table, int32_t index) {
  const auto at = std::partition_point(running_.begin(), running_.end(),
                                       [&](int32_t r) { return runs_before(table, r, index); });
  running_.insert(at, index);
}

void RequestQueues::erase(int32_t index, RequestStatus status) {
  std::vector<int32_t>& list = status == RequestStatus::kWaiting ? waiting_ : running_;
  list.erase(std::find(list.begin(), list.end(), index));
}

void RequestQueues::check_order(const RequestTable& table) const {
  for (size_t k = 1; k < running_.size(); ++k) {
    if (!runs_before(table, running_[k - 1], running_[k])) {
      throw std::logic_error("Scheduler invariant broken: running list out of priority order");
    }
  }
  for (size_t k = 1; k < waiting_.size(); ++k) {
    if (!runs_before(table, waiting_[k], waiting_[k - 1])) {
      throw std::logic_error("Scheduler invariant broken: waiting queue out of priority order");
    }
  }
}

BatchSlots::BatchSlots(int32_t max_num_seqs) {
  const auto seqs = static_cast<size_t>(max_num_seqs);
  for (int32_t s = max_num_seqs - 1; s >= 0; --s) free_.push_back(s);  // hand out slot 0 first
  owner_.assign(seqs, -1);
  released_.reserve(seqs);
}

}  // namespace ringserve
