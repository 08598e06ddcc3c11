// The one versioned definition of every record that crosses a RingServe ring.
//
// Wire format: RecordHeader{u32 length, u16 type, u16 layout_version} followed by a little-endian payload: the
// record's fixed fields in declaration order, then its arrays, each array as u32 count + elements, strings as
// u32 byte count + bytes, bools as one byte (0/1). The whole record is zero-padded to a multiple of 8 bytes and
// `length` counts the padding, so records stay 8-byte aligned inside a ring.
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

namespace ringserve {

static_assert(std::endian::native == std::endian::little, "ring records are little-endian; add byte swaps here");

inline constexpr uint16_t kLayoutVersion = 3;
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

// gRPC status codes the engine uses in RequestRejected.
inline constexpr uint32_t kStatusInvalidArgument = 3;
inline constexpr uint32_t kStatusResourceExhausted = 8;

// ---- request ring -------------------------------------------------------------------------------------------------
struct AddRequest {
  static constexpr RecordType kType = RecordType::kAddRequest;
  uint64_t request_id = 0;
  int32_t max_tokens = 16;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 = off
  uint64_t seed = 0;
  bool has_seed = false;
  bool ignore_eos = false;
  int32_t priority = 0;
  int64_t arrival_time_ns = 0;
  std::array<uint8_t, 16> trace_id{};  // all zero = no trace
  std::array<uint8_t, 8> span_id{};
  uint8_t trace_flags = 0;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> stop_token_ids;
  // layout version 2
  int32_t min_tokens = 0;
  float min_p = 0.0f;               // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  int32_t num_logprobs = 0;  // top-n alternatives per sampled token
  uint64_t cache_salt = 0;   // 0 = none; mixed into the first block's prefix hash
};

struct AbortRequest {
  static constexpr RecordType kType = RecordType::kAbortRequest;
  uint64_t request_id = 0;
};

struct StatsQuery {
  static constexpr RecordType kType = RecordType::kStatsQuery;
  uint64_t query_id = 0;
};

struct Shutdown {
  static constexpr RecordType kType = RecordType::kShutdown;
};

// ---- event ring ---------------------------------------------------------------------------------------------------
struct RequestOutput {
  uint64_t request_id = 0;
  FinishReason finish_reason = FinishReason::kNone;
  uint32_t num_prompt_tokens = 0;
  uint32_t num_cached_tokens = 0;
  int64_t arrival_time_ns = 0;  // engine receive time, CLOCK_REALTIME
  int64_t first_scheduled_time_ns = 0;
  int64_t first_token_time_ns = 0;
  std::vector<int32_t> new_token_ids;
  std::vector<float> logprobs;
  // layout version 2
  uint32_t num_top = 0;
  std::vector<int32_t> top_token_ids{};  // [new tokens, num_top], row-major
  std::vector<float> top_logprobs{};     // [new tokens, num_top]
  uint32_t num_computed_tokens = 0;    // prompt progress after this step (at most num_prompt_tokens)
  uint32_t num_scheduled_tokens = 0;   // tokens computed for this request in this step
  uint32_t num_preemptions = 0;
  // layout version 3: speculative decoding, this step's figures (on the request's first output of the step)
  uint32_t num_spec_proposed_tokens = 0;  // draft tokens the workers verified for it
  uint32_t num_spec_accepted_tokens = 0;  // of those, accepted (the step gave it this many tokens + 1)
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
};

struct EngineStats {
  static constexpr RecordType kType = RecordType::kEngineStats;
  uint64_t query_id = 0;  // 0 = unsolicited
  uint32_t num_running = 0;
  uint32_t num_waiting = 0;
  uint32_t num_total_blocks = 0;
  uint32_t num_free_blocks = 0;
  uint32_t block_size = 0;
  uint64_t num_steps = 0;
  uint64_t num_preemptions = 0;
  // layout version 2
  uint32_t num_scheduled_tokens = 0;  // last step
  int64_t step_time_ns = 0;           // last step: schedule + plan write + wait for the result + update
  uint64_t prefix_cache_queries = 0;  // cumulative, tokens
  uint64_t prefix_cache_hits = 0;     // cumulative, tokens
  float kv_usage = 0.0f;              // 0..1, cached-but-unreferenced blocks count as free
  uint64_t total_prompt_tokens = 0;
  uint64_t total_generation_tokens = 0;
  // layout version 3: speculative decoding, cumulative
  uint64_t spec_proposed_tokens = 0;  // draft tokens verified
  uint64_t spec_accepted_tokens = 0;  // draft tokens accepted
  uint64_t spec_verify_rows = 0;      // (request, step) pairs that verified at least one draft token
};

struct RequestRejected {
  static constexpr RecordType kType = RecordType::kRequestRejected;
  uint64_t request_id = 0;
  uint32_t status_code = 0;
  std::string message;
};

struct EngineReady {
  static constexpr RecordType kType = RecordType::kEngineReady;
  uint32_t num_total_blocks = 0;
  uint32_t block_size = 0;
  uint32_t max_model_len = 0;
};

struct EngineFailed {
  static constexpr RecordType kType = RecordType::kEngineFailed;
  std::string message;
};

// ---- step ring ----------------------------------------------------------------------------------------------------
struct NewRequestData {
  int32_t slot = 0;
  int32_t num_computed_tokens = 0;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  bool has_seed = false;
  std::vector<int32_t> token_ids;  // every known token: prompt, plus outputs when resumed after preemption
  std::vector<int32_t> block_ids;
  // layout version 2
  int32_t num_prompt_tokens = 0;  // token_ids[:num_prompt_tokens] is the prompt
  int32_t min_tokens = 0;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  int32_t num_logprobs = 0;
  std::vector<int32_t> suppress_token_ids{};  // masked while the request has fewer than min_tokens outputs
};

struct BlockAppend {
  int32_t slot = 0;
  std::vector<int32_t> block_ids;
};

struct StepPlan {
  static constexpr RecordType kType = RecordType::kStepPlan;
  uint64_t step_id = 0;
  std::vector<NewRequestData> new_requests;
  std::vector<BlockAppend> block_appends;
  std::vector<int32_t> sched_slots;
  std::vector<int32_t> sched_start;
  std::vector<int32_t> sched_len;
  std::vector<uint8_t> sched_sample;  // 0/1
  std::vector<int32_t> finished_slots;
  // layout version 3: speculative decoding. sched_lookahead: per scheduled entry (empty = all 0), the draft tokens
  // the workers may propose and verify after its one token (only on sampled one-token decode entries); the entry's
  // KV slots for those positions are reserved. trim_slots / trim_num_blocks: the slot's block table shrinks to that
  // many blocks (lookahead blocks the engine took back), applied before finished_slots.
  std::vector<int32_t> sched_lookahead;
  std::vector<int32_t> trim_slots;
  std::vector<int32_t> trim_num_blocks;

