#include "ringserve/records.h"

#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>

namespace ringserve {
namespace {

constexpr size_t align_up(size_t n) { return (n + kRecordAlign - 1) & ~(kRecordAlign - 1); }

// Appends little-endian fields after a header placeholder; finish() pads and fills in the header.
class PayloadWriter {
 public:
  PayloadWriter(ByteBuffer& out, RecordType type) : out_(out), type_(type) {
    out_.clear();
    out_.resize(sizeof(RecordHeader));
  }

  template <class T>
    requires std::is_arithmetic_v<T> || std::is_enum_v<T>
  void put(T value) {
    append(&value, sizeof(T));
  }

  void put_bool(bool value) { put<uint8_t>(value ? 1 : 0); }

  template <class T>
  void put_array(std::span<const T> values) {
    put<uint32_t>(checked_count(values.size()));
    if (!values.empty()) append(values.data(), values.size_bytes());
  }

  template <class T>
  void put_array(const std::vector<T>& values) {
    put_array(std::span<const T>(values));
  }

  void put_string(std::string_view s) {
    put_array(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  }

  template <size_t N>
  void put_bytes(const std::array<uint8_t, N>& bytes) {
    append(bytes.data(), N);
  }

  void finish() {
    out_.resize(align_up(out_.size()), 0);
    if (out_.size() > std::numeric_limits<uint32_t>::max()) throw RecordError("record larger than 4 GiB");
    const RecordHeader header{static_cast<uint32_t>(out_.size()), static_cast<uint16_t>(type_), kLayoutVersion};
    std::memcpy(out_.data(), &header, sizeof(header));
  }

  // insert() copies straight in; resize() would zero-fill first (a hot spot when encoding a 1,000-output step).
  void append(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    out_.insert(out_.end(), p, p + n);
  }

  static uint32_t checked_count(size_t n) {
    if (n > std::numeric_limits<uint32_t>::max()) throw RecordError("array longer than 2^32-1 elements");
    return static_cast<uint32_t>(n);
  }

 private:
  ByteBuffer& out_;
  RecordType type_;
};

// Reads fields in order; every read is checked against the record's end, so a malformed record cannot make it read
// out of bounds.
class PayloadReader {
 public:
  explicit PayloadReader(std::span<const uint8_t> bytes) : bytes_(bytes), pos_(sizeof(RecordHeader)) {}

