"""Pipeline parallelism through real processes: `serve --pipeline-parallel-size P` (with or without tensor-parallel
ranks in each stage) gives exactly the one-rank greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ringserve.v1 import generation_pb2 as pb
from server_harness import real_model_path, start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM as HfLlamaForCausalLM
from workers_testkit import TINY, save_word_tokenizer

# 149 prompt tokens in the first step: it runs through the stages as two micro-batches (workers/pipeline.py).
TOKEN_PROMPTS = [[5, 9, 200, 3, 17, 8], [250, 1, 2], list(range(30, 170))]
FLAGS = ("--worker-threads", "1", "--num-kv-blocks", "64", "--max-num-batched-tokens", "256")


def generate(model: Path, log_dir: Path, requests: list[pb.GenerateRequest], *flags: str) -> list[list[int]]:
    with start_server(model, log_dir, *FLAGS, *flags) as server:
        stub = server.stub()
        tokens = [[t for r in stub.Generate(request, timeout=300) for t in r.token_ids] for request in requests]
        code = server.stop()
    assert code == 0, f"{flags} server exited with {code}\n{server.log()}"
    return tokens


def greedy(n: int, *, ids: list[int] | None = None, text: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    if ids is not None:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling)
    return pb.GenerateRequest(text=text, sampling=sampling)


def save_three_layer_llama(folder: Path) -> Path:
    """3 layers (stages of 2 + 1) and a tied head (the last stage keeps its own copy of the embedding)."""
    torch.manual_seed(0)
    hf = HfLlamaForCausalLM(HfLlamaConfig(**{**TINY, "num_hidden_layers": 3}, tie_word_embeddings=True))
    hf.save_pretrained(folder)
    save_word_tokenizer(folder, hf.config.vocab_size)
    return folder


@pytest.fixture(scope="module")
def three_layer_llama(tmp_path_factory) -> Path:
    return save_three_layer_llama(tmp_path_factory.mktemp("llama-3-layers"))


def test_two_stages_and_two_by_two_ranks_decode_exactly_like_one(three_layer_llama: Path, tmp_path: Path) -> None:
    requests = [greedy(32, ids=ids) for ids in TOKEN_PROMPTS]
    single = generate(three_layer_llama, tmp_path, requests)
    assert all(len(t) == 32 for t in single)
    assert generate(three_layer_llama, tmp_path, requests, "--pipeline-parallel-size", "2") == single
    two_by_two = ("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2")
    assert generate(three_layer_llama, tmp_path, requests, *two_by_two) == single


def test_the_embedded_model_in_two_stages_decodes_exactly_like_one(tmp_path: Path) -> None:
    model = real_model_path()
    requests = [greedy(32, text="The capital of France is"), greedy(32, text="def fibonacci(n):")]
    single = generate(model, tmp_path, requests)
    assert generate(model, tmp_path, requests, "--pipeline-parallel-size", "2") == single
