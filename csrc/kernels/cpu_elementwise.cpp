#include "kernels/cpu_elementwise.h"

#include "kernels/parallel.h"
#include "kernels/simd_avx2.h"
#include "kernels/simd_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace ringserve::kernels {

namespace {

// One token's heads, which share its cos / sin row, 16 pairs at a time with the scalar loop's roundings (each product
// rounded before the sum, so nothing can be fused into an FMA). The row is rounded to the storage type once per
// group of up to four vectors (a whole head_dim 128), kept in registers, and applied to every head.
template <class T>
__attribute__((target("avx512f"))) void rope_token_avx512(T* x, std::size_t heads, std::size_t head_dim,
                                                          const float* c, const float* sn) {
  constexpr std::size_t kGroup = 4;
  const std::size_t half = head_dim / 2, vectors = half / 16;
  __m512 c1[kGroup], c2[kGroup], s1[kGroup], s2[kGroup];
  for (std::size_t v0 = 0; v0 < vectors; v0 += kGroup) {
    const std::size_t count = std::min(kGroup, vectors - v0);
    for (std::size_t v = 0; v < count; ++v) {
      const std::size_t i = (v0 + v) * 16;
      c1[v] = round16(_mm512_loadu_ps(c + i), T{});
      c2[v] = round16(_mm512_loadu_ps(c + i + half), T{});
      s1[v] = round16(_mm512_loadu_ps(sn + i), T{});
      s2[v] = round16(_mm512_loadu_ps(sn + i + half), T{});
    }
    for (std::size_t h = 0; h < heads; ++h) {
      T* head = x + h * head_dim;
      for (std::size_t v = 0; v < count; ++v) {
        const std::size_t i = (v0 + v) * 16;
        const __m512 x1 = load16(head + i);
        const __m512 x2 = load16(head + i + half);
        const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        store16(head + i,
                _mm512_add_ps(round16(_mm512_mul_ps(x1, c1[v]), T{}), round16(_mm512_mul_ps(neg_x2, s1[v]), T{})));
        store16(head + i + half,
                _mm512_add_ps(round16(_mm512_mul_ps(x2, c2[v]), T{}), round16(_mm512_mul_ps(x1, s2[v]), T{})));
      }
    }
  }
}

template <class T>
void rope(const RopeShape& s, std::span<T> x, std::span<const int64_t> positions, std::span<const float> cos,
          std::span<const float> sin, int threads) {
  constexpr const char* op = "rope";
  require(s.head_dim > 0 && s.head_dim % 2 == 0, op, "head_dim must be even and positive");
  require(s.row_stride >= s.heads * s.head_dim, op, "row_stride is shorter than a row");
  require(positions.size() == s.rows, op, "one position per row expected");
  require(cos.size() == s.max_position * s.head_dim && sin.size() == cos.size(), op, "cos / sin tables size");
  if (s.rows == 0 || s.heads == 0) return;
  require(x.size() >= (s.rows - 1) * s.row_stride + s.heads * s.head_dim, op, "x is smaller than its rows");
  for (const int64_t p : positions) {
    require(p >= 0 && static_cast<uint64_t>(p) < s.max_position, op,
          "position " + std::to_string(p) + " outside [0, " + std::to_string(s.max_position) + ")");
  }
  const std::size_t half = s.head_dim / 2;
  const bool vector = std::is_same_v<T, bf16_bits> && half % 16 == 0 && has_avx512f();
  const auto token = [&](std::size_t r) {
    const std::size_t table = static_cast<std::size_t>(positions[r]) * s.head_dim;
    const float* c = cos.data() + table;
    const float* sn = sin.data() + table;
    T* row = x.data() + r * s.row_stride;
    if (vector) {
      rope_token_avx512(row, s.heads, s.head_dim, c, sn);
      return;
    }
    for (std::size_t h = 0; h < s.heads; ++h) {
      T* v = row + h * s.head_dim;
      for (std::size_t i = 0; i < half; ++i) {
        const float x1 = load_scalar(v[i]);
        const float x2 = load_scalar(v[i + half]);
        const float c1 = round_to(c[i], T{});
        const float c2 = round_to(c[i + half], T{});
        const float s1 = round_to(sn[i], T{});
        const float s2 = round_to(sn[i + half], T{});
        store_scalar(v + i, round_to(x1 * c1, T{}) + round_to(-x2 * s1, T{}));
        store_scalar(v + i + half, round_to(x2 * c2, T{}) + round_to(x1 * s2, T{}));
      }
    }
  };
  for_each_item(s.rows, threads, s.rows * s.heads * s.head_dim >= kParallelValues, token);
}

template <class T>
void silu_mul_scalar(const T* gate, const T* up, T* out, std::size_t count) {
  for (std::size_t j = 0; j < count; ++j) {
    const float g = load_scalar(gate[j]);
    const float activated = round_to(g / (1.0F + std::exp(-g)), T{});
    store_scalar(out + j, activated * load_scalar(up[j]));
  }
}

// 16 values at a time with the vectorised exp (within a float32 rounding of std::exp's).
template <class T>
__attribute__((target("avx512f"))) void silu_mul_avx512(const T* gate, const T* up, T* out, std::size_t count) {
  std::size_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 g = load16(gate + j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 activated = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0F), e)), T{});
    store16(out + j, _mm512_mul_ps(activated, load16(up + j)));
  }
  silu_mul_scalar(gate + j, up + j, out + j, count - j);
}

