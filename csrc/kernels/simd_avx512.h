// AVX-512 helpers shared by the CPU kernels: each function is compiled for AVX-512F alone, so callers must check
// has_avx512f() first and keep a portable path.
#pragma once

#include <immintrin.h>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

inline bool has_avx512f() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported;
}

// 16 values as float32 lanes.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const bf16_bits* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // bf16 is float's top half. The zero-masked forms: GCC 12 flags the plain ones' undefined-vector source operand
  // as maybe-uninitialized once inlined (a false positive, like _mm512_reduce_add_ps's in cpu_linear.cpp).
  const __mmask16 all = 0xffff;
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, raw), 16));
}

// 16 float32 lanes rounded to bf16 (nearest even, NaN kept NaN) and stored.
__attribute__((target("avx512f"))) inline void store16(bf16_bits* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 float32 lanes rounded to what the storage type keeps (float32: themselves).
__attribute__((target("avx512f"))) inline __m512 round16(__m512 v, float /*type tag*/) { return v; }
__attribute__((target("avx512f"))) inline __m512 round16(__m512 v, bf16_bits /*type tag*/) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                           _mm512_set1_epi32(static_cast<int>(0xffff0000U)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded), v);
}

// The 16 lanes' sum (kMax false) or maximum, by halving: 8 with 8, 4 with 4, 2 with 2, 1 with 1 (no
// _mm512_reduce_*_ps: GCC 12 flags their undefined-vector operands, as in load16).
template <bool kMax>
__attribute__((target("avx512f"))) inline float reduce16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 half = kMax ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi);
  const __m128 a = _mm256_castps256_ps128(half), b = _mm256_extractf128_ps(half, 1);
  __m128 r = kMax ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
  r = kMax ? _mm_max_ps(r, _mm_movehl_ps(r, r)) : _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = kMax ? _mm_max_ss(r, _mm_movehdup_ps(r)) : _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
__attribute__((target("avx512f"))) inline float sum16(__m512 v) { return reduce16<false>(v); }
__attribute__((target("avx512f"))) inline float max16(__m512 v) { return reduce16<true>(v); }

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error ~1e-7, below float32's), times 2^n by scalef. Arguments below -87 give 0.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0F));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341F)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125F), x);  // ln2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06F), r);
  __m512 p = _mm512_set1_ps(1.0F / 720.0F);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0F / 120.0F));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0F / 24.0F));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0F / 6.0F));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5F));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0F));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0F));
  return _mm512_scalef_ps(p, n);
}

// Transposes the 16 x 16 matrix of 32-bit values in r (in place, in registers). The zero-masked forms with full masks
// are the plain instructions; GCC 12 flags the plain intrinsics' undefined pass-through operand as uninitialized once
// inlined (see load16).
__attribute__((target("avx512f"))) inline void transpose16x16(__m512i (&r)[16]) {
  const __mmask16 all = 0xffff;
  const __mmask8 all8 = 0xff;
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_epi32(all, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_epi32(all, r[i], r[i + 1]);
  }
  // u[4g + m] holds, in each 128-bit lane L, column 4L + m of rows 4g .. 4g + 3.
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {
    const int b = 4 * g;
    u[b + 0] = _mm512_maskz_unpacklo_epi64(all8, t[b], t[b + 2]);
    u[b + 1] = _mm512_maskz_unpackhi_epi64(all8, t[b], t[b + 2]);
    u[b + 2] = _mm512_maskz_unpacklo_epi64(all8, t[b + 1], t[b + 3]);
    u[b + 3] = _mm512_maskz_unpackhi_epi64(all8, t[b + 1], t[b + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_maskz_shuffle_i32x4(all, u[m], u[4 + m], 0x44);
    const __m512i x1 = _mm512_maskz_shuffle_i32x4(all, u[m], u[4 + m], 0xEE);
    const __m512i y0 = _mm512_maskz_shuffle_i32x4(all, u[8 + m], u[12 + m], 0x44);
    const __m512i y1 = _mm512_maskz_shuffle_i32x4(all, u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_maskz_shuffle_i32x4(all, x0, y0, 0x88);
    r[4 + m] = _mm512_maskz_shuffle_i32x4(all, x0, y0, 0xDD);
    r[8 + m] = _mm512_maskz_shuffle_i32x4(all, x1, y1, 0x88);
    r[12 + m] = _mm512_maskz_shuffle_i32x4(all, x1, y1, 0xDD);
  }
}

}  // namespace ringserve::kernels