  template <class T>
    requires std::is_arithmetic_v<T>
  T get(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  bool get_bool(const char* what) {
    const auto v = get<uint8_t>(what);
    if (v > 1) throw RecordError(std::string("field ") + what + " is not a bool (" + std::to_string(v) + ")");
    return v == 1;
  }

  FinishReason get_finish_reason() {
    const auto v = get<uint8_t>("finish_reason");
    if (v > static_cast<uint8_t>(FinishReason::kAbort)) {
      throw RecordError("unknown finish_reason " + std::to_string(v));
    }
    return static_cast<FinishReason>(v);
  }

  // Copies the next array into `out`; given `where`, records its location instead and leaves `out` alone.
  // Returns the element count.
  template <class T>
  uint32_t get_array(std::vector<T>& out, const char* what, ArrayLocation* where = nullptr) {
    const auto count = get<uint32_t>(what);
    // Divide instead of multiply so a huge count cannot overflow the comparison.
    if (count > (bytes_.size() - pos_) / sizeof(T)) {
      throw RecordError(std::string("truncated array ") + what + ": " + std::to_string(count) + " elements declared, " +
                        std::to_string(bytes_.size() - pos_) + " bytes left");
    }
    if (where != nullptr) {
      *where = {pos_, count};
    } else {
      out.resize(count);
      if (count != 0) std::memcpy(out.data(), bytes_.data() + pos_, count * sizeof(T));
    }
    pos_ += count * sizeof(T);
    return count;
  }

  std::string get_string(const char* what) {
    std::vector<uint8_t> raw;
    get_array(raw, what);
    return std::string(raw.begin(), raw.end());
  }

  template <size_t N>
  void get_bytes(std::array<uint8_t, N>& out, const char* what) {
    need(N, what);
    std::memcpy(out.data(), bytes_.data() + pos_, N);
    pos_ += N;
  }

  // Only zero padding to the 8-byte boundary may follow the last field.
  void finish() {
    if (align_up(pos_) != bytes_.size()) {
      throw RecordError("record has " + std::to_string(bytes_.size() - pos_) + " unexpected trailing bytes");
    }
    for (size_t i = pos_; i < bytes_.size(); ++i) {
      if (bytes_[i] != 0) throw RecordError("non-zero record padding");
    }
  }

  // A count of nested structs: each one takes at least `min_bytes`, which bounds the count before we reserve.
  uint32_t get_struct_count(size_t min_bytes, const char* what) {
    const auto count = get<uint32_t>(what);
    if (count > (bytes_.size() - pos_) / min_bytes) {
      throw RecordError(std::string("truncated array ") + what + ": " + std::to_string(count) + " entries declared");
    }
    return count;
  }

 private:
  void need(size_t n, const char* what) const {
    if (n > bytes_.size() - pos_) throw RecordError(std::string("record truncated in field ") + what);
  }

  std::span<const uint8_t> bytes_;
  size_t pos_;
};

RecordHeader check_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < sizeof(RecordHeader)) {
    throw RecordError("record of " + std::to_string(bytes.size()) + " bytes is shorter than its 8-byte header");
  }
  RecordHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.length != bytes.size()) {
    throw RecordError("record length field says " + std::to_string(h.length) + " bytes but the record has " +
                      std::to_string(bytes.size()));
  }
  if (h.length % kRecordAlign != 0) throw RecordError("record length " + std::to_string(h.length) + " not 8-aligned");
  if (h.layout_version != kLayoutVersion) {
    throw RecordError("record layout version " + std::to_string(h.layout_version) + " is not the supported version " +
                      std::to_string(kLayoutVersion));
  }
  return h;
}

[[noreturn]] void unknown_type(uint16_t type, const char* ring) {
  throw RecordError("unknown record type " + std::to_string(type) + " on the " + ring + " ring");
}

// Minimum encoded sizes of nested structs (fixed fields + array counts), used to bound declared counts.
constexpr size_t kMinRequestOutputBytes = 8 + 1 + 4 + 4 + 8 + 8 + 8 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4;
constexpr size_t kMinNewRequestBytes = 4 + 4 + 4 + 4 + 4 + 8 + 1 + 4 + 4 + 7 * 4 + 4;
constexpr size_t kMinBlockAppendBytes = 4 + 4;

// Array lengths of a StepResult agree: token rows = sum(token_counts) (or one per slot), top arrays per token row.
void check_step_result_shape(const StepResult& r) {
  uint64_t rows = r.slots.size();
  if (!r.token_counts.empty()) {
    if (r.token_counts.size() != r.slots.size()) throw RecordError("StepResult token_counts is not one per slot");
    rows = 0;
    for (const int32_t c : r.token_counts) {
      if (c < 1 || c > kMaxLookaheadSlots + 1) throw RecordError("StepResult token_counts entry outside [1, 65]");
      rows += static_cast<uint64_t>(c);
    }
  }
  if (!r.num_proposed.empty() && r.num_proposed.size() != r.slots.size()) {
    throw RecordError("StepResult num_proposed is not one per slot");
  }
  if (r.token_ids.size() != rows || r.logprobs.size() != rows) {
    throw RecordError("StepResult token_ids and logprobs must hold one entry per token (len(slots) or sum(token_counts))");
  }
  if (r.top_token_ids.size() != uint64_t{r.num_top} * rows || r.top_logprobs.size() != r.top_token_ids.size()) {
    throw RecordError("StepResult top_token_ids/top_logprobs must be [tokens, num_top]");
  }
}

}  // namespace

void encode(const AddRequest& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.put(r.max_tokens);
  w.put(r.temperature);
  w.put(r.top_p);
  w.put(r.top_k);
  w.put(r.seed);
  w.put_bool(r.has_seed);
  w.put_bool(r.ignore_eos);
  w.put(r.priority);
  w.put(r.arrival_time_ns);
  w.put_bytes(r.trace_id);
  w.put_bytes(r.span_id);
  w.put(r.trace_flags);
  w.put_array(r.prompt_token_ids);
  w.put_array(r.stop_token_ids);
  w.put(r.min_tokens);
  w.put(r.min_p);
  w.put(r.repetition_penalty);
  w.put(r.frequency_penalty);
  w.put(r.presence_penalty);
  w.put(r.num_logprobs);
  w.put(r.cache_salt);
  w.finish();
}

void encode(const AbortRequest& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.finish();
}

void encode(const StatsQuery& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.query_id);
  w.finish();
}

void encode(const Shutdown& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.finish();
}

