// The step being built and then in flight: one entry per scheduled request, as parallel arrays sized max_num_seqs
// once (a plan never holds more), so scheduling appends without growing anything and the plan's sched_* arrays are
// copies. When the StepResult comes back its rows are matched to the entries (normally in plan order, checked with
// one comparison) and their token counts checked against what the plan allowed, before anything changes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "ringserve/records.h"
#include "ringserve/step_cost.h"

namespace ringserve {

// The token a request holds, with async scheduling, for the one its in-flight step samples (never a real id).
inline constexpr int32_t kPendingToken = -1;

// How many requests ahead the per-request loops prefetch a request's state.
inline constexpr size_t kPrefetchAhead = 8;

// Fixed bytes of a StepPlan record and per entry, used to keep a plan under the ring's record size.
inline constexpr size_t kPlanFixedBytes = 64;
inline constexpr size_t kPlanBytesPerScheduled = 4 + 4 + 4 + 1 + 4;  // + sched_lookahead
inline constexpr size_t kPlanBytesPerTrim = 4 + 4;
inline constexpr size_t kPlanBytesPerAppend = 8;
inline constexpr size_t kPlanBytesPerNewRequest = 128;  // NewRequestData fixed fields and array counts, rounded up

// Takes an element with storage from `spare` (or a new one) onto the back of `v`: a plan's entries keep their arrays'
// storage between steps.
template <class T>
T& reuse_back(std::vector<T>& v, std::vector<T>& spare) {
  if (spare.empty()) return v.emplace_back();
  v.push_back(std::move(spare.back()));
  spare.pop_back();
  return v.back();
}

// Moves every element of `v` (with its storage) to `spare`.
template <class T>
void recycle(std::vector<T>& v, std::vector<T>& spare) {
  for (T& x : v) spare.push_back(std::move(x));
  v.clear();
}

class InFlightStep {
 public:
  explicit InFlightStep(int32_t max_num_seqs);

  // schedule(): a new plan.
  void clear() {
    if (num_dropped_ > 0) std::fill_n(dropped_.begin(), size_, 0);  // entries are pushed undropped
    size_ = 0;
    num_dropped_ = 0;
    advanced_ = false;
  }
  // Appends an entry: request `index` in `slot` computes `num_tokens` tokens from `start` of its `total` known ones,
  // with `lookahead` draft slots after them.
  [[gnu::always_inline]] void push(int32_t index, int32_t slot, int32_t start, int32_t num_tokens, int32_t total,
                                   int32_t lookahead) {
    const size_t e = size_;
    if (e >= max_entries_) throw std::logic_error("a plan with more than max_num_seqs entries");
    index_[e] = index;
    slot_[e] = slot;
    start_[e] = start;
    len_[e] = num_tokens;
    lookahead_[e] = lookahead;
    sample_[e] = start + num_tokens == total ? 1 : 0;  // the chunk reaches the last known token: sample
    size_ = e + 1;
  }
  size_t size() const { return size_; }
  // The entries -> the plan's sched_* arrays (sched_lookahead only `with_lookahead`), and the index array's padding
  // for update()'s prefetches. Returns how many entries sample.
  size_t write_entries(StepPlan& plan, bool with_lookahead);
  // The plan is sent as step `step_id`.
  void send(uint64_t step_id, size_t num_samples) {
    step_ = step_id;
    num_samples_ = num_samples;
    in_flight_ = true;
  }
  bool in_flight() const { return in_flight_; }

  // update(): throws std::runtime_error unless `result` answers the step in flight with one row per sampled entry.
  void check_result_header(const StepResult& result) const;
  // True when the rows come in plan order (their rows then set only with fill_rows); else sets every entry's row,
  // throwing (changing nothing) when a row's slot was not sampled or repeats.
  bool match_result_rows(const StepResult& result, bool fill_rows);
  // Throws, changing nothing, unless every row's tokens fit its entry's lookahead and the arrays agree in size; fills
  // the rows' token offsets (multi-token rows).
  void check_result_counts(const StepResult& result);
  // The result checked out and is being applied: no step is in flight any more (the entries stay until clear()).
  void mark_received() { in_flight_ = false; }

  // Async scheduling. A request that finished or was aborted while this step was in flight: its entry is dropped
  // (update() skips it and ignores its row; the request's table entry may already serve another request). Returns
  // false when the request has no entry here. Linear in the entries: only finishing requests call it.
  bool drop_request(int32_t index);
  size_t num_dropped() const { return num_dropped_; }
  const int32_t* dropped() const { return dropped_.data(); }
  // The next step was planned on top of this one: its entries' tokens count as computed and each sampled entry's
  // token sits in its request as a placeholder (kPendingToken) that update() replaces.
  void mark_advanced() { advanced_ = true; }
  bool advanced() const { return advanced_; }
  // The step's shape as the decode-latency guard's cost model sees it (set when it is sent).
  StepShape shape;

  // The entries, for update()'s walk. index() is padded with 2 x kPrefetchAhead copies of the last entry.
  const int32_t* index() const { return index_.data(); }
  const int32_t* len() const { return len_.data(); }
  const int32_t* sample() const { return sample_.data(); }
  const int32_t* lookahead() const { return lookahead_.data(); }
  const int32_t* result_row() const { return result_.data(); }  // its row in the StepResult, -1 if none
  size_t row_offset(size_t row) const { return row_offsets_[row]; }  // first token of a row (multi-token results)

 private:
  struct SampleMark {  // slot -> the entry that samples it, valid while step == step_
    uint64_t step = 0;
    int32_t pos = -1;
  };

  size_t max_entries_;
  std::vector<int32_t> index_;      // + 2 x kPrefetchAhead entries past the end repeating the last (update() reads)
  std::vector<int32_t> slot_;
  std::vector<int32_t> start_;      // num_computed_tokens when scheduled
  std::vector<int32_t> len_;        // tokens scheduled
  std::vector<int32_t> lookahead_;  // draft tokens the workers may verify after its token (reserved KV slots)
  std::vector<int32_t> sample_;     // 1 when the entry reaches its last known token (int32: no char aliasing)
  std::vector<int32_t> result_;     // update(): its row in the StepResult, -1 until matched
  std::vector<int32_t> dropped_;    // 1 when its request finished or was aborted while the step was in flight
  size_t size_ = 0;
  size_t num_dropped_ = 0;
  bool advanced_ = false;
  uint64_t step_ = 0;
  bool in_flight_ = false;
  size_t num_samples_ = 0;
  std::vector<int32_t> sampled_slots_;  // the sampled slots in plan order, when not every entry samples
  std::vector<SampleMark> sample_mark_;  // by batch slot: matches rows a worker sent out of plan order
  std::vector<size_t> row_offsets_;      // first token of each result row
};

}  // namespace ringserve
