// ringserve._core records: classes whose attributes come from each record's field list, and their codecs.
#include <optional>

#include <pybind11/operators.h>

#include "bindings/fields.h"

namespace ringserve::bindings {
namespace {

// [rows, cols] row-major copy of a flattened matrix.
template <class T>
py::array_t<T> to_matrix(const std::vector<T>& v, size_t rows, size_t cols) {
  py::array_t<T> a({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(cols)});
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

// Sets a StepResult's top-n arrays from [rows, n] matrices (either one may be left as is).
void set_top(StepResult& r, const std::optional<Int32Array>& ids, const std::optional<Float32Array>& logprobs) {
  auto shape_of = [&](const py::array& a, const char* what) {
    if (a.ndim() != 2 || static_cast<size_t>(a.shape(0)) != r.token_ids.size()) {
      throw py::value_error(std::string(what) + " must be a [len(token_ids), n] array");
    }
    return static_cast<uint32_t>(a.shape(1));
  };
  if (ids) {
    r.num_top = shape_of(*ids, "top_token_ids");
    r.top_token_ids.assign(ids->data(), ids->data() + ids->size());
  }
  if (logprobs) {
    const uint32_t n = shape_of(*logprobs, "top_logprobs");
    if (ids && n != r.num_top) throw py::value_error("top_token_ids and top_logprobs have different widths");
    r.num_top = n;
    r.top_logprobs.assign(logprobs->data(), logprobs->data() + logprobs->size());
  }
}

// A class of record R, constructed empty or from its fields by name, with one attribute per field.
template <class R, ArrayStyle A = ArrayStyle::kList>
py::class_<R> record_class(py::module_& m, const char* name) {
  py::class_<R> cls(m, name);
  cls.def(py::init(&record_from_kwargs<R>));
  def_fields<R, A>(cls);
  return cls;
}

// (name, default) of every SamplingParams field, in declaration order: what the workers' batch and the frontend's
// request mapping iterate, so a new sampling field needs no edit there.
py::tuple sampling_fields() {
  py::list out;
  const SamplingParams defaults;
  for_each_field<SamplingParams>([&](const auto& f) { out.append(py::make_tuple(f.name, defaults.*f.member)); });
  return py::tuple(out);
}

// The public API's face of every SamplingParams field (FieldApi), in declaration order: what the frontend's request
// validation iterates, so a new field's name, range and absent-value default (the struct's) need no edit there.
py::tuple sampling_api() {
  py::list out;
  const SamplingParams defaults;
  for_each_field<SamplingParams>([&](const auto& f) {
    py::dict d;
    d["field"] = f.name;
    d["api"] = *f.api.name != '\0' ? f.api.name : f.name;
    d["default"] = defaults.*f.member;
    d["min"] = f.api.min;
    d["max"] = f.api.max;
    d["min_open"] = f.api.min_open;
    d["note"] = f.api.note;
    d["presence_of"] = f.api.presence_of;
    out.append(d);
  });
  return py::tuple(out);
}

}  // namespace

void bind_records(py::module_& m) {
  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort);
  py::enum_<FailureReason>(m, "FailureReason")
      .value("ENGINE_FAILED", FailureReason::kEngineFailed)
      .value("WORKER_DIED", FailureReason::kWorkerDied)
      .value("STEP_TIMEOUT", FailureReason::kStepTimeout)
      .value("LOAD_FAILED", FailureReason::kLoadFailed)
      .value("ENGINE_DIED", FailureReason::kEngineDied);
  py::enum_<KvMode>(m, "KvMode")
      .value("NONE", KvMode::kNone)
      .value("PREFILL_ONLY", KvMode::kPrefillOnly)
      .value("PULL_REMOTE", KvMode::kPullRemote);

  py::class_<SamplingParams> sampling(m, "SamplingParams");
  sampling.def(py::init(&record_from_kwargs<SamplingParams>));
  def_fields<SamplingParams>(sampling);
  sampling.def(py::self == py::self);
  sampling.def("__copy__", [](const SamplingParams& s) { return s; });
  sampling.def("__deepcopy__", [](const SamplingParams& s, const py::dict&) { return s; }, py::arg("memo"));
  sampling.def("__repr__", [](const py::object& s) {
    std::string out = "SamplingParams(";
    for_each_field<SamplingParams>([&](const auto& f) {
      if (out.back() != '(') out += ", ";
      out += std::string(f.name) + "=" + std::string(py::repr(s.attr(f.name)));
    });
    return out + ")";
  });
  m.attr("SAMPLING_FIELDS") = sampling_fields();
  m.attr("SAMPLING_API") = sampling_api();

  // ---- request ring
  record_class<AddRequest>(m, "AddRequest").def("__repr__", [](const AddRequest& r) {
    return "AddRequest(request_id=" + std::to_string(r.request_id) +
           ", prompt_len=" + std::to_string(r.prompt_token_ids.size()) +
           ", max_tokens=" + std::to_string(r.max_tokens) + ")";
  });
  record_class<AbortRequest>(m, "AbortRequest");
  record_class<StatsQuery>(m, "StatsQuery");
  record_class<Shutdown>(m, "Shutdown");
  record_class<KvRequestOptions>(m, "KvRequestOptions");
  record_class<ReleaseKv>(m, "ReleaseKv");

