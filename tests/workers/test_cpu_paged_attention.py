"""The native CPU paged attention kernels (csrc/kernels/cpu_attention.cpp, cpu_chunk_attention.cpp) against a dense
float64 reference and against the PyTorch gather path they replace: float32 and bfloat16, grouped-query heads, the
AVX-512 and portable head sizes, non-contiguous block tables, strided queries, decode rows mixed with chunks (native
up to NATIVE_MAX_CHUNK rows) and longer ones (SDPA), both thread counts, and refusal of out-of-range indices."""

from __future__ import annotations

import pytest
import torch
from ringserve.workers.attention.metadata import NATIVE_MAX_CHUNK
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.model import cpu_ops

from tests.workers.test_triton_paged_attention import PagedStep, paged_step

pytestmark = pytest.mark.skipif(not cpu_ops.native_attention_available(), reason="the native kernels are not built")


def dense_reference(step: PagedStep) -> dict[int, torch.Tensor]:
    """Decode sequence -> its attention output [heads, head_dim] in float64, from the cache after this step's
    write, gathered position by position through the block table."""
    md = step.metadata
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[md.slot_mapping] = step.k.to(k_cache.dtype)
    flat_v[md.slot_mapping] = step.v.to(v_cache.dtype)
    heads, kv_heads = step.q.shape[1], k_cache.shape[2]
    out = {}
    for seq, (q_len, s_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
        if q_len != 1:
            continue
        positions = torch.arange(s_len)
        slots = md.block_tables[seq].long()[positions // md.block_size] * md.block_size + positions % md.block_size
        keys = flat_k[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, heads, hd]
        values = flat_v[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        query = step.q[int(md.cu_seqlens_q[seq])].double()  # [heads, hd]
        weights = (torch.einsum("hd,lhd->hl", query, keys) * step.scale).softmax(-1)
        out[seq] = torch.einsum("hl,lhd->hd", weights, values)
    return out


def decode_rows(step: PagedStep, out: torch.Tensor) -> dict[int, torch.Tensor]:
    md = step.metadata
    return {seq: out[int(md.cu_seqlens_q[seq])] for seq, q_len in enumerate(md.query_lens_cpu) if q_len == 1}


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 64, 16), (3, 64, 16), (2, 32, 8), (4, 24, 16)])
def test_float32_decode_matches_the_dense_reference(group: int, head_dim: int, block_size: int) -> None:
    # Lengths cover a single position, partial last blocks and softmax tails that are not a multiple of 16.
    step = paged_step([(1, 1), (1, 17), (1, 100), (1, 33)], group=group, head_dim=head_dim, block_size=block_size)
    got, _, _ = step.run(TorchSdpaBackend())
    ref = dense_reference(step)
    for seq, row in decode_rows(step, got).items():
        torch.testing.assert_close(row.double(), ref[seq], atol=2e-6, rtol=0)