  void clear() {
    step_id = 0;
    new_requests.clear();
    block_appends.clear();
    sched_slots.clear();
    sched_start.clear();
    sched_len.clear();
    sched_sample.clear();
    finished_slots.clear();
    sched_lookahead.clear();
    trim_slots.clear();
    trim_num_blocks.clear();
  }
};

struct WorkerShutdown {
  static constexpr RecordType kType = RecordType::kWorkerShutdown;
};

// ---- result ring --------------------------------------------------------------------------------------------------
struct StepResult {
  static constexpr RecordType kType = RecordType::kStepResult;
  uint64_t step_id = 0;
  std::vector<int32_t> slots;      // the slots whose sched_sample was true
  std::vector<int32_t> token_ids;  // one per slot, or sum(token_counts) (each row's tokens in order)
  std::vector<float> logprobs;     // same length as token_ids
  // layout version 2: optional top-n alternatives, [token_ids.size(), num_top] row-major; rows asking fewer pad -1
  uint32_t num_top = 0;
  std::vector<int32_t> top_token_ids{};
  std::vector<float> top_logprobs{};
  // layout version 3: speculative decoding. token_counts: tokens per row (empty = 1 each; with lookahead k a row
  // has 1..k+1: the accepted draft tokens, then the target's own); num_proposed: draft tokens verified per row
  // (empty = 0 each; at most the row's lookahead).
  std::vector<int32_t> token_counts{};
  std::vector<int32_t> num_proposed{};
};

struct WorkerReady {
  static constexpr RecordType kType = RecordType::kWorkerReady;
  uint32_t rank = 0;
  uint32_t num_kv_blocks = 0;
};

struct WorkerFailed {
  static constexpr RecordType kType = RecordType::kWorkerFailed;
  uint32_t rank = 0;
  std::string message;
};

// ---- disaggregated prefill/decode (issue #8): record types of their own, no existing payload changes -------------
// How a request uses KV computed elsewhere.
enum class KvMode : uint8_t {
  kNone = 0,
  kPrefillOnly = 1,  // compute the prompt, sample one token, then keep the blocks pinned (KvPinned) until ReleaseKv
  kPullRemote = 2,   // the prompt's KV is pulled from a remote engine; decoding starts at first_token_id
};

// Request ring: sent immediately before the AddRequest of the same request_id, which it modifies.
struct KvRequestOptions {
  static constexpr RecordType kType = RecordType::kKvRequestOptions;
  uint64_t request_id = 0;
  KvMode mode = KvMode::kNone;
  uint32_t pin_timeout_ms = 0;  // kPrefillOnly: pinned blocks are freed after this long without a ReleaseKv
  int32_t first_token_id = 0;   // kPullRemote: the token the prefill side sampled after the prompt
  std::vector<int32_t> remote_block_ids;  // kPullRemote: the prompt's blocks on the source, in order
  std::vector<uint8_t> peer;  // kPullRemote: the source workers' KV peer infos (opaque here; workers/kv_connector.py)
};

// Request ring: the decode side has the blocks (or gave up): free a pinned request's blocks. Unknown ids are ignored.
struct ReleaseKv {
  static constexpr RecordType kType = RecordType::kReleaseKv;
  uint64_t request_id = 0;
};

// Event ring: a kPrefillOnly request finished and its blocks are pinned; sent before its final output.
struct KvPinned {
  static constexpr RecordType kType = RecordType::kKvPinned;
  uint64_t request_id = 0;
  uint32_t num_tokens = 0;     // tokens whose KV the blocks hold (the prompt)
  int64_t expires_at_ns = 0;   // CLOCK_REALTIME when the engine frees them unless released earlier
  std::vector<int32_t> block_ids;
};

// Step ring: written right before the StepPlan that admits `slot`: pull these remote blocks into the local ones
// before running that plan.
struct KvPull {
  static constexpr RecordType kType = RecordType::kKvPull;
  int32_t slot = 0;
  std::vector<int32_t> remote_block_ids;
  std::vector<int32_t> local_block_ids;  // same length
  std::vector<uint8_t> peer;
};

using ByteBuffer = std::vector<uint8_t>;
using RequestRecord = std::variant<AddRequest, AbortRequest, StatsQuery, Shutdown, KvRequestOptions, ReleaseKv>;
using EngineEvent = std::variant<StepEvents, EngineStats, RequestRejected, EngineReady, EngineFailed, KvPinned>;
using WorkerCommand = std::variant<StepPlan, WorkerShutdown, KvPull>;
using WorkerResult = std::variant<StepResult, WorkerReady, WorkerFailed>;

// Encoders replace the contents of `out` (reusing its capacity, so hot paths do not allocate per record).
// They throw RecordError only when a record would not fit the u32 length / count fields.
void encode(const AddRequest& r, ByteBuffer& out);
void encode(const AbortRequest& r, ByteBuffer& out);
void encode(const StatsQuery& r, ByteBuffer& out);
void encode(const Shutdown& r, ByteBuffer& out);
void encode(const StepEvents& r, ByteBuffer& out);
void encode(const EngineStats& r, ByteBuffer& out);
void encode(const RequestRejected& r, ByteBuffer& out);
void encode(const EngineReady& r, ByteBuffer& out);
void encode(const EngineFailed& r, ByteBuffer& out);
void encode(const StepPlan& r, ByteBuffer& out);
void encode(const WorkerShutdown& r, ByteBuffer& out);
void encode(const StepResult& r, ByteBuffer& out);
void encode(const WorkerReady& r, ByteBuffer& out);
void encode(const WorkerFailed& r, ByteBuffer& out);
void encode(const KvRequestOptions& r, ByteBuffer& out);
void encode(const ReleaseKv& r, ByteBuffer& out);
void encode(const KvPinned& r, ByteBuffer& out);
void encode(const KvPull& r, ByteBuffer& out);

template <class Record>
ByteBuffer encode_to_bytes(const Record& r) {
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

// Every array of a StepPlan as its location in the record, for callers that view the arrays in place (the binding's
// zero-copy numpy arrays) instead of copying them.
struct StepPlanLayout {
  struct NewRequest {
    ArrayLocation token_ids, block_ids, suppress_token_ids;
  };
  std::vector<NewRequest> new_requests;      // parallel to StepPlan::new_requests
  std::vector<ArrayLocation> block_appends;  // each BlockAppend's block_ids
  ArrayLocation sched_slots, sched_start, sched_len, sched_sample, finished_slots;
  ArrayLocation sched_lookahead, trim_slots, trim_num_blocks;
};

// Bounds-checked decoders, one per ring. Each rejects (RecordError) a record of another ring's type.
RequestRecord decode_request_record(std::span<const uint8_t> bytes);
EngineEvent decode_engine_event(std::span<const uint8_t> bytes);
WorkerCommand decode_worker_command(std::span<const uint8_t> bytes);
// The same checks; a StepPlan comes back with every array empty and `layout` saying where each one lies in `bytes`.
WorkerCommand decode_worker_command(std::span<const uint8_t> bytes, StepPlanLayout& layout);
WorkerResult decode_worker_result(std::span<const uint8_t> bytes);

// Upper bound of the encoded size of one RequestOutput inside a StepEvents record (used to split large steps).
size_t encoded_size_bound(const RequestOutput& o);
size_t encoded_size_bound(const PackedOutput& o);
// Upper bound of the encoded size a NewRequestData adds to a StepPlan.
size_t encoded_size_bound(const NewRequestData& n);

}  // namespace ringserve
