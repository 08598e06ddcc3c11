// The one versioned definition of every record that crosses a RingServe ring.
//
// Wire format: RecordHeader{u32 length, u16 type, u16 layout_version} followed by a little-endian payload: the
// record's fields in the order its fields() lists them (a nested record's fields inline where it appears), each
// number little-endian at its own size, each array as u32 count + elements, strings as u32 byte count + bytes, bools
// and enums as one byte, an array of records as u32 count + each record. The whole record is zero-padded to a
// multiple of 8 bytes and `length` counts the padding, so records stay 8-byte aligned inside a ring.
//
// Any change to a payload bumps kLayoutVersion; decoders reject every other version.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "ringserve/record_fields.h"

namespace ringserve {

static_assert(std::endian::native == std::endian::little, "ring records are little-endian; add byte swaps here");

inline constexpr uint16_t kLayoutVersion = 5;
inline constexpr int32_t kMaxLookaheadSlots = 64;  // lookahead slots per request per step (a chain's length, a tree's nodes)
inline constexpr size_t kRecordAlign = 8;

enum class RecordType : uint16_t {
  // request ring: frontend -> engine
  kAddRequest = 1,
  kAbortRequest = 2,
  kStatsQuery = 3,
  kShutdown = 4,
  kKvRequestOptions = 5,  // disaggregated prefill/decode (issue #8)
  kReleaseKv = 6,
  // event ring: engine -> frontend
  kStepEvents = 16,
  kEngineStats = 17,
  kRequestRejected = 18,
  kEngineReady = 19,
  kEngineFailed = 20,
  kKvPinned = 21,
  // step ring: engine -> workers (broadcast)
  kStepPlan = 32,
  kWorkerShutdown = 33,
  kKvPull = 34,
  // result ring: worker rank 0 -> engine
  kStepResult = 48,
  kWorkerReady = 49,
  kWorkerFailed = 50,
};

struct RecordHeader {
  uint32_t length;  // whole record in bytes, padding included
  uint16_t type;    // a RecordType
  uint16_t layout_version;
};
static_assert(sizeof(RecordHeader) == 8);

// Thrown by every decoder on malformed input; the binding maps it to _core.RecordError (a ValueError).
class RecordError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class FinishReason : uint8_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };
constexpr uint8_t max_enum_value(FinishReason) { return static_cast<uint8_t>(FinishReason::kAbort); }

// gRPC status codes the engine uses in RequestRejected.
inline constexpr uint32_t kStatusInvalidArgument = 3;
inline constexpr uint32_t kStatusResourceExhausted = 8;

// ---- sampling: what decides each sampled token (the engine carries it, the workers' sampler applies it) ----------
// The one declaration of every sampling knob and its default: AddRequest embeds it, the scheduler holds it, each
// NewRequestData carries it to the workers, and the binding exposes its fields by name (_core.SAMPLING_FIELDS).
struct SamplingParams {
  // how a token is drawn
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;        // 1 = off
  int32_t top_k = 0;         // 0 = off
  float min_p = 0.0f;        // 0 = off
  // penalties on the request's token history
  float repetition_penalty = 1.0f;  // 1 = off
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // a seeded request draws the same tokens whatever else shares its steps
  uint64_t seed = 0;
  bool has_seed = false;
  // what each sampled token comes with
  int32_t min_tokens = 0;    // EOS and stop ids are masked (and do not stop) before this many outputs
  int32_t num_logprobs = 0;  // top-n alternatives per sampled token

  bool operator==(const SamplingParams&) const = default;

