// KvPins and the KV option checks on their own (disagg_test.cpp covers them through the scheduler and the engine).
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

namespace {

// A finished prefill-only request of a 6-token prompt holding 3 blocks of size 4 (its prompt needs 2).
int32_t finished_prefill(RequestTable& table, BlockPool& pool, uint64_t id, uint32_t timeout_ms) {
  KvRequestOptions kv;
  kv.mode = KvMode::kPrefillOnly;
  kv.pin_timeout_ms = timeout_ms;
  const int32_t index = table.add(make_request(id, 6, 4), table_config(), &kv, 0);
  CHECK(pool.allocate(3, table.state(index).block_ids));
  return index;
}

}  // namespace

TEST(kv_pins_hold_the_blocks_until_released_or_expired) {
  BlockPool pool(16);
  RequestTable table;
  KvPins pins;
  const int32_t a = finished_prefill(table, pool, 1, 10);
  const int32_t b = finished_prefill(table, pool, 2, 20);
  CHECK(table.details(a).kv_mode == KvMode::kPrefillOnly && table.state(a).length_limit == 7);  // first token only
  const std::vector<int32_t> blocks_a = table.state(a).block_ids;
  pins.pin(table.state(a), table.details(a), 2, 1'000'000);
  pins.pin(table.state(b), table.details(b), 2, 1'000'000);
  CHECK(table.state(a).block_ids.empty() && pins.num_pinned() == 2);  // the references moved to the pins
  CHECK(pins.events().size() == 2 && pins.events()[0].request_id == 1);
  CHECK(pins.events()[0].num_tokens == 6 && pins.events()[0].expires_at_ns == 11'000'000);
  CHECK((pins.events()[0].block_ids == std::vector<int32_t>{blocks_a[0], blocks_a[1]}));  // the prompt's blocks
  int32_t held = 0;
  pins.for_each_pinned_block([&](int32_t block) { held += pool.ref_count(block); });
  CHECK(held == 6 && pool.num_free() == 10);
  pins.clear_events();
  CHECK(pins.events().empty());

  CHECK(pins.expire(10'999'999, pool) == 0);
  CHECK(pins.expire(11'000'000, pool) == 1 && pool.num_free() == 13);  // a's three blocks
  CHECK(!pins.release(1, pool));  // already expired
  CHECK(pins.release(2, pool) && pool.num_free() == 16 && pins.num_pinned() == 0);
  pool.check_invariants();
}

TEST(kv_pins_list_each_pull_with_its_local_blocks) {
  RequestTable table;
  KvPins pins;
  KvRequestOptions kv;
  kv.mode = KvMode::kPullRemote;
  kv.first_token_id = 77;
  kv.remote_block_ids = {40, 41};
  kv.peer = {1, 2, 3};
  const int32_t index = table.add(make_request(1, 6, 4), table_config(), &kv, 0);
  RequestDetails& d = table.details(index);
  CHECK(d.kv_pull_pending && table.state(index).token_ids.back() == 77);  // the prefill side's token comes first
  const std::vector<int32_t> local = {3, 4, 5};
  pins.add_pull(2, d, local);
  CHECK(!d.kv_pull_pending && pins.pulls().size() == 1);
  const KvPull& p = pins.pulls()[0];
  CHECK(p.slot == 2 && (p.remote_block_ids == std::vector<int32_t>{40, 41}));
  CHECK((p.local_block_ids == std::vector<int32_t>{3, 4}) && (p.peer == std::vector<uint8_t>{1, 2, 3}));
  pins.clear_pulls();
  CHECK(pins.pulls().empty());
}

TEST(kv_options_are_checked_with_the_field_named) {
  const auto message = [](const AddRequest& r, const KvRequestOptions& kv, size_t max_plan_bytes = SIZE_MAX) {
    const auto rejected = check_kv_options(r, kv, 4, max_plan_bytes);
    return rejected ? rejected->message : std::string();
  };
  KvRequestOptions prefill;
  prefill.mode = KvMode::kPrefillOnly;
  CHECK(message(make_request(1, 6, 4), prefill).find("pin_timeout_ms") != std::string::npos);
  prefill.pin_timeout_ms = 5;
  CHECK(message(make_request(1, 6, 4), prefill).empty());

  KvRequestOptions pull;
  pull.mode = KvMode::kPullRemote;
  pull.remote_block_ids = {1, 2};
  pull.peer = {1};
  CHECK(message(make_request(1, 6, 4), pull).empty());
  CHECK(message(make_request(1, 9, 4), pull).find("remote_block_ids has 2 blocks, the prompt needs 3") == 0);
  CHECK(message(make_request(1, 6, 1), pull).find("max_tokens >= 2") != std::string::npos);
  KvRequestOptions bad = pull;
  bad.first_token_id = -1;
  CHECK(message(make_request(1, 6, 4), bad) == "first_token_id is negative");
  bad = pull;
  bad.peer.clear();
  CHECK(message(make_request(1, 6, 4), bad).find("peer info") != std::string::npos);
  bad = pull;
  bad.remote_block_ids = {1, -2};
  CHECK(message(make_request(1, 6, 4), bad) == "remote block id -2 is negative");
  CHECK(message(make_request(1, 6, 4), pull, 70).find("record limit") != std::string::npos);
}

TEST_MAIN()
