#include <cstring>
#include <random>

#include "check.h"
#include "ringserve/records.h"

using namespace ringserve;

namespace {

AddRequest sample_add_request() {
  AddRequest r;
  r.request_id = 0x1122334455667788ull;
  r.prompt_token_ids = {1, 2, 3, 49151};
  r.max_tokens = 64;
  r.sampling.temperature = 0.7f;
  r.sampling.top_p = 0.9f;
  r.sampling.top_k = 40;
  r.sampling.seed = 1234;
  r.sampling.has_seed = true;
  r.ignore_eos = true;
  r.stop_token_ids = {7, 8};
  r.priority = -3;
  r.arrival_time_ns = 1'700'000'000'000'000'000;
  r.trace_id.fill(0xab);
  r.span_id.fill(0xcd);
  r.trace_flags = 1;
  r.sampling.min_tokens = 3;
  r.sampling.min_p = 0.05f;
  r.sampling.repetition_penalty = 1.2f;
  r.sampling.frequency_penalty = 0.5f;
  r.sampling.presence_penalty = -0.5f;
  r.sampling.num_logprobs = 5;
  r.cache_salt = 0xfeedfacecafebeefull;
  return r;
}

StepPlan sample_plan() {
  StepPlan p;
  p.step_id = 42;
  NewRequestData& n = p.new_requests.emplace_back();
  n.slot = 3;
  n.token_ids = {5, 6, 7, 8, 9};
  n.block_ids = {10, 11};
  n.num_computed_tokens = 0;
  n.sampling.temperature = 0.5f;
  n.sampling.seed = 99;
  n.sampling.has_seed = true;
  n.num_prompt_tokens = 4;
  n.sampling.min_tokens = 2;
  n.sampling.min_p = 0.1f;
  n.sampling.repetition_penalty = 1.1f;
  n.sampling.frequency_penalty = 0.2f;
  n.sampling.presence_penalty = 0.3f;
  n.sampling.num_logprobs = 4;
  n.suppress_token_ids = {2, 7};
  p.block_appends.push_back({1, {12}});
  p.sched_slots = {1, 3};
  p.sched_start = {17, 0};
  p.sched_len = {1, 5};
  p.sched_sample = {1, 1};
  p.finished_slots = {2};
  return p;
}

StepEvents sample_events() {
  StepEvents e;
  e.step_id = 9;
  e.emit_time_ns = 123456789;
  RequestOutput& o = e.outputs.emplace_back();
  o.request_id = 77;
  o.new_token_ids = {4};
  o.logprobs = {-0.25f};
  o.finish_reason = FinishReason::kLength;
  o.num_prompt_tokens = 12;
  o.arrival_time_ns = 1;
  o.first_scheduled_time_ns = 2;
  o.first_token_time_ns = 3;
  o.num_top = 2;
  o.top_token_ids = {4, 9};
  o.top_logprobs = {-0.25f, -1.5f};
  o.num_computed_tokens = 12;
  o.num_scheduled_tokens = 1;
  o.num_preemptions = 2;
  e.outputs.emplace_back().request_id = 78;
  return e;
}

// Every valid record of every ring, with the decoder that owns it.
std::vector<std::pair<ByteBuffer, int>> all_records() {
  return {
      {encode_to_bytes(sample_add_request()), 0},
      {encode_to_bytes(AbortRequest{5}), 0},
      {encode_to_bytes(StatsQuery{6}), 0},
      {encode_to_bytes(Shutdown{}), 0},
      {encode_to_bytes(sample_events()), 1},
      {encode_to_bytes(EngineStats{
      .query_id = 1, .num_running = 2, .num_waiting = 3, .num_total_blocks = 4, .num_free_blocks = 5, .block_size = 16,
      .num_steps = 7, .num_preemptions = 8}), 1},
      {encode_to_bytes(RequestRejected{9, kStatusResourceExhausted, "too long"}), 1},
      {encode_to_bytes(EngineReady{100, 16, 1600}), 1},
      {encode_to_bytes(EngineFailed{"worker died", FailureReason::kWorkerDied}), 1},
      {encode_to_bytes(sample_plan()), 2},
      {encode_to_bytes(WorkerShutdown{}), 2},
      {encode_to_bytes(StepResult{42, {1, 3}, {100, 200}, {-1.0f, -2.0f}}), 3},
      {encode_to_bytes(WorkerReady{0, 512}), 3},
      {encode_to_bytes(WorkerFailed{0, "CUDA OOM"}), 3},
  };
}

void decode_with(int ring, std::span<const uint8_t> bytes) {
  switch (ring) {
    case 0: (void)decode_request_record(bytes); break;
    case 1: (void)decode_engine_event(bytes); break;
    case 2: (void)decode_worker_command(bytes); break;
    default: (void)decode_worker_result(bytes); break;
  }
}

void set_u32(ByteBuffer& b, size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); }
void set_u16(ByteBuffer& b, size_t at, uint16_t v) { std::memcpy(b.data() + at, &v, 2); }

}  // namespace

