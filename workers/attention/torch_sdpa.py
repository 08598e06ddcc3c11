"""Reference backend for any device: gather each context's blocks into contiguous K/V, then run SDPA.

On CPU, decode rows (one query token) and causal chunks of up to NATIVE_MAX_CHUNK rows (where the native chunk kernel
is vectorized for the head size) go to the native paged kernels (workers/model/cpu_ops.py), which read K/V in place
through the block tables. Elsewhere decode rows are batched with a padded gather and a length
mask. Prefill chunks are batched too: queries padded to the longest chunk, with a causal mask shifted by the tokens
already in the cache (chunked prefill) and cut at each context's length; when no chunk has cached tokens SDPA's own
causal path is used.
So a mixed step is at most two SDPA calls per layer, whatever the number of sequences (a sliding-window layer's
long chunks excepted, below).
A sliding-window layer masks keys older than its window in both paths; the native kernels have no window, so a
sequence longer than the window skips them. A windowed layer's chunks past the window (or after cached tokens) go in
query tiles, each attending only the band of keys its rows can see (_windowed_attention). Soft-capped scores (Gemma
2) skip the native kernels and SDPA: the scores are computed, capped and softmaxed in plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ringserve.workers.attention.backend import write_kv
from ringserve.workers.attention.metadata import AttentionMetadata
from ringserve.workers.model.cpu_ops import native_chunk_attention, paged_attention

# Query rows per SDPA call of a sliding-window layer's long chunk (_windowed_attention): each tile attends a band of
# tile + window - 1 keys. On Gemma 3 270M's shapes (window 512, 4 heads of 256, one KV head; 1 thread, float32)
# 64 to 256 rows measured alike and 512 slower; Gemma 3 270M's windowed layers in a 2,048-token prefill: 139 ms a
# layer against 167 ms for one masked call over the whole context (a global layer's causal SDPA: 235 ms).
WINDOW_TILE_ROWS = 128


class TorchSdpaBackend:
    name = "torch_sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        native, long, ids = metadata.paged_split(q.device.type == "cpu" and native_chunk_attention(q.shape[-1]))
        if softcap is not None or (window is not None and any(metadata.seq_lens_cpu[i] > window for i in native)):
            long, native = sorted(long + native), []  # the native kernels attend the whole context
        if native and not paged_attention(q, k_cache, v_cache, metadata, ids, scale, out):
            long = sorted(long + native)
        trees = metadata.tree_masks or {}
        decode = [i for i in long if metadata.query_lens_cpu[i] == 1 and i not in trees]
        if decode:
            self._decode(q, k_cache, v_cache, metadata, decode, scale, out, window, softcap)
        if chunks := [i for i in long if i not in decode]:
            self._prefill(q, k_cache, v_cache, metadata, chunks, scale, out, window, softcap)
        return out

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[seqs, blocks] block ids -> [seqs, blocks * block_size, kv_heads, head_dim] contiguous context."""
        # index_select of whole blocks as rows of a 2-D view (one contiguous copy per block); advanced indexing is
        # about 2x slower on CPU for this shape (a 2,000-token context: ~190 us against ~100 us on a quiet machine).
        ids = block_tables[:, :num_blocks].reshape(-1).long()
        total, block_size, kv_heads, head_dim = cache.shape
        rows = cache.view(total, block_size * kv_heads * head_dim).index_select(0, ids)
        return rows.view(block_tables.shape[0], num_blocks * block_size, kv_heads, head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        seqs: list[int],
        scale: float,
        out: torch.Tensor,
        window: int | None,
        softcap: float | None = None,
    ) -> None:
        rows = md.cu_seqlens_q[seqs].long()
        seq_lens = md.seq_lens[seqs]
        max_len = max(md.seq_lens_cpu[i] for i in seqs)
        num_blocks = -(-max_len // md.block_size)
        tables = md.block_tables[seqs]
        keys = self._gather(k_cache, tables, num_blocks).transpose(1, 2)  # [D, kv_heads, L, head_dim]
        values = self._gather(v_cache, tables, num_blocks).transpose(1, 2)
        # Padded positions past each context (and stale blocks of the padding) must not be attended.
        key_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        mask = key_pos < seq_lens[:, None]
        if window is not None:  # the query sits at seq_len - 1
            mask &= key_pos >= seq_lens[:, None] - window
        # Plain matmuls with each KV head's query group as the rows ([D, kv, group, hd] x [D, kv, hd, L]): for one
        # query row they beat CPU SDPA's kernel by far, and no K/V copy is broadcast across the group.
        num_seqs, kv_heads, _, head_dim = keys.shape
        query = q[rows].to(keys.dtype).view(num_seqs, kv_heads, -1, head_dim)
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale  # [D, kv, group, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        attn = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # [D, kv, group, hd]
        out[rows] = attn.view(num_seqs, -1, head_dim).to(out.dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        seqs: list[int],
        scale: float,
        out: torch.Tensor,
        window: int | None,
        softcap: float | None = None,
    ) -> None:
        device = q.device
        q_lens = torch.tensor([md.query_lens_cpu[i] for i in seqs], device=device)
        seq_lens = md.seq_lens[seqs].long()
        max_q = int(max(md.query_lens_cpu[i] for i in seqs))
        num_blocks = -(-max(md.seq_lens_cpu[i] for i in seqs) // md.block_size)
        tables = md.block_tables[seqs]
        keys = self._gather(k_cache, tables, num_blocks).transpose(1, 2)  # [P, kv_heads, L, head_dim]
        values = self._gather(v_cache, tables, num_blocks).transpose(1, 2)
        j = torch.arange(max_q, device=device)
        valid = j[None, :] < q_lens[:, None]  # [P, max_q]
        # Padded query rows repeat the chunk's last row (so no row is fully masked) and are dropped afterwards.
        rows = md.cu_seqlens_q[seqs].long()[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)
        query = q[rows].transpose(1, 2).to(keys.dtype)  # [P, heads, max_q, head_dim]
        query_pos = (seq_lens - q_lens)[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)
        trees = md.tree_masks or {}
        fresh = all(md.seq_lens_cpu[i] == md.query_lens_cpu[i] for i in seqs)
        plain = not any(i in trees for i in seqs) and softcap is None
        if plain and fresh and (window is None or max_q <= window):
            # Fresh prompts only: the plain causal mask is exact for every real row (keys past a prompt's end sit
            # after all its real queries), and SDPA's causal path is the fast one.
            keys, values = keys[:, :, :max_q], values[:, :, :max_q]
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        elif plain and window is not None:
            attn = _windowed_attention(query, keys, values, query_pos, seq_lens, window, scale, fresh)
        else:
            key_pos = torch.arange(keys.shape[2], device=device)
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
                key_pos[None, None, :] < seq_lens[:, None, None]
            )
            for p, i in enumerate(seqs):
                tree = trees.get(i)
                if tree is None:
                    continue
                q_len, s_len = tree.shape
                mask[p] = False
                mask[p, :q_len, :s_len] = tree
                mask[p, q_len:] = mask[p, q_len - 1]  # padded rows repeat the last real row
            if window is not None:
                mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
            if softcap is None:
                attn = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True
                )  # [P, heads, max_q, head_dim]
            else:
                attn = _capped_attention(query, keys, values, mask, scale, softcap)
        out[rows[valid]] = attn.transpose(1, 2)[valid].to(out.dtype)


