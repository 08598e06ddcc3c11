"""Sliding-window attention on the CPU backend: a query at position p sees exactly the keys (p - window, p] of its
own context, in decode rows, fresh prompts and chunks, whichever kernel (native paged or SDPA) the step takes, and
however a chunk past its window is cut into query tiles and key bands."""

from __future__ import annotations

import pytest
import torch
from ringserve.workers.attention import torch_sdpa
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from test_triton_paged_attention import PagedStep, paged_step


def dense_reference(step: PagedStep, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Each sequence's context read back from the cache through its block table, attended in float64 with the
    causal window mask written out."""
    md = step.metadata
    out = torch.empty(step.q.shape, dtype=torch.float64)
    block = md.block_size
    for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
        table = md.block_tables[i].long()
        slots = table[torch.arange(seq_len) // block] * block + torch.arange(seq_len) % block
        keys = k_cache.flatten(0, 1)[slots].double()  # [L, kv_heads, D]
        values = v_cache.flatten(0, 1)[slots].double()
        start = int(md.cu_seqlens_q[i])
        query = step.q[start : start + q_len].double()  # [q_len, heads, D]
        group = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = (key_pos <= pos) & (key_pos > pos - (step.window or seq_len))
        scores = torch.einsum("qhd,khd->hqk", query, keys) * step.scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("window", [1, 4, 16, None])
@pytest.mark.parametrize(
    "chunks",
    [
        [(1, 3), (1, 17), (1, 40)],  # decodes shorter and longer than the window
        [(6, 6), (20, 20)],  # fresh prompts
        [(5, 9), (12, 30), (1, 25), (3, 3)],  # chunked prefill after cached tokens, mixed with a decode
    ],
    ids=["decode", "fresh", "mixed"],
)
def test_window_masks_exactly_the_keys_before_it(chunks, window):
    step = paged_step(chunks, block_size=4, seed=len(chunks))
    step.window = window
    got, k_cache, v_cache = step.run(TorchSdpaBackend())
    torch.testing.assert_close(got.double(), dense_reference(step, k_cache, v_cache), atol=1e-5, rtol=0)


def test_a_window_longer_than_every_context_changes_nothing():
    step = paged_step([(1, 9), (7, 12), (10, 10)], block_size=4)
    plain, _, _ = step.run(TorchSdpaBackend())
    step.window = 64
    windowed, _, _ = step.run(TorchSdpaBackend())
    assert torch.equal(plain, windowed)


@pytest.mark.parametrize("tile_rows", [3, 8])
@pytest.mark.parametrize("window", [2, 5, 16, 64])
@pytest.mark.parametrize(
    "chunks",
    [
        [(40, 40)],  # one fresh prompt: its bands are slices of the context
        [(40, 40), (23, 23)],  # fresh prompts of two lengths: gathered bands, padded rows
        [(25, 60)],  # one chunk after cached tokens
        [(17, 50), (9, 9), (30, 61), (1, 33)],  # chunks after cached tokens beside a fresh prompt and a decode
    ],
    ids=["fresh", "fresh-two", "continued", "mixed"],
)
def test_long_chunks_in_query_tiles_see_exactly_their_window(chunks, window, tile_rows, monkeypatch):
    calls = []
    tiled = torch_sdpa._windowed_attention
    monkeypatch.setattr(torch_sdpa, "WINDOW_TILE_ROWS", tile_rows)
    monkeypatch.setattr(torch_sdpa, "_windowed_attention", lambda *args: calls.append(args) or tiled(*args))
    step = paged_step(chunks, block_size=4, seed=len(chunks) + window)
    step.window = window
    got, k_cache, v_cache = step.run(TorchSdpaBackend())
    torch.testing.assert_close(got.double(), dense_reference(step, k_cache, v_cache), atol=1e-5, rtol=0)
    if window < 40:  # a sequence is longer than the window: no native kernel, no plain causal SDPA for it
        assert len(calls) == 1