TEST(add_request_round_trips) {
  const AddRequest in = sample_add_request();
  const ByteBuffer bytes = encode_to_bytes(in);
  CHECK(bytes.size() % 8 == 0);
  const auto out = std::get<AddRequest>(decode_request_record(bytes));
  CHECK(out.request_id == in.request_id);
  CHECK(out.prompt_token_ids == in.prompt_token_ids);
  CHECK(out.max_tokens == in.max_tokens);
  CHECK(out.sampling.temperature == in.sampling.temperature && out.sampling.top_p == in.sampling.top_p && out.sampling.top_k == in.sampling.top_k);
  CHECK(out.sampling.seed == in.sampling.seed && out.sampling.has_seed && out.ignore_eos);
  CHECK(out.stop_token_ids == in.stop_token_ids);
  CHECK(out.priority == in.priority && out.arrival_time_ns == in.arrival_time_ns);
  CHECK(out.trace_id == in.trace_id && out.span_id == in.span_id && out.trace_flags == 1);
  CHECK(out.sampling.min_tokens == 3 && out.sampling.min_p == 0.05f && out.sampling.repetition_penalty == 1.2f);
  CHECK(out.sampling.frequency_penalty == 0.5f && out.sampling.presence_penalty == -0.5f && out.sampling.num_logprobs == 5);
  CHECK(out.cache_salt == in.cache_salt);
}

TEST(step_plan_round_trips) {
  const StepPlan in = sample_plan();
  const auto out = std::get<StepPlan>(decode_worker_command(encode_to_bytes(in)));
  CHECK(out.step_id == 42);
  CHECK(out.new_requests.size() == 1);
  CHECK(out.new_requests[0].slot == 3 && out.new_requests[0].token_ids == in.new_requests[0].token_ids);
  CHECK(out.new_requests[0].block_ids == in.new_requests[0].block_ids && out.new_requests[0].sampling.has_seed);
  CHECK(out.block_appends.size() == 1 && out.block_appends[0].slot == 1 && out.block_appends[0].block_ids[0] == 12);
  CHECK(out.sched_slots == in.sched_slots && out.sched_start == in.sched_start);
  CHECK(out.sched_len == in.sched_len && out.sched_sample == in.sched_sample);
  CHECK(out.finished_slots == in.finished_slots);
  const NewRequestData& n = out.new_requests[0];
  CHECK(n.num_prompt_tokens == 4 && n.sampling.min_tokens == 2 && n.sampling.min_p == 0.1f && n.sampling.repetition_penalty == 1.1f);
  CHECK(n.sampling.frequency_penalty == 0.2f && n.sampling.presence_penalty == 0.3f && n.sampling.num_logprobs == 4);
  CHECK(n.suppress_token_ids == in.new_requests[0].suppress_token_ids);
}

TEST(new_request_prompt_count_must_lie_inside_its_tokens) {
  StepPlan plan = sample_plan();
  plan.new_requests[0].num_prompt_tokens = 6;  // 5 token ids
  CHECK_THROWS(RecordError, decode_worker_command(encode_to_bytes(plan)));
}

