// Paged attention on CPU: decode rows (one query token per sequence) and prefill chunks (causal) against their
// context in the block-paged KV cache, read in place through the block table (no gathered copy, no padded mask).
//
// Layouts (row-major): q [num_q_rows, num_heads, head_dim] with rows q_row_stride values apart (q is often a view of
// a fused QKV output), out [num_q_rows, num_heads, head_dim] contiguous; k_cache and v_cache
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, table_stride] int32; seq_lens and
// cu_seqlens_q int32 as in the workers' AttentionMetadata. Each sequence in `seq_ids` has its one query at row
// cu_seqlens_q[seq] and attends to positions [0, seq_lens[seq]) of its context. Scores, softmax and the weighted
// sum are float32 whatever the storage type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/cpu_linear.h"

namespace ringserve::kernels {

struct PagedDecodeShape {
  std::size_t num_q_rows;
  std::size_t q_row_stride;  // values between consecutive rows of q (num_heads * head_dim when contiguous)
  std::size_t num_heads;
  std::size_t num_kv_heads;
  std::size_t head_dim;
  std::size_t num_blocks;
  std::size_t block_size;
  std::size_t num_seqs;      // rows of block_tables, seq_lens; cu_seqlens_q has num_seqs + 1
  std::size_t table_stride;  // columns of block_tables
};

struct PagedDecodeIndex {
  std::span<const int32_t> block_tables;
  std::span<const int32_t> seq_lens;
  std::span<const int32_t> cu_seqlens_q;
  std::span<const int32_t> seq_ids;  // the sequences to compute
};

// Throws std::invalid_argument unless every decode sequence in `index` has a query row, a length its block table
// holds, and block ids inside the cache (what the kernels below check before reading anything).
void check_paged_decode_index(const PagedDecodeShape& shape, const PagedDecodeIndex& index);
// The same for chunks: each sequence's rows [cu_seqlens_q[seq], cu_seqlens_q[seq + 1]) are at least one, inside q,
// and no more than its length.
void check_paged_chunk_index(const PagedDecodeShape& shape, const PagedDecodeIndex& index);
// The same for a whole step (paged_attention_*): sequences with one query row as decodes, the others as chunks.
void check_paged_step_index(const PagedDecodeShape& shape, const PagedDecodeIndex& index);
// Throws std::invalid_argument (naming `op`) unless the shape is consistent and the spans hold what it describes.
void check_paged_attention_sizes(const char* op, const PagedDecodeShape& shape, std::size_t q_size,
                                 std::size_t k_size, std::size_t v_size, std::size_t out_size);

// Throws std::invalid_argument when a size, sequence id, query row, length or block id is out of range (checked
// before anything is written). With `threads` >= 2 and enough work, the sequences are spread over the kernels' worker
// pool (kernels/parallel.h). Each sequence's K and V token rows are read in order, once,
// for all heads, prefetching the next block's row (blocks are scattered in the cache).
void paged_decode_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                std::span<const float> q, std::span<const float> k_cache,
                                std::span<const float> v_cache, std::span<float> out, float scale, int threads = 1);
void paged_decode_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                 std::span<const bf16_bits> q, std::span<const bf16_bits> k_cache,
                                 std::span<const bf16_bits> v_cache, std::span<bf16_bits> out, float scale,
                                 int threads = 1);

// Causal attention of prefill chunks (new prompts, chunked-prefill steps, speculative verification without a tree):
// each sequence in `seq_ids` has its q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq] query rows from row
// cu_seqlens_q[seq], the last q_len positions of its seq_lens[seq]; row i of them attends to positions
// [0, seq_lens[seq] - q_len + i]. Flash-attention style (cpu_chunk_attention.cpp): work items of one KV head and a
// tile of rows, each reading its context once with an online softmax, spread over `threads` (dynamic schedule).
// Checks as above, before anything is written.
void paged_chunk_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                               std::span<const float> q, std::span<const float> k_cache,
                               std::span<const float> v_cache, std::span<float> out, float scale, int threads = 1);
void paged_chunk_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index,
                                std::span<const bf16_bits> q, std::span<const bf16_bits> k_cache,
                                std::span<const bf16_bits> v_cache, std::span<bf16_bits> out, float scale,
                                int threads = 1);
// True when chunks of this head size run vector tiles (head_dim 64 or 128 on an AVX-512F or AVX2+FMA CPU); else the
// portable loops, correct but far slower than PyTorch's SDPA.
bool paged_chunk_attention_is_vectorized(std::size_t head_dim);

// A whole step's causal attention by the step's own index: the sequences in `seq_ids` with one query row go to the
// decode kernel, those with more to the chunk kernel.
void paged_attention_f32(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const float> q,
                         std::span<const float> k_cache, std::span<const float> v_cache, std::span<float> out,
                         float scale, int threads = 1);
void paged_attention_bf16(const PagedDecodeShape& shape, const PagedDecodeIndex& index, std::span<const bf16_bits> q,
                          std::span<const bf16_bits> k_cache, std::span<const bf16_bits> v_cache,
                          std::span<bf16_bits> out, float scale, int threads = 1);

}  // namespace ringserve::kernels