def test_bfloat16_decode_stays_close_to_the_reference() -> None:
    step = paged_step([(1, 70), (1, 9), (1, 256)], group=3, head_dim=64, dtype=torch.bfloat16)
    got, _, _ = step.run(TorchSdpaBackend())
    assert got.dtype == torch.bfloat16
    ref = dense_reference(step)
    for seq, row in decode_rows(step, got).items():
        torch.testing.assert_close(row.double(), ref[seq], atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_pytorch_paths_agree_in_a_mixed_step(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    # Chunks between the decode rows (fresh, with a cached prefix, deep into one, one of exactly NATIVE_MAX_CHUNK
    # rows) go native where the chunk kernel has AVX-512 or AVX2 tiles for the head size; a longer one goes to SDPA
    # either way.
    longest = NATIVE_MAX_CHUNK
    step = paged_step([(1, 40), (5, 5), (1, 3), (4, 30), (longest + 1, longest + 20), (longest, longest + 7), (1, 64),
                       (20, 1500)], group=3, head_dim=64, dtype=dtype)  # fmt: skip
    chunks = cpu_ops.native_chunk_attention(64)
    native, long, ids = step.metadata.paged_split(chunks)
    assert (native, long) == (([0, 1, 2, 3, 5, 6, 7], [4]) if chunks else ([0, 2, 6], [1, 3, 4, 5, 7]))
    assert ids.tolist() == native
    native_out, native_k, native_v = step.run(TorchSdpaBackend())
    monkeypatch.setattr(cpu_ops, "_ATTENTION", None)
    torch_path, torch_k, torch_v = step.run(TorchSdpaBackend())
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native_out.float(), torch_path.float(), atol=atol, rtol=0)
    assert torch.equal(native_k, torch_k) and torch.equal(native_v, torch_v)


def test_speculative_tree_chunks_stay_on_sdpa() -> None:
    step = paged_step([(1, 40), (4, 30)], group=3, head_dim=64)
    step.metadata.tree_masks = {1: torch.ones(4, 30, dtype=torch.bool).tril(26)}
    assert step.metadata.paged_split(True)[:2] == ([0], [1])


def test_queries_may_be_a_strided_view_of_a_fused_projection() -> None:
    step = paged_step([(1, 50), (1, 20)], group=3, kv_heads=3, head_dim=64)
    tokens, heads, head_dim = step.q.shape
    fused = torch.randn(tokens, heads + 6, head_dim)
    fused[:, :heads] = step.q
    strided = PagedStep(fused[:, :heads], step.k, step.v, step.k_cache, step.v_cache, step.metadata, step.scale)
    assert not strided.q.is_contiguous()
    got, _, _ = strided.run(TorchSdpaBackend())
    want, _, _ = step.run(TorchSdpaBackend())
    assert torch.equal(got, want)


def run_kernel(step: PagedStep, seqs: list[int], threads: int, tables: torch.Tensor | None = None,
               out: torch.Tensor | None = None, kernel: str = "paged_decode_attention") -> torch.Tensor:  # fmt: skip
    md = step.metadata
    tables = md.block_tables if tables is None else tables
    out = torch.full(step.q.shape, float("nan")) if out is None else out
    ids = torch.tensor(seqs, dtype=torch.int32)
    tokens, heads, head_dim = step.q.shape
    num_blocks, block_size, kv_heads, _ = step.k_cache.shape
    getattr(cpu_ops._MODULE, kernel)(
        False, step.q.data_ptr(), step.k_cache.data_ptr(), step.v_cache.data_ptr(), tables.data_ptr(),
        md.seq_lens.data_ptr(), md.cu_seqlens_q.data_ptr(), ids.data_ptr(), out.data_ptr(), tokens, heads * head_dim,
        heads, kv_heads, head_dim, num_blocks, block_size, tables.shape[0], tables.shape[1], len(seqs), step.scale,
        threads=threads)  # fmt: skip
    return out


def test_two_threads_give_the_single_threaded_result() -> None:
    # Enough work (sequences x heads x positions) to be spread over the kernels' pool threads.
    step = paged_step([(1, 300)] * 12, group=3, kv_heads=3, head_dim=64)
    seqs = list(range(12))
    assert torch.equal(run_kernel(step, seqs, threads=1), run_kernel(step, seqs, threads=2))
    # Chunks: work items of one KV head and a tile of rows, handed out dynamically, each computed whole by one thread.
    step = paged_step([(100, 100), (16, 900), (1, 50), (37, 37)], group=3, kv_heads=3, head_dim=64)
    one = run_kernel(step, [0, 1, 2, 3], threads=1, kernel="paged_attention")
    assert not torch.isnan(one).any()
    assert torch.equal(one, run_kernel(step, [0, 1, 2, 3], threads=2, kernel="paged_attention"))


def test_a_chunk_with_more_rows_than_positions_is_refused() -> None:
    step = paged_step([(1, 40), (6, 20)], head_dim=64)
    lens = step.metadata.seq_lens.clone()
    step.metadata.seq_lens[1] = 5
    out = torch.full(step.q.shape, float("nan"))
    with pytest.raises(ValueError, match="more query rows than positions"):
        run_kernel(step, [0, 1], threads=1, out=out, kernel="paged_attention")
    assert torch.isnan(out).all()
    step.metadata.seq_lens.copy_(lens)
    assert not torch.isnan(run_kernel(step, [0, 1], threads=1, out=out, kernel="paged_attention")).any()


def test_out_of_range_indices_are_refused_before_anything_is_written() -> None:
    step = paged_step([(1, 40), (1, 20)], head_dim=64)
    bad_tables = step.metadata.block_tables.clone()
    bad_tables[1, 0] = step.k_cache.shape[0]  # one past the last block
    out = torch.full(step.q.shape, float("nan"))
    with pytest.raises(ValueError, match="block id"):
        run_kernel(step, [0, 1], threads=1, tables=bad_tables, out=out)
    with pytest.raises(ValueError, match="sequence id"):
        run_kernel(step, [0, 2], threads=1, out=out)
    assert torch.isnan(out).all()  # sequence 0 was valid, and still nothing was computed
    assert not torch.isnan(run_kernel(step, [0, 1], threads=1, out=out)).any()
