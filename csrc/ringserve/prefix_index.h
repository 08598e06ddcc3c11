// The prefix-cache index: chained hashes of a request's full blocks, the lookup of its cached leading blocks at
// admission, and the registration of blocks whose KV it has computed. On admission a request reuses every cached
// leading full block, so it starts at num_computed_tokens > 0; it always computes at least its last token. Only full,
// computed blocks are registered: their contents never change again. The blocks themselves live in the BlockPool.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "ringserve/block_pool.h"
#include "ringserve/request_table.h"

namespace ringserve {

// The chained prefix hash of one full block: parent hash (or the salt-derived root for the first block) + its tokens.
uint64_t block_hash(uint64_t parent, bool is_first, uint64_t cache_salt, std::span<const int32_t> tokens);

// A waiting request waits one step for claimed blocks (PrefixIndex::waits_for_claimed) when they cover at least this
// many of its next tokens: fewer are cheaper to compute again than a step's delay.
inline constexpr int32_t kSharedPrefixWaitTokens = 32;

class PrefixIndex {
 public:
  PrefixIndex(int32_t block_size, bool enabled, int32_t num_blocks);

  bool enabled() const { return enabled_; }
  // Records that a request's first `blocks` blocks are registered, and from which num_computed_tokens the next one is
  // (never, without prefix caching).
  void set_registered_blocks(RequestState& r, int32_t blocks) const {
    r.num_registered_blocks = blocks;
    r.register_from = enabled_ ? (blocks + 1) * block_size_ : std::numeric_limits<int32_t>::max();
  }
  // The register_from that set_registered_blocks gives r (check_invariants).
  int64_t register_from(const RequestState& r) const {
    return enabled_ ? int64_t{r.num_registered_blocks + 1} * block_size_ : std::numeric_limits<int32_t>::max();
  }

  // Admission: finds r's cached leading full blocks (at most (num_tokens - 1) / block_size, so its last token is
  // computed) into hits(), in order; returns how many of them sit on the pool's free list now (they stop counting as
  // free once taken). Nothing without prefix caching. Hashes all of r's full blocks into d.block_hashes.
  int32_t find_cached_prefix(const RequestState& r, RequestDetails& d, const BlockPool& pool);
  const std::vector<int32_t>& hits() const { return hits_; }
  // Counts an admission's lookup for the stats: `queried` tokens, `hit` of them cached.
  void count_lookup(int32_t queried, int32_t hit) {
    queries_ += static_cast<uint64_t>(queried);
    hit_tokens_ += static_cast<uint64_t>(hit);
  }

  // update(): registers the newly computed full blocks of the requests listed in `completed` (each reached its
  // register_from). Their hash chains, block tables and tokens are cold by now: all are touched first so the misses
  // overlap, then hashed and registered.
  void register_computed_blocks(std::span<const int32_t> completed, RequestTable& table, BlockPool& pool);

  // In-batch sharing. The full blocks that the steps planned and not yet applied complete are claimed (by hash); a
  // waiting request whose next uncached blocks, kSharedPrefixWaitTokens or more of them, are claimed waits for them
  // to be registered instead of computing them a second time in the same step (requests that arrive together with a
  // common system prompt compute it once). update() clears the claims: a wait lasts one step.
  void clear_claims() { claimed_.clear(); }
  // Claims the blocks that computing tokens [computed, computed + n) completes (those whose hashes d holds).
  void claim_completed(const RequestDetails& d, int32_t computed, int32_t n);
  // Whether the request whose cached prefix find_cached_prefix() just found (of its `max_blocks` cacheable blocks)
  // should wait for claimed ones.
  bool waits_for_claimed(const RequestDetails& d, int32_t max_blocks) const;

  uint64_t queried_tokens() const { return queries_; }
  uint64_t hit_tokens() const { return hit_tokens_; }

 private:
  struct PendingBlock {
    int32_t block;
    uint64_t hash;
  };
  // Hashes r's full blocks up to `num_blocks` that have no hash yet.
  void extend_block_hashes(const RequestState& r, RequestDetails& d, int32_t num_blocks) const;

  int32_t block_size_;
  bool enabled_;
  std::vector<int32_t> hits_;            // scratch: cached blocks found for the request being admitted
  std::vector<PendingBlock> pending_;    // scratch: full blocks to register, prefetched first
  std::vector<uint64_t> claimed_;        // hashes of the blocks the steps in flight (or being planned) complete
  uint64_t queries_ = 0;
  uint64_t hit_tokens_ = 0;
};

}  // namespace ringserve
