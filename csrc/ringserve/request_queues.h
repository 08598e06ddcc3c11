// Queue order and batch slots. Both the waiting queue and the running list are kept in priority order: lower
// `priority` value first, then earlier arrival (FCFS within a priority). With aging (priority_aging_ms = A > 0) the
// order is by priority x A + arrival time instead: a request's effective priority improves by one per A waited, so
// one of priority p is overtaken only by requests of priority q < p that arrived less than (p - q) x A after it, and
// nobody waits forever behind a stream of better ones. A running request owns a batch slot in [0, max_num_seqs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ringserve/request_table.h"

namespace ringserve {

class RequestQueues {
 public:
  RequestQueues(int32_t priority_aging_ms, int32_t max_num_seqs);

  // Sets a new request's order key: its rank (priority, aged from now_ns) and its arrival sequence number.
  void stamp_arrival(RequestDetails& d, int32_t priority, int64_t now_ns);
  // True when request a runs before request b: lower rank, then earlier arrival.
  static bool runs_before(const RequestTable& table, int32_t a, int32_t b) {
    const RequestDetails& x = table.details(a);
    const RequestDetails& y = table.details(b);
    if (x.rank != y.rank) return x.rank < y.rank;
    return x.arrival_seq < y.arrival_seq;
  }
  void insert_waiting(const RequestTable& table, int32_t index);
  void insert_running(const RequestTable& table, int32_t index);
  // Removes a request from whichever list holds it (an abort).
  void erase(int32_t index, RequestStatus status);

  // The waiting queue, sorted last-to-run first: the next to admit is waiting().back() (pop_back is O(1)).
  std::vector<int32_t>& waiting() { return waiting_; }
  const std::vector<int32_t>& waiting() const { return waiting_; }
  // The running list, highest priority / earliest first; size <= max_num_seqs.
  std::vector<int32_t>& running() { return running_; }
  const std::vector<int32_t>& running() const { return running_; }

  // Throws std::logic_error naming the list that is out of order.
  void check_order(const RequestTable& table) const;

 private:
  int32_t priority_aging_ms_;
  std::vector<int32_t> waiting_;
  std::vector<int32_t> running_;
  uint64_t next_arrival_seq_ = 0;
  int64_t arrival_clock_ = 0;  // latest arrival time seen: the aging key never runs backwards with the wall clock
};

// The batch slots the workers index their persistent batch with. A slot released (finish, abort, preemption) is
// listed in the next plan's finished_slots; the workers drop it before running that plan, so the same plan may hand
// the slot to a new request.
class BatchSlots {
 public:
  explicit BatchSlots(int32_t max_num_seqs);

  // Hands the lowest free slot first on a fresh table; the caller checked that fewer than max_num_seqs run.
  int32_t take(int32_t owner) {
    const int32_t slot = free_.back();
    free_.pop_back();
    owner_[static_cast<size_t>(slot)] = owner;
    return slot;
  }
  // Frees a slot; the caller lists it where the workers see it (released() or the plan being built).
  void give_back(int32_t slot) {
    owner_[static_cast<size_t>(slot)] = -1;
    free_.push_back(slot);
  }
  int32_t owner(int32_t slot) const { return owner_[static_cast<size_t>(slot)]; }
  size_t num_free() const { return free_.size(); }
  // Slots freed between steps, for the next plan's finished_slots.
  std::vector<int32_t>& released() { return released_; }

 private:
  std::vector<int32_t> free_;      // not owned by a running request
  std::vector<int32_t> owner_;     // slot -> table index or -1
  std::vector<int32_t> released_;
};

}  // namespace ringserve
