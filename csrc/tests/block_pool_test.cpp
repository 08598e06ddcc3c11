#include <algorithm>
#include <random>
#include <set>
#include <stdexcept>

#include "check.h"
#include "ringserve/block_pool.h"

using namespace ringserve;

TEST(allocate_and_free_return_every_block) {
  BlockPool pool(8);
  std::vector<int32_t> a, b;
  CHECK(pool.allocate(3, a) && a.size() == 3);
  CHECK(pool.allocate(5, b) && b.size() == 5);
  CHECK(pool.num_free() == 0);
  std::set<int32_t> distinct(a.begin(), a.end());
  distinct.insert(b.begin(), b.end());
  CHECK(distinct.size() == 8);
  for (int32_t id : a) CHECK(pool.ref_count(id) == 1);
  pool.free(a);
  pool.free(b);
  CHECK(pool.num_free() == 8);
  pool.check_invariants();
}

TEST(allocation_is_all_or_nothing) {
  BlockPool pool(4);
  std::vector<int32_t> got;
  CHECK(pool.allocate(3, got));
  std::vector<int32_t> more;
  CHECK(!pool.allocate(2, more));
  CHECK(more.empty() && pool.num_free() == 1);
  CHECK(pool.allocate(0, more) && more.empty());
  pool.check_invariants();
}

TEST(free_list_is_lru_ordered) {
  BlockPool pool(4);
  std::vector<int32_t> all;
  CHECK(pool.allocate(4, all));
  pool.free(std::vector<int32_t>{all[2]});
  pool.free(std::vector<int32_t>{all[0]});
  std::vector<int32_t> again;
  CHECK(pool.allocate(2, again));
  CHECK(again[0] == all[2] && again[1] == all[0]);  // least recently freed first
}

TEST(shared_blocks_are_freed_by_the_last_reference) {
  BlockPool pool(2);
  std::vector<int32_t> ids;
  CHECK(pool.allocate(1, ids));
  pool.add_ref(ids[0]);
  CHECK(pool.ref_count(ids[0]) == 2);
  pool.free(ids);
  CHECK(pool.num_free() == 1 && pool.ref_count(ids[0]) == 1);
  pool.free(ids);
  CHECK(pool.num_free() == 2);
  pool.check_invariants();
}

TEST(double_free_and_bad_ids_are_refused_without_damage) {
  BlockPool pool(3);
  std::vector<int32_t> ids;
  CHECK(pool.allocate(2, ids));
  pool.free(std::vector<int32_t>{ids[0]});
  CHECK_THROWS(std::logic_error, pool.free(std::vector<int32_t>{ids[1], ids[0]}));
  CHECK(pool.ref_count(ids[1]) == 1);  // the valid id in the rejected call was not released
  CHECK_THROWS(std::logic_error, pool.free(std::vector<int32_t>{7}));
  CHECK_THROWS(std::logic_error, pool.add_ref(ids[0]));
  pool.check_invariants();
}

TEST(random_workload_frees_exactly_what_it_allocated) {
  BlockPool pool(64);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> owners;
  int64_t allocated = 0, freed = 0;
  for (int i = 0; i < 20000; ++i) {
    if (rng() % 2 == 0 || owners.empty()) {
      std::vector<int32_t> ids;
      const auto n = static_cast<int32_t>(rng() % 9);
      const int32_t before = pool.num_free();
      if (pool.allocate(n, ids)) {
        allocated += n;
        owners.push_back(std::move(ids));
      } else {
        CHECK(pool.num_free() == before && n > before);
      }
    } else {
      const size_t k = rng() % owners.size();
      freed += static_cast<int64_t>(owners[k].size());
      pool.free(owners[k]);
      owners.erase(owners.begin() + static_cast<std::ptrdiff_t>(k));
    }
    if (i % 500 == 0) pool.check_invariants();
  }
  for (auto& ids : owners) {
    freed += static_cast<int64_t>(ids.size());
    pool.free(ids);
  }
  CHECK(allocated == freed);
  CHECK(pool.num_free() == 64);
  pool.check_invariants();
}

