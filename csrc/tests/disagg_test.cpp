// Disaggregated prefill/decode in the scheduler and the records (issue #8): prefill-only requests pin their blocks
// until ReleaseKv / abort / timeout, and requests continuing from remote KV start decoding after a KvPull.
#include <numeric>

#include "check.h"
#include "ringserve/records.h"
#include "ringserve/scheduler.h"

using namespace ringserve;

namespace {

constexpr int32_t kEos = 2;
constexpr int64_t kMs = 1'000'000;

EngineConfig make_config(int32_t num_blocks, bool caching = true) {
  EngineConfig c;
  c.block_size = 4;
  c.num_blocks = num_blocks;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 8;  // prompts of more than 8 tokens are chunked
  c.eos_token_ids = {kEos};
  c.enable_prefix_caching = caching;
  return c;
}

AddRequest make_request(uint64_t id, int32_t prompt_len, int32_t max_tokens) {
  AddRequest r;
  r.request_id = id;
  r.max_tokens = max_tokens;
  for (int32_t i = 0; i < prompt_len; ++i) r.prompt_token_ids.push_back(100 + i);
  return r;
}

KvRequestOptions prefill_only(uint64_t id, uint32_t timeout_ms = 1000) {
  KvRequestOptions kv;
  kv.request_id = id;
  kv.mode = KvMode::kPrefillOnly;
  kv.pin_timeout_ms = timeout_ms;
  return kv;
}

// Runs steps (every sampled token = 7) until nothing is runnable; returns the outputs.
std::vector<RequestOutput> run(Scheduler& s, int64_t& now, std::vector<StepPlan>* plans = nullptr) {
  std::vector<RequestOutput> all, out;
  StepPlan plan;
  while (s.schedule(plan, ++now)) {
    if (plans != nullptr) plans->push_back(plan);
    StepResult r;
    r.step_id = plan.step_id;
    for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
      if (plan.sched_sample[i] == 0) continue;
      r.slots.push_back(plan.sched_slots[i]);
      r.token_ids.push_back(7);
      r.logprobs.push_back(0.0f);
    }
    s.update(r, ++now);
    s.check_invariants();
    s.take_outputs(out);
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

// A prefill-only request: chunked prompt, one token, then its blocks are pinned (not free) under its id.
std::vector<int32_t> prefill(Scheduler& s, int64_t& now, uint64_t id, int32_t prompt_len, uint32_t timeout_ms = 1000) {
  const KvRequestOptions kv = prefill_only(id, timeout_ms);
  CHECK(!s.add_request(make_request(id, prompt_len, 50), now, &kv));
  const std::vector<RequestOutput> out = run(s, now);
  CHECK(!out.empty() && out.back().finish_reason == FinishReason::kLength);
  CHECK((out.back().new_token_ids == std::vector<int32_t>{7}));
  const auto pins = s.kv_pins();
  CHECK(pins.size() == 1 && pins[0].request_id == id && pins[0].num_tokens == static_cast<uint32_t>(prompt_len));
  CHECK(pins[0].expires_at_ns > now && pins[0].expires_at_ns <= now + int64_t{timeout_ms} * kMs);
  std::vector<int32_t> blocks = pins[0].block_ids;
  CHECK(blocks.size() == static_cast<size_t>((prompt_len + 3) / 4));
  s.clear_kv_pins();
  return blocks;
}

}  // namespace

TEST(kv_records_round_trip) {
  KvRequestOptions kv;
  kv.request_id = 9;
  kv.mode = KvMode::kPullRemote;
  kv.pin_timeout_ms = 5;
  kv.first_token_id = 42;
  kv.remote_block_ids = {3, 1, 4};
  kv.peer = {1, 2, 3, 0, 255};
  const auto back = std::get<KvRequestOptions>(decode_request_record(encode_to_bytes(kv)));
  CHECK(back.request_id == 9 && back.mode == KvMode::kPullRemote && back.first_token_id == 42);
  CHECK(back.remote_block_ids == kv.remote_block_ids && back.peer == kv.peer && back.pin_timeout_ms == 5);
  CHECK(std::get<ReleaseKv>(decode_request_record(encode_to_bytes(ReleaseKv{77}))).request_id == 77);
  const KvPinned pin{5, 33, 123456789, {8, 9}};
  const auto pin_back = std::get<KvPinned>(decode_engine_event(encode_to_bytes(pin)));
  CHECK(pin_back.request_id == 5 && pin_back.num_tokens == 33 && pin_back.expires_at_ns == 123456789);
  CHECK((pin_back.block_ids == std::vector<int32_t>{8, 9}));
  KvPull pull{3, {10, 11}, {0, 1}, {7, 7}};
  const auto pull_back = std::get<KvPull>(decode_worker_command(encode_to_bytes(pull)));
  CHECK(pull_back.slot == 3 && pull_back.remote_block_ids == pull.remote_block_ids);
  CHECK(pull_back.local_block_ids == pull.local_block_ids && pull_back.peer == pull.peer);
  // Each record belongs to one ring; a bad mode and mismatched pull arrays are malformed.
  CHECK_THROWS(RecordError, decode_engine_event(encode_to_bytes(kv)));
  CHECK_THROWS(RecordError, decode_request_record(encode_to_bytes(pull)));
  ByteBuffer bad = encode_to_bytes(kv);
  bad[sizeof(RecordHeader) + 8] = 3;  // mode
  CHECK_THROWS(RecordError, decode_request_record(bad));
  pull.local_block_ids.pop_back();
  CHECK_THROWS(RecordError, encode_to_bytes(pull));
}

TEST(prefill_only_pins_blocks_until_released) {
  Scheduler s(make_config(32));
  int64_t now = 1000;
  const std::vector<int32_t> blocks = prefill(s, now, 1, 10);  // 3 blocks, chunked over 2 steps
  CHECK(s.num_pinned_requests() == 1);
  CHECK(s.block_pool().num_free() == 32 - 3);
  for (const int32_t b : blocks) CHECK(s.block_pool().ref_count(b) == 1);
  CHECK(s.release_pinned(1));
  CHECK(!s.release_pinned(1));  // a second release (or an expired one) is a no-op
  CHECK(s.block_pool().num_free() == 32 && s.num_pinned_requests() == 0);
  s.check_invariants();
}

TEST(pinned_blocks_expire_after_the_timeout) {
  Scheduler s(make_config(32));
  int64_t now = 1000;
  prefill(s, now, 1, 9, /*timeout_ms=*/5);
  prefill(s, now, 2, 4, /*timeout_ms=*/5000);
  CHECK(s.expire_pinned(now) == 0 && s.num_pinned_requests() == 2);
  CHECK(s.expire_pinned(now + 6 * kMs) == 1 && s.num_pinned_requests() == 1);
  CHECK(s.block_pool().num_free() == 32 - 1);
  CHECK(s.expire_pinned(now + 6000 * kMs) == 1 && s.block_pool().num_free() == 32);
  s.check_invariants();
}

TEST(aborting_a_pinned_or_running_prefill_frees_its_blocks) {
  Scheduler s(make_config(32));
  int64_t now = 1000;
  prefill(s, now, 1, 8);
  CHECK(s.abort_request(1) && s.num_pinned_requests() == 0 && s.block_pool().num_free() == 32);
  const KvRequestOptions kv = prefill_only(2);
  CHECK(!s.add_request(make_request(2, 20, 5), now, &kv));
  StepPlan plan;
  CHECK(s.schedule(plan, ++now));  // first chunk in flight
  StepResult r;
  r.step_id = plan.step_id;
  s.update(r, ++now);
  CHECK(s.abort_request(2));  // mid-prefill: not pinned, just freed
  CHECK(s.num_pinned_requests() == 0 && s.kv_pins().empty() && s.block_pool().num_free() == 32);
  s.check_invariants();
}

TEST(pinned_prompt_blocks_serve_later_prefix_hits) {
  Scheduler s(make_config(32));
  int64_t now = 1000;
  const std::vector<int32_t> blocks = prefill(s, now, 1, 12);
  const KvRequestOptions kv = prefill_only(2);
  CHECK(!s.add_request(make_request(2, 12, 5), now, &kv));
  const std::vector<RequestOutput> out = run(s, now);
  CHECK(out.back().num_cached_tokens == 8);  // two full blocks shared; the last token is always computed
  const auto pins = s.kv_pins();
  CHECK(pins.size() == 1 && pins[0].block_ids[0] == blocks[0] && pins[0].block_ids[1] == blocks[1]);
  CHECK(s.block_pool().ref_count(blocks[0]) == 2);
  s.clear_kv_pins();
  CHECK(s.release_pinned(1) && s.release_pinned(2) && s.block_pool().num_free() == 32);
  s.check_invariants();
}

TEST(a_remote_kv_request_pulls_then_decodes_from_the_first_token) {
  Scheduler s(make_config(32));
  int64_t now = 1000;
  AddRequest req = make_request(5, 10, 4);
  KvRequestOptions kv;
  kv.request_id = 5;
  kv.mode = KvMode::kPullRemote;
  kv.first_token_id = 9;
  kv.remote_block_ids = {20, 21, 22};
  kv.peer = {1, 2};
  CHECK(!s.add_request(req, now, &kv));
  StepPlan plan;
  CHECK(s.schedule(plan, ++now));
  const auto pulls = s.kv_pulls();
  CHECK(pulls.size() == 1 && pulls[0].remote_block_ids == kv.remote_block_ids && pulls[0].peer == kv.peer);
  CHECK(plan.new_requests.size() == 1 && pulls[0].slot == plan.new_requests[0].slot);
  const NewRequestData& nr = plan.new_requests[0];
  CHECK(nr.num_computed_tokens == 10 && nr.num_prompt_tokens == 10 && nr.token_ids.size() == 11 && nr.token_ids[10] == 9);
  CHECK(std::equal(pulls[0].local_block_ids.begin(), pulls[0].local_block_ids.end(), nr.block_ids.begin()));
  CHECK(plan.sched_start == std::vector<int32_t>{10} && plan.sched_len == std::vector<int32_t>{1});
  CHECK(plan.sched_sample == std::vector<uint8_t>{1});
  s.update(StepResult{plan.step_id, {nr.slot}, {7}, {0.0f}}, ++now);
  std::vector<RequestOutput> out;
  s.take_outputs(out);
  CHECK(out.size() == 1 && (out[0].new_token_ids == std::vector<int32_t>{7}) && out[0].num_cached_tokens == 0);
  // max_tokens 4 counts the first token: two more, then LENGTH; no further pulls.
  const std::vector<RequestOutput> rest = run(s, now);
  CHECK(rest.size() == 2 && rest.back().finish_reason == FinishReason::kLength);
  CHECK(s.kv_pulls().empty() && s.block_pool().num_free() == 32);
  s.check_invariants();
}

TEST(remote_kv_requests_are_validated) {
  Scheduler s(make_config(32));
  KvRequestOptions kv;
  kv.request_id = 1;
  kv.mode = KvMode::kPullRemote;
  kv.remote_block_ids = {1, 2};  // a 10-token prompt needs 3
  kv.peer = {1};
  auto rejected = s.add_request(make_request(1, 10, 4), 0, &kv);
  CHECK(rejected && rejected->status_code == kStatusInvalidArgument);
  CHECK(rejected->message.find("remote_block_ids") != std::string::npos);
  kv.remote_block_ids = {1, 2, 3};
  CHECK(s.add_request(make_request(1, 10, 1), 0, &kv).has_value());  // max_tokens 1 leaves nothing to decode
  kv.peer.clear();
  CHECK(s.add_request(make_request(1, 10, 4), 0, &kv).has_value());
  const KvRequestOptions no_timeout = prefill_only(1, 0);
  CHECK(s.add_request(make_request(1, 10, 4), 0, &no_timeout).has_value());
  CHECK(s.block_pool().num_free() == 32 && !s.has_unfinished());
}

TEST_MAIN()
