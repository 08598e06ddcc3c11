// Field lists of ring records: each record names its fields once, in wire order, with `static constexpr auto
// fields()`; the codec (records.cpp), the size bounds and the Python binding all walk that one list.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringserve {

// How a field reads in Python where its C++ type alone does not say (a std::vector<uint8_t> is either).
enum class FieldStyle : uint8_t {
  kPlain,
  kBoolArray,  // std::vector<uint8_t> of 0/1: a numpy bool array, validated 0/1 when decoded
  kBytes,      // std::vector<uint8_t> or std::array<uint8_t, N>: Python bytes
};

// What the public API says about a field a client sets (SamplingParams' fields): its name there, the values it
// accepts and what a special value means. The frontend's validation and the layer test read it through the binding
// (_core.SAMPLING_API), so a field's range is written here once. Records no client sets leave it empty.
struct FieldApi {
  const char* name = "";         // the field in protos/ringserve/v1 SamplingParams; "" = the record's own name
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;         // the range is (min, max] instead of [min, max]
  const char* note = "";         // what a special value means, for the error message ("0 = off")
  const char* presence_of = "";  // not set by the client: true when the API field named here is present
};

template <class R, class T, FieldStyle S = FieldStyle::kPlain>
struct Field {
  using Record = R;
  using Type = T;
  static constexpr FieldStyle style = S;
  const char* name;
  T R::*member;
  FieldApi api{};
};

template <class R, class T>
constexpr Field<R, T> field(const char* name, T R::*member, FieldApi api = {}) {
  return {name, member, api};
}

template <class R>
constexpr Field<R, std::vector<uint8_t>, FieldStyle::kBoolArray> bool_array(const char* name,
                                                                           std::vector<uint8_t> R::*member) {
  return {name, member};
}

template <class R, class T>
constexpr Field<R, T, FieldStyle::kBytes> bytes_field(const char* name, T R::*member) {
  return {name, member};
}

template <class R>
concept HasFields = requires { R::fields(); };

// Calls f(field) for every field of R, in wire order.
template <class R, class F>
constexpr void for_each_field(F&& f) {
  std::apply([&](const auto&... each) { (f(each), ...); }, R::fields());
}

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};
template <class T>
inline constexpr bool kIsVector = IsVector<T>::value;

template <class T>
struct IsByteArray : std::false_type {};
template <size_t N>
struct IsByteArray<std::array<uint8_t, N>> : std::true_type {};
template <class T>
inline constexpr bool kIsByteArray = IsByteArray<T>::value;

// Smallest encoding of a T: fixed fields at full size, each array or string as its u32 count alone.
template <class T>
constexpr size_t min_encoded_size() {
  if constexpr (HasFields<T>) {
    size_t n = 0;
    for_each_field<T>([&n](const auto& f) { n += min_encoded_size<typename std::decay_t<decltype(f)>::Type>(); });
    return n;
  } else if constexpr (kIsVector<T> || std::is_same_v<T, std::string>) {
    return sizeof(uint32_t);
  } else if constexpr (kIsByteArray<T>) {
    return std::tuple_size_v<T>;
  } else {
    static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>, "a record field is a number, enum, array or record");
    return sizeof(T);  // bool is one byte on every platform we build for (checked in records.cpp)
  }
}

}  // namespace ringserve
