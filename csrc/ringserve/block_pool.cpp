#include "ringserve/block_pool.h"

#include <sys/mman.h>

#include <new>
#include <stdexcept>
#include <string>

namespace ringserve {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

void* allocate_huge_pages(size_t bytes) {
  if (bytes < kHugePage) return ::operator new(bytes);
  // Whole huge pages, aligned to one: an anonymous mapping the kernel may back with 2 MiB pages on first touch.
  const size_t length = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  // Trim the mapping to a 2 MiB-aligned start so every page can be a huge one.
  auto* raw = static_cast<char*>(p);
  const auto misalign = reinterpret_cast<uintptr_t>(raw) % kHugePage;
  char* start = raw + (misalign == 0 ? 0 : kHugePage - misalign);
  if (start > raw) ::munmap(raw, static_cast<size_t>(start - raw));
  const size_t tail = static_cast<size_t>(raw + length + kHugePage - (start + length));
  if (tail > 0) ::munmap(start + length, tail);
  ::madvise(start, length, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
  return start;
}

void free_huge_pages(void* p, size_t bytes) noexcept {
  if (bytes < kHugePage) {
    ::operator delete(p);
    return;
  }
  ::munmap(p, (bytes + kHugePage - 1) / kHugePage * kHugePage);
}

BlockPool::BlockPool(int32_t num_blocks) {
  if (num_blocks < 0) throw std::invalid_argument("num_blocks must be >= 0");
  blocks_.resize(static_cast<size_t>(num_blocks));
  size_t size = 2;
  while (size < 2 * static_cast<size_t>(num_blocks)) size *= 2;
  table_.resize(size);
  mask_ = size - 1;
  for (int32_t id = 0; id < num_blocks; ++id) push_back_free(id);
}

void BlockPool::check_id(int32_t id) const {
  if (id < 0 || id >= num_blocks()) throw std::logic_error("block id " + std::to_string(id) + " out of range");
}

void BlockPool::push_back_free(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  b.prev = tail_;
  b.next = kNone;
  if (tail_ != kNone) {
    blocks_[static_cast<size_t>(tail_)].next = id;
  } else {
    head_ = id;
  }
  tail_ = id;
  ++num_free_;
}

void BlockPool::unlink_free(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  if (b.prev != kNone) {
    blocks_[static_cast<size_t>(b.prev)].next = b.next;
  } else {
    head_ = b.next;
  }
  if (b.next != kNone) {
    blocks_[static_cast<size_t>(b.next)].prev = b.prev;
  } else {
    tail_ = b.prev;
  }
  b.prev = b.next = kNone;
  --num_free_;
}

size_t BlockPool::find_slot(uint64_t hash) const {
  // The table always has empty slots (size >= 2 * blocks), so the probe ends.
  size_t i = hash & mask_;
  while (table_[i].block != kNone && table_[i].hash != hash) i = (i + 1) & mask_;
  return i;
}

void BlockPool::uncache(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  size_t hole = find_slot(b.hash);
  table_[hole] = Slot{};
  // Backward-shift deletion: pull later entries of the probe run into the hole so every lookup still finds them.
  for (size_t j = (hole + 1) & mask_; table_[j].block != kNone; j = (j + 1) & mask_) {
    const size_t home = table_[j].hash & mask_;
    const bool home_in_gap = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (home_in_gap) continue;  // its probe run does not cross the hole
    table_[hole] = table_[j];
    table_[j] = Slot{};
    hole = j;
  }
  b.cached = false;
  b.hash = 0;
  --num_cached_;
}

bool BlockPool::allocate(int32_t n, std::vector<int32_t>& out) {
  if (n < 0) throw std::invalid_argument("cannot allocate a negative number of blocks");
  if (n > num_free_) return false;  // all or nothing: decide before touching anything
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = head_;
    unlink_free(id);
    Block& b = blocks_[static_cast<size_t>(id)];
    if (b.cached) uncache(id);  // LRU eviction: the least recently freed block is reused
    b.ref_count = 1;
    out.push_back(id);
  }
  return true;
}

void BlockPool::free(std::span<const int32_t> block_ids, bool tail_first) {
  // Validate first so a bad id or an already-free block leaves the pool unchanged. (The same id listed more often
  // than its ref_count is still caught below, after the earlier entries were released.)
  for (const int32_t id : block_ids) {
    check_id(id);
    if (blocks_[static_cast<size_t>(id)].ref_count <= 0) {
      throw std::logic_error("double free of block " + std::to_string(id));
    }
  }
  const size_t n = block_ids.size();
  for (size_t k = 0; k < n; ++k) {
    const int32_t id = block_ids[tail_first ? n - 1 - k : k];
    Block& b = blocks_[static_cast<size_t>(id)];
    if (b.ref_count <= 0) throw std::logic_error("double free of block " + std::to_string(id));
    if (--b.ref_count == 0) push_back_free(id);
  }
}

void BlockPool::add_ref(int32_t block_id) {
  check_id(block_id);
  Block& b = blocks_[static_cast<size_t>(block_id)];
  if (b.ref_count <= 0) throw std::logic_error("add_ref on free block " + std::to_string(block_id));
  ++b.ref_count;
}

int32_t BlockPool::lookup(uint64_t hash) const { return table_[find_slot(hash)].block; }

void BlockPool::acquire_cached(int32_t block_id) {
  check_id(block_id);
  Block& b = blocks_[static_cast<size_t>(block_id)];
  if (!b.cached) throw std::logic_error("acquire_cached on uncached block " + std::to_string(block_id));
  if (b.ref_count == 0) unlink_free(block_id);
  ++b.ref_count;
}

bool BlockPool::cache(int32_t block_id, uint64_t hash) {
  check_id(block_id);
  Block& b = blocks_[static_cast<size_t>(block_id)];
  if (b.ref_count <= 0) throw std::logic_error("cache() on free block " + std::to_string(block_id));
  if (b.cached) return false;
  const size_t i = find_slot(hash);
  if (table_[i].block != kNone) return false;  // an equal block computed earlier stays the canonical one
  table_[i] = Slot{hash, block_id};
  b.cached = true;
  b.hash = hash;
  ++num_cached_;
  return true;
}

int32_t BlockPool::ref_count(int32_t block_id) const {
  check_id(block_id);
  return blocks_[static_cast<size_t>(block_id)].ref_count;
}

bool BlockPool::is_cached(int32_t block_id) const {
  check_id(block_id);
  return blocks_[static_cast<size_t>(block_id)].cached;
}

void BlockPool::check_invariants() const {
  auto fail = [](const std::string& what) { throw std::logic_error("BlockPool invariant broken: " + what); };
  int32_t listed = 0;
  int32_t prev = kNone;
  for (int32_t id = head_; id != kNone; id = blocks_[static_cast<size_t>(id)].next) {
    const Block& b = blocks_[static_cast<size_t>(id)];
    if (b.ref_count != 0) fail("referenced block " + std::to_string(id) + " on the free list");
    if (b.prev != prev) fail("broken prev link at block " + std::to_string(id));
    prev = id;
    if (++listed > num_blocks()) fail("free list has a cycle");
  }
  if (prev != tail_) fail("tail does not end the free list");
  int32_t unreferenced = 0;
  int32_t cached = 0;
  for (int32_t id = 0; id < num_blocks(); ++id) {
    const Block& b = blocks_[static_cast<size_t>(id)];
    if (b.ref_count < 0) fail("negative ref_count");
    unreferenced += b.ref_count == 0 ? 1 : 0;
    if (b.cached) {
      ++cached;
      if (lookup(b.hash) != id) fail("cached block " + std::to_string(id) + " not found under its hash");
    }
  }
  if (listed != num_free_ || unreferenced != num_free_) fail("num_free does not match the free list");
  int32_t entries = 0;
  for (const Slot& s : table_) {
    if (s.block == kNone) continue;
    ++entries;
    const Block& b = blocks_[static_cast<size_t>(s.block)];
    if (!b.cached || b.hash != s.hash) fail("hash table entry for an uncached block");
  }
  if (cached != num_cached_ || entries != num_cached_) fail("num_cached does not match the hash table");
}

}  // namespace ringserve