  // Wire order, and each field's face in the public API (FieldApi: name, accepted range, meaning of special values).
  static constexpr auto fields() {
    using S = SamplingParams;
    return std::tuple{
        field("temperature", &S::temperature, {.min = 0, .note = "0 = greedy"}),
        field("top_p", &S::top_p, {.min = 0, .max = 1, .min_open = true}),
        field("top_k", &S::top_k, {.min = 0, .note = "0 = off"}),
        field("min_p", &S::min_p, {.min = 0, .max = 1}),
        field("repetition_penalty", &S::repetition_penalty, {.min = 0, .min_open = true, .note = "1 = off"}),
        field("frequency_penalty", &S::frequency_penalty, {.min = -2, .max = 2}),
        field("presence_penalty", &S::presence_penalty, {.min = -2, .max = 2}),
        field("seed", &S::seed),
        field("has_seed", &S::has_seed, {.presence_of = "seed"}),
        field("min_tokens", &S::min_tokens, {.min = 0}),  // the frontend also caps it at max_tokens
        field("num_logprobs", &S::num_logprobs, {.name = "logprobs", .min = 0, .max = 20}),
    };
  }
};

// ---- request ring -------------------------------------------------------------------------------------------------
struct AddRequest {
  static constexpr RecordType kType = RecordType::kAddRequest;
  uint64_t request_id = 0;
  std::vector<int32_t> prompt_token_ids;
  SamplingParams sampling;
  // when it ends (the engine's)
  int32_t max_tokens = 256;  // the public API's default (protos/ringserve/v1)
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  // scheduling
  int32_t priority = 0;     // lower first
  uint64_t cache_salt = 0;  // 0 = none; mixed into the first block's prefix hash
  int64_t arrival_time_ns = 0;
  // trace context (W3C): all-zero trace_id = no trace
  std::array<uint8_t, 16> trace_id{};
  std::array<uint8_t, 8> span_id{};
  uint8_t trace_flags = 0;

  static constexpr auto fields() {
    using R = AddRequest;
    return std::tuple{field("request_id", &R::request_id), field("prompt_token_ids", &R::prompt_token_ids),
                      field("sampling", &R::sampling), field("max_tokens", &R::max_tokens),
                      field("ignore_eos", &R::ignore_eos), field("stop_token_ids", &R::stop_token_ids),
                      field("priority", &R::priority), field("cache_salt", &R::cache_salt),
                      field("arrival_time_ns", &R::arrival_time_ns), bytes_field("trace_id", &R::trace_id),
                      bytes_field("span_id", &R::span_id), field("trace_flags", &R::trace_flags)};
  }
};

struct AbortRequest {
  static constexpr RecordType kType = RecordType::kAbortRequest;
  uint64_t request_id = 0;
  static constexpr auto fields() { return std::tuple{field("request_id", &AbortRequest::request_id)}; }
};

struct StatsQuery {
  static constexpr RecordType kType = RecordType::kStatsQuery;
  uint64_t query_id = 0;
  static constexpr auto fields() { return std::tuple{field("query_id", &StatsQuery::query_id)}; }
};

struct Shutdown {
  static constexpr RecordType kType = RecordType::kShutdown;
  static constexpr auto fields() { return std::tuple{}; }
};

// ---- event ring ---------------------------------------------------------------------------------------------------
struct RequestOutput {
  uint64_t request_id = 0;
  FinishReason finish_reason = FinishReason::kNone;
  // this step's tokens; top-n alternatives are [new tokens, num_top] row-major
  std::vector<int32_t> new_token_ids;
  std::vector<float> logprobs;
  uint32_t num_top = 0;
  std::vector<int32_t> top_token_ids{};
  std::vector<float> top_logprobs{};
  // progress
  uint32_t num_prompt_tokens = 0;
  uint32_t num_cached_tokens = 0;
  uint32_t num_computed_tokens = 0;   // prompt progress after this step (at most num_prompt_tokens)
  uint32_t num_scheduled_tokens = 0;  // tokens computed for this request in this step
  uint32_t num_preemptions = 0;
  // speculative decoding, this step's figures (on the request's first output of the step)
  uint32_t num_spec_proposed_tokens = 0;  // draft tokens the workers verified for it
  uint32_t num_spec_accepted_tokens = 0;  // of those, accepted (the step gave it this many tokens + 1)
  // timing, CLOCK_REALTIME
  int64_t arrival_time_ns = 0;  // engine receive time
  int64_t first_scheduled_time_ns = 0;
  int64_t first_token_time_ns = 0;