void encode(const StepEvents& r, ByteBuffer& out) { encode_step_events(r.step_id, r.emit_time_ns, r.outputs, out); }

void encode_step_events(uint64_t step_id, int64_t emit_time_ns, std::span<const RequestOutput> outputs, ByteBuffer& out) {
  PayloadWriter w(out, StepEvents::kType);
  w.put(step_id);
  w.put(emit_time_ns);
  w.put<uint32_t>(PayloadWriter::checked_count(outputs.size()));
  for (const RequestOutput& o : outputs) {
    w.put(o.request_id);
    w.put(static_cast<uint8_t>(o.finish_reason));
    w.put(o.num_prompt_tokens);
    w.put(o.num_cached_tokens);
    w.put(o.arrival_time_ns);
    w.put(o.first_scheduled_time_ns);
    w.put(o.first_token_time_ns);
    w.put_array(o.new_token_ids);
    w.put_array(o.logprobs);
    if (o.top_token_ids.size() != size_t{o.num_top} * o.new_token_ids.size() ||
        o.top_logprobs.size() != o.top_token_ids.size()) {
      throw RecordError("RequestOutput top_token_ids/top_logprobs must hold num_top entries per new token");
    }
    w.put(o.num_top);
    w.put_array(o.top_token_ids);
    w.put_array(o.top_logprobs);
    w.put(o.num_computed_tokens);
    w.put(o.num_scheduled_tokens);
    w.put(o.num_preemptions);
    w.put(o.num_spec_proposed_tokens);
    w.put(o.num_spec_accepted_tokens);
  }
  w.finish();
}

void encode_step_events(uint64_t step_id, int64_t emit_time_ns, std::span<const PackedOutput> outputs,
                        std::span<const int32_t> top_token_ids, std::span<const float> top_logprobs, ByteBuffer& out) {
  size_t num_top = 0;
  for (const PackedOutput& o : outputs) {
    if (o.num_top != 0 && !o.has_token) throw RecordError("PackedOutput has top logprobs but no token");
    num_top += o.num_top;
  }
  if (top_token_ids.size() != num_top || top_logprobs.size() != num_top) {
    throw RecordError("PackedOutput top arrays do not hold the outputs' num_top entries");
  }
  PayloadWriter w(out, StepEvents::kType);
  w.put(step_id);
  w.put(emit_time_ns);
  w.put<uint32_t>(PayloadWriter::checked_count(outputs.size()));
  size_t top = 0;
  for (const PackedOutput& o : outputs) {
    // The fields of the RequestOutput encoding above, in its order; gathered in one buffer so each output costs one
    // append instead of one per field.
    uint8_t fixed[kMinRequestOutputBytes + 2 * sizeof(int32_t)];
    uint8_t* p = fixed;
    auto put = [&p](const auto& value) {
      std::memcpy(p, &value, sizeof(value));
      p += sizeof(value);
    };
    const uint32_t n = o.has_token ? 1 : 0;
    put(o.request_id);
    put(static_cast<uint8_t>(o.finish_reason));
    put(o.num_prompt_tokens);
    put(o.num_cached_tokens);
    put(o.arrival_time_ns);
    put(o.first_scheduled_time_ns);
    put(o.first_token_time_ns);
    put(n);
    if (n != 0) put(o.token_id);
    put(n);
    if (n != 0) put(o.logprob);
    put(uint32_t{o.num_top});
    w.append(fixed, static_cast<size_t>(p - fixed));
    w.put_array(top_token_ids.subspan(top, o.num_top));
    w.put_array(top_logprobs.subspan(top, o.num_top));
    top += o.num_top;
    w.put(o.num_computed_tokens);
    w.put(o.num_scheduled_tokens);
    w.put(uint32_t{o.num_preemptions});
    w.put(uint32_t{o.num_spec_proposed_tokens});
    w.put(uint32_t{o.num_spec_accepted_tokens});
  }
  w.finish();
}

