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

TEST_MAIN()