  static constexpr auto fields() {
    using R = RequestOutput;
    return std::tuple{field("request_id", &R::request_id), field("finish_reason", &R::finish_reason),
                      field("new_token_ids", &R::new_token_ids), field("logprobs", &R::logprobs),
                      field("num_top", &R::num_top), field("top_token_ids", &R::top_token_ids),
                      field("top_logprobs", &R::top_logprobs), field("num_prompt_tokens", &R::num_prompt_tokens),
                      field("num_cached_tokens", &R::num_cached_tokens),
                      field("num_computed_tokens", &R::num_computed_tokens),
                      field("num_scheduled_tokens", &R::num_scheduled_tokens),
                      field("num_preemptions", &R::num_preemptions),
                      field("num_spec_proposed_tokens", &R::num_spec_proposed_tokens),
                      field("num_spec_accepted_tokens", &R::num_spec_accepted_tokens),
                      field("arrival_time_ns", &R::arrival_time_ns),
                      field("first_scheduled_time_ns", &R::first_scheduled_time_ns),
                      field("first_token_time_ns", &R::first_token_time_ns)};
  }
};

// A RequestOutput with at most one new token in a fixed-size form: what the scheduler writes for every scheduled
// request in every step (one cache line, no arrays to refill). Not a record of its own: it encodes byte for byte as
// the RequestOutput it stands for. Its top logprobs (num_top, only with a token) are the next num_top entries of two
// side arrays shared by a step's outputs, in output order.
struct PackedOutput {
  uint64_t request_id = 0;
  int64_t arrival_time_ns = 0;
  int64_t first_scheduled_time_ns = 0;
  int64_t first_token_time_ns = 0;
  uint32_t num_prompt_tokens = 0;
  uint32_t num_cached_tokens = 0;
  uint32_t num_computed_tokens = 0;
  uint32_t num_scheduled_tokens = 0;
  int32_t token_id = 0;  // the new token, when has_token
  float logprob = 0.0f;
  uint16_t num_preemptions = 0;  // saturates at 65535 (the record carries u32)
  uint8_t num_spec_proposed_tokens = 0;  // at most kMaxLookaheadSlots per step
  uint8_t num_spec_accepted_tokens = 0;
  FinishReason finish_reason = FinishReason::kNone;
  bool has_token = false;
  uint16_t num_top = 0;
};
static_assert(sizeof(PackedOutput) == 64, "one cache line per output");

struct StepEvents {
  static constexpr RecordType kType = RecordType::kStepEvents;
  uint64_t step_id = 0;
  int64_t emit_time_ns = 0;
  std::vector<RequestOutput> outputs;

  static constexpr auto fields() {
    using R = StepEvents;
    return std::tuple{field("step_id", &R::step_id), field("emit_time_ns", &R::emit_time_ns),
                      field("outputs", &R::outputs)};
  }
};

struct EngineStats {
  static constexpr RecordType kType = RecordType::kEngineStats;
  uint64_t query_id = 0;  // 0 = unsolicited
  // requests and KV blocks now
  uint32_t num_running = 0;
  uint32_t num_waiting = 0;
  uint32_t num_total_blocks = 0;
  uint32_t num_free_blocks = 0;
  uint32_t block_size = 0;
  float kv_usage = 0.0f;  // 0..1, cached-but-unreferenced blocks count as free
  // the last step
  uint32_t num_scheduled_tokens = 0;
  int64_t step_time_ns = 0;  // schedule + plan write + wait for the result + update
  // cumulative
  uint64_t num_steps = 0;
  uint64_t num_preemptions = 0;
  uint64_t prefix_cache_queries = 0;  // tokens
  uint64_t prefix_cache_hits = 0;     // tokens
  uint64_t total_prompt_tokens = 0;
  uint64_t total_generation_tokens = 0;
  uint64_t spec_proposed_tokens = 0;  // draft tokens verified
  uint64_t spec_accepted_tokens = 0;  // draft tokens accepted
  uint64_t spec_verify_rows = 0;      // (request, step) pairs that verified at least one draft token