RequestOutput unpack_output(const PackedOutput& o, std::span<const int32_t> top_token_ids,
                            std::span<const float> top_logprobs) {
  RequestOutput r;
  r.request_id = o.request_id;
  r.finish_reason = o.finish_reason;
  r.num_prompt_tokens = o.num_prompt_tokens;
  r.num_cached_tokens = o.num_cached_tokens;
  r.arrival_time_ns = o.arrival_time_ns;
  r.first_scheduled_time_ns = o.first_scheduled_time_ns;
  r.first_token_time_ns = o.first_token_time_ns;
  if (o.has_token) {
    r.new_token_ids.push_back(o.token_id);
    r.logprobs.push_back(o.logprob);
    r.num_top = o.num_top;
    r.top_token_ids.assign(top_token_ids.begin(), top_token_ids.end());
    r.top_logprobs.assign(top_logprobs.begin(), top_logprobs.end());
  }
  r.num_computed_tokens = o.num_computed_tokens;
  r.num_scheduled_tokens = o.num_scheduled_tokens;
  r.num_preemptions = o.num_preemptions;
  r.num_spec_proposed_tokens = o.num_spec_proposed_tokens;
  r.num_spec_accepted_tokens = o.num_spec_accepted_tokens;
  return r;
}

void encode(const EngineStats& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.query_id);
  w.put(r.num_running);
  w.put(r.num_waiting);
  w.put(r.num_total_blocks);
  w.put(r.num_free_blocks);
  w.put(r.block_size);
  w.put(r.num_steps);
  w.put(r.num_preemptions);
  w.put(r.num_scheduled_tokens);
  w.put(r.step_time_ns);
  w.put(r.prefix_cache_queries);
  w.put(r.prefix_cache_hits);
  w.put(r.kv_usage);
  w.put(r.total_prompt_tokens);
  w.put(r.total_generation_tokens);
  w.put(r.spec_proposed_tokens);
  w.put(r.spec_accepted_tokens);
  w.put(r.spec_verify_rows);
  w.finish();
}

void encode(const RequestRejected& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.put(r.status_code);
  w.put_string(r.message);
  w.finish();
}

void encode(const EngineReady& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.num_total_blocks);
  w.put(r.block_size);
  w.put(r.max_model_len);
  w.finish();
}

void encode(const EngineFailed& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put_string(r.message);
  w.finish();
}

void encode(const StepPlan& r, ByteBuffer& out) {
  const size_t n = r.sched_slots.size();
  if (r.sched_start.size() != n || r.sched_len.size() != n || r.sched_sample.size() != n) {
    throw RecordError("StepPlan sched_slots/sched_start/sched_len/sched_sample must have equal lengths");
  }
  if (!r.sched_lookahead.empty() && r.sched_lookahead.size() != n) {
    throw RecordError("StepPlan sched_lookahead must be empty or as long as sched_slots");
  }
  if (r.trim_slots.size() != r.trim_num_blocks.size()) {
    throw RecordError("StepPlan trim_slots and trim_num_blocks must have equal lengths");
  }
  PayloadWriter w(out, r.kType);
  w.put(r.step_id);
  w.put<uint32_t>(PayloadWriter::checked_count(r.new_requests.size()));
  for (const NewRequestData& nr : r.new_requests) {
    w.put(nr.slot);
    w.put(nr.num_computed_tokens);
    w.put(nr.temperature);
    w.put(nr.top_p);
    w.put(nr.top_k);
    w.put(nr.seed);
    w.put_bool(nr.has_seed);
    w.put_array(nr.token_ids);
    w.put_array(nr.block_ids);
    w.put(nr.num_prompt_tokens);
    w.put(nr.min_tokens);
    w.put(nr.min_p);
    w.put(nr.repetition_penalty);
    w.put(nr.frequency_penalty);
    w.put(nr.presence_penalty);
    w.put(nr.num_logprobs);
    w.put_array(nr.suppress_token_ids);
  }
  w.put<uint32_t>(PayloadWriter::checked_count(r.block_appends.size()));
  for (const BlockAppend& ba : r.block_appends) {
    w.put(ba.slot);
    w.put_array(ba.block_ids);
  }
  w.put_array(r.sched_slots);
  w.put_array(r.sched_start);
  w.put_array(r.sched_len);
  w.put_array(r.sched_sample);
  w.put_array(r.finished_slots);
  w.put_array(r.sched_lookahead);
  w.put_array(r.trim_slots);
  w.put_array(r.trim_num_blocks);
  w.finish();
}

void encode(const WorkerShutdown& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.finish();
}

void encode(const StepResult& r, ByteBuffer& out) {
  check_step_result_shape(r);
  PayloadWriter w(out, r.kType);
  w.put(r.step_id);
  w.put_array(r.slots);
  w.put_array(r.token_ids);
  w.put_array(r.logprobs);
  w.put(r.num_top);
  w.put_array(r.top_token_ids);
  w.put_array(r.top_logprobs);
  w.put_array(r.token_counts);
  w.put_array(r.num_proposed);
  w.finish();
}

