// Greedy decoding's last step on CPU: for each row of logits, the first index of its maximum and the row's
// log-sum-exp, in one native call over all rows (two passes over each row, the second from cache), so the
// sampled token's log-probability is logits[id] - lse without materializing a [rows, vocab] log-softmax.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

// logits [rows, vocab] (contiguous); ids and logprobs [rows]. ids[r] is the first index of the row's maximum, as
// torch.argmax picks it (a NaN counts as the maximum, as there); logprobs[r] = logits[r, ids[r]] - logsumexp(row),
// computed in float32. With `threads` >= 2 the rows are split over that many threads of the kernels' pool.
// Throws std::invalid_argument on a size mismatch or an empty vocabulary.
void argmax_logprob_f32(std::size_t rows, std::size_t vocab, std::span<const float> logits, std::span<int64_t> ids,
                        std::span<float> logprobs, int threads = 1);
void argmax_logprob_bf16(std::size_t rows, std::size_t vocab, std::span<const bf16_bits> logits,
                         std::span<int64_t> ids, std::span<float> logprobs, int threads = 1);

}  // namespace ringserve::kernels
