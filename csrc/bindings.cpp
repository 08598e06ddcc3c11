// ringserve._core: the Python face of the native core (see docs/contracts.md for the API).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <system_error>

#include "ringserve/block_pool.h"
#include "ringserve/core_bench.h"
#include "ringserve/engine.h"
#include "ringserve/records.h"
#include "ringserve/ring_notifier.h"
#include "ringserve/shm_ring.h"

namespace py = pybind11;
using namespace ringserve;

namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Float32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

py::array_t<bool> to_bool_array(const std::vector<uint8_t>& v) {
  py::array_t<bool> a(static_cast<py::ssize_t>(v.size()));
  bool* out = a.mutable_data();
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] != 0;
  return a;
}

template <class Array>
auto from_array(const Array& a) {
  using T = typename Array::value_type;
  if (a.ndim() != 1) throw py::value_error("expected a 1-D array");
  return std::vector<T>(a.data(), a.data() + a.size());
}

std::vector<uint8_t> from_bool_array(const BoolArray& a) {
  if (a.ndim() != 1) throw py::value_error("expected a 1-D array");
  std::vector<uint8_t> v(static_cast<size_t>(a.size()));
  for (py::ssize_t i = 0; i < a.size(); ++i) v[static_cast<size_t>(i)] = a.data()[i] ? 1 : 0;
  return v;
}

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
    if (a.ndim() != 2 || static_cast<size_t>(a.shape(0)) != r.slots.size()) {
      throw py::value_error(std::string(what) + " must be a [len(slots), n] array");
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

py::bytes to_bytes(const std::vector<uint8_t>& b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

template <class Record>
py::bytes encode_py(const Record& r) {
  ByteBuffer out;
  encode(r, out);
  return to_bytes(out);
}

// A read-only view of any bytes-like object; keeps the buffer exported (and so alive and unresizable) while used.
struct BytesView {
  py::buffer_info info;
  explicit BytesView(const py::buffer& b) : info(b.request()) {
    if (info.ndim != 1 || info.itemsize != 1 || (info.ndim == 1 && info.strides[0] != 1)) {
      throw py::value_error("expected a contiguous bytes-like object");
    }
  }
  std::span<const uint8_t> span() const {
    return {static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size)};
  }
};

template <size_t N>
py::bytes array_bytes(const std::array<uint8_t, N>& a) {
  return py::bytes(reinterpret_cast<const char*>(a.data()), N);
}

template <size_t N>
void set_array_bytes(std::array<uint8_t, N>& a, const py::bytes& value, const char* field) {
  const std::string s = value;
  if (s.empty()) {
    a.fill(0);
    return;
  }
  if (s.size() != N) throw py::value_error(std::string(field) + " must be " + std::to_string(N) + " bytes (or empty)");
  std::memcpy(a.data(), s.data(), N);
}

std::chrono::nanoseconds to_timeout(double seconds) {
  if (!(seconds >= 0)) seconds = 0;     // also maps NaN to 0
  seconds = std::min(seconds, 1e7);      // ~115 days: effectively forever, far from overflow
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

// The Python wrappers serialize calls: the native reader/writer are single-threaded objects and their blocking
// calls run without the GIL.
struct PyRingWriter {
  RingWriter writer;
  std::mutex mutex;
  explicit PyRingWriter(std::shared_ptr<ShmRing> ring) : writer(std::move(ring)) {}
};

struct PyRingReader {
  RingReader reader;
  std::mutex mutex;
  PyRingReader(std::shared_ptr<ShmRing> ring, uint32_t index) : reader(std::move(ring), index) {}
};

py::object maybe_bytes(bool got, const ByteBuffer& b) { return got ? py::object(to_bytes(b)) : py::none(); }

// While Engine.run() holds no GIL, Python signal handlers only run when someone calls PyErr_CheckSignals.
class InterruptCheckScope {
 public:
  explicit InterruptCheckScope(Engine& engine) : engine_(engine) {
    engine_.set_interrupt_check([this] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) {  // a handler raised (e.g. KeyboardInterrupt): the error stays pending
        interrupted_ = true;
        return true;
      }
      return false;
    });
  }
  ~InterruptCheckScope() { engine_.set_interrupt_check({}); }
  bool interrupted() const { return interrupted_; }

 private:
  Engine& engine_;
  std::atomic<bool> interrupted_{false};
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "RingServe native core: shared-memory rings, ring records, KV block pool, scheduler and engine loop.";

  py::register_exception<RecordError>(m, "RecordError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      // OSError(errno, message) picks the matching subclass (FileNotFoundError, FileExistsError, ...).
      py::object err = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "is", e.code().value(), e.what()));
      if (err) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  m.attr("LAYOUT_VERSION") = kLayoutVersion;
  m.attr("MAX_RING_READERS") = kMaxRingReaders;

  // ---- records --------------------------------------------------------------------------------------------------
  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort);

  py::class_<AddRequest>(m, "AddRequest")
      .def(py::init<>())
      .def_readwrite("request_id", &AddRequest::request_id)
      .def_readwrite("prompt_token_ids", &AddRequest::prompt_token_ids)
      .def_readwrite("max_tokens", &AddRequest::max_tokens)
      .def_readwrite("temperature", &AddRequest::temperature)
      .def_readwrite("top_p", &AddRequest::top_p)
      .def_readwrite("top_k", &AddRequest::top_k)
      .def_readwrite("seed", &AddRequest::seed)
      .def_readwrite("has_seed", &AddRequest::has_seed)
      .def_readwrite("ignore_eos", &AddRequest::ignore_eos)
      .def_readwrite("stop_token_ids", &AddRequest::stop_token_ids)
      .def_readwrite("priority", &AddRequest::priority)
      .def_readwrite("arrival_time_ns", &AddRequest::arrival_time_ns)
      .def_property(
          "trace_id", [](const AddRequest& r) { return array_bytes(r.trace_id); },
          [](AddRequest& r, const py::bytes& v) { set_array_bytes(r.trace_id, v, "trace_id"); })
      .def_property(
          "span_id", [](const AddRequest& r) { return array_bytes(r.span_id); },
          [](AddRequest& r, const py::bytes& v) { set_array_bytes(r.span_id, v, "span_id"); })
      .def_readwrite("trace_flags", &AddRequest::trace_flags)
      .def_readwrite("min_tokens", &AddRequest::min_tokens)
      .def_readwrite("min_p", &AddRequest::min_p)
      .def_readwrite("repetition_penalty", &AddRequest::repetition_penalty)
      .def_readwrite("frequency_penalty", &AddRequest::frequency_penalty)
      .def_readwrite("presence_penalty", &AddRequest::presence_penalty)
      .def_readwrite("num_logprobs", &AddRequest::num_logprobs)
      .def_readwrite("cache_salt", &AddRequest::cache_salt)
      .def("__repr__", [](const AddRequest& r) {
        return "AddRequest(request_id=" + std::to_string(r.request_id) +
               ", prompt_len=" + std::to_string(r.prompt_token_ids.size()) +
               ", max_tokens=" + std::to_string(r.max_tokens) + ")";
      });

  py::class_<AbortRequest>(m, "AbortRequest")
      .def(py::init<>())
      .def_readwrite("request_id", &AbortRequest::request_id);
  py::class_<StatsQuery>(m, "StatsQuery").def(py::init<>()).def_readwrite("query_id", &StatsQuery::query_id);
  py::class_<Shutdown>(m, "Shutdown").def(py::init<>());

  py::class_<RequestOutput>(m, "RequestOutput")
      .def(py::init<>())
      .def_readwrite("request_id", &RequestOutput::request_id)
      .def_readwrite("new_token_ids", &RequestOutput::new_token_ids)
      .def_readwrite("logprobs", &RequestOutput::logprobs)
      .def_readwrite("finish_reason", &RequestOutput::finish_reason)
      .def_readwrite("num_prompt_tokens", &RequestOutput::num_prompt_tokens)
      .def_readwrite("num_cached_tokens", &RequestOutput::num_cached_tokens)
      .def_readwrite("arrival_time_ns", &RequestOutput::arrival_time_ns)
      .def_readwrite("first_scheduled_time_ns", &RequestOutput::first_scheduled_time_ns)
      .def_readwrite("first_token_time_ns", &RequestOutput::first_token_time_ns)
      .def_readwrite("num_top", &RequestOutput::num_top)
      .def_readwrite("top_token_ids", &RequestOutput::top_token_ids)
      .def_readwrite("top_logprobs", &RequestOutput::top_logprobs)
      .def_readwrite("num_computed_tokens", &RequestOutput::num_computed_tokens)
      .def_readwrite("num_scheduled_tokens", &RequestOutput::num_scheduled_tokens)
      .def_readwrite("num_preemptions", &RequestOutput::num_preemptions)
      .def("__repr__", [](const RequestOutput& o) {
        return "RequestOutput(request_id=" + std::to_string(o.request_id) +
               ", new_tokens=" + std::to_string(o.new_token_ids.size()) +
               ", finish_reason=" + std::to_string(static_cast<int>(o.finish_reason)) + ")";
      });

  py::class_<StepEvents>(m, "StepEvents")
      .def(py::init<>())
      .def_readwrite("step_id", &StepEvents::step_id)
      .def_readwrite("emit_time_ns", &StepEvents::emit_time_ns)
      .def_readwrite("outputs", &StepEvents::outputs);

  py::class_<EngineStats>(m, "EngineStats")
      .def(py::init<>())
      .def_readwrite("query_id", &EngineStats::query_id)
      .def_readwrite("num_running", &EngineStats::num_running)
      .def_readwrite("num_waiting", &EngineStats::num_waiting)
      .def_readwrite("num_total_blocks", &EngineStats::num_total_blocks)
      .def_readwrite("num_free_blocks", &EngineStats::num_free_blocks)
      .def_readwrite("block_size", &EngineStats::block_size)
      .def_readwrite("num_steps", &EngineStats::num_steps)
      .def_readwrite("num_preemptions", &EngineStats::num_preemptions)
      .def_readwrite("num_scheduled_tokens", &EngineStats::num_scheduled_tokens)
      .def_readwrite("step_time_ns", &EngineStats::step_time_ns)
      .def_readwrite("prefix_cache_queries", &EngineStats::prefix_cache_queries)
      .def_readwrite("prefix_cache_hits", &EngineStats::prefix_cache_hits)
      .def_readwrite("kv_usage", &EngineStats::kv_usage)
      .def_readwrite("total_prompt_tokens", &EngineStats::total_prompt_tokens)
      .def_readwrite("total_generation_tokens", &EngineStats::total_generation_tokens);

  py::class_<RequestRejected>(m, "RequestRejected")
      .def(py::init<>())
      .def_readwrite("request_id", &RequestRejected::request_id)
      .def_readwrite("status_code", &RequestRejected::status_code)
      .def_readwrite("message", &RequestRejected::message);

  py::class_<EngineReady>(m, "EngineReady")
      .def(py::init<>())
      .def_readwrite("num_total_blocks", &EngineReady::num_total_blocks)
      .def_readwrite("block_size", &EngineReady::block_size)
      .def_readwrite("max_model_len", &EngineReady::max_model_len);

  py::class_<EngineFailed>(m, "EngineFailed").def(py::init<>()).def_readwrite("message", &EngineFailed::message);

  py::class_<NewRequestData>(m, "NewRequestData")
      .def(py::init<>())
      .def_readwrite("slot", &NewRequestData::slot)
      .def_property(
          "token_ids", [](const NewRequestData& n) { return to_array(n.token_ids); },
          [](NewRequestData& n, const Int32Array& a) { n.token_ids = from_array(a); })
      .def_property(
          "block_ids", [](const NewRequestData& n) { return to_array(n.block_ids); },
          [](NewRequestData& n, const Int32Array& a) { n.block_ids = from_array(a); })
      .def_readwrite("num_computed_tokens", &NewRequestData::num_computed_tokens)
      .def_readwrite("temperature", &NewRequestData::temperature)
      .def_readwrite("top_p", &NewRequestData::top_p)
      .def_readwrite("top_k", &NewRequestData::top_k)
      .def_readwrite("seed", &NewRequestData::seed)
      .def_readwrite("has_seed", &NewRequestData::has_seed)
      .def_readwrite("num_prompt_tokens", &NewRequestData::num_prompt_tokens)
      .def_readwrite("min_tokens", &NewRequestData::min_tokens)
      .def_readwrite("min_p", &NewRequestData::min_p)
      .def_readwrite("repetition_penalty", &NewRequestData::repetition_penalty)
      .def_readwrite("frequency_penalty", &NewRequestData::frequency_penalty)
      .def_readwrite("presence_penalty", &NewRequestData::presence_penalty)
      .def_readwrite("num_logprobs", &NewRequestData::num_logprobs)
      .def_property(
          "suppress_token_ids", [](const NewRequestData& n) { return to_array(n.suppress_token_ids); },
          [](NewRequestData& n, const Int32Array& a) { n.suppress_token_ids = from_array(a); });

  py::class_<BlockAppend>(m, "BlockAppend")
      .def(py::init<>())
      .def_readwrite("slot", &BlockAppend::slot)
      .def_property(
          "block_ids", [](const BlockAppend& b) { return to_array(b.block_ids); },
          [](BlockAppend& b, const Int32Array& a) { b.block_ids = from_array(a); });

  py::class_<StepPlan>(m, "StepPlan")
      .def(py::init<>())
      .def_readwrite("step_id", &StepPlan::step_id)
      .def_readwrite("new_requests", &StepPlan::new_requests)
      .def_readwrite("block_appends", &StepPlan::block_appends)
      .def_property(
          "sched_slots", [](const StepPlan& p) { return to_array(p.sched_slots); },
          [](StepPlan& p, const Int32Array& a) { p.sched_slots = from_array(a); })
      .def_property(
          "sched_start", [](const StepPlan& p) { return to_array(p.sched_start); },
          [](StepPlan& p, const Int32Array& a) { p.sched_start = from_array(a); })
      .def_property(
          "sched_len", [](const StepPlan& p) { return to_array(p.sched_len); },
          [](StepPlan& p, const Int32Array& a) { p.sched_len = from_array(a); })
      .def_property(
          "sched_sample", [](const StepPlan& p) { return to_bool_array(p.sched_sample); },
          [](StepPlan& p, const BoolArray& a) { p.sched_sample = from_bool_array(a); })
      .def_property(
          "finished_slots", [](const StepPlan& p) { return to_array(p.finished_slots); },
          [](StepPlan& p, const Int32Array& a) { p.finished_slots = from_array(a); });

  py::class_<WorkerShutdown>(m, "WorkerShutdown").def(py::init<>());

  py::class_<StepResult>(m, "StepResult")
      .def(py::init<>())
      .def_readwrite("step_id", &StepResult::step_id)
      .def_property(
          "slots", [](const StepResult& r) { return to_array(r.slots); },
          [](StepResult& r, const Int32Array& a) { r.slots = from_array(a); })
      .def_property(
          "token_ids", [](const StepResult& r) { return to_array(r.token_ids); },
          [](StepResult& r, const Int32Array& a) { r.token_ids = from_array(a); })
      .def_property(
          "logprobs", [](const StepResult& r) { return to_array(r.logprobs); },
          [](StepResult& r, const Float32Array& a) { r.logprobs = from_array(a); })
      .def_readwrite("num_top", &StepResult::num_top)
      .def_property(
          "top_token_ids", [](const StepResult& r) { return to_matrix(r.top_token_ids, r.slots.size(), r.num_top); },
          [](StepResult& r, const Int32Array& a) { set_top(r, a, std::nullopt); })
      .def_property(
          "top_logprobs", [](const StepResult& r) { return to_matrix(r.top_logprobs, r.slots.size(), r.num_top); },
          [](StepResult& r, const Float32Array& a) { set_top(r, std::nullopt, a); });

  py::class_<WorkerReady>(m, "WorkerReady")
      .def(py::init<>())
      .def_readwrite("rank", &WorkerReady::rank)
      .def_readwrite("num_kv_blocks", &WorkerReady::num_kv_blocks);

  py::class_<WorkerFailed>(m, "WorkerFailed")
      .def(py::init<>())
      .def_readwrite("rank", &WorkerFailed::rank)
      .def_readwrite("message", &WorkerFailed::message);

  // Encoders named by the contract.
  m.def("encode_add_request", &encode_py<AddRequest>, py::arg("r"));
  m.def("encode_abort_request", [](uint64_t id) { return encode_py(AbortRequest{id}); }, py::arg("request_id"));
  m.def("encode_stats_query", [](uint64_t id) { return encode_py(StatsQuery{id}); }, py::arg("query_id"));
  m.def("encode_shutdown", [] { return encode_py(Shutdown{}); });
  m.def(
      "encode_step_result",
      [](uint64_t step_id, const Int32Array& slots, const Int32Array& token_ids, const Float32Array& logprobs,
         const std::optional<Int32Array>& top_token_ids, const std::optional<Float32Array>& top_logprobs) {
        StepResult r{step_id, from_array(slots), from_array(token_ids), from_array(logprobs)};
        if (top_token_ids.has_value() != top_logprobs.has_value()) {
          throw py::value_error("top_token_ids and top_logprobs must be given together");
        }
        if (top_token_ids) set_top(r, top_token_ids, top_logprobs);
        return encode_py(r);
      },
      py::arg("step_id"), py::arg("slots"), py::arg("token_ids"), py::arg("logprobs"),
      py::arg("top_token_ids") = py::none(), py::arg("top_logprobs") = py::none());
  m.def(
      "encode_worker_ready", [](uint32_t rank, uint32_t blocks) { return encode_py(WorkerReady{rank, blocks}); },
      py::arg("rank"), py::arg("num_kv_blocks"));
  m.def(
      "encode_worker_failed",
      [](uint32_t rank, const std::string& message) { return encode_py(WorkerFailed{rank, message}); },
      py::arg("rank"), py::arg("message"));
  // Any record object -> bytes (fakes of the engine or workers in tests use these).
  m.def("encode_record", &encode_py<AddRequest>, py::arg("record"));
  m.def("encode_record", &encode_py<AbortRequest>, py::arg("record"));
  m.def("encode_record", &encode_py<StatsQuery>, py::arg("record"));
  m.def("encode_record", &encode_py<Shutdown>, py::arg("record"));
  m.def("encode_record", &encode_py<StepEvents>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineStats>, py::arg("record"));
  m.def("encode_record", &encode_py<RequestRejected>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineReady>, py::arg("record"));
  m.def("encode_record", &encode_py<EngineFailed>, py::arg("record"));
  m.def("encode_record", &encode_py<StepPlan>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerShutdown>, py::arg("record"));
  m.def("encode_record", &encode_py<StepResult>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerReady>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerFailed>, py::arg("record"));

  m.def(
      "decode_engine_event", [](const py::buffer& b) { return decode_engine_event(BytesView(b).span()); },
      py::arg("record"));
  m.def(
      "decode_worker_command", [](const py::buffer& b) { return decode_worker_command(BytesView(b).span()); },
      py::arg("record"));
  m.def(
      "decode_request_record", [](const py::buffer& b) { return decode_request_record(BytesView(b).span()); },
      py::arg("record"));
  m.def(
      "decode_worker_result", [](const py::buffer& b) { return decode_worker_result(BytesView(b).span()); },
      py::arg("record"));

  // ---- rings ----------------------------------------------------------------------------------------------------
  py::class_<ShmRing, std::shared_ptr<ShmRing>>(m, "ShmRing")
      .def_static("create", &ShmRing::create, py::arg("name"), py::arg("capacity"), py::arg("num_readers") = 1)
      .def_static("attach", &ShmRing::attach, py::arg("name"))
      .def_property_readonly("name", &ShmRing::name)
      .def_property_readonly("capacity", &ShmRing::capacity)
      .def_property_readonly("num_readers", &ShmRing::num_readers)
      .def_property_readonly("max_record_size", &ShmRing::max_record_size)
      .def("unlink", &ShmRing::unlink);

  py::class_<PyRingWriter>(m, "RingWriter")
      .def(py::init<std::shared_ptr<ShmRing>>(), py::arg("ring"))
      .def(
          "try_write",
          [](PyRingWriter& w, const py::buffer& record) {
            const BytesView view(record);
            std::lock_guard lock(w.mutex);
            return w.writer.try_write(view.span());
          },
          py::arg("record"))
      .def(
          "write",
          [](PyRingWriter& w, const py::buffer& record, double timeout_s) {
            const BytesView view(record);  // stays exported while the GIL is released
            py::gil_scoped_release release;
            std::lock_guard lock(w.mutex);
            return w.writer.write(view.span(), to_timeout(timeout_s));
          },
          py::arg("record"), py::arg("timeout_s"));

  py::class_<PyRingReader>(m, "RingReader")
      .def(py::init<std::shared_ptr<ShmRing>, uint32_t>(), py::arg("ring"), py::arg("reader_index") = 0)
      .def("try_read",
           [](PyRingReader& r) {
             ByteBuffer out;
             bool got;
             {
               std::lock_guard lock(r.mutex);
               got = r.reader.try_read(out);
             }
             return maybe_bytes(got, out);
           })
      .def(
          "read",
          [](PyRingReader& r, double timeout_s) {
            ByteBuffer out;
            bool got;
            {
              py::gil_scoped_release release;
              std::lock_guard lock(r.mutex);
              got = r.reader.read(out, to_timeout(timeout_s));
            }
            return maybe_bytes(got, out);
          },
          py::arg("timeout_s"));

  py::class_<RingNotifier>(m, "RingNotifier")
      .def(py::init<std::shared_ptr<ShmRing>, uint32_t>(), py::arg("ring"), py::arg("reader_index") = 0)
      .def("fileno", &RingNotifier::fileno)
      .def("drain",
           [](RingNotifier& n) {
             const auto records = n.drain();
             py::list out(records.size());
             for (size_t i = 0; i < records.size(); ++i) out[i] = to_bytes(records[i]);
             return out;
           })
      .def("close", &RingNotifier::close, py::call_guard<py::gil_scoped_release>());

  m.def("reclaim_stale_segments", &reclaim_stale_segments);

  // ---- engine ---------------------------------------------------------------------------------------------------
  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("block_size", &EngineConfig::block_size)
      .def_readwrite("num_blocks", &EngineConfig::num_blocks)
      .def_readwrite("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &EngineConfig::max_model_len)
      .def_readwrite("eos_token_ids", &EngineConfig::eos_token_ids)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("long_prefill_token_threshold", &EngineConfig::long_prefill_token_threshold)
      .def_readwrite("stats_interval_ms", &EngineConfig::stats_interval_ms);

  // The scheduler on its own, for property tests with a fake worker in Python (not part of the serving path).
  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<EngineConfig>(), py::arg("config"))
      .def(
          "add_request",
          [](Scheduler& s, const AddRequest& r, int64_t now_ns) -> py::object {
            auto rejected = s.add_request(r, now_ns);
            return rejected ? py::cast(*rejected) : py::none();
          },
          py::arg("request"), py::arg("now_ns") = 0)
      .def("abort_request", &Scheduler::abort_request, py::arg("request_id"))
      .def(
          "schedule",
          [](Scheduler& s, int64_t now_ns) -> py::object {
            StepPlan plan;
            return s.schedule(plan, now_ns) ? py::cast(std::move(plan)) : py::none();
          },
          py::arg("now_ns") = 0)
      .def("update", &Scheduler::update, py::arg("result"), py::arg("now_ns") = 0)
      .def("take_outputs",
           [](Scheduler& s) {
             std::vector<RequestOutput> out;
             s.take_outputs(out);
             return out;
           })
      .def("stats", &Scheduler::stats, py::arg("query_id") = 0)
      .def("check_invariants", &Scheduler::check_invariants)
      .def("block_ref_count", [](const Scheduler& s, int32_t id) { return s.block_pool().ref_count(id); },
           py::arg("block_id"))
      .def("block_is_cached", [](const Scheduler& s, int32_t id) { return s.block_pool().is_cached(id); },
           py::arg("block_id"))
      .def_property_readonly("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.block_pool().num_free(); })
      .def_property_readonly("num_cached_blocks", [](const Scheduler& s) { return s.block_pool().num_cached(); })
      .def_property_readonly("num_total_blocks", [](const Scheduler& s) { return s.block_pool().num_blocks(); })
      .def_property_readonly("num_preemptions", &Scheduler::num_preemptions);

  m.def(
      "bench_scheduler_steps",
      [](int32_t num_running, int32_t prompt_len, int32_t block_size, int32_t num_steps, bool prefix_caching) {
        py::gil_scoped_release release;
        return bench_scheduler_steps(num_running, prompt_len, block_size, num_steps, prefix_caching);
      },
      py::arg("num_running"), py::arg("prompt_len") = 128, py::arg("block_size") = 16, py::arg("num_steps") = 1000,
      py::arg("enable_prefix_caching") = true,
      "ns per steady-state decode step (schedule + update with a fake result) at num_running running requests");
  m.def(
      "bench_engine_loop",
      [](int32_t num_running, int32_t prompt_len, int32_t num_steps) {
        EngineLoopTiming t;
        {
          py::gil_scoped_release release;
          t = bench_engine_loop(num_running, prompt_len, num_steps);
        }
        py::dict d;
        d["us_per_step"] = t.us_per_step;
        d["steps"] = t.steps;
        return d;
      },
      py::arg("num_running"), py::arg("prompt_len") = 128, py::arg("num_steps") = 1000,
      "us per step of the whole engine loop (rings, C++ null worker, event drain) at num_running requests");

  py::class_<Engine>(m, "Engine")
      .def(py::init<EngineConfig, const std::string&, const std::string&, const std::string&, const std::string&,
                    std::vector<pid_t>>(),
           py::arg("config"), py::arg("request_ring"), py::arg("event_ring"), py::arg("step_ring"),
           py::arg("result_ring"), py::arg("worker_pids"))
      .def("run",
           [](Engine& e) {
             bool interrupted;
             {
               InterruptCheckScope interrupt_check(e);
               {
                 py::gil_scoped_release release;
                 e.run();
               }
               interrupted = interrupt_check.interrupted();
             }
             if (interrupted && PyErr_Occurred()) throw py::error_already_set();
           })
      .def("stop", &Engine::stop);

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int32_t>(), py::arg("num_blocks"))
      .def(
          "allocate",
          [](BlockPool& p, int32_t n) {
            std::vector<int32_t> ids;
            p.allocate(n, ids);  // all or nothing: [] when fewer than n are free
            return ids;
          },
          py::arg("n"))
      .def("free", [](BlockPool& p, const std::vector<int32_t>& ids) { p.free(ids); }, py::arg("block_ids"))
      .def("lookup", &BlockPool::lookup, py::arg("hash"))
      .def("cache", &BlockPool::cache, py::arg("block_id"), py::arg("hash"))
      .def("acquire_cached", &BlockPool::acquire_cached, py::arg("block_id"))
      .def("is_cached", &BlockPool::is_cached, py::arg("block_id"))
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def("add_ref", &BlockPool::add_ref, py::arg("block_id"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("check_invariants", &BlockPool::check_invariants)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks);
}