  static constexpr auto fields() {
    using R = EngineStats;
    return std::tuple{field("query_id", &R::query_id), field("num_running", &R::num_running),
                      field("num_waiting", &R::num_waiting), field("num_total_blocks", &R::num_total_blocks),
                      field("num_free_blocks", &R::num_free_blocks), field("block_size", &R::block_size),
                      field("kv_usage", &R::kv_usage), field("num_scheduled_tokens", &R::num_scheduled_tokens),
                      field("step_time_ns", &R::step_time_ns), field("num_steps", &R::num_steps),
                      field("num_preemptions", &R::num_preemptions),
                      field("prefix_cache_queries", &R::prefix_cache_queries),
                      field("prefix_cache_hits", &R::prefix_cache_hits),
                      field("total_prompt_tokens", &R::total_prompt_tokens),
                      field("total_generation_tokens", &R::total_generation_tokens),
                      field("spec_proposed_tokens", &R::spec_proposed_tokens),
                      field("spec_accepted_tokens", &R::spec_accepted_tokens),
                      field("spec_verify_rows", &R::spec_verify_rows)};
  }
};

struct RequestRejected {
  static constexpr RecordType kType = RecordType::kRequestRejected;
  uint64_t request_id = 0;
  uint32_t status_code = 0;  // a gRPC status code
  std::string message;

  static constexpr auto fields() {
    using R = RequestRejected;
    return std::tuple{field("request_id", &R::request_id), field("status_code", &R::status_code),
                      field("message", &R::message)};
  }
};

struct EngineReady {
  static constexpr RecordType kType = RecordType::kEngineReady;
  uint32_t num_total_blocks = 0;
  uint32_t block_size = 0;
  uint32_t max_model_len = 0;

  static constexpr auto fields() {
    using R = EngineReady;
    return std::tuple{field("num_total_blocks", &R::num_total_blocks), field("block_size", &R::block_size),
                      field("max_model_len", &R::max_model_len)};
  }
};

// Why an engine replica stopped serving: EngineFailed's `reason`, and the frontend's label for the restart
// (ringserve_engine_restarts_total{reason}: the Python name in lower case). The engine writes the first three; the
// frontend gives the last two to failures it sees itself (and engine_main to ranks it could not start).
enum class FailureReason : uint8_t {
  kEngineFailed = 0,  // anything else: a broken step protocol, a malformed record, an error inside the engine
  kWorkerDied = 1,    // a worker process exited, or a rank reported WorkerFailed
  kStepTimeout = 2,   // no step result within --step-timeout: a rank alive but stuck
  kLoadFailed = 3,    // the model's ranks could not be started (a first start or a restart)
  kEngineDied = 4,    // the engine process itself exited
};
constexpr uint8_t max_enum_value(FailureReason) { return static_cast<uint8_t>(FailureReason::kEngineDied); }

struct EngineFailed {
  static constexpr RecordType kType = RecordType::kEngineFailed;
  std::string message;
  FailureReason reason = FailureReason::kEngineFailed;
  static constexpr auto fields() {
    return std::tuple{field("message", &EngineFailed::message), field("reason", &EngineFailed::reason)};
  }
};

// ---- step ring ----------------------------------------------------------------------------------------------------
struct NewRequestData {
  int32_t slot = 0;
  std::vector<int32_t> token_ids;  // every known token: prompt, plus outputs when resumed after preemption
  int32_t num_prompt_tokens = 0;   // token_ids[:num_prompt_tokens] is the prompt
  int32_t num_computed_tokens = 0;
  std::vector<int32_t> block_ids;
  SamplingParams sampling;
  std::vector<int32_t> suppress_token_ids{};  // masked while the request has fewer than min_tokens outputs

  static constexpr auto fields() {
    using R = NewRequestData;
    return std::tuple{field("slot", &R::slot), field("token_ids", &R::token_ids),
                      field("num_prompt_tokens", &R::num_prompt_tokens),
                      field("num_computed_tokens", &R::num_computed_tokens), field("block_ids", &R::block_ids),
                      field("sampling", &R::sampling), field("suppress_token_ids", &R::suppress_token_ids)};
  }
};