def _capped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """SDPA with soft-capped scores: query [P, heads, Q, hd], keys/values [P, kv_heads, L, hd], mask [P, Q, L]."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask[:, None], float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)


def _windowed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    scale: float,
    fresh: bool,
) -> torch.Tensor:
    """SDPA for a sliding-window layer's chunks longer than its window, or after cached tokens: query [P, heads, Q,
    hd], keys/values [P, kv_heads, L, hd] (index = position), query_pos [P, Q]. A fresh prompt's rows within the
    window see every key before them (SDPA's causal path, no mask); the other rows go in tiles of WINDOW_TILE_ROWS,
    each against only the keys its rows can see (a band of tile + window - 1), so the work grows with Q x window
    rather than Q x L."""
    num_seqs, _, num_q, _ = query.shape
    length = keys.shape[2]
    out = torch.empty_like(query)
    causal = min(window, num_q) if fresh else 0
    if causal:  # row j sits at position j (padded rows are dropped)
        out[:, :, :causal] = F.scaled_dot_product_attention(query[:, :, :causal], keys[:, :, :causal],
                                                            values[:, :, :causal], is_causal=True, scale=scale,
                                                            enable_gqa=True)  # fmt: skip
    rows = WINDOW_TILE_ROWS if WINDOW_TILE_ROWS + window - 1 < length else num_q  # else no tile saves keys
    for first in range(causal, num_q, rows):
        last = min(first + rows, num_q)
        tile_pos = query_pos[:, first:last]
        span = min(last - first + window - 1, length)
        # The band starts `window - 1` keys before the tile's first query, moved back where it would run past the
        # context: every key a row of the tile may see lies inside it.
        start = (tile_pos[:, 0] - (window - 1)).clamp(min=0, max=length - span)
        key_pos = start[:, None] + torch.arange(span, device=query.device)  # [P, span]
        if num_seqs == 1:
            band = slice(int(start[0]), int(start[0]) + span)
            band_keys, band_values = keys[:, :, band], values[:, :, band]
        else:
            index = key_pos[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            band_keys, band_values = keys.gather(2, index), values.gather(2, index)
        mask = (
            (key_pos[:, None, :] <= tile_pos[:, :, None])
            & (key_pos[:, None, :] > tile_pos[:, :, None] - window)
            & (key_pos[:, None, :] < seq_lens[:, None, None])
        )
        out[:, :, first:last] = F.scaled_dot_product_attention(query[:, :, first:last], band_keys, band_values,
                                                               attn_mask=mask[:, None], scale=scale,
                                                               enable_gqa=True)  # fmt: skip
    return out
