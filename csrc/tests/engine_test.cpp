#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <thread>

#include "check.h"
#include "ringserve/engine.h"

using namespace ringserve;
using namespace std::chrono_literals;

namespace {

struct Rings {
  std::map<std::string, std::shared_ptr<ShmRing>> by_role;
  Rings() {
    static int counter = 0;
    for (const char* role : {"req", "evt", "step", "res"}) {
      const std::string name =
          "/ringserve-test-" + std::to_string(::getpid()) + "-eng" + std::to_string(counter) + "-" + role;
      by_role[role] = ShmRing::create(name, 1 << 14);
    }
    ++counter;
  }
  ~Rings() {
    for (auto& [role, ring] : by_role) ring->unlink();
  }
  const std::string& name(const char* role) { return by_role.at(role)->name(); }
};

// Answers every plan; samples token 7 (or EOS for slot 0's third token, so stop rules run too).
void fake_worker(Rings& rings, std::atomic<bool>& saw_shutdown) {
  RingReader steps(rings.by_role["step"], 0);
  RingWriter results(rings.by_role["res"]);
  ByteBuffer buf;
  encode(WorkerReady{0, 32}, buf);
  results.write(buf, 10s);
  while (true) {
    if (!steps.read(buf, 10s)) return;
    auto command = decode_worker_command(buf);
    if (std::holds_alternative<WorkerShutdown>(command)) {
      saw_shutdown = true;
      return;
    }
    const auto& plan = std::get<StepPlan>(command);
    StepResult result;
    result.step_id = plan.step_id;
    for (size_t i = 0; i < plan.sched_slots.size(); ++i) {
      if (plan.sched_sample[i] == 0) continue;
      result.slots.push_back(plan.sched_slots[i]);
      result.token_ids.push_back(7);
      result.logprobs.push_back(0.0f);
    }
    encode(result, buf);
    results.write(buf, 10s);
  }
}

EngineConfig small_config() {
  EngineConfig c;
  c.max_num_seqs = 2;
  c.max_num_batched_tokens = 16;
  c.eos_token_ids = {2};
  return c;
}

}  // namespace

