// The KV block pool: a fixed number of blocks, each either free (on the free list, ref_count 0) or referenced
// (ref_count > 0, off the list). The free list is an intrusive doubly linked list threaded through the block array,
// ordered oldest-freed first, so a later prefix cache can unlink a cached block on a hit in O(1) and evict in LRU order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ringserve {

class BlockPool {
 public:
  static constexpr int32_t kNone = -1;

  explicit BlockPool(int32_t num_blocks);

  // All or nothing: appends `n` block ids (ref_count 1) to `out` and returns true, or changes nothing and returns
  // false when fewer than `n` blocks are free.
  bool allocate(int32_t n, std::vector<int32_t>& out);
  // Drops one reference to each block; a block whose count reaches 0 goes to the tail of the free list.
  // Throws std::logic_error for an id out of range or a block that is already free (the pool is left unchanged).
  void free(std::span<const int32_t> block_ids);
  // Adds a reference to a block that is already referenced (sharing).
  void add_ref(int32_t block_id);

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t num_free() const { return num_free_; }
  int32_t ref_count(int32_t block_id) const;
  // Walks the whole pool and throws std::logic_error if an invariant is broken (tests only: O(num_blocks)).
  void check_invariants() const;

 private:
  struct Block {
    int32_t ref_count = 0;
    int32_t prev = kNone;  // free-list links; meaningful only while ref_count == 0
    int32_t next = kNone;
  };

  void push_back_free(int32_t id);
  void unlink_free(int32_t id);
  void check_id(int32_t id) const;

  std::vector<Block> blocks_;
  int32_t head_ = kNone;  // next block to allocate (least recently freed)
  int32_t tail_ = kNone;
  int32_t num_free_ = 0;  // invariant: == length of the free list == count of blocks with ref_count 0
};

}  // namespace ringserve
