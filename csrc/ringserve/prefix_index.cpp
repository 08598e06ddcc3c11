#include "ringserve/prefix_index.h"

#include <algorithm>
#include <cstring>

namespace ringserve {
namespace {

// splitmix64's finalizer: a bijective 64-bit mix.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t block_hash(uint64_t parent, bool is_first, uint64_t cache_salt, std::span<const int32_t> tokens) {
  // The salt seeds the chain's root, so requests with different salts never share a block.
  const uint64_t chain = is_first ? mix64(cache_salt ^ 0x243f6a8885a308d3ull) : parent;
  // Two tokens at a time as one 64-bit word (their bits as stored: an injective packing), each word keyed by its
  // position and folded with one 64x64->128-bit multiply; the products are independent (they overlap in the
  // pipeline instead of forming a serial chain) and their sum joins the chain through a full mix. A decode step that
  // completes a block pays for this, so it is kept to a few instructions per token.
  uint64_t sum = tokens.size();
  uint64_t key = 0x9e3779b97f4a7c15ull;
  size_t i = 0;
#pragma GCC unroll 8
  for (; i + 1 < tokens.size(); i += 2, key += 0x9e3779b97f4a7c15ull) {
    uint64_t word;
    std::memcpy(&word, &tokens[i], sizeof(word));
    const unsigned __int128 product = static_cast<unsigned __int128>(word ^ key) * 0xd6e8feb86659fd93ull;
    sum += static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  if (i < tokens.size()) {
    const uint64_t word = uint64_t{static_cast<uint32_t>(tokens[i])} | (uint64_t{1} << 63);  // an odd last token
    const unsigned __int128 product = static_cast<unsigned __int128>(word ^ key) * 0xd6e8feb86659fd93ull;
    sum += static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  return mix64(chain ^ mix64(sum));
}

PrefixIndex::PrefixIndex(int32_t block_size, bool enabled, int32_t num_blocks)
    : block_size_(block_size), enabled_(enabled) {
  hits_.reserve(static_cast<size_t>(num_blocks));
  pending_.reserve(static_cast<size_t>(num_blocks));
  claimed_.reserve(static_cast<size_t>(num_blocks));
}

void PrefixIndex::extend_block_hashes(const RequestState& r, RequestDetails& d, int32_t num_blocks) const {
  const auto bs = static_cast<size_t>(block_size_);
  for (auto k = d.block_hashes.size(); k < static_cast<size_t>(num_blocks); ++k) {
    const uint64_t parent = k == 0 ? 0 : d.block_hashes[k - 1];
    d.block_hashes.push_back(block_hash(parent, k == 0, d.cache_salt, std::span(r.token_ids).subspan(k * bs, bs)));
  }
}

int32_t PrefixIndex::find_cached_prefix(const RequestState& r, RequestDetails& d, const BlockPool& pool) {
  hits_.clear();
  if (!enabled_) return 0;
  int32_t revived = 0;
  extend_block_hashes(r, d, r.num_tokens() / block_size_);
  const int32_t max_hits = (r.num_tokens() - 1) / block_size_;
  for (int32_t j = 0; j < max_hits; ++j) {
    const int32_t id = pool.lookup(d.block_hashes[static_cast<size_t>(j)]);
    if (id == BlockPool::kNone) break;
    hits_.push_back(id);
    revived += pool.ref_count(id) == 0 ? 1 : 0;
  }
  return revived;
}

void PrefixIndex::claim_completed(const RequestDetails& d, int32_t computed, int32_t n) {
  if (!enabled_) return;
  const auto known = static_cast<int32_t>(d.block_hashes.size());
  for (int32_t j = computed / block_size_; j < std::min((computed + n) / block_size_, known); ++j) {
    claimed_.push_back(d.block_hashes[static_cast<size_t>(j)]);
  }
}

bool PrefixIndex::waits_for_claimed(const RequestDetails& d, int32_t max_blocks) const {
  if (claimed_.empty()) return false;
  // Hashes chain: the blocks after the first claimed one can only be claimed by the same requests, so a run of
  // claimed blocks is found block by block.
  int32_t run = 0;
  for (auto j = static_cast<int32_t>(hits_.size()); j < max_blocks; ++j, ++run) {
    if (std::find(claimed_.begin(), claimed_.end(), d.block_hashes[static_cast<size_t>(j)]) == claimed_.end()) break;
  }
  return run > 0 && run * block_size_ >= kSharedPrefixWaitTokens;
}

void PrefixIndex::register_computed_blocks(std::span<const int32_t> completed, RequestTable& table, BlockPool& pool) {
  if (completed.empty()) return;
  const auto bs = static_cast<size_t>(block_size_);
  for (const int32_t index : completed) {
    const RequestState& r = table.state(index);
    const auto next = static_cast<size_t>(r.num_registered_blocks);
    if (next > 0) __builtin_prefetch(&table.details(index).block_hashes[next - 1]);
    __builtin_prefetch(&r.block_ids[next]);
    __builtin_prefetch(&r.token_ids[next * bs]);
  }
  pending_.clear();
  for (const int32_t index : completed) {
    RequestState& r = table.state(index);
    RequestDetails& d = table.details(index);
    const int32_t full = std::min(r.num_computed_tokens / block_size_, static_cast<int32_t>(r.block_ids.size()));
    if (full <= r.num_registered_blocks) continue;
    extend_block_hashes(r, d, full);
    for (int32_t j = r.num_registered_blocks; j < full; ++j) {
      const uint64_t hash = d.block_hashes[static_cast<size_t>(j)];
      pool.prefetch(hash, r.block_ids[static_cast<size_t>(j)]);  // registered after this loop: misses overlap
      pending_.push_back({r.block_ids[static_cast<size_t>(j)], hash});
    }
    set_registered_blocks(r, full);
  }
  // The caller releases finished requests only after this: a block must still be referenced when it enters the cache.
  for (const PendingBlock& b : pending_) pool.cache(b.block, b.hash);
}

}  // namespace ringserve