void encode(const WorkerReady& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.rank);
  w.put(r.num_kv_blocks);
  w.finish();
}

void encode(const WorkerFailed& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.rank);
  w.put_string(r.message);
  w.finish();
}

void encode(const KvRequestOptions& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.put(r.mode);
  w.put(r.pin_timeout_ms);
  w.put(r.first_token_id);
  w.put_array(r.remote_block_ids);
  w.put_array(r.peer);
  w.finish();
}

void encode(const ReleaseKv& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.finish();
}

void encode(const KvPinned& r, ByteBuffer& out) {
  PayloadWriter w(out, r.kType);
  w.put(r.request_id);
  w.put(r.num_tokens);
  w.put(r.expires_at_ns);
  w.put_array(r.block_ids);
  w.finish();
}

void encode(const KvPull& r, ByteBuffer& out) {
  if (r.remote_block_ids.size() != r.local_block_ids.size()) {
    throw RecordError("KvPull remote_block_ids and local_block_ids must have equal lengths");
  }
  PayloadWriter w(out, r.kType);
  w.put(r.slot);
  w.put_array(r.remote_block_ids);
  w.put_array(r.local_block_ids);
  w.put_array(r.peer);
  w.finish();
}

RequestRecord decode_request_record(std::span<const uint8_t> bytes) {
  const RecordHeader h = check_header(bytes);
  PayloadReader rd(bytes);
  switch (static_cast<RecordType>(h.type)) {
    case RecordType::kAddRequest: {
      AddRequest r;
      r.request_id = rd.get<uint64_t>("request_id");
      r.max_tokens = rd.get<int32_t>("max_tokens");
      r.temperature = rd.get<float>("temperature");
      r.top_p = rd.get<float>("top_p");
      r.top_k = rd.get<int32_t>("top_k");
      r.seed = rd.get<uint64_t>("seed");
      r.has_seed = rd.get_bool("has_seed");
      r.ignore_eos = rd.get_bool("ignore_eos");
      r.priority = rd.get<int32_t>("priority");
      r.arrival_time_ns = rd.get<int64_t>("arrival_time_ns");
      rd.get_bytes(r.trace_id, "trace_id");
      rd.get_bytes(r.span_id, "span_id");
      r.trace_flags = rd.get<uint8_t>("trace_flags");
      rd.get_array(r.prompt_token_ids, "prompt_token_ids");
      rd.get_array(r.stop_token_ids, "stop_token_ids");
      r.min_tokens = rd.get<int32_t>("min_tokens");
      r.min_p = rd.get<float>("min_p");
      r.repetition_penalty = rd.get<float>("repetition_penalty");
      r.frequency_penalty = rd.get<float>("frequency_penalty");
      r.presence_penalty = rd.get<float>("presence_penalty");
      r.num_logprobs = rd.get<int32_t>("num_logprobs");
      r.cache_salt = rd.get<uint64_t>("cache_salt");
      rd.finish();
      return r;
    }
    case RecordType::kAbortRequest: {
      AbortRequest r;
      r.request_id = rd.get<uint64_t>("request_id");
      rd.finish();
      return r;
    }
    case RecordType::kStatsQuery: {
      StatsQuery r;
      r.query_id = rd.get<uint64_t>("query_id");
      rd.finish();
      return r;
    }
    case RecordType::kShutdown:
      rd.finish();
      return Shutdown{};
    case RecordType::kKvRequestOptions: {
      KvRequestOptions r;
      r.request_id = rd.get<uint64_t>("request_id");
      const auto mode = rd.get<uint8_t>("mode");
      if (mode > static_cast<uint8_t>(KvMode::kPullRemote)) throw RecordError("unknown KV mode " + std::to_string(mode));
      r.mode = static_cast<KvMode>(mode);
      r.pin_timeout_ms = rd.get<uint32_t>("pin_timeout_ms");
      r.first_token_id = rd.get<int32_t>("first_token_id");
      rd.get_array(r.remote_block_ids, "remote_block_ids");
      rd.get_array(r.peer, "peer");
      rd.finish();
      return r;
    }
    case RecordType::kReleaseKv: {
      ReleaseKv r;
      r.request_id = rd.get<uint64_t>("request_id");
      rd.finish();
      return r;
    }
    default:
      unknown_type(h.type, "request");
  }
}

