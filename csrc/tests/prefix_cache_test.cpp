// The prefix cache through the scheduler, and PrefixIndex on its own.
#include "scheduler_harness.h"

using namespace ringserve;
using namespace ringserve::scheduler_testing;

TEST(a_request_sharing_a_prefix_reuses_the_cached_blocks) {
  Harness h(make_config(64, 8, 64));  // block size 4
  CHECK(h.add(prompt_of(1, iota_tokens(40), 3)));
  h.run_to_completion();
  CHECK(h.scheduler.block_pool().num_cached() >= 10);  // the finished request's full blocks stay cached
  std::vector<int32_t> second = iota_tokens(40);
  second.insert(second.end(), {7, 7, 7, 7, 7, 7});
  CHECK(h.add(prompt_of(2, second, 2)));
  CHECK(h.step());
  CHECK(h.plan.new_requests.size() == 1);
  const NewRequestData& nr = h.plan.new_requests[0];
  CHECK(nr.num_computed_tokens == 40 && h.plan.sched_start[0] == 40 && h.plan.sched_len[0] == 6);
  CHECK(nr.num_prompt_tokens == 46);
  h.run_to_completion();
  const RequestOutput* o = final_output(h, 2);
  CHECK(o != nullptr && o->num_cached_tokens == 40);
  const EngineStats st = h.scheduler.stats(0);
  CHECK(st.prefix_cache_hits == 40 && st.prefix_cache_queries == 86);
}

TEST(a_fully_cached_prompt_still_computes_its_last_token) {
  Harness h(make_config(64, 8, 64));
  CHECK(h.add(prompt_of(1, iota_tokens(40), 2)));
  h.run_to_completion();
  CHECK(h.add(prompt_of(2, iota_tokens(40), 2)));
  CHECK(h.step());
  // 40 tokens = 10 full blocks, but only 9 may be reused: the block holding the last prompt token is recomputed.
  CHECK(h.plan.new_requests[0].num_computed_tokens == 36 && h.plan.sched_len[0] == 4 && h.plan.sched_sample[0] == 1);
  h.run_to_completion();
  CHECK(final_output(h, 2)->num_cached_tokens == 36);
}

TEST(running_requests_share_blocks_with_reference_counts) {
  Harness h(make_config(64, 8, 64));
  CHECK(h.add(prompt_of(1, iota_tokens(17), 20)));
  CHECK(h.step());  // request 1's prompt is computed: its 4 full blocks are cached
  CHECK(h.add(prompt_of(2, iota_tokens(17), 20)));
  CHECK(h.step());
  const std::vector<int32_t>& shared = h.plan.new_requests[0].block_ids;
  for (size_t j = 0; j < 4; ++j) CHECK(h.scheduler.block_pool().ref_count(shared[j]) == 2);
  h.run_to_completion();
  CHECK(h.scheduler.block_pool().num_free() == 64);
}

// Requests a, b, c, d arrive together; a, b and d share 40 prompt tokens (10 blocks of 4), c shares nothing.
std::vector<AddRequest> arriving_together(int32_t shared_tokens) {
  const std::vector<int32_t> shared = iota_tokens(shared_tokens);
  auto with = [&](std::initializer_list<int32_t> own) {
    std::vector<int32_t> p = shared;
    p.insert(p.end(), own);
    return p;
  };
  return {prompt_of(1, with({1, 1}), 3), prompt_of(2, with({2, 2, 2}), 3), prompt_of(3, iota_tokens(30, 5000), 3),
          prompt_of(4, with({4}), 3)};
}

TEST(requests_arriving_together_compute_their_shared_prefix_once) {
  Harness h(make_config(128, 8, 256));
  for (const AddRequest& r : arriving_together(40)) CHECK(h.add(r));
  CHECK(h.step());  // a computes the shared blocks; b and d wait for them, c (nothing shared) overtakes them
  CHECK(h.plan.new_requests.size() == 2);
  CHECK(h.plan.new_requests[0].num_prompt_tokens == 42 && h.plan.new_requests[1].num_prompt_tokens == 30);
  CHECK(h.scheduler.num_waiting() == 2);
  CHECK(h.step());  // b and d, in their order, start after the shared blocks
  CHECK(h.plan.new_requests.size() == 2);
  CHECK(h.plan.new_requests[0].num_prompt_tokens == 43 && h.plan.new_requests[0].num_computed_tokens == 40);
  CHECK(h.plan.new_requests[1].num_prompt_tokens == 41 && h.plan.new_requests[1].num_computed_tokens == 40);
  h.run_to_completion();
  CHECK(final_output(h, 2)->num_cached_tokens == 40 && final_output(h, 4)->num_cached_tokens == 40);
  CHECK(h.scheduler.block_pool().num_free() == 128);
}

