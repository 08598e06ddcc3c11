// StepPlan's Python face. Arrays are numpy arrays. A decoded plan's arrays are read-only views of the record's bytes
// (the array's base keeps them alive), so a worker reads token, block and slot ids without copying; a plan built in
// Python or returned by Scheduler.schedule owns its arrays. StepPlan, NewRequestData and BlockAppend are one
// generic wrapper, PyArrays, walked from their field lists.
#include "bindings/fields.h"

namespace ringserve::bindings {
namespace {

template <class R>
constexpr size_t num_arrays() {
  size_t n = 0;
  for_each_field<R>([&n](const auto& f) { n += kIsVector<typename std::decay_t<decltype(f)>::Type> ? 1 : 0; });
  return n;
}

// A record whose array fields live in Python: a numpy array each, or a list of PyArrays for an array of records.
template <class R>
struct PyArrays {
  R scalars;  // its vectors stay empty
  std::array<py::object, num_arrays<R>()> arrays;

  PyArrays() {
    size_t k = 0;
    for_each_field<R>([&](const auto& f) {
      using F = std::decay_t<decltype(f)>;
      using T = typename F::Type;
      if constexpr (kIsVector<T>) {
        using E = typename T::value_type;
        if constexpr (HasFields<E>) {
          arrays[k++] = py::list();
        } else if constexpr (F::style == FieldStyle::kBoolArray) {
          arrays[k++] = py::array_t<bool>(0);
        } else {
          arrays[k++] = py::array_t<E>(0);
        }
      }
    });
  }
};

template <class R>
R to_native(const PyArrays<R>& p) {
  R r = p.scalars;
  size_t k = 0;
  for_each_field<R>([&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    using T = typename F::Type;
    if constexpr (kIsVector<T>) {
      using E = typename T::value_type;
      const py::object& a = p.arrays[k++];
      if constexpr (HasFields<E>) {
        for (const py::handle item : a) (r.*f.member).push_back(to_native(item.cast<const PyArrays<E>&>()));
      } else if constexpr (F::style == FieldStyle::kBoolArray) {
        r.*f.member = copy_out_bools(a);
      } else {
        r.*f.member = copy_out<E>(a);
      }
    }
  });
  return r;
}

template <class R>
PyArrays<R> to_python(R&& r) {
  PyArrays<R> p;
  size_t k = 0;
  for_each_field<R>([&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    using T = typename F::Type;
    if constexpr (kIsVector<T>) {
      using E = typename T::value_type;
      auto& v = r.*f.member;
      if constexpr (HasFields<E>) {
        py::list items;
        for (E& e : v) items.append(py::cast(to_python(std::move(e))));
        p.arrays[k++] = items;
      } else if constexpr (F::style == FieldStyle::kBoolArray) {
        p.arrays[k++] = to_bool_array(v);
      } else {
        p.arrays[k++] = to_array(v);
      }
      v.clear();
    }
  });
  p.scalars = std::move(r);
  return p;
}

// A read-only numpy view of `location` inside the record `bytes`; `owner` keeps those bytes alive and unchanged.
template <class T>
py::array view_of(const py::object& owner, std::span<const uint8_t> bytes, const ArrayLocation& location) {
  py::array a(py::dtype::of<T>(), {static_cast<py::ssize_t>(location.count)}, {static_cast<py::ssize_t>(sizeof(T))},
              bytes.data() + location.offset, owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

// The decoded record with each array a view of the next location (decode_worker_command's order: field order).
template <class R>
PyArrays<R> viewed(R&& r, const py::object& owner, std::span<const uint8_t> bytes, const StepPlanLayout& layout,
                   size_t& next) {
  PyArrays<R> p;
  size_t k = 0;
  for_each_field<R>([&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    using T = typename F::Type;
    if constexpr (kIsVector<T>) {
      using E = typename T::value_type;
      if constexpr (HasFields<E>) {
        py::list items;
        for (E& e : r.*f.member) items.append(py::cast(viewed(std::move(e), owner, bytes, layout, next)));
        (r.*f.member).clear();  // scalars keeps no vector entries: to_native rebuilds them from the list
        p.arrays[k++] = items;
      } else if constexpr (F::style == FieldStyle::kBoolArray) {
        p.arrays[k++] = view_of<bool>(owner, bytes, layout.arrays.at(next++));  // validated 0/1: valid numpy bools
      } else {
        p.arrays[k++] = view_of<E>(owner, bytes, layout.arrays.at(next++));
      }
    }
  });
  p.scalars = std::move(r);
  return p;
}

// The class of PyArrays<R>: array fields as numpy (or list) attributes, the others as R's own attributes.
template <class R>
void bind_arrays_class(py::module_& m, const char* name) {
  using P = PyArrays<R>;
  py::class_<P> cls(m, name);
  cls.def(py::init(&record_from_kwargs<P>));
  size_t k = 0;
  for_each_field<R>([&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    using T = typename F::Type;
    if constexpr (kIsVector<T>) {
      using E = typename T::value_type;
      const size_t i = k++;
      auto get = [i](const P& p) { return p.arrays[i]; };
      if constexpr (HasFields<E>) {
        cls.def_property(f.name, get, [i](P& p, const py::iterable& items) { p.arrays[i] = py::list(items); });
      } else if constexpr (F::style == FieldStyle::kBoolArray) {
        cls.def_property(f.name, get, [i](P& p, const BoolArray& a) { p.arrays[i] = checked_1d(a); });
      } else {
        cls.def_property(f.name, get, [i](P& p, const py::array_t<E, py::array::c_style | py::array::forcecast>& a) {
          p.arrays[i] = checked_1d(a);
        });
      }
    }
  });
  // The other fields are R's own, reached through `scalars` (a nested record also lends its fields by name).
  for_each_field<R>([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::Type;
    if constexpr (!kIsVector<T>) {
      const auto mp = f.member;
      if constexpr (HasFields<T>) {
        cls.def_property(
            f.name,
            py::cpp_function([mp](P& p) -> T& { return p.scalars.*mp; }, py::return_value_policy::reference_internal),
            py::cpp_function([mp](P& p, const T& v) { p.scalars.*mp = v; }));
        def_fields<T>(cls, [mp](auto& p) -> auto& { return p.scalars.*mp; });
      } else {
        cls.def_property(
            f.name, [mp](const P& p) { return p.scalars.*mp; }, [mp](P& p, const T& v) { p.scalars.*mp = v; });
      }
    }
  });
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
  size_t next = 0;
  return py::cast(viewed(std::move(*decoded), owner, view.span(), layout, next));
}

}  // namespace

py::object step_plan_to_python(StepPlan&& plan) { return py::cast(to_python(std::move(plan))); }

void bind_step_plan(py::module_& m) {
  bind_arrays_class<NewRequestData>(m, "NewRequestData");
  bind_arrays_class<BlockAppend>(m, "BlockAppend");
  bind_arrays_class<StepPlan>(m, "StepPlan");
  m.def("encode_record", [](const PyArrays<StepPlan>& p) { return encode_py(to_native(p)); }, py::arg("record"));
  m.def("decode_worker_command", &decode_worker_command_py, py::arg("record"),
        "StepPlan (arrays: read-only numpy views of `record`), KvPull or WorkerShutdown");
}

}  // namespace ringserve::bindings