TEST(engine_serves_requests_until_shutdown) {
  Rings rings;
  std::atomic<bool> saw_shutdown{false};
  std::thread worker(fake_worker, std::ref(rings), std::ref(saw_shutdown));
  Engine engine(small_config(), rings.name("req"), rings.name("evt"), rings.name("step"), rings.name("res"), {});
  std::thread loop([&] { engine.run(); });

  RingWriter requests(rings.by_role["req"]);
  RingReader events(rings.by_role["evt"], 0);
  ByteBuffer buf;
  for (uint64_t id = 1; id <= 4; ++id) {
    AddRequest r;
    r.request_id = id;
    r.prompt_token_ids.assign(20 + id, 5);
    r.max_tokens = 3;
    encode(r, buf);
    CHECK(requests.write(buf, 10s));
  }
  std::map<uint64_t, std::vector<int32_t>> tokens;
  int finished = 0;
  bool ready = false;
  while (finished < 4 && events.read(buf, 10s)) {
    auto event = decode_engine_event(buf);
    ready |= std::holds_alternative<EngineReady>(event);
    if (const auto* step = std::get_if<StepEvents>(&event)) {
      for (const RequestOutput& o : step->outputs) {
        tokens[o.request_id].insert(tokens[o.request_id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
        finished += o.finish_reason == FinishReason::kLength ? 1 : 0;
      }
    }
  }
  CHECK(ready && finished == 4);
  for (uint64_t id = 1; id <= 4; ++id) CHECK((tokens[id] == std::vector<int32_t>{7, 7, 7}));

  encode(StatsQuery{9}, buf);
  CHECK(requests.write(buf, 10s));
  EngineStats stats;
  while (events.read(buf, 10s)) {  // skip the engine's unsolicited (query_id 0) reports
    auto event = decode_engine_event(buf);
    if (const auto* s = std::get_if<EngineStats>(&event); s != nullptr && s->query_id != 0) {
      stats = *s;
      break;
    }
  }
  CHECK(stats.query_id == 9 && stats.num_free_blocks == 32 && stats.num_running == 0);

  encode(Shutdown{}, buf);
  CHECK(requests.write(buf, 10s));
  loop.join();
  worker.join();
  CHECK(saw_shutdown.load());
}

TEST(stop_from_another_thread_ends_an_idle_engine) {
  Rings rings;
  std::atomic<bool> saw_shutdown{false};
  std::thread worker(fake_worker, std::ref(rings), std::ref(saw_shutdown));
  Engine engine(small_config(), rings.name("req"), rings.name("evt"), rings.name("step"), rings.name("res"), {});
  std::thread loop([&] { engine.run(); });
  RingReader events(rings.by_role["evt"], 0);
  ByteBuffer buf;
  CHECK(events.read(buf, 10s) && std::holds_alternative<EngineReady>(decode_engine_event(buf)));
  std::this_thread::sleep_for(50ms);  // let it go idle on the request ring's futex
  engine.stop();
  loop.join();
  worker.join();
  CHECK(saw_shutdown.load());
}

static bool name_exists(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

TEST(ring_names_are_removed_once_every_peer_has_attached) {
  Rings rings;
  for (const char* role : {"req", "evt", "step", "res"}) CHECK(name_exists(rings.name(role)));
  std::atomic<bool> saw_shutdown{false};
  Engine engine(small_config(), rings.name("req"), rings.name("evt"), rings.name("step"), rings.name("res"), {});
  // The frontend created the request and event rings and the engine has attached them.
  CHECK(!name_exists(rings.name("req")) && !name_exists(rings.name("evt")));
  CHECK(name_exists(rings.name("step")) && name_exists(rings.name("res")));  // the workers have not attached yet
  std::thread worker(fake_worker, std::ref(rings), std::ref(saw_shutdown));
  std::thread loop([&] { engine.run(); });
  RingReader events(rings.by_role["evt"], 0);
  ByteBuffer buf;
  CHECK(events.read(buf, 10s) && std::holds_alternative<EngineReady>(decode_engine_event(buf)));
  // Ready means every worker attached: the mappings keep working, the names are gone.
  CHECK(!name_exists(rings.name("step")) && !name_exists(rings.name("res")));
  RingWriter requests(rings.by_role["req"]);
  AddRequest r;
  r.request_id = 1;
  r.prompt_token_ids.assign(4, 5);
  r.max_tokens = 2;
  encode(r, buf);
  CHECK(requests.write(buf, 10s));
  bool finished = false;
  while (!finished && events.read(buf, 10s)) {
    const auto event = decode_engine_event(buf);
    if (const auto* step = std::get_if<StepEvents>(&event)) {
      for (const RequestOutput& o : step->outputs) finished |= o.finish_reason != FinishReason::kNone;
    }
  }
  CHECK(finished);
  engine.stop();
  loop.join();
  worker.join();
  CHECK(saw_shutdown.load());
}

TEST(worker_failure_is_reported_and_thrown) {
  Rings rings;
  Engine engine(small_config(), rings.name("req"), rings.name("evt"), rings.name("step"), rings.name("res"), {});
  RingWriter results(rings.by_role["res"]);
  ByteBuffer buf;
  encode(WorkerFailed{0, "out of memory"}, buf);
  CHECK(results.write(buf, 1s));
  CHECK_THROWS(WorkerFailure, engine.run());
  RingReader events(rings.by_role["evt"], 0);
  CHECK(events.read(buf, 1s));
  const auto failed = std::get<EngineFailed>(decode_engine_event(buf));
  CHECK(failed.message.find("out of memory") != std::string::npos);
  CHECK(failed.reason == FailureReason::kWorkerDied);
}

TEST(packed_outputs_encode_byte_for_byte_like_request_outputs) {
  // A decode token with top logprobs, a prefill chunk's progress, an abort and a plain final token.
  std::vector<PackedOutput> packed(4);
  packed[0] = {.request_id = 11, .arrival_time_ns = 100, .first_scheduled_time_ns = 110, .first_token_time_ns = 120,
               .num_prompt_tokens = 7, .num_cached_tokens = 4, .num_computed_tokens = 7, .num_scheduled_tokens = 1,
               .token_id = 42, .logprob = -0.25f, .num_preemptions = 2, .num_spec_proposed_tokens = 4,
               .num_spec_accepted_tokens = 3, .finish_reason = FinishReason::kNone, .has_token = true, .num_top = 2};
  packed[1] = {.request_id = 12, .arrival_time_ns = 200, .first_scheduled_time_ns = 210, .num_prompt_tokens = 900,
               .num_computed_tokens = 256, .num_scheduled_tokens = 256};
  packed[2] = {.request_id = 13, .arrival_time_ns = 300, .num_prompt_tokens = 5, .finish_reason = FinishReason::kAbort};
  packed[3] = {.request_id = 14, .arrival_time_ns = 400, .first_scheduled_time_ns = 410, .first_token_time_ns = 430,
               .num_prompt_tokens = 3, .num_computed_tokens = 3, .num_scheduled_tokens = 3, .token_id = 2,
               .logprob = -1.5f, .finish_reason = FinishReason::kStop, .has_token = true};
  const std::vector<int32_t> top_ids{42, 17};
  const std::vector<float> top_logprobs{-0.25f, -2.0f};

  std::vector<RequestOutput> full;
  size_t top = 0;
  for (const PackedOutput& o : packed) {
    full.push_back(unpack_output(o, std::span(top_ids).subspan(top, o.num_top),
                                 std::span(top_logprobs).subspan(top, o.num_top)));
    top += o.num_top;
  }
  CHECK(full[0].new_token_ids == std::vector<int32_t>{42} && full[0].num_top == 2 && full[0].top_token_ids == top_ids);
  CHECK(full[1].new_token_ids.empty() && full[1].num_scheduled_tokens == 256);
  ByteBuffer from_packed, from_full;
  encode_step_events(5, 999, packed, top_ids, top_logprobs, from_packed);
  encode_step_events(5, 999, full, from_full);
  CHECK(from_packed == from_full);
  const auto decoded = std::get<StepEvents>(decode_engine_event(from_packed));
  CHECK(decoded.outputs.size() == 4 && decoded.outputs[3].finish_reason == FinishReason::kStop);
  CHECK(decoded.outputs[0].top_logprobs == top_logprobs && decoded.outputs[2].finish_reason == FinishReason::kAbort);
  size_t bound = 0;
  for (const PackedOutput& o : packed) bound += encoded_size_bound(o);
  CHECK(from_packed.size() <= bound + 40);  // header, step id, emit time, count, padding
  // Side arrays that do not hold the outputs' top entries are refused, not read past.
  CHECK_THROWS(RecordError, encode_step_events(5, 999, packed, std::span(top_ids).first(1),
                                               std::span(top_logprobs).first(1), from_packed));
}

TEST_MAIN()