TEST(step_result_carries_optional_top_logprobs) {
  StepResult in{7, {0, 2}, {11, 12}, {-0.1f, -0.2f}};
  in.num_top = 3;
  in.top_token_ids = {11, 5, 6, 12, 4, -1};
  in.top_logprobs = {-0.1f, -2.0f, -3.0f, -0.2f, -2.5f, 0.0f};
  const auto out = std::get<StepResult>(decode_worker_result(encode_to_bytes(in)));
  CHECK(out.num_top == 3 && out.top_token_ids == in.top_token_ids && out.top_logprobs == in.top_logprobs);
  in.top_token_ids.pop_back();
  CHECK_THROWS(RecordError, encode_to_bytes(in));
  const auto plain = std::get<StepResult>(decode_worker_result(encode_to_bytes(StepResult{8, {1}, {2}, {-1.0f}})));
  CHECK(plain.num_top == 0 && plain.top_token_ids.empty());
}

TEST(v2_event_fields_round_trip) {
  const auto ev = std::get<StepEvents>(decode_engine_event(encode_to_bytes(sample_events())));
  const RequestOutput& o = ev.outputs[0];
  CHECK(o.num_top == 2 && o.top_token_ids == std::vector<int32_t>({4, 9}) && o.top_logprobs[1] == -1.5f);
  CHECK(o.num_computed_tokens == 12 && o.num_scheduled_tokens == 1 && o.num_preemptions == 2);
  EngineStats s{1, 2, 3, 4, 5, 16, 7, 8};
  s.num_scheduled_tokens = 300;
  s.step_time_ns = 4567;
  s.prefix_cache_queries = 1000;
  s.prefix_cache_hits = 640;
  s.kv_usage = 0.25f;
  s.total_prompt_tokens = 2000;
  s.total_generation_tokens = 3000;
  const auto d = std::get<EngineStats>(decode_engine_event(encode_to_bytes(s)));
  CHECK(d.num_scheduled_tokens == 300 && d.step_time_ns == 4567 && d.prefix_cache_queries == 1000);
  CHECK(d.prefix_cache_hits == 640 && d.kv_usage == 0.25f && d.total_prompt_tokens == 2000);
  CHECK(d.total_generation_tokens == 3000);
}

TEST(events_and_results_round_trip) {
  const auto ev = std::get<StepEvents>(decode_engine_event(encode_to_bytes(sample_events())));
  CHECK(ev.step_id == 9 && ev.outputs.size() == 2);
  CHECK(ev.outputs[0].new_token_ids == std::vector<int32_t>{4} && ev.outputs[0].logprobs[0] == -0.25f);
  CHECK(ev.outputs[0].finish_reason == FinishReason::kLength && ev.outputs[0].first_token_time_ns == 3);
  CHECK(ev.outputs[1].request_id == 78 && ev.outputs[1].new_token_ids.empty());
  const auto rej = std::get<RequestRejected>(decode_engine_event(encode_to_bytes(RequestRejected{9, 8, "msg"})));
  CHECK(rej.request_id == 9 && rej.status_code == 8 && rej.message == "msg");
  const auto res = std::get<StepResult>(decode_worker_result(encode_to_bytes(StepResult{4, {1}, {2}, {-3.0f}})));
  CHECK(res.step_id == 4 && res.slots[0] == 1 && res.token_ids[0] == 2 && res.logprobs[0] == -3.0f);
  const auto failed = std::get<WorkerFailed>(decode_worker_result(encode_to_bytes(WorkerFailed{2, "boom"})));
  CHECK(failed.rank == 2 && failed.message == "boom");
  const auto engine_failed = std::get<EngineFailed>(
      decode_engine_event(encode_to_bytes(EngineFailed{"stuck", FailureReason::kStepTimeout})));
  CHECK(engine_failed.message == "stuck" && engine_failed.reason == FailureReason::kStepTimeout);
  const auto stats = std::get<EngineStats>(decode_engine_event(encode_to_bytes(EngineStats{
      .query_id = 1, .num_running = 2, .num_waiting = 3, .num_total_blocks = 4, .num_free_blocks = 5, .block_size = 16,
      .num_steps = 7, .num_preemptions = 8})));
  CHECK(stats.num_free_blocks == 5 && stats.num_preemptions == 8);
}

