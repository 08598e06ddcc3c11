"""The one interface every attention backend implements, and the cache write they share.

The model only computes q/k/v and calls `backend.forward`; writing the cache and reading it through block
tables is the backend's job, so a CUDA paged kernel can replace the gather path without touching the model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from ringserve.workers.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: a query at position p sees keys (p - window, p]; None = all
        softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap) before the softmax
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Writes this step's k/v into the cache through the slot mapping, then attends over each context (the
        blocks wholly before a window stay in the cache and are masked, not freed)."""
        ...


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters new keys/values into their flat cache slots (block_id * block_size + offset): on CPU by the native
    copy (checked slots), else index_copy_."""
    from ringserve.workers.model.cpu_ops import write_kv_  # here: the model package imports this one

    if write_kv_(k_cache, v_cache, k, v, slot_mapping):
        return
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
