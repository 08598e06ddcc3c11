// Disaggregated prefill/decode in the scheduler. A prefill-only request (KvMode::kPrefillOnly) ends after its first
// token with its prompt's blocks pinned: they stay referenced for the decode engine to pull until a ReleaseKv (or an
// abort of that id) or until its pin timeout passes. A request continuing from remote KV (kPullRemote) has its
// prompt's blocks pulled by the workers before the plan that admits it runs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "ringserve/block_pool.h"
#include "ringserve/records.h"
#include "ringserve/request_table.h"

namespace ringserve {

// Why a request's KV options can never work (INVALID_ARGUMENT / RESOURCE_EXHAUSTED), or nothing.
std::optional<RequestRejected> check_kv_options(const AddRequest& req, const KvRequestOptions& kv, int32_t block_size,
                                                size_t max_plan_bytes);

class KvPins {
 public:
  // A finished prefill-only request: the references of its blocks move to a pin (r.block_ids is left empty, so
  // releasing the request frees nothing), and a KvPinned event names its prompt's first `prompt_blocks` blocks.
  void pin(RequestState& r, const RequestDetails& d, int32_t prompt_blocks, int64_t now_ns);
  // Frees a pin's blocks (its full prompt blocks stay cached for later prefix hits). False if not pinned.
  bool release(uint64_t request_id, BlockPool& pool);
  // Frees the pins whose timeout passed; returns how many.
  int32_t expire(int64_t now_ns, BlockPool& pool);
  int32_t num_pinned() const { return static_cast<int32_t>(pinned_.size()); }
  // Calls f(block_id) for every pinned block reference (check_invariants).
  template <class F>
  void for_each_pinned_block(F&& f) const {
    for (const Pin& p : pinned_) {
      for (const int32_t b : p.block_ids) f(b);
    }
  }

  // KvPinned events since the last clear_events (sent before the outputs of the same update).
  std::span<const KvPinned> events() const { return events_; }
  void clear_events() { events_.clear(); }

  // Admission of a kPullRemote request in the step being built: the pull of its prompt's blocks into `local`.
  void add_pull(int32_t slot, RequestDetails& d, std::span<const int32_t> local);
  // The pulls the workers must do before the plan being built / last built.
  std::span<const KvPull> pulls() const { return pulls_; }
  void clear_pulls() { pulls_.clear(); }

 private:
  struct Pin {
    uint64_t request_id;
    int64_t expires_at_ns;
    std::vector<int32_t> block_ids;
  };
  std::vector<Pin> pinned_;
  std::vector<KvPull> pulls_;
  std::vector<KvPinned> events_;
};

}  // namespace ringserve
