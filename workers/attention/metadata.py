"""Per-step attention metadata, set once before the forward pass and read by every attention layer.

Keeping it out of the model signatures (nano-vllm style) lets backends add fields without touching the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

# The longest chunk the native CPU kernels attend (csrc/kernels/cpu_chunk_attention.cpp: causal, K/V read in place
# through the block tables). Measured through the backend with SmolLM2's heads on 2 cores, against the SDPA path
# (gather, mask, SDPA): 1.4x-1.6x faster in float32 and 1.05x-2.4x in bf16 for fresh prompts of 512-1,536 tokens and
# chunks of 512-1,024 rows at depth 2,048; level (1.03x-1.15x) at 2,048 fresh. Longer chunks, not measured, go to SDPA.
NATIVE_MAX_CHUNK = 2048


@dataclass
class AttentionMetadata:
    """Layout of one packed step: sequence i owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1])."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat cache slot (block_id * block_size + offset) per new token
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: query start offsets in the packed batch
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: padded with 0 past each sequence's blocks
    logits_indices: torch.Tensor | None  # int64 [num_rows]: packed rows that produce logits; None = every row
    # Host copies so CPU backends can plan without reading device tensors back.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Speculative trees: sequence index -> bool [query_len, seq_len], which context positions each query row sees
    # (replacing the causal rule for that sequence). None = every sequence is causal.
    tree_masks: dict[int, torch.Tensor] | None = None
    # int32 [num_seqs] on the device, 0..num_seqs-1, when every sequence is a decode and the caller keeps the ids
    # (a CUDA graph's static buffers: the paged backend must not upload a fresh id tensor inside the capture).
    decode_ids: torch.Tensor | None = None
    _split: dict[bool, tuple[list[int], list[int], torch.Tensor]] = field(default_factory=dict, init=False,
                                                                          repr=False, compare=False)  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def paged_split(self, native_chunks: bool) -> tuple[list[int], list[int], torch.Tensor]:
        """(sequences for the native paged kernels: decode rows, and with `native_chunks` chunks of at most
        NATIVE_MAX_CHUNK rows, none with a tree mask; the others, for SDPA; the first as int32 ids), worked out by
        the first layer that asks and reused by the rest (the step's layout does not change)."""
        split = self._split.get(native_chunks)
        if split is None:
            query_lens = np.asarray(self.query_lens_cpu, dtype=np.int64)
            native = (query_lens == 1) | (native_chunks & (query_lens <= NATIVE_MAX_CHUNK))
            if self.tree_masks:
                native[list(self.tree_masks)] = False
            ids = np.flatnonzero(native)
            split = (ids.tolist(), np.flatnonzero(~native).tolist(), torch.from_numpy(ids.astype(np.int32)))
            self._split[native_chunks] = split
        return split

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        logits_indices: list[int] | None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Derives slot mapping and padded block tables from per-sequence (query_len, seq_len, blocks)."""
        slots: list[torch.Tensor] = []
        for q_len, s_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
            if s_len > len(blocks) * block_size:
                raise ValueError(f"sequence of {s_len} tokens does not fit its {len(blocks)} blocks of {block_size}")
            positions = torch.arange(s_len - q_len, s_len)
            table = torch.tensor(blocks, dtype=torch.int64)
            slots.append(table[positions // block_size] * block_size + positions % block_size)
        max_blocks = max((len(b) for b in block_tables), default=0)
        padded = torch.zeros((len(block_tables), max(max_blocks, 1)), dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            padded[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        rows = None if logits_indices is None else torch.tensor(logits_indices, dtype=torch.int64, device=device)
        return cls(
            slot_mapping=(torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)).to(device),
            cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=padded.to(device),
            logits_indices=rows,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_size=block_size,
        )


_CURRENT: AttentionMetadata | None = None


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    global _CURRENT
    _CURRENT = metadata


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention metadata is not set; wrap the forward pass in attention_metadata_scope(...)")
    return _CURRENT


@contextmanager
def attention_metadata_scope(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Sets the metadata for one forward pass and clears it afterwards so a stale step is never read."""
    set_attention_metadata(metadata)
    try:
        yield metadata
    finally:
        set_attention_metadata(None)