struct BlockAppend {
  int32_t slot = 0;
  std::vector<int32_t> block_ids;
  static constexpr auto fields() {
    return std::tuple{field("slot", &BlockAppend::slot), field("block_ids", &BlockAppend::block_ids)};
  }
};

struct StepPlan {
  static constexpr RecordType kType = RecordType::kStepPlan;
  uint64_t step_id = 0;
  // deltas of the workers' persistent batch: slots that start, grow, shrink and end
  std::vector<NewRequestData> new_requests;
  std::vector<BlockAppend> block_appends;
  // trim_slots / trim_num_blocks: the slot's block table shrinks to that many blocks (lookahead blocks the engine
  // took back), applied before finished_slots.
  std::vector<int32_t> trim_slots;
  std::vector<int32_t> trim_num_blocks;
  std::vector<int32_t> finished_slots;
  // what this step computes, one entry per scheduled request: tokens [start, start + len) of its slot, sampled or
  // not; sched_lookahead (empty = all 0): the draft tokens the workers may propose and verify after its one token
  // (only on sampled one-token decode entries), whose KV slots are reserved.
  std::vector<int32_t> sched_slots;
  std::vector<int32_t> sched_start;
  std::vector<int32_t> sched_len;
  std::vector<uint8_t> sched_sample;  // 0/1
  std::vector<int32_t> sched_lookahead;

  static constexpr auto fields() {
    using R = StepPlan;
    return std::tuple{field("step_id", &R::step_id), field("new_requests", &R::new_requests),
                      field("block_appends", &R::block_appends), field("trim_slots", &R::trim_slots),
                      field("trim_num_blocks", &R::trim_num_blocks), field("finished_slots", &R::finished_slots),
                      field("sched_slots", &R::sched_slots), field("sched_start", &R::sched_start),
                      field("sched_len", &R::sched_len), bool_array("sched_sample", &R::sched_sample),
                      field("sched_lookahead", &R::sched_lookahead)};
  }

  void clear() {
    step_id = 0;
    new_requests.clear();
    block_appends.clear();
    trim_slots.clear();
    trim_num_blocks.clear();
    finished_slots.clear();
    sched_slots.clear();
    sched_start.clear();
    sched_len.clear();
    sched_sample.clear();
    sched_lookahead.clear();
  }
};

struct WorkerShutdown {
  static constexpr RecordType kType = RecordType::kWorkerShutdown;
  static constexpr auto fields() { return std::tuple{}; }
};

// ---- result ring --------------------------------------------------------------------------------------------------
struct StepResult {
  static constexpr RecordType kType = RecordType::kStepResult;
  uint64_t step_id = 0;
  std::vector<int32_t> slots;      // the slots whose sched_sample was true
  std::vector<int32_t> token_ids;  // one per slot, or sum(token_counts) (each row's tokens in order)
  std::vector<float> logprobs;     // same length as token_ids
  // optional top-n alternatives, [token_ids.size(), num_top] row-major; rows asking fewer pad -1
  uint32_t num_top = 0;
  std::vector<int32_t> top_token_ids{};
  std::vector<float> top_logprobs{};
  // speculative decoding. token_counts: tokens per row (empty = 1 each; with lookahead k a row has 1..k+1: the
  // accepted draft tokens, then the target's own); num_proposed: draft tokens verified per row (empty = 0 each; at
  // most the row's lookahead).
  std::vector<int32_t> token_counts{};
  std::vector<int32_t> num_proposed{};

  static constexpr auto fields() {
    using R = StepResult;
    return std::tuple{field("step_id", &R::step_id), field("slots", &R::slots), field("token_ids", &R::token_ids),
                      field("logprobs", &R::logprobs), field("num_top", &R::num_top),
                      field("top_token_ids", &R::top_token_ids), field("top_logprobs", &R::top_logprobs),
                      field("token_counts", &R::token_counts), field("num_proposed", &R::num_proposed)};
  }
};

