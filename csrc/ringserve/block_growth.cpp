// Block growth: a scheduled request gets the KV blocks its tokens and lookahead slots need, preempting the running
// requests last in queue order when the pool runs dry; the blocks of lookahead slots its drafts did not fill go back.
#include <algorithm>
#include <limits>

#include "ringserve/scheduler.h"

namespace ringserve {

Scheduler::Growth Scheduler::grow_blocks(int32_t index, int32_t n, int32_t& k, StepPlan& plan, size_t& plan_bytes) {
  RequestState& r = table_.state(index);
  const int32_t bs = config_.block_size;
  const int32_t computed = r.num_computed_tokens;
  const auto have = static_cast<int32_t>(r.block_ids.size());
  // Lookahead takes only free blocks: it shrinks rather than preempt anyone.
  const int32_t room = (have + pool_.num_free()) * bs - computed - n;
  k = std::clamp(room, 0, k);
  if (computed + n + k <= have * bs) return Growth::kGrown;  // the shrunk lookahead fits what it has
  const int32_t needed = blocks_for(computed + n + k) - have;
  Growth grown = Growth::kGrown;
  std::vector<int32_t>& running = queues_.running();
  while (needed > pool_.num_free()) {
    // The running list is in priority order, so its back is the lowest-priority, latest-arrived request; it sits
    // behind this one in the running list (or is this request), so nothing of it is in the plan yet.
    const int32_t victim = running.back();
    running.pop_back();
    preempt(victim, plan);
    if (victim == index) return Growth::kPreemptedSelf;
    grown = Growth::kGrownAfterPreempting;
  }
  pool_.allocate(needed, r.block_ids);
  BlockAppend& append = reuse_back(plan.block_appends, spare_appends_);
  append.slot = r.slot;
  append.block_ids.clear();  // element by element: usually one block, and assign() would call memmove for it
  for (auto b = r.block_ids.begin() + have; b != r.block_ids.end(); ++b) append.block_ids.push_back(*b);
  plan_bytes += kPlanBytesPerAppend + static_cast<size_t>(needed) * sizeof(int32_t);
  return grown;
}

void Scheduler::preempt(int32_t index, StepPlan& plan) {
  RequestState& r = table_.state(index);
  pool_.free(r.block_ids, /*tail_first=*/true);
  r.block_ids.clear();
  // Recompute later; the generated tokens stay in token_ids and are re-sent as part of the prompt (and its computed
  // full blocks stay cached, so the recompute is mostly prefix hits unless they get evicted meanwhile).
  r.num_computed_tokens = 0;
  prefix_.set_registered_blocks(r, 0);
  slots_.give_back(r.slot);
  plan.finished_slots.push_back(r.slot);  // the workers drop its state before this step
  r.slot = -1;
  r.status = RequestStatus::kWaiting;
  queues_.insert_waiting(table_, index);
  if (r.num_preemptions < std::numeric_limits<uint16_t>::max()) ++r.num_preemptions;  // saturates, as outputs do
  ++num_preemptions_;
}

void Scheduler::trim_lookahead_blocks(RequestState& r) {
  // Lookahead slots of rejected drafts are returned: keep only the blocks the request's known tokens need.
  const auto keep = static_cast<size_t>(blocks_for(r.num_tokens()));
  if (r.block_ids.size() <= keep) return;
  pool_.free(std::span(r.block_ids).subspan(keep), /*tail_first=*/true);
  r.block_ids.resize(keep);
  pending_trim_slots_.push_back(r.slot);
  pending_trim_blocks_.push_back(static_cast<int32_t>(keep));
}

}  // namespace ringserve
