#include "ringserve/records.h"

#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>
#include <utility>

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

  template <class E>
    requires std::is_enum_v<E>
  E get_enum(const char* what) {
    const auto v = get<std::underlying_type_t<E>>(what);
    if (v > max_enum_value(E{})) throw RecordError(std::string("unknown ") + what + " " + std::to_string(v));
    return static_cast<E>(v);
  }

  // Copies the next array into `out`, or, in locate mode, appends its location instead and leaves `out` alone.
  // Returns the element count.
  template <class T>
  uint32_t get_array(std::vector<T>& out, const char* what) {
    const auto count = get<uint32_t>(what);
    // Divide instead of multiply so a huge count cannot overflow the comparison.
    if (count > (bytes_.size() - pos_) / sizeof(T)) {
      throw RecordError(std::string("truncated array ") + what + ": " + std::to_string(count) + " elements declared, " +
                        std::to_string(bytes_.size() - pos_) + " bytes left");
    }
    if (located_ != nullptr) {
      located_->push_back({pos_, count});
      counts_.emplace_back(&out, count);
    } else {
      out.resize(count);
      if (count != 0) std::memcpy(out.data(), bytes_.data() + pos_, count * sizeof(T));
    }
    pos_ += count * sizeof(T);
    return count;
  }

  // The next `count` bytes of the payload, already bounds-checked by the get_array that read them.
  const uint8_t* just_read(uint32_t count) const { return bytes_.data() + pos_ - count; }

  // Locate mode (the zero-copy StepPlan): arrays are located into `out`, in read order, instead of copied.
  void locate_into(std::vector<ArrayLocation>* out) { located_ = out; }

  // The length of an array this reader read (its location's count in locate mode, where `v` stays empty).
  template <class T>
  size_t length_of(const std::vector<T>& v) const {
    if (located_ == nullptr) return v.size();
    for (auto it = counts_.rbegin(); it != counts_.rend(); ++it) {
      if (it->first == &v) return it->second;
    }
    return 0;
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
  std::vector<ArrayLocation>* located_ = nullptr;
  std::vector<std::pair<const void*, uint32_t>> counts_;  // locate mode: each located array's count, by address
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

static_assert(sizeof(bool) == 1, "bools travel as one byte");

// ---- what a field list cannot say: how a record's arrays agree --------------------------------------------------
// Each check runs before a record is encoded and after it is decoded. `len(v)` is the length of the array `v`: its
// size, or its located count when a StepPlan is decoded without copying its arrays.

template <class R, class Len>
void check(const R&, const Len&) {}  // most records: their field list says everything

template <class Len>
void check(const RequestOutput& o, const Len& len) {
  if (len(o.top_token_ids) != size_t{o.num_top} * len(o.new_token_ids) || len(o.top_logprobs) != len(o.top_token_ids)) {
    throw RecordError("RequestOutput top_token_ids/top_logprobs must hold num_top entries per new token");
  }
}

template <class Len>
void check(const NewRequestData& n, const Len& len) {
  if (n.num_prompt_tokens < 0 || static_cast<size_t>(n.num_prompt_tokens) > len(n.token_ids)) {
    throw RecordError("NewRequestData num_prompt_tokens " + std::to_string(n.num_prompt_tokens) + " outside its " +
                      std::to_string(len(n.token_ids)) + " token_ids");
  }
}

template <class Len>
void check(const StepPlan& p, const Len& len) {
  const size_t n = len(p.sched_slots);
  if (len(p.sched_start) != n || len(p.sched_len) != n || len(p.sched_sample) != n) {
    throw RecordError("StepPlan sched_slots/sched_start/sched_len/sched_sample must have equal lengths");
  }
  if (len(p.sched_lookahead) != 0 && len(p.sched_lookahead) != n) {
    throw RecordError("StepPlan sched_lookahead must be empty or as long as sched_slots");
  }
  if (len(p.trim_slots) != len(p.trim_num_blocks)) {
    throw RecordError("StepPlan trim_slots and trim_num_blocks must have equal lengths");
  }
}

// Token rows = sum(token_counts) (or one per slot), top arrays per token row. Reads token_counts' values, so a
// StepResult is always decoded with its arrays copied.
template <class Len>
void check(const StepResult& r, const Len&) {
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

template <class Len>
void check(const KvPull& r, const Len& len) {
  if (len(r.remote_block_ids) != len(r.local_block_ids)) {
    throw RecordError("KvPull remote_block_ids and local_block_ids must have equal lengths");
  }
}

// ---- the generic codec: one walk over a record's field list -----------------------------------------------------

constexpr auto kSizeOf = [](const auto& v) { return v.size(); };

template <class R>
void put_fields(PayloadWriter& w, const R& r);

template <FieldStyle S, class T>
void put_value(PayloadWriter& w, const T& v) {
  if constexpr (HasFields<T>) {
    put_fields(w, v);
  } else if constexpr (kIsVector<T>) {
    if constexpr (HasFields<typename T::value_type>) {
      w.put<uint32_t>(PayloadWriter::checked_count(v.size()));
      for (const auto& e : v) put_fields(w, e);
    } else {
      w.put_array(v);
    }
  } else if constexpr (std::is_same_v<T, std::string>) {
    w.put_string(v);
  } else if constexpr (kIsByteArray<T>) {
    w.put_bytes(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    w.put_bool(v);
  } else {
    w.put(v);
  }
}

template <class R>
void put_fields(PayloadWriter& w, const R& r) {
  check(r, kSizeOf);
  for_each_field<R>([&](const auto& f) { put_value<std::decay_t<decltype(f)>::style>(w, r.*f.member); });
}

template <class R>
void get_fields(PayloadReader& rd, R& r);

template <FieldStyle S, class T>
void get_value(PayloadReader& rd, T& v, const char* name) {
  if constexpr (HasFields<T>) {
    get_fields(rd, v);
  } else if constexpr (kIsVector<T>) {
    using E = typename T::value_type;
    if constexpr (HasFields<E>) {
      v.resize(rd.get_struct_count(min_encoded_size<E>(), name));
      for (E& e : v) get_fields(rd, e);
    } else {
      const uint32_t n = rd.get_array(v, name);
      if constexpr (S == FieldStyle::kBoolArray) {
        const uint8_t* b = rd.just_read(n);
        for (uint32_t i = 0; i < n; ++i) {
          if (b[i] > 1) throw RecordError(std::string(name) + " holds a non-bool");
        }
      }
    }
  } else if constexpr (std::is_same_v<T, std::string>) {
    v = rd.get_string(name);
  } else if constexpr (kIsByteArray<T>) {
    rd.get_bytes(v, name);
  } else if constexpr (std::is_same_v<T, bool>) {
    v = rd.get_bool(name);
  } else if constexpr (std::is_enum_v<T>) {
    v = rd.get_enum<T>(name);
  } else {
    v = rd.get<T>(name);
  }
}

template <class R>
void get_fields(PayloadReader& rd, R& r) {
  for_each_field<R>([&](const auto& f) { get_value<std::decay_t<decltype(f)>::style>(rd, r.*f.member, f.name); });
  check(r, [&rd](const auto& v) { return rd.length_of(v); });
}

// The record of `h.type` among the alternatives of Variant (a ring's record types), decoded and checked.
template <class Variant, size_t I = 0>
Variant decode_one_of(const RecordHeader& h, PayloadReader& rd, const char* ring) {
  if constexpr (I == std::variant_size_v<Variant>) {
    unknown_type(h.type, ring);
  } else {
    using R = std::variant_alternative_t<I, Variant>;
    if (h.type != static_cast<uint16_t>(R::kType)) return decode_one_of<Variant, I + 1>(h, rd, ring);
    R r;
    get_fields(rd, r);
    rd.finish();
    return r;
  }
}

template <class Variant>
Variant decode_ring_record(std::span<const uint8_t> bytes, const char* ring,
                           std::vector<ArrayLocation>* located = nullptr) {
  const RecordHeader h = check_header(bytes);
  PayloadReader rd(bytes);
  rd.locate_into(located);
  return decode_one_of<Variant>(h, rd, ring);
}

}  // namespace

template <Record R>
void encode(const R& r, ByteBuffer& out) {
  PayloadWriter w(out, R::kType);
  put_fields(w, r);
  w.finish();
}

template void encode(const AddRequest&, ByteBuffer&);
template void encode(const AbortRequest&, ByteBuffer&);
template void encode(const StatsQuery&, ByteBuffer&);
template void encode(const Shutdown&, ByteBuffer&);
template void encode(const KvRequestOptions&, ByteBuffer&);
template void encode(const ReleaseKv&, ByteBuffer&);
template void encode(const StepEvents&, ByteBuffer&);
template void encode(const EngineStats&, ByteBuffer&);
template void encode(const RequestRejected&, ByteBuffer&);
template void encode(const EngineReady&, ByteBuffer&);
template void encode(const EngineFailed&, ByteBuffer&);
template void encode(const KvPinned&, ByteBuffer&);
template void encode(const StepPlan&, ByteBuffer&);
template void encode(const WorkerShutdown&, ByteBuffer&);
template void encode(const KvPull&, ByteBuffer&);
template void encode(const StepResult&, ByteBuffer&);
template void encode(const WorkerReady&, ByteBuffer&);
template void encode(const WorkerFailed&, ByteBuffer&);

// StepEvents' own fields (step_id, emit_time_ns, outputs), written from a span instead of a StepEvents.
void encode_step_events(uint64_t step_id, int64_t emit_time_ns, std::span<const RequestOutput> outputs, ByteBuffer& out) {
  PayloadWriter w(out, StepEvents::kType);
  w.put(step_id);
  w.put(emit_time_ns);
  w.put<uint32_t>(PayloadWriter::checked_count(outputs.size()));
  for (const RequestOutput& o : outputs) put_fields(w, o);
  w.finish();
}

// The hot path's encoder: each packed output written as the RequestOutput it stands for (RequestOutput::fields()
// order; engine_test checks the bytes against encoding unpack_output), in two appends instead of one per field.
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
    uint8_t fixed[min_encoded_size<RequestOutput>() + 2 * sizeof(int32_t)];
    uint8_t* p = fixed;
    auto put = [&p](const auto& value) {
      std::memcpy(p, &value, sizeof(value));
      p += sizeof(value);
    };
    const uint32_t n = o.has_token ? 1 : 0;
    put(o.request_id);
    put(static_cast<uint8_t>(o.finish_reason));
    put(n);
    if (n != 0) put(o.token_id);
    put(n);
    if (n != 0) put(o.logprob);
    put(uint32_t{o.num_top});
    w.append(fixed, static_cast<size_t>(p - fixed));
    w.put_array(top_token_ids.subspan(top, o.num_top));
    w.put_array(top_logprobs.subspan(top, o.num_top));
    top += o.num_top;
    p = fixed;
    put(o.num_prompt_tokens);
    put(o.num_cached_tokens);
    put(o.num_computed_tokens);
    put(o.num_scheduled_tokens);
    put(uint32_t{o.num_preemptions});
    put(uint32_t{o.num_spec_proposed_tokens});
    put(uint32_t{o.num_spec_accepted_tokens});
    put(o.arrival_time_ns);
    put(o.first_scheduled_time_ns);
    put(o.first_token_time_ns);
    w.append(fixed, static_cast<size_t>(p - fixed));
  }
  w.finish();
}

