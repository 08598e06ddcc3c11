"""Piecewise graphs (workers/piecewise_graphs.py) against the plain eager forward: the real C++ scheduler drives a
tiny random model through several prompts, chunked prefill, decodes beside prompt chunks and preemption (a KV pool
too small for every request), in float32. On CPU the pieces' static buffers, padding and cuts run eagerly
(capture_graphs=False); on CUDA they are captured and replayed."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model_runner import ModelRunner
from ringserve.workers.piecewise_graphs import piecewise_token_sizes
from workers_testkit import save_tiny_hf_model, serve_in_process

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 6 requests of up to 43 tokens need 64 blocks at once: the scheduler preempts
MAX_GRAPH_TOKENS = 16  # under the step budget of 20, so the largest steps run eagerly beside the pieces

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captured graphs)")


class RecordingRunner(ModelRunner):
    """Keeps every step's logits and scheduled (start, len) chunks, and counts the steps the pieces ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []
        self.chunks: list[list[tuple[int, int]]] = []
        self.piece_steps = 0
        if self.pieces is not None:
            run = self.pieces.run

            def counted(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                self.piece_steps += 1
                return run(input_ids, positions)

            self.pieces.run = counted  # type: ignore[method-assign]

    def execute(self, plan: Any) -> Any:
        starts, lens = np.asarray(plan.sched_start).reshape(-1), np.asarray(plan.sched_len).reshape(-1)
        self.chunks.append([(int(s), int(n)) for s, n in zip(starts, lens, strict=True)])
        return super().execute(plan)

    def _sample(self, step_id: int, logits: torch.Tensor, sampled_slots: np.ndarray) -> Any:
        self.logits.append(logits.float().cpu().clone())
        return super()._sample(step_id, logits, sampled_slots)


def requests() -> list[dict[str, object]]:
    rng = np.random.default_rng(3)
    return [
        {"request_id": rid, "prompt_token_ids": rng.integers(3, 256, int(rng.integers(3, 34))).tolist(),
         "max_tokens": int(rng.integers(4, 10)), "temperature": 0.0, "ignore_eos": True}
        for rid in range(1, 7)
    ]  # fmt: skip


def serve(runner: ModelRunner) -> tuple[dict[int, list[int]], Any]:
    return serve_in_process(runner, requests(), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                            max_num_batched_tokens=20, max_num_seqs=6)  # fmt: skip


def make_runner(folder: Path, device: str, **kwargs: Any) -> RecordingRunner:
    model = load_hf_model(folder, torch.float32, device)
    return RecordingRunner(model, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, device=device,
                           max_graph_tokens=MAX_GRAPH_TOKENS, **kwargs)  # fmt: skip


def assert_same_outputs(pieces: RecordingRunner, eager: RecordingRunner, atol: float) -> None:
    got, got_stats = serve(pieces)
    want, want_stats = serve(eager)
    assert want_stats.num_preemptions > 0, "the scenario must preempt"
    assert any(any(n == 1 for _, n in step) and any(n > 1 for _, n in step) for step in eager.chunks), "no mixed step"
    assert any(s > 0 and n > 1 for step in eager.chunks for s, n in step), "no prompt chunk after a first one"
    assert got == want and got_stats.num_preemptions == want_stats.num_preemptions
    assert len(pieces.logits) == len(eager.logits)
    for a, b in zip(pieces.logits, eager.logits, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)
    # Every KV slot the engine hands out, owned now or not, holds what the eager run wrote: padding rows wrote
    # nowhere (decode graphs' padding goes to their own scratch block, past NUM_BLOCKS).
    for got_cache, want_cache in ((pieces.kv_cache.k, eager.kv_cache.k), (pieces.kv_cache.v, eager.kv_cache.v)):
        for a, b in zip(got_cache, want_cache, strict=True):
            torch.testing.assert_close(a[:NUM_BLOCKS], b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma2"])
def test_static_pieces_give_the_eager_tokens_logits_and_kv(tmp_path: Path, variant: str) -> None:
    # llama: the fused fast-path layers; qwen3: the plain attention with q/k norms; gemma2: soft-capped attention in
    # sliding windows and a soft-capped LM head.
    save_tiny_hf_model(variant, tmp_path)
    pieces = make_runner(tmp_path, "cpu", attention_backend="torch_sdpa", cuda_graphs="piecewise",
                         capture_graphs=False)  # fmt: skip
    eager = make_runner(tmp_path, "cpu", attention_backend="torch_sdpa", cuda_graphs="off")
    assert pieces.pieces is not None and pieces.graphs is None and eager.pieces is None
    assert pieces.pieces.sizes == [1, 2, 4, 8, 16] and pieces.kv_cache.num_blocks == NUM_BLOCKS  # no scratch block
    assert_same_outputs(pieces, eager, atol=1e-5)
    steps = len(pieces.logits)
    assert 0 < pieces.piece_steps < steps  # most steps through the pieces; those over 16 tokens eagerly
    assert pieces.pieces.rows > 0 and all(attn.backend.name == "torch_sdpa" for attn in pieces.pieces.attention)


def test_token_sizes_and_where_pieces_apply(tmp_path: Path) -> None:
    assert piecewise_token_sizes(1) == [1]
    assert piecewise_token_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = piecewise_token_sizes(2048)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[19:22] == [256, 320, 384] and sizes[-3:] == [1536, 1792, 2048]
    assert all(b - a <= max(a // 4, 16) for a, b in itertools.pairwise(sizes))  # little padding
    with pytest.raises(ValueError, match="max_tokens"):
        piecewise_token_sizes(0)
    save_tiny_hf_model("mixtral", tmp_path / "moe")
    moe = load_hf_model(tmp_path / "moe", torch.float32)
    with pytest.raises(ValueError, match="mixture of experts"):
        ModelRunner(moe, block_size=4, num_kv_blocks=8, cuda_graphs="piecewise", capture_graphs=False)
    # Captured graphs need CUDA: on the CPU every mode runs eagerly.
    save_tiny_hf_model("llama", tmp_path / "llama")
    for mode in ("auto", "decode", "piecewise"):
        model = load_hf_model(tmp_path / "llama", torch.float32)
        runner = ModelRunner(model, block_size=4, num_kv_blocks=8, cuda_graphs=mode)  # type: ignore[arg-type]
        assert runner.pieces is None and runner.graphs is None and runner.kv_cache.num_blocks == 8
    with pytest.raises(ValueError, match="capture_graphs=False"):  # static buffers: say which graphs
        ModelRunner(load_hf_model(tmp_path / "llama", torch.float32), block_size=4, num_kv_blocks=8,
                    cuda_graphs="auto", capture_graphs=False)  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("backend", ["triton_paged", "torch_sdpa"])
def test_cuda_piecewise_graphs_replay_the_eager_tokens_logits_and_kv(tmp_path: Path, backend: str) -> None:
    # triton_paged: decode-only steps replay the decode graphs, the others the pieces; torch_sdpa: every step up to
    # 16 tokens the pieces. float32: a padded step's other GEMM kernels change logits by rounding only.
    if backend == "triton_paged":
        pytest.importorskip("triton", reason="the triton_paged backend needs triton")
    save_tiny_hf_model("llama", tmp_path)
    pieces = make_runner(tmp_path, "cuda", attention_backend=backend, cuda_graphs="piecewise")
    eager = make_runner(tmp_path, "cuda", attention_backend=backend, cuda_graphs="off")
    assert pieces.pieces is not None and pieces.pieces.capture_graphs
    assert sorted(pieces.pieces._captured) == [1, 2, 4, 8, 16]
    assert (pieces.graphs is not None) == (backend == "triton_paged")
    assert_same_outputs(pieces, eager, atol=1e-4)
    assert pieces.piece_steps > 0
