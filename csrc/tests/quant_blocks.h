// Random GGUF-style weight blocks of every QuantType for the quantized-product tests, with their values, and the
// inputs' float32 / bf16 conversion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/cpu_quant.h"

namespace ringserve::testing {

using kernels::QuantType;

inline constexpr QuantType kTypes[] = {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ4_1F,
                                       QuantType::kQ8_2F};

// A float16 scale of either sign between 2^-9 and 2^-3.
inline uint16_t random_half(std::mt19937& gen) {
  std::uniform_int_distribution<int> exponent(6, 12);
  std::uniform_int_distribution<int> mantissa(0, 1023);
  std::uniform_int_distribution<int> sign(0, 1);
  return static_cast<uint16_t>((sign(gen) << 15) | (exponent(gen) << 10) | mantissa(gen));
}

inline void put(std::vector<uint8_t>& out, const void* p, std::size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + bytes);
}

// One random block of `type`, appended to `bytes`, and its 32 values appended to `values`.
inline void random_block(QuantType type, std::mt19937& gen, std::vector<uint8_t>& bytes, std::vector<double>& values) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> int8(-127, 127);
  std::uniform_real_distribution<float> real(-0.1F, 0.1F);
  if (type == QuantType::kQ8_0 || type == QuantType::kQ8_2F) {
    double d[2];
    if (type == QuantType::kQ8_0) {
      const uint16_t h = random_half(gen);
      put(bytes, &h, 2);
      d[0] = d[1] = kernels::half_to_float(h);
    } else {
      const float f[2] = {real(gen), real(gen)};
      put(bytes, f, 8);
      d[0] = f[0];
      d[1] = f[1];
    }
    for (int p = 0; p < 32; ++p) {
      const auto q = static_cast<int8_t>(int8(gen));
      put(bytes, &q, 1);
      values.push_back(d[p / 16] * q);
    }
    return;
  }
  double d = 0.0;
  double m = 0.0;
  if (type == QuantType::kQ4_0) {
    const uint16_t h = random_half(gen);
    put(bytes, &h, 2);
    d = kernels::half_to_float(h);
    m = -8.0 * d;
  } else if (type == QuantType::kQ4_1) {
    const uint16_t h[2] = {random_half(gen), random_half(gen)};
    put(bytes, h, 4);
    d = kernels::half_to_float(h[0]);
    m = kernels::half_to_float(h[1]);
  } else {
    const float f[2] = {real(gen), real(gen)};
    put(bytes, f, 8);
    d = f[0];
    m = f[1];
  }
  uint8_t qs[16];
  for (auto& q : qs) q = static_cast<uint8_t>(byte(gen));
  put(bytes, qs, 16);
  for (int p = 0; p < 32; ++p) values.push_back(d * (p < 16 ? qs[p] & 0x0F : qs[p - 16] >> 4) + m);
}

// v as a float32 or bf16 input.
template <class T>
T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return kernels::float_to_bf16(v);
  }
}

}  // namespace ringserve::testing
