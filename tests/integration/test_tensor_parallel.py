"""Tensor parallelism through real processes: `serve --tensor-parallel-size N` gives exactly the TP=1 greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import real_model_path, start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from workers_testkit import save_tiny_hf_model, save_word_tokenizer

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
TOKEN_PROMPTS = [[5, 9, 200, 3, 17, 8], [250, 1, 2], list(range(30, 70))]


def greedy(stub, request: pb.GenerateRequest) -> list[int]:
    return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]


def serve_and_generate(
    model: Path, log_dir: Path, tp: int, requests: list[pb.GenerateRequest], *extra: str
) -> list[list[int]]:
    flags = ("--tensor-parallel-size", str(tp), "--num-kv-blocks", "128", "--max-num-batched-tokens", "256", *extra)
    with start_server(model, log_dir, *flags) as server:
        stub = server.stub()
        tokens = [greedy(stub, r) for r in requests]
        code = server.stop()
    assert code == 0, f"TP={tp} server exited with {code}\n{server.log()}"
    return tokens


def text_request(text: str, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_tiny_llama_over_two_ranks_decodes_exactly_like_one(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    hf = save_tiny_hf_model("llama", folder)
    save_word_tokenizer(folder, hf.config.vocab_size)
    requests = [
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        for ids in TOKEN_PROMPTS
    ]
    single = serve_and_generate(folder, tmp_path, 1, requests)
    assert all(len(t) == 12 for t in single)
    assert serve_and_generate(folder, tmp_path, 2, requests) == single
    # A draft model sharded like the target (its own paged KV per rank), proposing a 2x1 tree of depth 3.
    save_tiny_hf_model("llama", tmp_path / "draft", seed=0)
    spec = ("--num-speculative-tokens", "3", "--draft", str(tmp_path / "draft"), "--spec-tree", "2x1")
    assert serve_and_generate(folder, tmp_path, 2, requests, *spec) == single


def test_smollm2_over_three_ranks_decodes_exactly_like_one(tmp_path: Path) -> None:
    """9 heads and 3 KV heads: each of 3 ranks holds 3 query heads and 1 KV head."""
    model = real_model_path()
    requests = [text_request(t, 8) for t in TEXT_PROMPTS]
    single = serve_and_generate(model, tmp_path, 1, requests)
    assert serve_and_generate(model, tmp_path, 3, requests) == single


def test_heads_the_world_size_cannot_divide_fail_the_start_with_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    hf = save_tiny_hf_model("llama", folder)  # 4 heads
    save_word_tokenizer(folder, hf.config.vocab_size)
    with pytest.raises(AssertionError) as failed:
        start_server(folder, tmp_path, "--tensor-parallel-size", "3", ready_timeout_s=120)
    assert "does not divide the model's 4 attention heads" in str(failed.value)
