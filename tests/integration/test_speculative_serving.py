"""Speculative decoding through the real server: frontend, engine (lookahead slots) and worker (n-gram proposer)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import RunningServer, start_server
from test_generate_end_to_end import collect, greedy_request, wait_all_blocks_free

# Prompts a model continues by copying: n-gram lookup then proposes (and gets accepted) whole runs of tokens.
COPYING = [
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "The capital of France is",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spec_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # A small KV pool so concurrent requests get preempted while they speculate.
    srv = start_server(model_path, tmp_path_factory.mktemp("spec_server"), "--num-speculative-tokens", "4",
                       "--prompt-lookup-min", "1", "--num-kv-blocks", "12", "--max-num-seqs", "8")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


def test_greedy_streams_with_ngram_speculation_equal_the_plain_server(
    server: RunningServer, spec_server: RunningServer
) -> None:
    plain = server.stub()
    spec = spec_server.stub()
    expected = [collect(plain, greedy_request(prompt, MAX_TOKENS)) for prompt in COPYING]
    ids, text, responses = collect(spec, greedy_request(COPYING[0], MAX_TOKENS))
    assert (ids, text) == expected[0][:2]
    assert responses[-1].usage.completion_tokens == MAX_TOKENS
    assert responses[-1].usage.spec_accepted_tokens <= responses[-1].usage.spec_proposed_tokens
    # All at once on 12 blocks of 16: preemption mid-run, lookahead shrinking to what is free.
    with concurrent.futures.ThreadPoolExecutor(len(COPYING)) as pool:
        together = list(pool.map(lambda p: collect(spec, greedy_request(p, MAX_TOKENS)), COPYING))
    for got, want, prompt in zip(together, expected, COPYING, strict=True):
        assert got[:2] == want[:2], prompt
        assert got[2][-1].usage.spec_accepted_tokens <= got[2][-1].usage.spec_proposed_tokens
    assert sum(got[2][-1].usage.spec_accepted_tokens for got in together) > 0
    stats = wait_all_blocks_free(spec)
    assert stats.free_kv_blocks == stats.total_kv_blocks, stats


def test_greedy_streams_with_a_draft_tree_equal_the_plain_server(
    server: RunningServer, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A self-draft from the first 20 of 30 layers proposing a 2x2 tree of depth 3 (10 nodes, 10 lookahead slots);
    # 12 blocks of 16 for three concurrent requests, so they are preempted and recomputed while they speculate.
    srv = start_server(model_path, tmp_path_factory.mktemp("tree_server"), "--num-speculative-tokens", "3",
                       "--draft", "layers:20", "--spec-tree", "2x2", "--num-kv-blocks", "12",
                       "--max-num-seqs", "8")  # fmt: skip
    with srv:
        plain = server.stub()
        expected = [collect(plain, greedy_request(prompt, MAX_TOKENS)) for prompt in COPYING]
        spec = srv.stub()
        with concurrent.futures.ThreadPoolExecutor(len(COPYING)) as pool:
            together = list(pool.map(lambda p: collect(spec, greedy_request(p, MAX_TOKENS)), COPYING))
        for got, want, prompt in zip(together, expected, COPYING, strict=True):
            assert got[:2] == want[:2], prompt
            usage = got[2][-1].usage
            assert usage.spec_accepted_tokens <= usage.spec_proposed_tokens
        assert sum(got[2][-1].usage.spec_accepted_tokens for got in together) > 0
        stats = wait_all_blocks_free(spec)
        assert stats.free_kv_blocks == stats.total_kv_blocks, stats
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"
