#include "ringserve/kv_pins.h"

#include <algorithm>
#include <string>

#include "ringserve/in_flight_step.h"

namespace ringserve {

std::optional<RequestRejected> check_kv_options(const AddRequest& req, const KvRequestOptions& kv, int32_t block_size,
                                                size_t max_plan_bytes) {
  const uint64_t id = req.request_id;
  const auto reject = [id](uint32_t code, std::string message) {
    return RequestRejected{id, code, std::move(message)};
  };
  if (kv.mode == KvMode::kPrefillOnly && kv.pin_timeout_ms == 0) {
    return reject(kStatusInvalidArgument, "a prefill-only request needs pin_timeout_ms > 0");
  }
  if (kv.mode != KvMode::kPullRemote) return std::nullopt;
  const size_t prompt_blocks = (req.prompt_token_ids.size() + static_cast<size_t>(block_size) - 1) /
                               static_cast<size_t>(block_size);
  if (kv.remote_block_ids.size() != prompt_blocks) {
    return reject(kStatusInvalidArgument, "remote_block_ids has " + std::to_string(kv.remote_block_ids.size()) +
                                              " blocks, the prompt needs " + std::to_string(prompt_blocks));
  }
  if (req.max_tokens < 2) {
    return reject(kStatusInvalidArgument, "a request continuing from remote KV needs max_tokens >= 2");
  }
  if (kv.first_token_id < 0) return reject(kStatusInvalidArgument, "first_token_id is negative");
  if (kv.peer.empty()) return reject(kStatusInvalidArgument, "a remote KV pull needs the source's peer info");
  for (const int32_t b : kv.remote_block_ids) {
    if (b < 0) return reject(kStatusInvalidArgument, "remote block id " + std::to_string(b) + " is negative");
  }
  if (kPlanFixedBytes + kv.peer.size() + 2 * prompt_blocks * sizeof(int32_t) > max_plan_bytes) {
    return reject(kStatusResourceExhausted, "the KV pull of this request exceeds the step ring's record limit");
  }
  return std::nullopt;
}

void KvPins::pin(RequestState& r, const RequestDetails& d, int32_t prompt_blocks, int64_t now_ns) {
  const int64_t expires = now_ns + int64_t{d.kv_pin_timeout_ms} * 1'000'000;
  KvPinned& event = events_.emplace_back();
  event.request_id = r.request_id;
  event.num_tokens = static_cast<uint32_t>(r.num_prompt_tokens);
  event.expires_at_ns = expires;
  event.block_ids.assign(r.block_ids.begin(), r.block_ids.begin() + prompt_blocks);
  pinned_.push_back({r.request_id, expires, std::move(r.block_ids)});
  r.block_ids = {};
}

bool KvPins::release(uint64_t request_id, BlockPool& pool) {
  const auto it = std::find_if(pinned_.begin(), pinned_.end(), [&](const Pin& p) { return p.request_id == request_id; });
  if (it == pinned_.end()) return false;
  pool.free(it->block_ids, /*tail_first=*/true);  // full prompt blocks stay cached for later prefix hits
  pinned_.erase(it);
  return true;
}

int32_t KvPins::expire(int64_t now_ns, BlockPool& pool) {
  int32_t freed = 0;
  for (size_t k = 0; k < pinned_.size();) {
    if (pinned_[k].expires_at_ns <= now_ns) {
      pool.free(pinned_[k].block_ids, /*tail_first=*/true);
      pinned_.erase(pinned_.begin() + static_cast<std::ptrdiff_t>(k));
      ++freed;
    } else {
      ++k;
    }
  }
  return freed;
}

void KvPins::add_pull(int32_t slot, RequestDetails& d, std::span<const int32_t> local) {
  KvPull& p = pulls_.emplace_back();
  p.slot = slot;
  p.remote_block_ids = d.kv_remote_block_ids;
  p.local_block_ids.assign(local.begin(), local.begin() + static_cast<std::ptrdiff_t>(d.kv_remote_block_ids.size()));
  p.peer = d.kv_peer;
  d.kv_pull_pending = false;
}

}  // namespace ringserve
