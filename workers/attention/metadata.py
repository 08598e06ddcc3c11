"""Per-step attention metadata, set once before the forward pass and read by every attention layer.

Keeping it out of the model signatures (nano-vllm style) lets backends add fields without touching the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

# Which sequences the native paged kernel attends on CPU, one query per row reading K/V in place: decode rows, and
# short chunks (new prompts, a chunked prefill's small steps, speculative verification) of at most
# PAGED_MAX_QUERY_LEN rows and PAGED_MAX_PAIRS query-key pairs (rows x context). Each row reads its whole context, so
# the kernel's cost grows with the pairs, while SDPA reads the gathered context once for all rows: with SmolLM2's
# heads here the kernel is 3-4x faster for fresh prompts up to 64 tokens and level with SDPA at 16 rows x 1,000
# positions. The rest go to SDPA.
PAGED_MAX_QUERY_LEN = 64
PAGED_MAX_PAIRS = 16384


@dataclass(frozen=True)
class PagedRows:
    """Query rows as the native paged kernel indexes them: pseudo-sequence r has its query at packed row
    cu_seqlens_q[r] and attends to positions [0, seq_lens[r]) through block_tables[r]; `ids` lists the ones to
    compute."""

    block_tables: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]
    cu_seqlens_q: torch.Tensor  # int32 [R + 1]
    ids: torch.Tensor  # int32 [rows to compute]


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
    _split: tuple[list[int], list[int], PagedRows] | None = field(default=None, init=False, repr=False,
                                                                    compare=False)  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def paged_split(self) -> tuple[list[int], list[int], PagedRows]:
        """(short sequences: decode rows and chunks within PAGED_MAX_QUERY_LEN and PAGED_MAX_PAIRS, without a tree
        mask; the others; the short ones' query rows as the native paged kernel takes them), worked out by the first
        layer that asks and reused by the rest (the step's layout does not change)."""
        if self._split is None:
            query_lens = np.asarray(self.query_lens_cpu, dtype=np.int64)
            masked = np.zeros(len(query_lens), np.bool_)
            if self.tree_masks:
                masked[list(self.tree_masks)] = True
            pairs = query_lens * np.asarray(self.seq_lens_cpu, dtype=np.int64)
            chunk = (query_lens <= PAGED_MAX_QUERY_LEN) & (pairs <= PAGED_MAX_PAIRS)
            is_short = ((query_lens == 1) | chunk) & ~masked
            short = np.flatnonzero(is_short)
            rows = self._paged_rows(query_lens, short)
            self._split = (short.tolist(), np.flatnonzero(~is_short).tolist(), rows)
        return self._split

    def _paged_rows(self, query_lens: np.ndarray, short: np.ndarray) -> PagedRows:
        counts = query_lens[short]
        if not counts.size or counts.max() == 1:
            # Decode rows only: the step's own index, one query per listed sequence.
            ids = torch.from_numpy(short.astype(np.int32))
            return PagedRows(self.block_tables, self.seq_lens, self.cu_seqlens_q, ids)
        # Each query row of a short sequence is one pseudo-sequence of the kernel: its own packed row, its sequence's
        # block table, and the causal length (what that token may see: the context before the chunk, then the chunk
        # up to itself).
        total = int(counts.sum())
        offset = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # row within its chunk
        starts = np.concatenate(([0], np.cumsum(query_lens)))[short]
        seq_lens = np.asarray(self.seq_lens_cpu, dtype=np.int64)[short]
        rows = np.repeat(starts, counts) + offset
        lengths = np.repeat(seq_lens - counts + 1, counts) + offset
        owner = torch.from_numpy(np.repeat(short, counts)).to(self.block_tables.device)
        cu = torch.from_numpy(np.append(rows, int(query_lens.sum())).astype(np.int32))
        tables = self.block_tables.index_select(0, owner)
        return PagedRows(tables, torch.from_numpy(lengths.astype(np.int32)), cu, torch.arange(total, dtype=torch.int32))

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
