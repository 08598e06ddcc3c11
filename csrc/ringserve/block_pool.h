// The KV block pool and its prefix cache.
//
// A block is either free (on the free list, ref_count 0) or referenced (ref_count > 0, off the list). The free list is
// an intrusive doubly linked list threaded through the block array, least recently freed first. A full block whose KV
// has been computed may be registered under its chained prefix hash; it keeps that hash after it is freed, so a later
// request with the same prefix can take it back off the free list in O(1) (a cache hit). A cached block loses its hash
// only when allocate() reuses it, which always takes the least recently freed block: LRU eviction, only when needed.
//
// The hash table is open addressing with linear probing and backward-shift deletion, sized once for every block, so
// neither hits nor evictions allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace ringserve {

// Backs the pool's two big arrays (the hash table and the block array, tens of MB for a large pool) with transparent
// huge pages where the kernel allows it: cache hits touch them at random, and with 4 KiB pages nearly every such touch
// would also miss the TLB. Small arrays and kernels without THP get ordinary pages.
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}
  T* allocate(size_t n);
  void deallocate(T* p, size_t n) noexcept;
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
};
void* allocate_huge_pages(size_t bytes);
void free_huge_pages(void* p, size_t bytes) noexcept;
template <class T>
T* HugePageAllocator<T>::allocate(size_t n) { return static_cast<T*>(allocate_huge_pages(n * sizeof(T))); }
template <class T>
void HugePageAllocator<T>::deallocate(T* p, size_t n) noexcept { free_huge_pages(p, n * sizeof(T)); }

class BlockPool {
 public:
  static constexpr int32_t kNone = -1;

  explicit BlockPool(int32_t num_blocks);

  // All or nothing: appends `n` block ids (ref_count 1) to `out` and returns true, or changes nothing and returns
  // false when fewer than `n` blocks are free. A cached block taken from the free list is evicted (forgets its hash).
  bool allocate(int32_t n, std::vector<int32_t>& out);
  // Drops one reference to each block; a block whose count reaches 0 goes to the tail of the free list (keeping its
  // hash). `tail_first` walks the ids backwards, so a request's last blocks are evicted before its first ones.
  // Throws std::logic_error for an id out of range or a block that is already free (the pool is left unchanged).
  void free(std::span<const int32_t> block_ids, bool tail_first = false);
  // Adds a reference to a block that is already referenced (sharing).
  void add_ref(int32_t block_id);

  // The cached block registered under `hash`, or kNone.
  int32_t lookup(uint64_t hash) const;
  // Takes a reference on a cached block found by lookup(); a free one comes off the free list (a hit, not a reuse).
  void acquire_cached(int32_t block_id);
  // Registers a referenced, full, computed block under `hash`. False (and nothing changes) when another block already
  // holds that hash or this block is registered already.
  bool cache(int32_t block_id, uint64_t hash);
  // Hints that cache(block_id, hash) follows soon, so a batch of them overlaps its cache misses.
  void prefetch(uint64_t hash, int32_t block_id) const {
    __builtin_prefetch(&table_[hash & mask_]);
    __builtin_prefetch(&blocks_[static_cast<size_t>(block_id)]);
  }

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t num_free() const { return num_free_; }
  int32_t num_cached() const { return num_cached_; }
  int32_t ref_count(int32_t block_id) const;
  bool is_cached(int32_t block_id) const;
  // Walks the whole pool and throws std::logic_error if an invariant is broken (tests only: O(num_blocks)).
  void check_invariants() const;

 private:
  struct Block {
    int32_t ref_count = 0;
    int32_t prev = kNone;  // free-list links; meaningful only while ref_count == 0
    int32_t next = kNone;
    bool cached = false;  // registered in the hash table under `hash`
    uint64_t hash = 0;
  };
  struct Slot {
    uint64_t hash = 0;
    int32_t block = kNone;  // kNone = empty
  };

  void push_back_free(int32_t id);
  void unlink_free(int32_t id);
  void check_id(int32_t id) const;
  size_t find_slot(uint64_t hash) const;  // the slot holding `hash`, or the empty slot that ends its probe run
  void uncache(int32_t id);

  std::vector<Block, HugePageAllocator<Block>> blocks_;
  std::vector<Slot, HugePageAllocator<Slot>> table_;  // power-of-two size >= 2 * num_blocks: probe runs stay short
  size_t mask_ = 0;
  int32_t head_ = kNone;  // next block to allocate (least recently freed)
  int32_t tail_ = kNone;
  int32_t num_free_ = 0;  // invariant: == length of the free list == count of blocks with ref_count 0
  int32_t num_cached_ = 0;
};

}  // namespace ringserve
