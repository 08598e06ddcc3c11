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
#include "ringserve/ring_bench.h"
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

// Record strings are bytes on the wire (a sender may have cut a message inside a UTF-8 sequence); decode them
// leniently so a diagnostic never makes its record unreadable in Python.
template <class Record>
py::str message_of(const Record& r) {
  PyObject* text = PyUnicode_DecodeUTF8(r.message.data(), static_cast<py::ssize_t>(r.message.size()), "replace");
  if (text == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(text);
}

template <class Record>
void set_message(Record& r, std::string message) {
  r.message = std::move(message);
}

// Locks `mutex` without holding the GIL while waiting for it: another Python thread may hold it across a blocking
// ring call, and waiting with the GIL would stall every thread of the interpreter.
std::unique_lock<std::mutex> lock_without_gil(std::mutex& mutex) {
  std::unique_lock lock(mutex, std::try_to_lock);
  if (!lock.owns_lock()) {
    py::gil_scoped_release release;
    lock.lock();
  }
  return lock;
}

// The next record as bytes, copied once straight out of the ring, or None. Needs the GIL and the reader's mutex.
py::object take_record(RingReader& reader) {
  const auto record = reader.peek();
  if (!record) return py::none();
  py::bytes out(reinterpret_cast<const char*>(record->data()), record->size());
  reader.release();  // only now may the writer reuse those bytes
  return out;
}

// ---- StepPlan's Python face ------------------------------------------------------------------------------------
// Arrays are numpy arrays. A decoded plan's arrays are read-only views of the record's bytes (the array's base keeps
// them alive), so a worker reads token, block and slot ids without copying; a plan built in Python or returned by
// Scheduler.schedule owns its arrays.
struct PyNewRequestData {
  NewRequestData fields;  // the scalars; its vectors stay empty (the arrays below hold the ids)
  py::array token_ids = py::array_t<int32_t>(0);
  py::array block_ids = py::array_t<int32_t>(0);
  py::array suppress_token_ids = py::array_t<int32_t>(0);
};

struct PyBlockAppend {
  int32_t slot = 0;
  py::array block_ids = py::array_t<int32_t>(0);
};

struct PyStepPlan {
  uint64_t step_id = 0;
  py::list new_requests;   // of PyNewRequestData
  py::list block_appends;  // of PyBlockAppend
  py::array sched_slots = py::array_t<int32_t>(0);
  py::array sched_start = py::array_t<int32_t>(0);
  py::array sched_len = py::array_t<int32_t>(0);
  py::array sched_sample = py::array_t<bool>(0);
  py::array finished_slots = py::array_t<int32_t>(0);
  py::array sched_lookahead = py::array_t<int32_t>(0);
  py::array trim_slots = py::array_t<int32_t>(0);
  py::array trim_num_blocks = py::array_t<int32_t>(0);
};

// A 1-D array of T from anything numpy converts (the setters' input); keeps an int32 array as is.
template <class T>
py::array checked_1d(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 1) throw py::value_error("expected a 1-D array");
  return a;
}

// Copies through memcpy: a view of a record may be unaligned for T.
template <class T>
std::vector<T> copy_out(const py::array& a) {
  const auto c = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c || c.ndim() != 1) throw py::value_error("expected a 1-D array");
  std::vector<T> v(static_cast<size_t>(c.size()));
  if (!v.empty()) std::memcpy(v.data(), c.data(), v.size() * sizeof(T));
  return v;
}

