"""Reference backend for any device: gather each context's blocks into contiguous K/V, then run SDPA.

Decode rows (one query token) are batched with a padded gather and a length mask; prefill chunks run one
sequence at a time with a causal mask shifted by the tokens already in the cache (chunked prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ringserve.workers.attention.backend import write_kv
from ringserve.workers.attention.metadata import AttentionMetadata


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
    ) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        decode_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
        if decode_seqs:
            self._decode(q, k_cache, v_cache, metadata, decode_seqs, scale, out)
        starts = metadata.cu_seqlens_q.tolist()
        for i, q_len in enumerate(metadata.query_lens_cpu):
            if q_len > 1:
                self._prefill(q, k_cache, v_cache, metadata, i, starts[i], scale, out)
        return out

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[seqs, blocks] block ids -> [seqs, blocks * block_size, kv_heads, head_dim] contiguous context."""
        gathered = cache[block_tables[:, :num_blocks].long()]
        seqs, _, block_size, kv_heads, head_dim = gathered.shape
        return gathered.reshape(seqs, num_blocks * block_size, kv_heads, head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        seqs: list[int],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        rows = md.cu_seqlens_q[seqs].long()
        seq_lens = md.seq_lens[seqs]
        max_len = max(md.seq_lens_cpu[i] for i in seqs)
        num_blocks = -(-max_len // md.block_size)
        tables = md.block_tables[seqs]
        keys = self._gather(k_cache, tables, num_blocks).transpose(1, 2)  # [D, kv_heads, L, head_dim]
        values = self._gather(v_cache, tables, num_blocks).transpose(1, 2)
        # Padded positions past each context (and stale blocks of the padding) must not be attended.
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] < seq_lens[:, None]
        query = q[rows].unsqueeze(2).to(keys.dtype)  # [D, heads, 1, head_dim]
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[rows] = attn.squeeze(2).to(out.dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        i: int,
        row_start: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        q_len, seq_len = md.query_lens_cpu[i], md.seq_lens_cpu[i]
        cached = seq_len - q_len
        num_blocks = -(-seq_len // md.block_size)
        keys = self._gather(k_cache, md.block_tables[i : i + 1], num_blocks)[:, :seq_len].transpose(1, 2)
        values = self._gather(v_cache, md.block_tables[i : i + 1], num_blocks)[:, :seq_len].transpose(1, 2)
        query = q[row_start : row_start + q_len].transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, heads, q, hd]
        if cached == 0:
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query token j sits at position cached + j and sees every key up to and including itself.
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(cached, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[row_start : row_start + q_len] = attn.squeeze(0).transpose(0, 1).to(out.dtype)