struct WorkerReady {
  static constexpr RecordType kType = RecordType::kWorkerReady;
  uint32_t rank = 0;
  uint32_t num_kv_blocks = 0;
  static constexpr auto fields() {
    return std::tuple{field("rank", &WorkerReady::rank), field("num_kv_blocks", &WorkerReady::num_kv_blocks)};
  }
};

struct WorkerFailed {
  static constexpr RecordType kType = RecordType::kWorkerFailed;
  uint32_t rank = 0;
  std::string message;
  static constexpr auto fields() {
    return std::tuple{field("rank", &WorkerFailed::rank), field("message", &WorkerFailed::message)};
  }
};

// ---- disaggregated prefill/decode ---------------------------------------------------------------------------------
// How a request uses KV computed elsewhere.
enum class KvMode : uint8_t {
  kNone = 0,
  kPrefillOnly = 1,  // compute the prompt, sample one token, then keep the blocks pinned (KvPinned) until ReleaseKv
  kPullRemote = 2,   // the prompt's KV is pulled from a remote engine; decoding starts at first_token_id
};
constexpr uint8_t max_enum_value(KvMode) { return static_cast<uint8_t>(KvMode::kPullRemote); }

// Request ring: sent immediately before the AddRequest of the same request_id, which it modifies.
struct KvRequestOptions {
  static constexpr RecordType kType = RecordType::kKvRequestOptions;
  uint64_t request_id = 0;
  KvMode mode = KvMode::kNone;
  uint32_t pin_timeout_ms = 0;  // kPrefillOnly: pinned blocks are freed after this long without a ReleaseKv
  int32_t first_token_id = 0;   // kPullRemote: the token the prefill side sampled after the prompt
  std::vector<int32_t> remote_block_ids;  // kPullRemote: the prompt's blocks on the source, in order
  std::vector<uint8_t> peer;  // kPullRemote: the source workers' KV peer infos (opaque here; workers/kv_connector.py)

  static constexpr auto fields() {
    using R = KvRequestOptions;
    return std::tuple{field("request_id", &R::request_id), field("mode", &R::mode),
                      field("pin_timeout_ms", &R::pin_timeout_ms), field("first_token_id", &R::first_token_id),
                      field("remote_block_ids", &R::remote_block_ids), bytes_field("peer", &R::peer)};
  }
};

// Request ring: the decode side has the blocks (or gave up): free a pinned request's blocks. Unknown ids are ignored.
struct ReleaseKv {
  static constexpr RecordType kType = RecordType::kReleaseKv;
  uint64_t request_id = 0;
  static constexpr auto fields() { return std::tuple{field("request_id", &ReleaseKv::request_id)}; }
};

// Event ring: a kPrefillOnly request finished and its blocks are pinned; sent before its final output.
struct KvPinned {
  static constexpr RecordType kType = RecordType::kKvPinned;
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;     // tokens whose KV the blocks hold (the prompt)
  int64_t expires_at_ns = 0;   // CLOCK_REALTIME when the engine frees them unless released earlier
  std::vector<int32_t> block_ids;

  static constexpr auto fields() {
    using R = KvPinned;
    return std::tuple{field("request_id", &R::request_id), field("num_tokens", &R::num_tokens),
                      field("expires_at_ns", &R::expires_at_ns), field("block_ids", &R::block_ids)};
  }
};

// Step ring: written right before the StepPlan that admits `slot`: pull these remote blocks into the local ones
// before running that plan.
struct KvPull {
  static constexpr RecordType kType = RecordType::kKvPull;
  int32_t slot = 0;
  std::vector<int32_t> remote_block_ids;
  std::vector<int32_t> local_block_ids;  // same length
  std::vector<uint8_t> peer;

  static constexpr auto fields() {
    using R = KvPull;
    return std::tuple{field("slot", &R::slot), field("remote_block_ids", &R::remote_block_ids),
                      field("local_block_ids", &R::local_block_ids), bytes_field("peer", &R::peer)};
  }
};