  // ---- event ring
  record_class<RequestOutput>(m, "RequestOutput").def("__repr__", [](const RequestOutput& o) {
    return "RequestOutput(request_id=" + std::to_string(o.request_id) +
           ", new_tokens=" + std::to_string(o.new_token_ids.size()) +
           ", finish_reason=" + std::to_string(static_cast<int>(o.finish_reason)) + ")";
  });
  record_class<StepEvents>(m, "StepEvents");
  record_class<EngineStats>(m, "EngineStats");
  record_class<RequestRejected>(m, "RequestRejected");
  record_class<EngineReady>(m, "EngineReady");
  record_class<EngineFailed>(m, "EngineFailed");
  record_class<KvPinned>(m, "KvPinned");

  // ---- step ring (StepPlan and what it nests: step_plan.cpp)
  record_class<WorkerShutdown>(m, "WorkerShutdown");
  record_class<KvPull>(m, "KvPull");

  // ---- result ring: StepResult's arrays are numpy copies; its top-n arrays are [tokens, num_top] matrices
  record_class<StepResult, ArrayStyle::kNumpy>(m, "StepResult")
      .def_property(
          "top_token_ids", [](const StepResult& r) { return to_matrix(r.top_token_ids, r.token_ids.size(), r.num_top); },
          [](StepResult& r, const Int32Array& a) { set_top(r, a, std::nullopt); })
      .def_property(
          "top_logprobs", [](const StepResult& r) { return to_matrix(r.top_logprobs, r.token_ids.size(), r.num_top); },
          [](StepResult& r, const Float32Array& a) { set_top(r, std::nullopt, a); });
  record_class<WorkerReady>(m, "WorkerReady");
  record_class<WorkerFailed>(m, "WorkerFailed");

  // Encoders named by the contract.
  m.def("encode_add_request", &encode_py<AddRequest>, py::arg("r"));
  m.def("encode_abort_request", [](uint64_t id) { return encode_py(AbortRequest{id}); }, py::arg("request_id"));
  m.def("encode_stats_query", [](uint64_t id) { return encode_py(StatsQuery{id}); }, py::arg("query_id"));
  m.def("encode_shutdown", [] { return encode_py(Shutdown{}); });
  m.def("encode_kv_request_options", &encode_py<KvRequestOptions>, py::arg("r"));
  m.def("encode_release_kv", [](uint64_t id) { return encode_py(ReleaseKv{id}); }, py::arg("request_id"));
  m.def(
      "encode_step_result",
      [](uint64_t step_id, const Int32Array& slots, const Int32Array& token_ids, const Float32Array& logprobs,
         const std::optional<Int32Array>& top_token_ids, const std::optional<Float32Array>& top_logprobs,
         const std::optional<Int32Array>& token_counts, const std::optional<Int32Array>& num_proposed) {
        StepResult r{step_id, from_array(slots), from_array(token_ids), from_array(logprobs)};
        if (top_token_ids.has_value() != top_logprobs.has_value()) {
          throw py::value_error("top_token_ids and top_logprobs must be given together");
        }
        if (top_token_ids) set_top(r, top_token_ids, top_logprobs);
        if (token_counts) r.token_counts = from_array(*token_counts);
        if (num_proposed) r.num_proposed = from_array(*num_proposed);
        return encode_py(r);
      },
      py::arg("step_id"), py::arg("slots"), py::arg("token_ids"), py::arg("logprobs"),
      py::arg("top_token_ids") = py::none(), py::arg("top_logprobs") = py::none(),
      py::arg("token_counts") = py::none(), py::arg("num_proposed") = py::none());
  m.def(
      "encode_worker_ready", [](uint32_t rank, uint32_t blocks) { return encode_py(WorkerReady{rank, blocks}); },
      py::arg("rank"), py::arg("num_kv_blocks"));
  m.def(
      "encode_worker_failed",
      [](uint32_t rank, const std::string& message) { return encode_py(WorkerFailed{rank, message}); },
      py::arg("rank"), py::arg("message"));

  // Any record object -> bytes (fakes of the engine or workers in tests use these). StepPlan's: step_plan.cpp.
  m.def("encode_record", &encode_py<AddRequest>, py::arg("record"));
  m.def("encode_record", &encode_py<AbortRequest>, py::arg("record"));
  m.def("encode_record", &encode_py<StatsQuery>, py::arg("record"));
  m.def("encode_record", &encode_py<Shutdown>, py::arg("record"));
  m.def("encode_record", &encode_py<KvRequestOptions>, py::arg("record"));
  m.def("encode_record", &encode_py<ReleaseKv>, py::arg("record"));
  m.def("encode_record", &encode_py<StepEvents>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineStats>, py::arg("record"));
  m.def("encode_record", &encode_py<RequestRejected>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineReady>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineFailed>, py::arg("record"));
  m.def("encode_record", &encode_py<KvPinned>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerShutdown>, py::arg("record"));
  m.def("encode_record", &encode_py<KvPull>, py::arg("record"));
  m.def("encode_record", &encode_py<StepResult>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerReady>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerFailed>, py::arg("record"));

  m.def(
      "decode_request_record", [](const py::buffer& b) { return decode_request_record(BytesView(b).span()); },
      py::arg("record"));
  m.def(
      "decode_engine_event", [](const py::buffer& b) { return decode_engine_event(BytesView(b).span()); },
      py::arg("record"));
  m.def(
      "decode_worker_result", [](const py::buffer& b) { return decode_worker_result(BytesView(b).span()); },
      py::arg("record"));
}

}  // namespace ringserve::bindings