EngineEvent decode_engine_event(std::span<const uint8_t> bytes) {
  const RecordHeader h = check_header(bytes);
  PayloadReader rd(bytes);
  switch (static_cast<RecordType>(h.type)) {
    case RecordType::kStepEvents: {
      StepEvents r;
      r.step_id = rd.get<uint64_t>("step_id");
      r.emit_time_ns = rd.get<int64_t>("emit_time_ns");
      r.outputs.resize(rd.get_struct_count(kMinRequestOutputBytes, "outputs"));
      for (RequestOutput& o : r.outputs) {
        o.request_id = rd.get<uint64_t>("request_id");
        o.finish_reason = rd.get_finish_reason();
        o.num_prompt_tokens = rd.get<uint32_t>("num_prompt_tokens");
        o.num_cached_tokens = rd.get<uint32_t>("num_cached_tokens");
        o.arrival_time_ns = rd.get<int64_t>("arrival_time_ns");
        o.first_scheduled_time_ns = rd.get<int64_t>("first_scheduled_time_ns");
        o.first_token_time_ns = rd.get<int64_t>("first_token_time_ns");
        rd.get_array(o.new_token_ids, "new_token_ids");
        rd.get_array(o.logprobs, "logprobs");
        o.num_top = rd.get<uint32_t>("num_top");
        rd.get_array(o.top_token_ids, "top_token_ids");
        rd.get_array(o.top_logprobs, "top_logprobs");
        o.num_computed_tokens = rd.get<uint32_t>("num_computed_tokens");
        o.num_scheduled_tokens = rd.get<uint32_t>("num_scheduled_tokens");
        o.num_preemptions = rd.get<uint32_t>("num_preemptions");
        o.num_spec_proposed_tokens = rd.get<uint32_t>("num_spec_proposed_tokens");
        o.num_spec_accepted_tokens = rd.get<uint32_t>("num_spec_accepted_tokens");
        if (o.top_token_ids.size() != uint64_t{o.num_top} * o.new_token_ids.size() ||
            o.top_logprobs.size() != o.top_token_ids.size()) {
          throw RecordError("RequestOutput arrays do not match its new_token_ids and num_top");
        }
      }
      rd.finish();
      return r;
    }
    case RecordType::kEngineStats: {
      EngineStats r;
      r.query_id = rd.get<uint64_t>("query_id");
      r.num_running = rd.get<uint32_t>("num_running");
      r.num_waiting = rd.get<uint32_t>("num_waiting");
      r.num_total_blocks = rd.get<uint32_t>("num_total_blocks");
      r.num_free_blocks = rd.get<uint32_t>("num_free_blocks");
      r.block_size = rd.get<uint32_t>("block_size");
      r.num_steps = rd.get<uint64_t>("num_steps");
      r.num_preemptions = rd.get<uint64_t>("num_preemptions");
      r.num_scheduled_tokens = rd.get<uint32_t>("num_scheduled_tokens");
      r.step_time_ns = rd.get<int64_t>("step_time_ns");
      r.prefix_cache_queries = rd.get<uint64_t>("prefix_cache_queries");
      r.prefix_cache_hits = rd.get<uint64_t>("prefix_cache_hits");
      r.kv_usage = rd.get<float>("kv_usage");
      r.total_prompt_tokens = rd.get<uint64_t>("total_prompt_tokens");
      r.total_generation_tokens = rd.get<uint64_t>("total_generation_tokens");
      r.spec_proposed_tokens = rd.get<uint64_t>("spec_proposed_tokens");
      r.spec_accepted_tokens = rd.get<uint64_t>("spec_accepted_tokens");
      r.spec_verify_rows = rd.get<uint64_t>("spec_verify_rows");
      rd.finish();
      return r;
    }
    case RecordType::kRequestRejected: {
      RequestRejected r;
      r.request_id = rd.get<uint64_t>("request_id");
      r.status_code = rd.get<uint32_t>("status_code");
      r.message = rd.get_string("message");
      rd.finish();
      return r;
    }
    case RecordType::kEngineReady: {
      EngineReady r;
      r.num_total_blocks = rd.get<uint32_t>("num_total_blocks");
      r.block_size = rd.get<uint32_t>("block_size");
      r.max_model_len = rd.get<uint32_t>("max_model_len");
      rd.finish();
      return r;
    }
    case RecordType::kEngineFailed: {
      EngineFailed r;
      r.message = rd.get_string("message");
      rd.finish();
      return r;
    }
    case RecordType::kKvPinned: {
      KvPinned r;
      r.request_id = rd.get<uint64_t>("request_id");
      r.num_tokens = rd.get<uint32_t>("num_tokens");
      r.expires_at_ns = rd.get<int64_t>("expires_at_ns");
      rd.get_array(r.block_ids, "block_ids");
      rd.finish();
      return r;
    }
    default:
      unknown_type(h.type, "event");
  }
}

