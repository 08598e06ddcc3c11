#include "kernels/cpu_sampling.h"

#include "kernels/parallel.h"
#include <cmath>
#include <limits>

#include "kernels/simd_avx2.h"
#include "kernels/simd_avx512.h"

namespace ringserve::kernels {

namespace {

constexpr const char* kOp = "argmax_logprob";

struct RowResult {
  int64_t id;
  float logprob;
};

template <class T>
RowResult row_portable(const T* row, std::size_t vocab) {
  std::size_t best = 0;
  float best_value = load_scalar(row[0]);
  for (std::size_t i = 0; i < vocab; ++i) {
    const float v = load_scalar(row[i]);
    if (std::isnan(v)) return {static_cast<int64_t>(i), std::numeric_limits<float>::quiet_NaN()};
    if (v > best_value) best_value = v, best = i;
  }
  if (std::isinf(best_value) && best_value < 0) {
    return {static_cast<int64_t>(best), std::numeric_limits<float>::quiet_NaN()};  // as log_softmax of all -inf
  }
  float sum = 0.0F;
  for (std::size_t i = 0; i < vocab; ++i) sum += std::exp(load_scalar(row[i]) - best_value);
  return {static_cast<int64_t>(best), -std::log(sum)};  // logits[best] - (max + log(sum)), with logits[best] = max
}

// The end of the vector paths' first pass: the row's maximum and its first index, from the lanes' maxima (each with
// the first index reaching it) and the scalar tail [i, vocab). False when the tail holds a NaN.
template <class T>
bool finish_max(const float* lane_best, const int32_t* lane_index, int lanes, const T* row, std::size_t i,
                std::size_t vocab, float& max_value, int64_t& id) {
  max_value = lane_best[0];
  id = lane_index[0];
  for (int l = 1; l < lanes; ++l) {
    if (lane_best[l] > max_value || (lane_best[l] == max_value && lane_index[l] < id)) {
      max_value = lane_best[l], id = lane_index[l];
    }
  }
  for (; i < vocab; ++i) {  // the tail
    const float v = load_scalar(row[i]);
    if (std::isnan(v)) return false;
    if (v > max_value) max_value = v, id = static_cast<int64_t>(i);
  }
  return true;
}

template <class T>
__attribute__((target("avx512f"))) RowResult row_avx512(const T* row, std::size_t vocab) {
  if (vocab < 16) return row_portable(row, vocab);
  // Pass 1: per-lane maximum and the first index reaching it; NaNs are looked for on the way.
  __m512 best = load16(row);
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  __m512i index = best_index;
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t i = 16;
  for (; i + 16 <= vocab; i += 16) {
    index = _mm512_add_epi32(index, step);
    const __m512 v = load16(row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: earlier indices win ties
    best = _mm512_mask_blend_ps(greater, best, v);
    best_index = _mm512_mask_blend_epi32(greater, best_index, index);
  }
  if (nan != 0) return row_portable(row, vocab);
  alignas(64) float lane_best[16];
  alignas(64) int32_t lane_index[16];
  _mm512_store_ps(lane_best, best);
  _mm512_store_si512(lane_index, best_index);
  float max_value = 0.0F;
  int64_t id = 0;
  if (!finish_max(lane_best, lane_index, 16, row, i, vocab, max_value, id)) return row_portable(row, vocab);
  if (std::isinf(max_value) && max_value < 0) return {id, std::numeric_limits<float>::quiet_NaN()};
  // Pass 2: the sum of exp(x - max), from cache.
  const __m512 shift = _mm512_set1_ps(max_value);
  __m512 sums = _mm512_setzero_ps();
  std::size_t j = 0;
  for (; j + 16 <= vocab; j += 16) sums = _mm512_add_ps(sums, exp16(_mm512_sub_ps(load16(row + j), shift)));
  alignas(64) float lane_sum[16];
  _mm512_store_ps(lane_sum, sums);
  float sum = 0.0F;
  for (const float s : lane_sum) sum += s;
  for (; j < vocab; ++j) sum += std::exp(load_scalar(row[j]) - max_value);
  return {id, -std::log(sum)};
}

// The same two passes on 8 lanes (AVX2 + FMA, CPUs without AVX-512).
template <class T>
__attribute__((target("avx2,fma"))) RowResult row_avx2(const T* row, std::size_t vocab) {
  if (vocab < 8) return row_portable(row, vocab);
  __m256 best = load8(row);
  __m256i best_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  __m256i index = best_index;
  const __m256i step = _mm256_set1_epi32(8);
  std::size_t i = 8;
  for (; i + 8 <= vocab; i += 8) {
    index = _mm256_add_epi32(index, step);
    const __m256 v = load8(row + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly: earlier indices win ties
    best = _mm256_blendv_ps(best, v, greater);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), greater));
  }
  if (_mm256_movemask_ps(nan) != 0) return row_portable(row, vocab);
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_index[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_index), best_index);
  float max_value = 0.0F;
  int64_t id = 0;
  if (!finish_max(lane_best, lane_index, 8, row, i, vocab, max_value, id)) return row_portable(row, vocab);
  if (std::isinf(max_value) && max_value < 0) return {id, std::numeric_limits<float>::quiet_NaN()};
  const __m256 shift = _mm256_set1_ps(max_value);
  __m256 sums = _mm256_setzero_ps();
  std::size_t j = 0;
  for (; j + 8 <= vocab; j += 8) sums = _mm256_add_ps(sums, exp8(_mm256_sub_ps(load8(row + j), shift)));
  float sum = sum8(sums);
  for (; j < vocab; ++j) sum += std::exp(load_scalar(row[j]) - max_value);
  return {id, -std::log(sum)};
}

template <class T>
void argmax_logprob_rows(std::size_t rows, std::size_t vocab, std::span<const T> logits, std::span<int64_t> ids,
                         std::span<float> logprobs, int threads) {
  require(vocab > 0, kOp, "vocab must be positive");
  require_size(kOp, "logits", logits.size(), rows * vocab);
  require_size(kOp, "ids", ids.size(), rows);
  require_size(kOp, "logprobs", logprobs.size(), rows);
  const bool vector16 = has_avx512f();
  const bool vector8 = !vector16 && has_avx2_fma();
  const auto one = [&](std::size_t r) {
    const T* row = logits.data() + r * vocab;
    const RowResult result = vector16  ? row_avx512(row, vocab)
                             : vector8 ? row_avx2(row, vocab)
                                       : row_portable(row, vocab);
    ids[r] = result.id;
    logprobs[r] = result.logprob;
  };
  for_each_item(rows, threads, true, one);
}

}  // namespace

void argmax_logprob_f32(std::size_t rows, std::size_t vocab, std::span<const float> logits, std::span<int64_t> ids,
                        std::span<float> logprobs, int threads) {
  argmax_logprob_rows(rows, vocab, logits, ids, logprobs, threads);
}

void argmax_logprob_bf16(std::size_t rows, std::size_t vocab, std::span<const bf16_bits> logits,
                         std::span<int64_t> ids, std::span<float> logprobs, int threads) {
  argmax_logprob_rows(rows, vocab, logits, ids, logprobs, threads);
}

}  // namespace ringserve::kernels
