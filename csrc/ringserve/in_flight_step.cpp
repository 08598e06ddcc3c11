#include "ringserve/in_flight_step.h"

#include <algorithm>
#include <string>

namespace ringserve {

InFlightStep::InFlightStep(int32_t max_num_seqs) : max_entries_(static_cast<size_t>(max_num_seqs)) {
  for (auto* a : {&slot_, &start_, &len_, &lookahead_, &sample_, &result_, &dropped_}) a->assign(max_entries_, 0);
  index_.assign(max_entries_ + 2 * kPrefetchAhead, 0);  // + the padding update()'s prefetches read
  sample_mark_.assign(max_entries_, SampleMark{});
  sampled_slots_.reserve(max_entries_);
  row_offsets_.reserve(max_entries_ + 1);
}

size_t InFlightStep::write_entries(StepPlan& plan, bool with_lookahead) {
  // After scheduling, as copies: stores into the plan's uint8 sample array may alias anything, so writing it entry by
  // entry while scheduling would make the compiler reload every pointer after each one.
  const size_t n = size_;
  const auto copy = [n](const std::vector<int32_t>& from, std::vector<int32_t>& to) {
    to.resize(n);
    std::copy_n(from.begin(), n, to.begin());
  };
  copy(slot_, plan.sched_slots);
  copy(start_, plan.sched_start);
  copy(len_, plan.sched_len);
  // Without speculation the array stays empty (the workers read that as no lookahead anywhere).
  if (with_lookahead) {
    copy(lookahead_, plan.sched_lookahead);
  } else {
    plan.sched_lookahead.clear();
  }
  plan.sched_sample.resize(n);
  const int32_t* sample = sample_.data();
  uint8_t* samples = plan.sched_sample.data();
  size_t sampled = 0;
  for (size_t k = 0; k < n; ++k) {
    samples[k] = static_cast<uint8_t>(sample[k]);
    sampled += static_cast<size_t>(sample[k]);
  }
  // The result's rows are matched against the sampled slots: the plan's own when every entry samples.
  sampled_slots_.clear();
  if (sampled < n) {
    for (size_t k = 0; k < n; ++k) {
      if (sample[k] != 0) sampled_slots_.push_back(slot_[k]);
    }
  }
  // update() prefetches up to 2 x kPrefetchAhead entries ahead: past the last one, they repeat it.
  if (n > 0) std::fill_n(index_.begin() + static_cast<std::ptrdiff_t>(n), 2 * kPrefetchAhead, index_[n - 1]);
  return sampled;
}

bool InFlightStep::drop_request(int32_t index) {
  for (size_t k = 0; k < size_; ++k) {
    if (index_[k] == index && dropped_[k] == 0) {
      dropped_[k] = 1;
      ++num_dropped_;
      return true;
    }
  }
  return false;
}

void InFlightStep::check_result_header(const StepResult& result) const {
  if (!in_flight_) throw std::logic_error("update without a step in flight");
  if (result.step_id != step_) {
    throw std::runtime_error("StepResult for step " + std::to_string(result.step_id) + " but step " +
                             std::to_string(step_) + " is in flight");
  }
  if (result.slots.size() != num_samples_) {
    throw std::runtime_error("StepResult has " + std::to_string(result.slots.size()) + " sampled slots, plan asked for " +
                             std::to_string(num_samples_));
  }
}

bool InFlightStep::match_result_rows(const StepResult& result, bool fill_rows) {
  // Workers normally answer in plan order: one comparison of the rows' slots with the sampled entries' (a memcmp)
  // confirms that. As many rows as sampled entries (checked by the caller), each matched to a different one, means
  // every sampled slot got exactly one token.
  const size_t n = size_;
  const int32_t* slots = result.slots.data();
  int32_t* rows = result_.data();
  const int32_t* sample = sample_.data();
  const bool every_entry = result.slots.size() == n;  // the caller checked: as many rows as sampled entries
  const int32_t* expected = every_entry ? slot_.data() : sampled_slots_.data();
  if (std::equal(slots, slots + result.slots.size(), expected)) {
    if (fill_rows) {
      int32_t row = 0;
      for (size_t k = 0; k < n; ++k) rows[k] = sample[k] != 0 ? row++ : -1;
    }
    return true;
  }
  // Any other order: match the rows through a slot -> entry map, stamped with this step so it needs no clearing.
  std::fill_n(rows, n, -1);
  for (size_t k = 0; k < n; ++k) {
    if (sample[k] != 0) sample_mark_[static_cast<size_t>(slot_[k])] = {step_, static_cast<int32_t>(k)};
  }
  for (size_t i = 0; i < result.slots.size(); ++i) {
    const int32_t slot = slots[i];
    int32_t entry = -1;
    if (slot >= 0 && static_cast<size_t>(slot) < max_entries_) {
      const SampleMark& mark = sample_mark_[static_cast<size_t>(slot)];
      if (mark.step == step_) entry = mark.pos;
    }
    if (entry < 0 || rows[entry] != -1) {
      std::fill_n(rows, n, -1);
      throw std::runtime_error("StepResult has a slot that was not sampled or is repeated: " + std::to_string(slot));
    }
    rows[entry] = static_cast<int32_t>(i);
  }
  return false;
}

void InFlightStep::check_result_counts(const StepResult& result) {
  const size_t rows = result.slots.size();
  const bool multi = !result.token_counts.empty();
  if ((multi && result.token_counts.size() != rows) ||
      (!result.num_proposed.empty() && result.num_proposed.size() != rows)) {
    throw std::runtime_error("StepResult token_counts / num_proposed are not one per sampled slot");
  }
  size_t tokens = rows;  // one per row, unless token_counts says otherwise
  if (multi) {
    row_offsets_.resize(rows + 1);
    row_offsets_[0] = 0;
    for (size_t i = 0; i < rows; ++i) {
      row_offsets_[i + 1] = row_offsets_[i] + static_cast<size_t>(std::max(result.token_counts[i], 0));
    }
    tokens = row_offsets_[rows];
  }
  if (result.token_ids.size() != tokens || result.logprobs.size() != tokens) {
    throw std::runtime_error("StepResult has " + std::to_string(result.token_ids.size()) + " tokens, its rows count " +
                             std::to_string(tokens));
  }
  if (result.top_token_ids.size() != size_t{result.num_top} * tokens ||
      result.top_logprobs.size() != result.top_token_ids.size()) {
    throw std::runtime_error("StepResult top arrays are not [tokens, num_top]");
  }
  if (!multi && result.num_proposed.empty()) return;
  for (size_t k = 0; k < size_; ++k) {
    if (sample_[k] == 0) continue;
    const auto row = static_cast<size_t>(result_[k]);
    const int32_t n = multi ? result.token_counts[row] : 1;
    const int32_t proposed = result.num_proposed.empty() ? 0 : result.num_proposed[row];
    const int32_t lookahead = lookahead_[k];
    // Each accepted token must be a verified draft token, and drafts only fill the slots the plan reserved.
    if (proposed < 0 || proposed > lookahead || n < 1 || n - 1 > proposed) {
      throw std::runtime_error("StepResult slot " + std::to_string(slot_[k]) + ": " + std::to_string(n) +
                               " tokens from " + std::to_string(proposed) + " proposed, but its lookahead is " +
                               std::to_string(lookahead));
    }
  }
}

}  // namespace ringserve