RequestOutput unpack_output(const PackedOutput& o, std::span<const int32_t> top_token_ids,
                            std::span<const float> top_logprobs) {
  RequestOutput r;
  r.request_id = o.request_id;
  r.finish_reason = o.finish_reason;
  if (o.has_token) {
    r.new_token_ids.push_back(o.token_id);
    r.logprobs.push_back(o.logprob);
    r.num_top = o.num_top;
    r.top_token_ids.assign(top_token_ids.begin(), top_token_ids.end());
    r.top_logprobs.assign(top_logprobs.begin(), top_logprobs.end());
  }
  r.num_prompt_tokens = o.num_prompt_tokens;
  r.num_cached_tokens = o.num_cached_tokens;
  r.num_computed_tokens = o.num_computed_tokens;
  r.num_scheduled_tokens = o.num_scheduled_tokens;
  r.num_preemptions = o.num_preemptions;
  r.num_spec_proposed_tokens = o.num_spec_proposed_tokens;
  r.num_spec_accepted_tokens = o.num_spec_accepted_tokens;
  r.arrival_time_ns = o.arrival_time_ns;
  r.first_scheduled_time_ns = o.first_scheduled_time_ns;
  r.first_token_time_ns = o.first_token_time_ns;
  return r;
}

RequestRecord decode_request_record(std::span<const uint8_t> bytes) {
  return decode_ring_record<RequestRecord>(bytes, "request");
}

