// ringserve._core rings: shared-memory rings, their Python reader/writer wrappers and the ring notifier.
#include <mutex>

#include "bindings/common.h"
#include "ringserve/ring_notifier.h"
#include "ringserve/shm_ring.h"

namespace ringserve::bindings {
namespace {

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

}  // namespace

void bind_rings(py::module_& m) {
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
}

}  // namespace ringserve::bindings
