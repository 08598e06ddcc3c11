"""One architecture of each kind served by the real server, on one rank and over two tensor-parallel ranks, gives
transformers' greedy tokens; prompts are prefilled in chunks of 8 tokens, so chunks cross the 8-token windows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from workers_testkit import hf_greedy, save_tiny_hf_model, save_word_tokenizer

# dense with fused checkpoint tensors, q/k/v biases, q/k norms, sliding windows, experts with a shared expert
KINDS = ("phi3", "qwen2_attention_bias", "qwen3", "mistral_sliding_window", "qwen2_moe", "gemma2", "gemma3")
PROMPTS = [[5, 9, 200, 3, 17, 8, 44, 61, 90, 12, 7, 33, 150, 2, 99, 64, 31, 18, 77], [250, 1, 2], list(range(30, 50))]
NEW_TOKENS = 32


def served_greedy(model: Path, log_dir: Path, tp: int) -> list[list[int]]:
    flags = ("--tensor-parallel-size", str(tp), "--num-kv-blocks", "64", "--block-size", "4",
             "--max-num-batched-tokens", "8", "--worker-threads", "1")  # fmt: skip
    with start_server(model, log_dir, *flags) as server:
        stub = server.stub()
        tokens = []
        for prompt in PROMPTS:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            )
            tokens.append([t for r in stub.Generate(request, timeout=300) for t in r.token_ids])
        code = server.stop()
    assert code == 0, f"TP={tp} server exited with {code}\n{server.log()}"
    return tokens


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_architecture_serves_transformers_greedy_tokens_on_one_and_two_ranks(tmp_path, kind):
    folder = tmp_path / kind
    hf = save_tiny_hf_model(kind, folder)
    save_word_tokenizer(folder, hf.config.vocab_size)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert served_greedy(folder, tmp_path, 1) == expected
    assert served_greedy(folder, tmp_path, 2) == expected