namespace {

// Decodes a StepPlan payload; with a layout, its arrays are located instead of copied (see StepPlanLayout).
StepPlan decode_step_plan(std::span<const uint8_t> bytes, PayloadReader& rd, StepPlanLayout* layout) {
  auto at = [&](ArrayLocation& location) { return layout != nullptr ? &location : nullptr; };
  StepPlan r;
  r.step_id = rd.get<uint64_t>("step_id");
  r.new_requests.resize(rd.get_struct_count(kMinNewRequestBytes, "new_requests"));
  StepPlanLayout::NewRequest unused_request;
  if (layout != nullptr) layout->new_requests.resize(r.new_requests.size());
  for (size_t i = 0; i < r.new_requests.size(); ++i) {
    NewRequestData& nr = r.new_requests[i];
    StepPlanLayout::NewRequest& where = layout != nullptr ? layout->new_requests[i] : unused_request;
    nr.slot = rd.get<int32_t>("slot");
    nr.num_computed_tokens = rd.get<int32_t>("num_computed_tokens");
    nr.temperature = rd.get<float>("temperature");
    nr.top_p = rd.get<float>("top_p");
    nr.top_k = rd.get<int32_t>("top_k");
    nr.seed = rd.get<uint64_t>("seed");
    nr.has_seed = rd.get_bool("has_seed");
    const uint32_t num_tokens = rd.get_array(nr.token_ids, "token_ids", at(where.token_ids));
    rd.get_array(nr.block_ids, "block_ids", at(where.block_ids));
    nr.num_prompt_tokens = rd.get<int32_t>("num_prompt_tokens");
    nr.min_tokens = rd.get<int32_t>("min_tokens");
    nr.min_p = rd.get<float>("min_p");
    nr.repetition_penalty = rd.get<float>("repetition_penalty");
    nr.frequency_penalty = rd.get<float>("frequency_penalty");
    nr.presence_penalty = rd.get<float>("presence_penalty");
    nr.num_logprobs = rd.get<int32_t>("num_logprobs");
    rd.get_array(nr.suppress_token_ids, "suppress_token_ids", at(where.suppress_token_ids));
    if (nr.num_prompt_tokens < 0 || static_cast<uint32_t>(nr.num_prompt_tokens) > num_tokens) {
      throw RecordError("NewRequestData num_prompt_tokens " + std::to_string(nr.num_prompt_tokens) + " outside its " +
                        std::to_string(num_tokens) + " token_ids");
    }
  }
  r.block_appends.resize(rd.get_struct_count(kMinBlockAppendBytes, "block_appends"));
  if (layout != nullptr) layout->block_appends.resize(r.block_appends.size());
  for (size_t i = 0; i < r.block_appends.size(); ++i) {
    BlockAppend& ba = r.block_appends[i];
    ba.slot = rd.get<int32_t>("slot");
    rd.get_array(ba.block_ids, "block_ids", layout != nullptr ? &layout->block_appends[i] : nullptr);
  }
  StepPlanLayout unused_layout;
  StepPlanLayout& where = layout != nullptr ? *layout : unused_layout;
  const uint32_t n = rd.get_array(r.sched_slots, "sched_slots", at(where.sched_slots));
  const uint32_t n_start = rd.get_array(r.sched_start, "sched_start", at(where.sched_start));
  const uint32_t n_len = rd.get_array(r.sched_len, "sched_len", at(where.sched_len));
  const uint32_t n_sample = rd.get_array(r.sched_sample, "sched_sample", at(where.sched_sample));
  rd.get_array(r.finished_slots, "finished_slots", at(where.finished_slots));
  const uint32_t n_lookahead = rd.get_array(r.sched_lookahead, "sched_lookahead", at(where.sched_lookahead));
  const uint32_t n_trim = rd.get_array(r.trim_slots, "trim_slots", at(where.trim_slots));
  const uint32_t n_trim_blocks = rd.get_array(r.trim_num_blocks, "trim_num_blocks", at(where.trim_num_blocks));
  rd.finish();
  if (n_start != n || n_len != n || n_sample != n) throw RecordError("StepPlan scheduled arrays have different lengths");
  if (n_lookahead != 0 && n_lookahead != n) throw RecordError("StepPlan sched_lookahead is neither empty nor per entry");
  if (n_trim != n_trim_blocks) throw RecordError("StepPlan trim_slots and trim_num_blocks have different lengths");
  const uint8_t* samples = layout != nullptr ? bytes.data() + layout->sched_sample.offset : r.sched_sample.data();
  for (uint32_t i = 0; i < n_sample; ++i) {
    if (samples[i] > 1) throw RecordError("StepPlan sched_sample holds a non-bool");
  }
  return r;
}

WorkerCommand decode_worker_command(std::span<const uint8_t> bytes, StepPlanLayout* layout) {
  const RecordHeader h = check_header(bytes);
  PayloadReader rd(bytes);
  switch (static_cast<RecordType>(h.type)) {
    case RecordType::kStepPlan:
      return decode_step_plan(bytes, rd, layout);
    case RecordType::kWorkerShutdown:
      rd.finish();
      return WorkerShutdown{};
    case RecordType::kKvPull: {
      KvPull r;
      r.slot = rd.get<int32_t>("slot");
      const uint32_t n = rd.get_array(r.remote_block_ids, "remote_block_ids");
      if (rd.get_array(r.local_block_ids, "local_block_ids") != n) {
        throw RecordError("KvPull remote_block_ids and local_block_ids have different lengths");
      }
      rd.get_array(r.peer, "peer");
      rd.finish();
      return r;
    }
    default:
      unknown_type(h.type, "step");
  }
}

}  // namespace