using ByteBuffer = std::vector<uint8_t>;
using RequestRecord = std::variant<AddRequest, AbortRequest, StatsQuery, Shutdown, KvRequestOptions, ReleaseKv>;
using EngineEvent = std::variant<StepEvents, EngineStats, RequestRejected, EngineReady, EngineFailed, KvPinned>;
using WorkerCommand = std::variant<StepPlan, WorkerShutdown, KvPull>;
using WorkerResult = std::variant<StepResult, WorkerReady, WorkerFailed>;

template <class R>
concept Record = HasFields<R> && requires { R::kType; };

// Encoders replace the contents of `out` (reusing its capacity, so hot paths do not allocate per record).
// They throw RecordError when a record would not fit the u32 length / count fields or its arrays disagree.
// Instantiated in records.cpp for every record type.
template <Record R>
void encode(const R& r, ByteBuffer& out);

template <Record R>
ByteBuffer encode_to_bytes(const R& r) {
  ByteBuffer out;
  encode(r, out);
  return out;
}

// StepEvents straight from a span of outputs (the engine's hot path: no copy into a StepEvents first).
void encode_step_events(uint64_t step_id, int64_t emit_time_ns, std::span<const RequestOutput> outputs, ByteBuffer& out);
// The same record from packed outputs; `top_token_ids` / `top_logprobs` hold their top entries in output order (the
// sum of their num_top each). Throws RecordError when the side arrays do not match.
void encode_step_events(uint64_t step_id, int64_t emit_time_ns, std::span<const PackedOutput> outputs,
                        std::span<const int32_t> top_token_ids, std::span<const float> top_logprobs, ByteBuffer& out);
// The RequestOutput a packed one stands for, given its own num_top top entries.
RequestOutput unpack_output(const PackedOutput& o, std::span<const int32_t> top_token_ids,
                            std::span<const float> top_logprobs);
// Decodes a result-ring record into `out`, reusing its arrays, when it is a StepResult; returns false (out untouched)
// for any other valid result-ring type. Throws RecordError on malformed input.
bool decode_step_result_into(std::span<const uint8_t> bytes, StepResult& out);

// Where an array of a decoded record lies in the record's bytes: `count` elements starting at byte `offset`.
struct ArrayLocation {
  size_t offset = 0;
  uint32_t count = 0;
};

// Every array of a StepPlan as its location in the record, in field order (nested records' arrays where they
// appear), for callers that view the arrays in place (the binding's zero-copy numpy arrays) instead of copying them.
struct StepPlanLayout {
  std::vector<ArrayLocation> arrays;
};

// Bounds-checked decoders, one per ring. Each rejects (RecordError) a record of another ring's type.
RequestRecord decode_request_record(std::span<const uint8_t> bytes);
EngineEvent decode_engine_event(std::span<const uint8_t> bytes);
WorkerCommand decode_worker_command(std::span<const uint8_t> bytes);
// The same checks; a StepPlan comes back with every array empty and `layout` saying where each one lies in `bytes`.
WorkerCommand decode_worker_command(std::span<const uint8_t> bytes, StepPlanLayout& layout);
WorkerResult decode_worker_result(std::span<const uint8_t> bytes);

// Upper bound of the encoded size of a record or nested record (a RequestOutput inside a StepEvents record, used
// to split large steps; a NewRequestData inside a StepPlan), walked from its fields.
template <HasFields T>
size_t encoded_size_bound(const T& r) {
  size_t n = min_encoded_size<T>();
  for_each_field<T>([&](const auto& f) {
    using F = typename std::decay_t<decltype(f)>::Type;
    if constexpr (kIsVector<F>) {
      using E = typename F::value_type;
      if constexpr (HasFields<E>) {
        for (const E& e : r.*f.member) n += encoded_size_bound(e);
      } else {
        n += (r.*f.member).size() * sizeof(E);
      }
    } else if constexpr (std::is_same_v<F, std::string>) {
      n += (r.*f.member).size();
    } else if constexpr (HasFields<F>) {
      n += encoded_size_bound(r.*f.member) - min_encoded_size<F>();
    }
  });
  return n;
}
size_t encoded_size_bound(const PackedOutput& o);

}  // namespace ringserve
