// Python attributes of ring records, defined from each record's field list (ringserve/record_fields.h).
#pragma once

#include <string>
#include <string_view>

#include "bindings/common.h"

namespace ringserve::bindings {

// Record strings are bytes on the wire (a sender may have cut a message inside a UTF-8 sequence); decode them
// leniently so a diagnostic never makes its record unreadable in Python.
inline py::str lenient_str(const std::string& s) {
  PyObject* text = PyUnicode_DecodeUTF8(s.data(), static_cast<py::ssize_t>(s.size()), "replace");
  if (text == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(text);
}

template <size_t N>
void set_byte_array(std::array<uint8_t, N>& a, const py::bytes& value, const char* field) {
  const std::string_view s(value);
  if (s.empty()) {
    a.fill(0);
    return;
  }
  if (s.size() != N) throw py::value_error(std::string(field) + " must be " + std::to_string(N) + " bytes (or empty)");
  std::memcpy(a.data(), s.data(), N);
}

// How a record's number arrays read in Python: lists (most records) or numpy copies (StepResult).
enum class ArrayStyle : uint8_t { kList, kNumpy };

// One Python attribute per field of R on `cls` (a class of R, or of a wrapper W reaching R through `of`). A nested
// record is an attribute of its own (by reference) and, with `flatten`, also lends its fields to `cls` by name.
template <class R, ArrayStyle A = ArrayStyle::kList, class Cls, class Of>
void def_fields(Cls& cls, Of of) {
  using W = typename Cls::type;
  for_each_field<R>([&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    using T = typename F::Type;
    const auto m = f.member;
    if constexpr (F::style == FieldStyle::kBytes) {
      cls.def_property(
          f.name, [of, m](const W& w) { const T& v = of(w).*m; return to_bytes({v.data(), v.size()}); },
          [of, m, name = f.name](W& w, const py::bytes& b) {
            if constexpr (kIsVector<T>) {
              const std::string_view s(b);
              (of(w).*m).assign(s.begin(), s.end());
            } else {
              set_byte_array(of(w).*m, b, name);
            }
          });
    } else if constexpr (std::is_same_v<T, std::string>) {
      cls.def_property(
          f.name, [of, m](const W& w) { return lenient_str(of(w).*m); },
          [of, m](W& w, std::string s) { of(w).*m = std::move(s); });
    } else if constexpr (HasFields<T>) {
      cls.def_property(
          f.name, py::cpp_function([of, m](W& w) -> T& { return of(w).*m; }, py::return_value_policy::reference_internal),
          py::cpp_function([of, m](W& w, const T& v) { of(w).*m = v; }));
      def_fields<T, A>(cls, [of, m](auto& w) -> auto& { return of(w).*m; });
    } else if constexpr (kIsVector<T> && A == ArrayStyle::kNumpy) {
      using E = typename T::value_type;
      cls.def_property(
          f.name, [of, m](const W& w) { return to_array(of(w).*m); },
          [of, m](W& w, const py::array_t<E, py::array::c_style | py::array::forcecast>& a) {
            of(w).*m = from_array(a);
          });
    } else {
      cls.def_property(
          f.name, [of, m](const W& w) { return of(w).*m; }, [of, m](W& w, const T& v) { of(w).*m = v; });
    }
  });
}

// The common case: a class of R itself.
template <class R, ArrayStyle A = ArrayStyle::kList, class Cls>
void def_fields(Cls& cls) {
  def_fields<R, A>(cls, [](auto& r) -> auto& { return r; });
}

// W(**fields): a default W with each named attribute set through its property (so each field converts and checks
// its value as an assignment would, and a nested record's flattened names work too); an unknown name is a TypeError.
template <class W>
W record_from_kwargs(const py::kwargs& kwargs) {
  if (kwargs.empty()) return W{};
  py::object record = py::cast(W{});
  const py::object type = py::type::of(record);
  for (const auto& [key, value] : kwargs) {
    const py::object attr = py::getattr(type, key, py::none());
    if (!py::isinstance(attr, py::module_::import("builtins").attr("property"))) {
      throw py::type_error(py::str("{}() got an unknown field {!r}").format(type.attr("__name__"), key));
    }
    record.attr(key) = value;
  }
  return record.cast<W>();
}

}  // namespace ringserve::bindings