TEST(freed_cached_blocks_stay_cached_until_the_pool_needs_them) {
  BlockPool pool(4);
  std::vector<int32_t> ids;
  CHECK(pool.allocate(2, ids));
  CHECK(pool.cache(ids[0], 111) && pool.cache(ids[1], 222));
  CHECK(!pool.cache(ids[0], 333));  // already registered
  pool.free(ids, /*tail_first=*/true);
  CHECK(pool.num_free() == 4 && pool.num_cached() == 2);
  CHECK(pool.lookup(111) == ids[0] && pool.lookup(222) == ids[1]);
  // A hit takes the block back off the free list without evicting it.
  pool.acquire_cached(ids[0]);
  CHECK(pool.ref_count(ids[0]) == 1 && pool.num_free() == 3 && pool.lookup(111) == ids[0]);
  // Two never-cached blocks are handed out before any cached one.
  std::vector<int32_t> fresh;
  CHECK(pool.allocate(2, fresh));
  CHECK(pool.num_cached() == 2 && pool.lookup(222) == ids[1]);
  // Now the pool must evict the last cached free block.
  std::vector<int32_t> last;
  CHECK(pool.allocate(1, last));
  CHECK(last[0] == ids[1] && pool.lookup(222) == BlockPool::kNone && pool.num_cached() == 1);
  pool.check_invariants();
}

TEST(tail_first_free_evicts_a_requests_last_block_first) {
  BlockPool pool(3);
  std::vector<int32_t> ids;
  CHECK(pool.allocate(3, ids));
  for (int32_t i = 0; i < 3; ++i) CHECK(pool.cache(ids[static_cast<size_t>(i)], 1000u + static_cast<uint64_t>(i)));
  pool.free(ids, /*tail_first=*/true);
  std::vector<int32_t> one;
  CHECK(pool.allocate(1, one));
  CHECK(one[0] == ids[2] && pool.lookup(1000) == ids[0] && pool.lookup(1001) == ids[1]);
}

TEST(an_equal_hash_keeps_the_first_block_canonical) {
  BlockPool pool(2);
  std::vector<int32_t> ids;
  CHECK(pool.allocate(2, ids));
  CHECK(pool.cache(ids[0], 7));
  CHECK(!pool.cache(ids[1], 7));
  CHECK(pool.lookup(7) == ids[0] && !pool.is_cached(ids[1]));
  CHECK_THROWS(std::logic_error, pool.acquire_cached(ids[1]));
  pool.check_invariants();
}

TEST(hash_table_survives_random_caching_and_eviction) {
  // Hashes that collide in the table's low bits stress linear probing and backward-shift deletion.
  BlockPool pool(16);
  std::mt19937 rng(11);
  std::vector<int32_t> held;
  for (int i = 0; i < 20000; ++i) {
    const uint32_t op = rng() % 3;
    if (op == 0) {
      std::vector<int32_t> got;
      if (pool.allocate(1, got)) held.push_back(got[0]);
    } else if (op == 1 && !held.empty()) {
      const size_t k = rng() % held.size();
      const uint64_t hash = (uint64_t{rng() % 8} << 32) | (rng() % 4);  // few distinct low bits
      pool.cache(held[k], hash);
      if (rng() % 2 == 0) {
        pool.free(std::vector<int32_t>{held[k]});
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      }
    } else if (op == 2) {
      const uint64_t hash = (uint64_t{rng() % 8} << 32) | (rng() % 4);
      const int32_t id = pool.lookup(hash);
      if (id != BlockPool::kNone) {
        pool.acquire_cached(id);
        held.push_back(id);
      }
    }
    if (i % 97 == 0) pool.check_invariants();
  }
  pool.free(held);
  CHECK(pool.num_free() == 16);
  pool.check_invariants();
}

TEST_MAIN()