WorkerCommand decode_worker_command(std::span<const uint8_t> bytes) { return decode_worker_command(bytes, nullptr); }

WorkerCommand decode_worker_command(std::span<const uint8_t> bytes, StepPlanLayout& layout) {
  layout = {};
  return decode_worker_command(bytes, &layout);
}

bool decode_step_result_into(std::span<const uint8_t> bytes, StepResult& r) {
  const RecordHeader h = check_header(bytes);
  if (static_cast<RecordType>(h.type) != RecordType::kStepResult) {
    const auto t = static_cast<RecordType>(h.type);
    if (t != RecordType::kWorkerReady && t != RecordType::kWorkerFailed) unknown_type(h.type, "result");
    return false;
  }
  PayloadReader rd(bytes);
  r.step_id = rd.get<uint64_t>("step_id");
  rd.get_array(r.slots, "slots");
  rd.get_array(r.token_ids, "token_ids");
  rd.get_array(r.logprobs, "logprobs");
  r.num_top = rd.get<uint32_t>("num_top");
  rd.get_array(r.top_token_ids, "top_token_ids");
  rd.get_array(r.top_logprobs, "top_logprobs");
  rd.get_array(r.token_counts, "token_counts");
  rd.get_array(r.num_proposed, "num_proposed");
  rd.finish();
  check_step_result_shape(r);
  return true;
}

WorkerResult decode_worker_result(std::span<const uint8_t> bytes) {
  const RecordHeader h = check_header(bytes);
  PayloadReader rd(bytes);
  switch (static_cast<RecordType>(h.type)) {
    case RecordType::kStepResult: {
      StepResult r;
      decode_step_result_into(bytes, r);
      return r;
    }
    case RecordType::kWorkerReady: {
      WorkerReady r;
      r.rank = rd.get<uint32_t>("rank");
      r.num_kv_blocks = rd.get<uint32_t>("num_kv_blocks");
      rd.finish();
      return r;
    }
    case RecordType::kWorkerFailed: {
      WorkerFailed r;
      r.rank = rd.get<uint32_t>("rank");
      r.message = rd.get_string("message");
      rd.finish();
      return r;
    }
    default:
      unknown_type(h.type, "result");
  }
}

size_t encoded_size_bound(const RequestOutput& o) {
  return kMinRequestOutputBytes + o.new_token_ids.size() * sizeof(int32_t) + o.logprobs.size() * sizeof(float) +
         o.top_token_ids.size() * sizeof(int32_t) + o.top_logprobs.size() * sizeof(float);
}

size_t encoded_size_bound(const PackedOutput& o) {
  return kMinRequestOutputBytes + (o.has_token ? 2 * sizeof(int32_t) : 0) + size_t{o.num_top} * 2 * sizeof(int32_t);
}

size_t encoded_size_bound(const NewRequestData& n) {
  return kMinNewRequestBytes + (n.token_ids.size() + n.block_ids.size() + n.suppress_token_ids.size()) * sizeof(int32_t);
}

}  // namespace ringserve