TEST(header_errors_are_rejected) {
  ByteBuffer b = encode_to_bytes(AbortRequest{1});
  CHECK_THROWS(RecordError, decode_request_record(std::span<const uint8_t>(b.data(), 4)));  // shorter than header
  ByteBuffer bad_len = b;
  set_u32(bad_len, 0, static_cast<uint32_t>(b.size() + 8));
  CHECK_THROWS(RecordError, decode_request_record(bad_len));
  ByteBuffer bad_version = b;
  set_u16(bad_version, 6, kLayoutVersion + 1);
  CHECK_THROWS(RecordError, decode_request_record(bad_version));
  ByteBuffer unknown = b;
  set_u16(unknown, 4, 999);
  CHECK_THROWS(RecordError, decode_request_record(unknown));
  // A valid record of another ring is an unknown type here.
  CHECK_THROWS(RecordError, decode_request_record(encode_to_bytes(WorkerShutdown{})));
  CHECK_THROWS(RecordError, decode_worker_command(encode_to_bytes(Shutdown{})));
  // Misaligned length.
  ByteBuffer odd = b;
  odd.push_back(0);
  set_u32(odd, 0, static_cast<uint32_t>(odd.size()));
  CHECK_THROWS(RecordError, decode_request_record(odd));
  // Extra trailing payload.
  ByteBuffer longer = b;
  longer.resize(b.size() + 8, 0);
  set_u32(longer, 0, static_cast<uint32_t>(longer.size()));
  CHECK_THROWS(RecordError, decode_request_record(longer));
}

TEST(truncated_arrays_and_bad_fields_are_rejected) {
  ByteBuffer add = encode_to_bytes(sample_add_request());
  // prompt_token_ids count follows the 8-byte header and request_id.
  ByteBuffer huge = add;
  set_u32(huge, 16, 0x7fffffff);
  CHECK_THROWS(RecordError, decode_request_record(huge));
  ByteBuffer bad_bool = add;
  // has_seed: after the prompt, then the sampling fields before it (their sizes from the field list).
  size_t has_seed_at = 16 + 4 + 4 * sample_add_request().prompt_token_ids.size();
  bool before = true;
  for_each_field<SamplingParams>([&](const auto& f) {
    before = before && std::strcmp(f.name, "has_seed") != 0;
    if (before) has_seed_at += min_encoded_size<typename std::decay_t<decltype(f)>::Type>();
  });
  bad_bool[has_seed_at] = 2;
  CHECK_THROWS(RecordError, decode_request_record(bad_bool));

  ByteBuffer events = encode_to_bytes(sample_events());
  ByteBuffer bad_reason = events;
  bad_reason[8 + 8 + 8 + 4 + 8] = 9;  // first output's finish_reason
  CHECK_THROWS(RecordError, decode_engine_event(bad_reason));
  ByteBuffer many_outputs = events;
  set_u32(many_outputs, 8 + 16, 0xffffffffu);
  CHECK_THROWS(RecordError, decode_engine_event(many_outputs));
  ByteBuffer bad_failure = encode_to_bytes(EngineFailed{"x", FailureReason::kEngineDied});
  bad_failure[8 + 4 + 1] = static_cast<uint8_t>(FailureReason::kEngineDied) + 1;  // the reason, after the message
  CHECK_THROWS(RecordError, decode_engine_event(bad_failure));

  // Unequal scheduled arrays in a plan, unequal result arrays.
  StepPlan plan = sample_plan();
  plan.sched_len.pop_back();
  CHECK_THROWS(RecordError, encode_to_bytes(plan));
  CHECK_THROWS(RecordError, encode_to_bytes(StepResult{1, {1, 2}, {3}, {0.0f}}));
}

TEST(every_truncation_of_every_record_is_rejected) {
  for (const auto& [bytes, ring] : all_records()) {
    for (size_t cut = 0; cut < bytes.size(); ++cut) {
      ByteBuffer prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut));
      // Also fix the length field so the decoder must notice the missing payload itself.
      if (prefix.size() >= 4) set_u32(prefix, 0, static_cast<uint32_t>(prefix.size()));
      CHECK_THROWS(RecordError, decode_with(ring, prefix));
    }
    decode_with(ring, bytes);  // the whole record still decodes
  }
}

TEST(random_corruption_never_crashes) {
  std::mt19937 rng(7);
  for (const auto& [bytes, ring] : all_records()) {
    for (int trial = 0; trial < 2000; ++trial) {
      ByteBuffer b = bytes;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<uint8_t>(rng());
      try {
        decode_with(ring, b);  // may legitimately decode: a flipped token id is still a token id
      } catch (const RecordError&) {
      }
    }
  }
  CHECK(true);
}

TEST_MAIN()