std::vector<uint8_t> copy_out_bools(const py::array& a) {
  const auto c = py::array_t<bool, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c || c.ndim() != 1) throw py::value_error("expected a 1-D array");
  std::vector<uint8_t> v(static_cast<size_t>(c.size()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = c.data()[i] ? 1 : 0;
  return v;
}

StepPlan to_native(const PyStepPlan& p) {
  StepPlan plan;
  plan.step_id = p.step_id;
  for (const py::handle item : p.new_requests) {
    const auto& n = item.cast<const PyNewRequestData&>();
    NewRequestData nr = n.fields;
    nr.token_ids = copy_out<int32_t>(n.token_ids);
    nr.block_ids = copy_out<int32_t>(n.block_ids);
    nr.suppress_token_ids = copy_out<int32_t>(n.suppress_token_ids);
    plan.new_requests.push_back(std::move(nr));
  }
  for (const py::handle item : p.block_appends) {
    const auto& b = item.cast<const PyBlockAppend&>();
    plan.block_appends.push_back({b.slot, copy_out<int32_t>(b.block_ids)});
  }
  plan.sched_slots = copy_out<int32_t>(p.sched_slots);
  plan.sched_start = copy_out<int32_t>(p.sched_start);
  plan.sched_len = copy_out<int32_t>(p.sched_len);
  plan.sched_sample = copy_out_bools(p.sched_sample);
  plan.finished_slots = copy_out<int32_t>(p.finished_slots);
  plan.sched_lookahead = copy_out<int32_t>(p.sched_lookahead);
  plan.trim_slots = copy_out<int32_t>(p.trim_slots);
  plan.trim_num_blocks = copy_out<int32_t>(p.trim_num_blocks);
  return plan;
}

py::object to_python(StepPlan&& plan) {
  PyStepPlan p;
  p.step_id = plan.step_id;
  for (NewRequestData& nr : plan.new_requests) {
    PyNewRequestData n;
    n.token_ids = to_array(nr.token_ids);
    n.block_ids = to_array(nr.block_ids);
    n.suppress_token_ids = to_array(nr.suppress_token_ids);
    nr.token_ids.clear();
    nr.block_ids.clear();
    nr.suppress_token_ids.clear();
    n.fields = std::move(nr);
    p.new_requests.append(py::cast(std::move(n)));
  }
  for (const BlockAppend& ba : plan.block_appends) {
    p.block_appends.append(py::cast(PyBlockAppend{ba.slot, to_array(ba.block_ids)}));
  }
  p.sched_slots = to_array(plan.sched_slots);
  p.sched_start = to_array(plan.sched_start);
  p.sched_len = to_array(plan.sched_len);
  p.sched_sample = to_bool_array(plan.sched_sample);
  p.finished_slots = to_array(plan.finished_slots);
  p.sched_lookahead = to_array(plan.sched_lookahead);
  p.trim_slots = to_array(plan.trim_slots);
  p.trim_num_blocks = to_array(plan.trim_num_blocks);
  return py::cast(std::move(p));
}

// A read-only numpy view of `location` inside the record `bytes`; `owner` keeps those bytes alive and unchanged.
template <class T>
py::array view_of(const py::object& owner, std::span<const uint8_t> bytes, const ArrayLocation& location) {
  py::array a(py::dtype::of<T>(), {static_cast<py::ssize_t>(location.count)}, {static_cast<py::ssize_t>(sizeof(T))},
              bytes.data() + location.offset, owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

py::object decode_worker_command_py(const py::buffer& record) {
  const BytesView view(record);
  StepPlanLayout layout;
  WorkerCommand command = decode_worker_command(view.span(), layout);
  auto* decoded = std::get_if<StepPlan>(&command);
  if (decoded == nullptr) {
    if (auto* pull = std::get_if<KvPull>(&command)) return py::cast(std::move(*pull));
    return py::cast(std::get<WorkerShutdown>(command));
  }
  // bytes are immutable; anything else is viewed through a memoryview, whose buffer export keeps a bytearray (say)
  // from being resized under the views.
  const py::object owner = PyBytes_Check(record.ptr()) ? py::object(record) : py::object(py::memoryview(record));
  const auto bytes = view.span();
  PyStepPlan p;
  p.step_id = decoded->step_id;
  for (size_t i = 0; i < decoded->new_requests.size(); ++i) {
    PyNewRequestData n;
    n.fields = std::move(decoded->new_requests[i]);
    n.token_ids = view_of<int32_t>(owner, bytes, layout.new_requests[i].token_ids);
    n.block_ids = view_of<int32_t>(owner, bytes, layout.new_requests[i].block_ids);
    n.suppress_token_ids = view_of<int32_t>(owner, bytes, layout.new_requests[i].suppress_token_ids);
    p.new_requests.append(py::cast(std::move(n)));
  }
  for (size_t i = 0; i < decoded->block_appends.size(); ++i) {
    const py::array block_ids = view_of<int32_t>(owner, bytes, layout.block_appends[i]);
    p.block_appends.append(py::cast(PyBlockAppend{decoded->block_appends[i].slot, block_ids}));
  }
  p.sched_slots = view_of<int32_t>(owner, bytes, layout.sched_slots);
  p.sched_start = view_of<int32_t>(owner, bytes, layout.sched_start);
  p.sched_len = view_of<int32_t>(owner, bytes, layout.sched_len);
  p.sched_sample = view_of<bool>(owner, bytes, layout.sched_sample);  // validated 0/1 bytes: valid numpy bools
  p.finished_slots = view_of<int32_t>(owner, bytes, layout.finished_slots);
  p.sched_lookahead = view_of<int32_t>(owner, bytes, layout.sched_lookahead);
  p.trim_slots = view_of<int32_t>(owner, bytes, layout.trim_slots);
  p.trim_num_blocks = view_of<int32_t>(owner, bytes, layout.trim_num_blocks);
  return py::cast(std::move(p));
}

// A NewRequestData scalar as a read/write Python attribute.
template <auto Member>
void def_new_request_field(py::class_<PyNewRequestData>& cls, const char* name) {
  using T = std::remove_cvref_t<decltype(std::declval<NewRequestData&>().*Member)>;
  cls.def_property(
      name, [](const PyNewRequestData& n) { return n.fields.*Member; },
      [](PyNewRequestData& n, T value) { n.fields.*Member = value; });
}

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
      .def_readwrite("num_spec_proposed_tokens", &RequestOutput::num_spec_proposed_tokens)
      .def_readwrite("num_spec_accepted_tokens", &RequestOutput::num_spec_accepted_tokens)
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
      .def_readwrite("total_generation_tokens", &EngineStats::total_generation_tokens)
      .def_readwrite("spec_proposed_tokens", &EngineStats::spec_proposed_tokens)
      .def_readwrite("spec_accepted_tokens", &EngineStats::spec_accepted_tokens)
      .def_readwrite("spec_verify_rows", &EngineStats::spec_verify_rows);

  py::class_<RequestRejected>(m, "RequestRejected")
      .def(py::init<>())
      .def_readwrite("request_id", &RequestRejected::request_id)
      .def_readwrite("status_code", &RequestRejected::status_code)
      .def_property("message", &message_of<RequestRejected>, &set_message<RequestRejected>);

  py::class_<EngineReady>(m, "EngineReady")
      .def(py::init<>())
      .def_readwrite("num_total_blocks", &EngineReady::num_total_blocks)
      .def_readwrite("block_size", &EngineReady::block_size)
      .def_readwrite("max_model_len", &EngineReady::max_model_len);

  py::class_<EngineFailed>(m, "EngineFailed")
      .def(py::init<>())
      .def_property("message", &message_of<EngineFailed>, &set_message<EngineFailed>);

  py::class_<PyNewRequestData> new_request(m, "NewRequestData");
  new_request.def(py::init<>());
  def_new_request_field<&NewRequestData::slot>(new_request, "slot");
  def_new_request_field<&NewRequestData::num_computed_tokens>(new_request, "num_computed_tokens");
  def_new_request_field<&NewRequestData::temperature>(new_request, "temperature");
  def_new_request_field<&NewRequestData::top_p>(new_request, "top_p");
  def_new_request_field<&NewRequestData::top_k>(new_request, "top_k");
  def_new_request_field<&NewRequestData::seed>(new_request, "seed");
  def_new_request_field<&NewRequestData::has_seed>(new_request, "has_seed");
  def_new_request_field<&NewRequestData::num_prompt_tokens>(new_request, "num_prompt_tokens");
  def_new_request_field<&NewRequestData::min_tokens>(new_request, "min_tokens");
  def_new_request_field<&NewRequestData::min_p>(new_request, "min_p");
  def_new_request_field<&NewRequestData::repetition_penalty>(new_request, "repetition_penalty");
  def_new_request_field<&NewRequestData::frequency_penalty>(new_request, "frequency_penalty");
  def_new_request_field<&NewRequestData::presence_penalty>(new_request, "presence_penalty");
  def_new_request_field<&NewRequestData::num_logprobs>(new_request, "num_logprobs");
  new_request
      .def_property(
          "token_ids", [](const PyNewRequestData& n) { return n.token_ids; },
          [](PyNewRequestData& n, const Int32Array& a) { n.token_ids = checked_1d(a); })
      .def_property(
          "block_ids", [](const PyNewRequestData& n) { return n.block_ids; },
          [](PyNewRequestData& n, const Int32Array& a) { n.block_ids = checked_1d(a); })
      .def_property(
          "suppress_token_ids", [](const PyNewRequestData& n) { return n.suppress_token_ids; },
          [](PyNewRequestData& n, const Int32Array& a) { n.suppress_token_ids = checked_1d(a); });

  py::class_<PyBlockAppend>(m, "BlockAppend")
      .def(py::init<>())
      .def_readwrite("slot", &PyBlockAppend::slot)
      .def_property(
          "block_ids", [](const PyBlockAppend& b) { return b.block_ids; },
          [](PyBlockAppend& b, const Int32Array& a) { b.block_ids = checked_1d(a); });

  py::class_<PyStepPlan>(m, "StepPlan")
      .def(py::init<>())
      .def_readwrite("step_id", &PyStepPlan::step_id)
      .def_property(
          "new_requests", [](const PyStepPlan& p) { return p.new_requests; },
          [](PyStepPlan& p, const py::iterable& items) { p.new_requests = py::list(items); })
      .def_property(
          "block_appends", [](const PyStepPlan& p) { return p.block_appends; },
          [](PyStepPlan& p, const py::iterable& items) { p.block_appends = py::list(items); })
      .def_property(
          "sched_slots", [](const PyStepPlan& p) { return p.sched_slots; },
          [](PyStepPlan& p, const Int32Array& a) { p.sched_slots = checked_1d(a); })
      .def_property(
          "sched_start", [](const PyStepPlan& p) { return p.sched_start; },
          [](PyStepPlan& p, const Int32Array& a) { p.sched_start = checked_1d(a); })
      .def_property(
          "sched_len", [](const PyStepPlan& p) { return p.sched_len; },
          [](PyStepPlan& p, const Int32Array& a) { p.sched_len = checked_1d(a); })
      .def_property(
          "sched_sample", [](const PyStepPlan& p) { return p.sched_sample; },
          [](PyStepPlan& p, const BoolArray& a) { p.sched_sample = checked_1d(a); })
      .def_property(
          "finished_slots", [](const PyStepPlan& p) { return p.finished_slots; },
          [](PyStepPlan& p, const Int32Array& a) { p.finished_slots = checked_1d(a); })
      .def_property(
          "sched_lookahead", [](const PyStepPlan& p) { return p.sched_lookahead; },
          [](PyStepPlan& p, const Int32Array& a) { p.sched_lookahead = checked_1d(a); })
      .def_property(
          "trim_slots", [](const PyStepPlan& p) { return p.trim_slots; },
          [](PyStepPlan& p, const Int32Array& a) { p.trim_slots = checked_1d(a); })
      .def_property(
          "trim_num_blocks", [](const PyStepPlan& p) { return p.trim_num_blocks; },
          [](PyStepPlan& p, const Int32Array& a) { p.trim_num_blocks = checked_1d(a); });

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
          "top_token_ids", [](const StepResult& r) { return to_matrix(r.top_token_ids, r.token_ids.size(), r.num_top); },
          [](StepResult& r, const Int32Array& a) { set_top(r, a, std::nullopt); })
      .def_property(
          "top_logprobs", [](const StepResult& r) { return to_matrix(r.top_logprobs, r.token_ids.size(), r.num_top); },
          [](StepResult& r, const Float32Array& a) { set_top(r, std::nullopt, a); })
      .def_property(
          "token_counts", [](const StepResult& r) { return to_array(r.token_counts); },
          [](StepResult& r, const Int32Array& a) { r.token_counts = from_array(a); })
      .def_property(
          "num_proposed", [](const StepResult& r) { return to_array(r.num_proposed); },
          [](StepResult& r, const Int32Array& a) { r.num_proposed = from_array(a); });

  py::class_<WorkerReady>(m, "WorkerReady")
      .def(py::init<>())
      .def_readwrite("rank", &WorkerReady::rank)
      .def_readwrite("num_kv_blocks", &WorkerReady::num_kv_blocks);

  py::class_<WorkerFailed>(m, "WorkerFailed")
      .def(py::init<>())
      .def_readwrite("rank", &WorkerFailed::rank)
      .def_property("message", &message_of<WorkerFailed>, &set_message<WorkerFailed>);

  // ---- disaggregated prefill/decode (issue #8) -------------------------------------------------------------------
  py::enum_<KvMode>(m, "KvMode")
      .value("NONE", KvMode::kNone)
      .value("PREFILL_ONLY", KvMode::kPrefillOnly)
      .value("PULL_REMOTE", KvMode::kPullRemote);
  auto bytes_of = [](const std::vector<uint8_t>& v) {
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
  };
  auto to_vector = [](const py::bytes& b) {
    const std::string_view s(b);
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  py::class_<KvRequestOptions>(m, "KvRequestOptions")
      .def(py::init<>())
      .def_readwrite("request_id", &KvRequestOptions::request_id)
      .def_readwrite("mode", &KvRequestOptions::mode)
      .def_readwrite("pin_timeout_ms", &KvRequestOptions::pin_timeout_ms)
      .def_readwrite("first_token_id", &KvRequestOptions::first_token_id)
      .def_readwrite("remote_block_ids", &KvRequestOptions::remote_block_ids)
      .def_property(
          "peer", [bytes_of](const KvRequestOptions& r) { return bytes_of(r.peer); },
          [to_vector](KvRequestOptions& r, const py::bytes& b) { r.peer = to_vector(b); });
  py::class_<ReleaseKv>(m, "ReleaseKv").def(py::init<>()).def_readwrite("request_id", &ReleaseKv::request_id);
  py::class_<KvPinned>(m, "KvPinned")
      .def(py::init<>())
      .def_readwrite("request_id", &KvPinned::request_id)
      .def_readwrite("num_tokens", &KvPinned::num_tokens)
      .def_readwrite("expires_at_ns", &KvPinned::expires_at_ns)
      .def_readwrite("block_ids", &KvPinned::block_ids);
  py::class_<KvPull>(m, "KvPull")
      .def(py::init<>())
      .def_readwrite("slot", &KvPull::slot)
      .def_readwrite("remote_block_ids", &KvPull::remote_block_ids)
      .def_readwrite("local_block_ids", &KvPull::local_block_ids)
      .def_property(
          "peer", [bytes_of](const KvPull& r) { return bytes_of(r.peer); },
          [to_vector](KvPull& r, const py::bytes& b) { r.peer = to_vector(b); });
  m.def("encode_kv_request_options", &encode_py<KvRequestOptions>, py::arg("r"));
  m.def("encode_release_kv", [](uint64_t id) { return encode_py(ReleaseKv{id}); }, py::arg("request_id"));
  m.def("encode_record", &encode_py<KvRequestOptions>, py::arg("record"));
  m.def("encode_record", &encode_py<ReleaseKv>, py::arg("record"));
  m.def("encode_record", &encode_py<KvPinned>, py::arg("record"));
  m.def("encode_record", &encode_py<KvPull>, py::arg("record"));

  // Encoders named by the contract.
  m.def("encode_add_request", &encode_py<AddRequest>, py::arg("r"));
  m.def("encode_abort_request", [](uint64_t id) { return encode_py(AbortRequest{id}); }, py::arg("request_id"));
  m.def("encode_stats_query", [](uint64_t id) { return encode_py(StatsQuery{id}); }, py::arg("query_id"));
  m.def("encode_shutdown", [] { return encode_py(Shutdown{}); });
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
  m.def("encode_record", [](const PyStepPlan& p) { return encode_py(to_native(p)); }, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerShutdown>, py::arg("record"));
  m.def("encode_record", &encode_py<StepResult>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerReady>, py::arg("record"));
  m.def("encode_record", &encode_py<WorkerFailed>, py::arg("record"));

  m.def(
      "decode_engine_event", [](const py::buffer& b) { return decode_engine_event(BytesView(b).span()); },
      py::arg("record"));
  m.def("decode_worker_command", &decode_worker_command_py, py::arg("record"),
        "StepPlan (arrays: read-only numpy views of `record`) or WorkerShutdown");
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

  // Fast paths run with the GIL held (a memcpy); only waiting releases it.
  py::class_<PyRingWriter>(m, "RingWriter")
      .def(py::init<std::shared_ptr<ShmRing>>(), py::arg("ring"))
      .def(
          "try_write",
          [](PyRingWriter& w, const py::buffer& record) {
            const BytesView view(record);
            const auto lock = lock_without_gil(w.mutex);
            return w.writer.try_write(view.span());
          },
          py::arg("record"))
      .def(
          "write",
          [](PyRingWriter& w, const py::buffer& record, double timeout_s) {
            const BytesView view(record);  // stays exported while the GIL is released
            const auto lock = lock_without_gil(w.mutex);
            if (w.writer.try_write(view.span())) return true;
            py::gil_scoped_release release;
            return w.writer.write(view.span(), to_timeout(timeout_s));
          },
          py::arg("record"), py::arg("timeout_s"));

  py::class_<PyRingReader>(m, "RingReader")
      .def(py::init<std::shared_ptr<ShmRing>, uint32_t>(), py::arg("ring"), py::arg("reader_index") = 0)
      .def("try_read",
           [](PyRingReader& r) {
             const auto lock = lock_without_gil(r.mutex);
             return take_record(r.reader);
           })
      .def(
          "read",
          [](PyRingReader& r, double timeout_s) {
            const auto deadline = std::chrono::steady_clock::now() + to_timeout(timeout_s);
            const auto lock = lock_without_gil(r.mutex);
            while (true) {
              py::object record = take_record(r.reader);
              if (!record.is_none()) return record;
              const auto left = deadline - std::chrono::steady_clock::now();
              if (left <= std::chrono::nanoseconds::zero()) return record;
              bool ready;
              {
                py::gil_scoped_release release;
                ready = r.reader.wait(left);
              }
              if (!ready) return record;  // None
            }
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

  // Native halves of benchmarks/ring.py (GIL released: they spin and sleep on the rings).
  m.def(
      "bench_ring_ping",
      [](const std::shared_ptr<ShmRing>& out, const std::shared_ptr<ShmRing>& in, size_t record_size, uint64_t count,
         double timeout_s) {
        std::vector<int64_t> rtt;
        {
          py::gil_scoped_release release;
          rtt = bench_ring_ping(out, in, record_size, count, to_timeout(timeout_s));
        }
        return to_array(rtt);
      },
      py::arg("out_ring"), py::arg("in_ring"), py::arg("record_size"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "round trips (ns, np.int64) of `count` records sent on out_ring and echoed back on in_ring");
  m.def(
      "bench_ring_echo",
      [](const std::shared_ptr<ShmRing>& in, const std::shared_ptr<ShmRing>& out, uint64_t count, double timeout_s) {
        py::gil_scoped_release release;
        return bench_ring_echo(in, out, count, to_timeout(timeout_s));
      },
      py::arg("in_ring"), py::arg("out_ring"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "echoes `count` records from in_ring back on out_ring");
  m.def(
      "bench_ring_produce",
      [](const std::shared_ptr<ShmRing>& ring, size_t record_size, uint64_t count, double timeout_s) {
        py::gil_scoped_release release;
        return bench_ring_produce(ring, record_size, count, to_timeout(timeout_s));
      },
      py::arg("ring"), py::arg("record_size"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "writes `count` sequence-numbered records; returns the elapsed ns");
  m.def(
      "bench_ring_consume",
      [](const std::shared_ptr<ShmRing>& ring, uint64_t count, double timeout_s) {
        RingThroughput t;
        {
          py::gil_scoped_release release;
          t = bench_ring_consume(ring, count, to_timeout(timeout_s));
        }
        py::dict d;
        d["records"] = t.records;
        d["bytes"] = t.bytes;
        d["elapsed_ns"] = t.elapsed_ns;
        return d;
      },
      py::arg("ring"), py::arg("count"), py::arg("timeout_s") = 10.0,
      "reads and sequence-checks `count` records; elapsed_ns runs from the first record to the last");

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
      .def_readwrite("stats_interval_ms", &EngineConfig::stats_interval_ms)
      .def_readwrite("priority_aging_ms", &EngineConfig::priority_aging_ms)
      .def_readwrite("num_speculative_tokens", &EngineConfig::num_speculative_tokens)
      .def_readwrite("spec_max_batch", &EngineConfig::spec_max_batch)
      .def_readwrite("spec_min_acceptance", &EngineConfig::spec_min_acceptance)
      .def_readwrite("spec_backoff_steps", &EngineConfig::spec_backoff_steps)
      .def_readwrite("max_step_slowdown", &EngineConfig::max_step_slowdown);

  // The scheduler on its own, for property tests with a fake worker in Python (not part of the serving path).
  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<EngineConfig>(), py::arg("config"))
      .def(
          "add_request",
          [](Scheduler& s, const AddRequest& r, int64_t now_ns, const std::optional<KvRequestOptions>& kv) -> py::object {
            auto rejected = s.add_request(r, now_ns, kv ? &*kv : nullptr);
            return rejected ? py::cast(*rejected) : py::none();
          },
          py::arg("request"), py::arg("now_ns") = 0, py::arg("kv") = py::none())
      .def("release_pinned", &Scheduler::release_pinned, py::arg("request_id"))
      .def("expire_pinned", &Scheduler::expire_pinned, py::arg("now_ns"))
      .def_property_readonly("num_pinned_requests", &Scheduler::num_pinned_requests)
      .def("take_kv_pulls",
           [](Scheduler& s) { return std::vector<KvPull>(s.kv_pulls().begin(), s.kv_pulls().end()); })
      .def("take_kv_pins",
           [](Scheduler& s) {
             std::vector<KvPinned> pins(s.kv_pins().begin(), s.kv_pins().end());
             s.clear_kv_pins();
             return pins;
           })
      .def("abort_request", &Scheduler::abort_request, py::arg("request_id"))
      .def(
          "schedule",
          [](Scheduler& s, int64_t now_ns) -> py::object {
            StepPlan plan;
            return s.schedule(plan, now_ns) ? to_python(std::move(plan)) : py::none();
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
      .def("observe_step_time", &Scheduler::observe_step_time, py::arg("ns"))
      .def_property_readonly("prefill_time_budget", &Scheduler::prefill_time_budget)
      .def_property_readonly("step_cost",
                             [](const Scheduler& s) -> py::object {
                               const StepCostModel& m = s.step_cost();
                               if (!m.fitted()) return py::none();
                               return py::make_tuple(m.base_ns(), m.per_token_ns(), m.per_pair_ns(),
                                                     m.per_context_ns(), m.per_decode_ns(), m.base_decode_rows());
                             })
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