TEST(a_short_shared_prefix_is_computed_again_rather_than_waited_for) {
  static_assert(7 * 4 < kSharedPrefixWaitTokens);
  Harness h(make_config(128, 8, 256));
  for (const AddRequest& r : arriving_together(28)) CHECK(h.add(r));
  CHECK(h.step() && h.plan.new_requests.size() == 4);
  for (const NewRequestData& nr : h.plan.new_requests) CHECK(nr.num_computed_tokens == 0);
  EngineConfig off = make_config(128, 8, 256);
  off.enable_prefix_caching = false;
  Harness g(off);
  for (const AddRequest& r : arriving_together(40)) CHECK(g.add(r));
  CHECK(g.step() && g.plan.new_requests.size() == 4);
}

TEST(a_wait_for_shared_blocks_lasts_one_step) {
  // The request that claimed the blocks is aborted with its step in flight: they are never registered, and the one
  // that waited for them computes them itself in the next step.
  Harness h(make_config(128, 8, 256));
  for (const AddRequest& r : arriving_together(40)) CHECK(h.add(r));
  CHECK(h.scheduler.schedule(h.plan, ++h.now) && h.plan.new_requests.size() == 2);
  CHECK(h.scheduler.abort_request(1));
  h.scheduler.update(h.worker.execute(h.plan, [](int32_t) { return 7; }), ++h.now);
  h.collect();
  CHECK(h.step() && h.plan.new_requests.size() == 1);  // b computes the shared blocks, d waits for them
  CHECK(h.plan.new_requests[0].num_prompt_tokens == 43 && h.plan.new_requests[0].num_computed_tokens == 0);
  CHECK(h.step() && h.plan.new_requests.size() == 1 && h.plan.new_requests[0].num_computed_tokens == 40);
  h.run_to_completion();
  CHECK(h.scheduler.block_pool().num_free() == 128);
}

TEST(cache_salt_separates_equal_prompts) {
  Harness h(make_config(64, 8, 64));
  AddRequest a = prompt_of(1, iota_tokens(20), 2);
  a.cache_salt = 1;
  CHECK(h.add(a));
  h.run_to_completion();
  AddRequest b = prompt_of(2, iota_tokens(20), 2);
  b.cache_salt = 2;
  CHECK(h.add(b));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 0);
  h.run_to_completion();
  AddRequest c = prompt_of(3, iota_tokens(20), 2);
  c.cache_salt = 1;
  CHECK(h.add(c));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 16);
}

TEST(prefix_caching_can_be_turned_off) {
  EngineConfig c = make_config(64, 8, 64);
  c.enable_prefix_caching = false;
  Harness h(c);
  CHECK(h.add(prompt_of(1, iota_tokens(20), 2)));
  h.run_to_completion();
  CHECK(h.add(prompt_of(2, iota_tokens(20), 2)));
  CHECK(h.step() && h.plan.new_requests[0].num_computed_tokens == 0);
  CHECK(h.scheduler.block_pool().num_cached() == 0 && h.scheduler.stats(0).prefix_cache_queries == 0);
}

TEST(long_prefill_token_threshold_caps_a_requests_chunk) {
  EngineConfig c = make_config(64, 8, 64);
  c.long_prefill_token_threshold = 8;
  Harness h(c);
  CHECK(h.add(prompt_of(1, iota_tokens(30), 2)));
  CHECK(h.add(prompt_of(2, iota_tokens(5, 900), 2)));
  CHECK(h.step());
  CHECK((h.plan.sched_len == std::vector<int32_t>{8, 5}));  // both fit the 64-token budget in one step
  std::vector<int32_t> chunks{8};
  for (int i = 0; i < 3; ++i) {
    CHECK(h.step());
    chunks.push_back(h.plan.sched_len[0]);  // request 1 runs first: it arrived first
  }
  CHECK((chunks == std::vector<int32_t>{8, 8, 8, 6}));
}

// ---- PrefixIndex on its own ------------------------------------------------------------------------------------

