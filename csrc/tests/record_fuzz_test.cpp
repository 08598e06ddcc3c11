// Random and mutated records through every decoder, natively, so AddressSanitizer sees every byte a decoder touches:
// each input decodes or throws RecordError, and never reads outside its span (the input is copied into an exactly
// sized heap buffer, so one byte too far is a heap-buffer-overflow report). Also: the zero-copy StepPlan decoding
// locates exactly the arrays the copying decoder returns.
#include <cstring>
#include <memory>
#include <random>

#include "check.h"
#include "ringserve/records.h"

using namespace ringserve;

namespace {

#if defined(__SANITIZE_THREAD__)
constexpr int kInputs = 5000;  // single-threaded: TSan has nothing to find here, and it slows exceptions a lot
#elif defined(__SANITIZE_ADDRESS__)
constexpr int kInputs = 40000;
#else
constexpr int kInputs = 100000;
#endif

using Rng = std::mt19937_64;

std::vector<int32_t> random_ids(Rng& rng, size_t most) {
  std::vector<int32_t> v(rng() % (most + 1));
  for (auto& x : v) x = static_cast<int32_t>(rng());
  return v;
}

std::string random_text(Rng& rng) {
  std::string s(rng() % 24, 'x');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

StepPlan random_plan(Rng& rng) {
  StepPlan p;
  p.step_id = rng();
  for (size_t i = rng() % 3; i > 0; --i) {
    NewRequestData& n = p.new_requests.emplace_back();
    n.slot = static_cast<int32_t>(rng() % 64);
    n.token_ids = random_ids(rng, 40);
    n.num_prompt_tokens = static_cast<int32_t>(rng() % (n.token_ids.size() + 1));
    n.block_ids = random_ids(rng, 6);
    n.suppress_token_ids = random_ids(rng, 3);
    n.sampling.seed = rng();
    n.sampling.has_seed = rng() % 2 == 0;
  }
  for (size_t i = rng() % 3; i > 0; --i) {
    p.block_appends.push_back({static_cast<int32_t>(rng() % 64), random_ids(rng, 4)});
  }
  for (size_t i = rng() % 5; i > 0; --i) {
    p.sched_slots.push_back(static_cast<int32_t>(rng() % 64));
    p.sched_start.push_back(static_cast<int32_t>(rng() % 999));
    p.sched_len.push_back(1);
    p.sched_sample.push_back(static_cast<uint8_t>(rng() % 2));
  }
  p.finished_slots = random_ids(rng, 3);
  return p;
}

ByteBuffer random_valid_record(Rng& rng) {
  switch (rng() % 10) {
    case 0: {
      AddRequest r;
      r.request_id = rng();
      r.prompt_token_ids = random_ids(rng, 60);
      r.stop_token_ids = random_ids(rng, 4);
      r.sampling.has_seed = rng() % 2 == 0;
      return encode_to_bytes(r);
    }
    case 1: return encode_to_bytes(AbortRequest{rng()});
    case 2: {
      StepEvents e;
      e.step_id = rng();
      for (size_t i = rng() % 4; i > 0; --i) {
        RequestOutput& o = e.outputs.emplace_back();
        o.request_id = rng();
        o.new_token_ids = random_ids(rng, 3);
        o.logprobs.assign(o.new_token_ids.size(), -0.5f);
        o.num_top = static_cast<uint32_t>(rng() % 3);
        o.top_token_ids.assign(o.num_top * o.new_token_ids.size(), 7);
        o.top_logprobs.assign(o.top_token_ids.size(), -1.0f);
        o.finish_reason = static_cast<FinishReason>(rng() % 4);
      }
      return encode_to_bytes(e);
    }
    case 3: return encode_to_bytes(EngineStats{.query_id = rng(), .num_running = 1, .num_waiting = 2, .num_total_blocks = 3,
                                               .num_free_blocks = 4, .block_size = 16, .num_steps = rng(),
                                               .num_preemptions = 8});
    case 4: return encode_to_bytes(RequestRejected{rng(), kStatusInvalidArgument, random_text(rng)});
    case 5: return encode_to_bytes(EngineFailed{random_text(rng), static_cast<FailureReason>(rng() % 5)});
    case 6: return encode_to_bytes(random_plan(rng));
    case 7: {
      StepResult r;
      r.step_id = rng();
      r.slots = random_ids(rng, 5);
      r.token_ids.assign(r.slots.size(), 3);
      r.logprobs.assign(r.slots.size(), -2.0f);
      r.num_top = static_cast<uint32_t>(rng() % 3);
      r.top_token_ids.assign(r.num_top * r.slots.size(), 1);
      r.top_logprobs.assign(r.top_token_ids.size(), -3.0f);
      return encode_to_bytes(r);
    }
    case 8: return encode_to_bytes(WorkerFailed{static_cast<uint32_t>(rng() % 4), random_text(rng)});
    default: return encode_to_bytes(Shutdown{});
  }
}

void put_u32(ByteBuffer& b, size_t at, uint32_t v) {
  if (at + 4 <= b.size()) std::memcpy(b.data() + at, &v, 4);
}

uint32_t interesting_u32(Rng& rng, size_t size) {
  const uint32_t picks[] = {0, 1, 7, 8, static_cast<uint32_t>(size), static_cast<uint32_t>(size / 4), 0x7fffffffu,
                            0x80000000u, 0xffffffffu, static_cast<uint32_t>(rng())};
  return picks[rng() % std::size(picks)];
}

ByteBuffer mutate(Rng& rng, ByteBuffer b) {
  switch (rng() % 6) {
    case 0:  // truncate, usually with an honest length field
      b.resize(rng() % b.size());
      if (rng() % 4 != 0) put_u32(b, 0, static_cast<uint32_t>(b.size()));
      break;
    case 1:  // any 4-byte field: lengths, counts, scalars
      put_u32(b, rng() % b.size(), interesting_u32(rng, b.size()));
      break;
    case 2:  // type / version
      b[4 + rng() % 4] = static_cast<uint8_t>(rng());
      break;
    case 3:  // random bytes
      for (int i = 1 + static_cast<int>(rng() % 4); i > 0; --i) b[rng() % b.size()] = static_cast<uint8_t>(rng());
      break;
    case 4:  // trailing bytes
      b.resize(b.size() + 1 + rng() % 16, static_cast<uint8_t>(rng()));
      if (rng() % 2 == 0) put_u32(b, 0, static_cast<uint32_t>(b.size()));
      break;
    default: {  // pure noise with a plausible header
      b.assign(rng() % 160, 0);
      for (auto& x : b) x = static_cast<uint8_t>(rng());
      if (b.size() >= 8) {
        const RecordHeader h{static_cast<uint32_t>(b.size()), static_cast<uint16_t>(rng() % 52), kLayoutVersion};
        std::memcpy(b.data(), &h, sizeof(h));
      }
    }
  }
  return b;
}

// Decodes `bytes` from an exactly sized heap copy with `decoder`; true when it decoded, false on RecordError.
template <class Decoder>
bool decodes(const ByteBuffer& bytes, Decoder decoder) {
  auto exact = std::make_unique<uint8_t[]>(bytes.size() + (bytes.empty() ? 1 : 0));
  if (!bytes.empty()) std::memcpy(exact.get(), bytes.data(), bytes.size());
  try {
    (void)decoder(std::span<const uint8_t>(exact.get(), bytes.size()));
    return true;
  } catch (const RecordError&) {
    return false;
  }
}

template <class T>
bool located(const ByteBuffer& bytes, const ArrayLocation& at, const std::vector<T>& expected) {
  if (at.count != expected.size() || at.offset + at.count * sizeof(T) > bytes.size()) return false;
  return expected.empty() || std::memcmp(bytes.data() + at.offset, expected.data(), at.count * sizeof(T)) == 0;
}

// Checks each array of `r` (nested records' arrays where they appear, in field order) against the next location.
template <class R>
void check_located(const ByteBuffer& bytes, const R& r, const std::vector<ArrayLocation>& at, size_t& next) {
  for_each_field<R>([&](const auto& f) {
    using F = typename std::decay_t<decltype(f)>::Type;
    if constexpr (HasFields<F>) {
      check_located(bytes, r.*f.member, at, next);
    } else if constexpr (kIsVector<F>) {
      if constexpr (HasFields<typename F::value_type>) {
        for (const auto& e : r.*f.member) check_located(bytes, e, at, next);
      } else {
        CHECK(next < at.size() && located(bytes, at[next], r.*f.member));
        ++next;
      }
    }
  });
}

}  // namespace

TEST(random_and_mutated_records_decode_or_throw_record_error_within_their_bytes) {
  Rng rng(4);
  int decoded = 0;
  int rejected = 0;
  StepPlanLayout layout;
  for (int i = 0; i < kInputs; ++i) {
    ByteBuffer valid = random_valid_record(rng);
    const ByteBuffer input = mutate(rng, std::move(valid));
    // Anything other than RecordError escapes to the harness and fails the test.
    const bool results[] = {
        decodes(input, [](auto s) { return decode_request_record(s); }),
        decodes(input, [](auto s) { return decode_engine_event(s); }),
        decodes(input, [](auto s) { return decode_worker_command(s); }),
        decodes(input, [&](auto s) { return decode_worker_command(s, layout); }),
        decodes(input, [](auto s) { return decode_worker_result(s); }),
    };
    CHECK(results[2] == results[3]);  // the zero-copy decoder accepts exactly what the copying one accepts
    for (bool r : results) (r ? decoded : rejected)++;
  }
  CHECK(decoded > 0 && rejected > kInputs);
}

TEST(zero_copy_plan_decoding_locates_exactly_the_copied_arrays) {
  Rng rng(5);
  for (int i = 0; i < 2000; ++i) {
    const StepPlan plan = random_plan(rng);
    const ByteBuffer bytes = encode_to_bytes(plan);
    const auto copied = std::get<StepPlan>(decode_worker_command(bytes));
    StepPlanLayout layout;
    const auto viewed = std::get<StepPlan>(decode_worker_command(bytes, layout));
    CHECK(viewed.sched_slots.empty() && viewed.finished_slots.empty());  // nothing copied
    CHECK(viewed.step_id == copied.step_id && viewed.new_requests.size() == copied.new_requests.size());
    for (size_t k = 0; k < copied.new_requests.size(); ++k) {
      CHECK(viewed.new_requests[k].token_ids.empty() && viewed.new_requests[k].slot == copied.new_requests[k].slot);
    }
    size_t next = 0;
    check_located(bytes, copied, layout.arrays, next);
    CHECK(next == layout.arrays.size());
  }
}

TEST_MAIN()