// 8 values at a time, as silu_mul_avx512 computes them.
template <class T>
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const T* gate, const T* up, T* out, std::size_t count) {
  std::size_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 g = load8(gate + j);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 activated = round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0F), e)), T{});
    store8(out + j, _mm256_mul_ps(activated, load8(up + j)));
  }
  silu_mul_scalar(gate + j, up + j, out + j, count - j);
}

template <class T>
void silu_mul(std::size_t rows, std::size_t dim, std::span<const T> gate_up, std::span<T> out,
              int threads) {
  constexpr const char* op = "silu_mul";
  require(gate_up.size() == rows * 2 * dim, op, "gate_up must be [rows, 2 * dim]");
  require(out.size() == rows * dim, op, "out must be [rows, dim]");
  const bool vector = has_avx512f();
  const bool vector8 = !vector && has_avx2_fma();
  const auto one = [&](std::size_t r) {
    const T* gate = gate_up.data() + r * 2 * dim;
    if (vector) {
      silu_mul_avx512(gate, gate + dim, out.data() + r * dim, dim);
    } else if (vector8) {
      silu_mul_avx2(gate, gate + dim, out.data() + r * dim, dim);
    } else {
      silu_mul_scalar(gate, gate + dim, out.data() + r * dim, dim);
    }
  };
  for_each_item(rows, threads, rows * dim >= kParallelValues, one);
}

}  // namespace

void rope_f32(const RopeShape& shape, std::span<float> x, std::span<const int64_t> positions,
              std::span<const float> cos, std::span<const float> sin, int threads) {
  rope(shape, x, positions, cos, sin, threads);
}

void rope_bf16(const RopeShape& shape, std::span<bf16_bits> x, std::span<const int64_t> positions,
               std::span<const float> cos, std::span<const float> sin, int threads) {
  rope(shape, x, positions, cos, sin, threads);
}

void silu_mul_f32(std::size_t rows, std::size_t dim, std::span<const float> gate_up, std::span<float> out,
                  int threads) {
  silu_mul(rows, dim, gate_up, out, threads);
}

void silu_mul_bf16(std::size_t rows, std::size_t dim, std::span<const bf16_bits> gate_up, std::span<bf16_bits> out,
                   int threads) {
  silu_mul(rows, dim, gate_up, out, threads);
}

void write_kv(const KvWriteShape& shape, std::span<std::byte> k_cache, std::span<std::byte> v_cache,
              std::span<const std::byte> k, std::span<const std::byte> v, std::span<const int64_t> slots) {
  constexpr const char* op = "write_kv";
  const std::size_t slot_bytes = shape.row_bytes;
  require(slot_bytes > 0, op, "row_bytes must be positive");
  require_size(op, "slots", slots.size(), shape.rows);
  require(k_cache.size() % slot_bytes == 0 && v_cache.size() == k_cache.size(), op,
          "the caches must be the same whole number of slots");
  const auto need = [&](std::size_t stride) { return shape.rows == 0 ? 0 : (shape.rows - 1) * stride + slot_bytes; };
  require_size(op, "k bytes", k.size(), need(shape.k_stride));
  require_size(op, "v bytes", v.size(), need(shape.v_stride));
  const std::size_t num_slots = k_cache.size() / slot_bytes;
  for (const int64_t slot : slots) {
    require(slot >= 0 && static_cast<std::size_t>(slot) < num_slots, op,
            "slot " + std::to_string(slot) + " outside the cache's " + std::to_string(num_slots));
  }
  for (std::size_t r = 0; r < shape.rows; ++r) {
    const auto at = static_cast<std::size_t>(slots[r]) * slot_bytes;
    std::memcpy(k_cache.data() + at, k.data() + r * shape.k_stride, slot_bytes);
    std::memcpy(v_cache.data() + at, v.data() + r * shape.v_stride, slot_bytes);
  }
}

}  // namespace ringserve::kernels
