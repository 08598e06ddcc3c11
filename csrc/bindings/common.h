// Helpers shared by the files of the ringserve._core binding (one file per concern; module.cpp joins them).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#include "ringserve/records.h"

namespace ringserve::bindings {

namespace py = pybind11;

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Float32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

inline py::array_t<bool> to_bool_array(const std::vector<uint8_t>& v) {
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

// A 1-D array of T from anything numpy converts (the setters' input); keeps an array of T as is.
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

inline std::vector<uint8_t> copy_out_bools(const py::array& a) {
  const auto c = py::array_t<bool, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c || c.ndim() != 1) throw py::value_error("expected a 1-D array");
  std::vector<uint8_t> v(static_cast<size_t>(c.size()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = c.data()[i] ? 1 : 0;
  return v;
}

inline py::bytes to_bytes(std::span<const uint8_t> b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

template <Record R>
py::bytes encode_py(const R& r) {
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

inline std::chrono::nanoseconds to_timeout(double seconds) {
  if (!(seconds >= 0)) seconds = 0;     // also maps NaN to 0
  seconds = std::min(seconds, 1e7);      // ~115 days: effectively forever, far from overflow
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

// The Python face of a StepPlan the scheduler built (it owns its numpy arrays); step_plan.cpp.
py::object step_plan_to_python(StepPlan&& plan);

void bind_records(py::module_& m);
void bind_step_plan(py::module_& m);
void bind_rings(py::module_& m);
void bind_engine(py::module_& m);
void bind_benchmarks(py::module_& m);

}  // namespace ringserve::bindings
