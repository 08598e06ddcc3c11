// ringserve._core: the Python face of the native core (see docs/contracts.md for the API). One file per concern:
// records.cpp and step_plan.cpp (ring records), rings.cpp, engine.cpp (engine, scheduler, block pool), benchmarks.cpp.
#include <system_error>

#include "bindings/common.h"
#include "ringserve/shm_ring.h"

PYBIND11_MODULE(_core, m) {
  using namespace ringserve;
  using namespace ringserve::bindings;
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
  m.attr("MAX_LOOKAHEAD_SLOTS") = kMaxLookaheadSlots;

  bind_records(m);
  bind_step_plan(m);
  bind_rings(m);
  bind_engine(m);
  bind_benchmarks(m);
}

