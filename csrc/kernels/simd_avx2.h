// AVX2 + FMA helpers shared by the CPU kernels: each function is compiled for AVX2 and FMA alone, so callers must
// check has_avx2_fma() first and keep a portable path.
#pragma once

#include <immintrin.h>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

inline bool has_avx2_fma() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
}

// 8 values as float32 lanes.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const bf16_bits* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));  // bf16 is float's top half
}

// 8 float32 lanes rounded to what the storage type keeps (float32: themselves; bf16: nearest even, NaN kept NaN).
__attribute__((target("avx2,fma"))) inline __m256 round8(__m256 v, float /*type tag*/) { return v; }
__attribute__((target("avx2,fma"))) inline __m256 round8(__m256 v, bf16_bits /*type tag*/) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                           _mm256_set1_epi32(static_cast<int>(0xffff0000U)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// 8 float32 lanes stored as the storage type (bf16: rounded as round8 rounds them).
__attribute__((target("avx2,fma"))) inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
__attribute__((target("avx2,fma"))) inline void store8(bf16_bits* p, __m256 v) {
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round8(v, bf16_bits{})), 16);  // 0..65535 each
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);     // lanes 0-3, then 4-7
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The 8 lanes' sum, by halving: 4 with 4, 2 with 2, 1 with 1.
__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// The lane sums of 8 vectors, in order (lane i: the sum of v[i]'s lanes), by pairwise horizontal adds.
__attribute__((target("avx2,fma"))) inline __m256 sum8x8(const __m256* v) {
  // u0: the sums of lanes 0-3 of v[0..3] (low half) and of lanes 4-7 (high half); u1 the same for v[4..7].
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// e^x as exp16 (simd_avx512.h) computes it: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error ~1e-7), times 2^n built in the exponent bits. Arguments below -87 give e^-87 (~1.6e-38),
// above 88 give e^88.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0F)), _mm256_set1_ps(88.0F));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341F)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125F), x);  // ln2 in two parts: exact n * hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06F), r);
  __m256 p = _mm256_set1_ps(1.0F / 720.0F);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0F / 120.0F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0F / 24.0F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0F / 6.0F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0F));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0F));
  // 2^n for n in [-126, 127]: a normal float's exponent bits.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace ringserve::kernels