EngineEvent decode_engine_event(std::span<const uint8_t> bytes) {
  return decode_ring_record<EngineEvent>(bytes, "event");
}

WorkerCommand decode_worker_command(std::span<const uint8_t> bytes) {
  return decode_ring_record<WorkerCommand>(bytes, "step");
}

WorkerCommand decode_worker_command(std::span<const uint8_t> bytes, StepPlanLayout& layout) {
  layout.arrays.clear();
  const RecordHeader h = check_header(bytes);
  if (static_cast<RecordType>(h.type) != RecordType::kStepPlan) return decode_worker_command(bytes);  // copied
  return decode_ring_record<WorkerCommand>(bytes, "step", &layout.arrays);
}

bool decode_step_result_into(std::span<const uint8_t> bytes, StepResult& r) {
  const RecordHeader h = check_header(bytes);
  if (static_cast<RecordType>(h.type) != RecordType::kStepResult) {
    const auto t = static_cast<RecordType>(h.type);
    if (t != RecordType::kWorkerReady && t != RecordType::kWorkerFailed) unknown_type(h.type, "result");
    return false;
  }
  PayloadReader rd(bytes);
  get_fields(rd, r);
  rd.finish();
  return true;
}

WorkerResult decode_worker_result(std::span<const uint8_t> bytes) {
  return decode_ring_record<WorkerResult>(bytes, "result");
}

size_t encoded_size_bound(const PackedOutput& o) {
  return min_encoded_size<RequestOutput>() + (o.has_token ? 2 * sizeof(int32_t) : 0) +
         size_t{o.num_top} * 2 * sizeof(int32_t);
}

}  // namespace ringserve