namespace {

// A waiting table entry holding `tokens` as its prompt, nothing registered yet.
int32_t add_entry(RequestTable& table, const PrefixIndex& index, std::vector<int32_t> tokens, uint64_t salt = 0) {
  AddRequest r = prompt_of(static_cast<uint64_t>(table.num_live() + 1), std::move(tokens), 1);
  r.cache_salt = salt;
  const int32_t entry = table.add(r, table_config(), nullptr, 0);
  index.set_registered_blocks(table.state(entry), 0);
  return entry;
}

}  // namespace

TEST(block_hash_chains_blocks_keys_them_by_salt_and_reads_every_token) {
  const std::vector<int32_t> a = {1, 2, 3, 4};
  const std::vector<int32_t> b = {1, 2, 4, 3};
  CHECK(block_hash(0, true, 0, a) == block_hash(0, true, 0, a));
  CHECK(block_hash(0, true, 0, a) != block_hash(0, true, 0, b));         // order matters
  CHECK(block_hash(0, true, 0, a) != block_hash(0, true, 1, a));         // the salt seeds the root
  CHECK(block_hash(5, false, 0, a) != block_hash(6, false, 0, a));       // the parent joins the chain
  CHECK(block_hash(5, false, 0, a) == block_hash(5, false, 9, a));       // past the root the salt is in the parent
  const std::vector<int32_t> odd = {1, 2, 3};
  const std::vector<int32_t> odd_zero = {1, 2, 3, 0};
  CHECK(block_hash(0, true, 0, odd) != block_hash(0, true, 0, odd_zero));  // an odd last token is not a zero pair
}

TEST(prefix_index_finds_the_cached_leading_blocks_and_leaves_the_last_token_to_compute) {
  BlockPool pool(16);
  RequestTable table;
  PrefixIndex index(4, true, 16);  // block size 4
  // A first request computes 12 tokens (3 full blocks) and registers them.
  const int32_t first = add_entry(table, index, iota_tokens(12));
  RequestState& r = table.state(first);  // valid until the next add_entry
  CHECK(r.register_from == 4);
  CHECK(pool.allocate(3, r.block_ids));
  r.num_computed_tokens = 12;
  const std::vector<int32_t> completed = {first};
  index.register_computed_blocks(completed, table, pool);
  CHECK(r.num_registered_blocks == 3 && r.register_from == 16 && pool.num_cached() == 3);
  CHECK(table.details(first).block_hashes.size() == 3);
  // Registering again changes nothing.
  index.register_computed_blocks(completed, table, pool);
  CHECK(pool.num_cached() == 3);
  const std::vector<int32_t> blocks = r.block_ids;

  // The same 12 tokens: 2 hits, not 3 (its last token must be computed); none of them is free.
  const int32_t same = add_entry(table, index, iota_tokens(12));
  CHECK(index.find_cached_prefix(table.state(same), table.details(same), pool) == 0);
  CHECK(index.hits().size() == 2 && index.hits()[0] == blocks[0] && index.hits()[1] == blocks[1]);
  // 13 tokens with the same first 12: all 3 hit. Once the first request freed its blocks, they are revived hits.
  std::vector<int32_t> longer = iota_tokens(13);
  const int32_t more = add_entry(table, index, longer);
  pool.free(blocks, true);
  CHECK(index.find_cached_prefix(table.state(more), table.details(more), pool) == 3);
  CHECK(index.hits().size() == 3);
  // A different second block stops the chain there; another salt finds nothing.
  longer[5] = 7;
  const int32_t diverged = add_entry(table, index, longer);
  CHECK(index.find_cached_prefix(table.state(diverged), table.details(diverged), pool) == 1);
  CHECK(index.hits().size() == 1);
  const int32_t salted = add_entry(table, index, iota_tokens(13), 42);
  index.find_cached_prefix(table.state(salted), table.details(salted), pool);
  CHECK(index.hits().empty());
  index.count_lookup(13, 12);
  CHECK(index.queried_tokens() == 13 && index.hit_tokens() == 12);
}

TEST(a_disabled_prefix_index_finds_nothing_and_never_registers) {
  BlockPool pool(16);
  RequestTable table;
  PrefixIndex index(4, false, 16);
  const int32_t e = add_entry(table, index, iota_tokens(12));
  RequestState& r = table.state(e);
  CHECK(r.register_from == std::numeric_limits<int32_t>::max() && index.register_from(r) == r.register_from);
  CHECK(index.find_cached_prefix(r, table.details(e), pool) == 0 && index.hits().empty());
}

TEST_MAIN()
