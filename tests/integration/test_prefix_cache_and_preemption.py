"""Prefix caching and preemption end to end on the real model (issue #3).

A request that shares a long prefix with an earlier one must report the cached prompt tokens and still produce the
output an uncached run produces; a KV pool too small for its concurrent requests must preempt, and every output must
still equal the request's solo greedy run.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.timeout(600)

# About 145 tokens: at least eight full 16-token blocks that a second request can reuse.
SHARED_PREFIX = (
    "Prefix cache check. You are a meticulous archivist of a coastal town. The ledger lists the harbour's boats by "
    "name, length, owner and the year each was built: the Gull, nine metres, owned by Ada Marsh, built in 1962; the "
    "Heron, eleven metres, owned by Tomas Reyes, built in 1971; the Puffin, seven metres, owned by the Lund family, "
    "built in 1958; the Osprey, thirteen metres, owned by the harbour trust, built in 1984; the Tern, six metres, "
    "owned by Mei Okafor, built in 1999. Read the ledger carefully and answer the question that follows."
)
TINY_POOL = ("--num-kv-blocks", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")
# Each prompt is over 10 tokens, so prompt + 24 generated tokens spans 3 blocks: 8 x 3 blocks cannot fit in 16.
CONCURRENT_PROMPTS = [
    "The history of the old stone lighthouse on the northern cape begins",
    "Write a short haiku about the autumn rain falling on a quiet city",
    "List three prime numbers larger than one hundred and explain why",
    "The quick brown fox jumps over the lazy dog, and then the dog",
    "In a distant galaxy, a small maintenance robot named Pip discovered",
    "Here is a simple recipe for fluffy pancakes: first, in a large bowl,",
    "def add(a: int, b: int) -> int:\n    \"\"\"Return the sum of a and b.",
    "The ocean at night is dark and restless, and the sailors on deck",
]


def greedy(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))


def run(server: RunningServer, request: pb.GenerateRequest) -> tuple[list[int], pb.Usage]:
    with server.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids], responses[-1].usage


def preemptions(server: RunningServer) -> int:
    with server.channel() as channel:
        stats = generation_pb2_grpc.GenerationStub(channel).GetEngineStats(pb.EngineStatsRequest(), timeout=30)
    return int(stats.num_preemptions)


@pytest.fixture(scope="module")
def tiny_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server whose KV pool (16 blocks of 16 tokens) cannot hold 8 concurrent 35-to-45-token sequences."""
    srv = start_server(model_path, tmp_path_factory.mktemp("tiny"), *TINY_POOL)
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


def test_a_shared_prefix_is_served_from_the_cache_with_unchanged_output(server: RunningServer,
                                                                         tiny_server: RunningServer) -> None:
    first_ids, first_usage = run(server, greedy(SHARED_PREFIX + " Question: who owns the Heron?", 12))
    assert first_usage.cached_tokens == 0
    question = SHARED_PREFIX + " Question: which boat is the oldest?"
    second_ids, second_usage = run(server, greedy(question, 12))
    assert second_usage.cached_tokens >= 128, second_usage  # the prefix is ~145 tokens: at least 8 full blocks
    assert second_usage.cached_tokens % 16 == 0 and second_usage.cached_tokens < second_usage.prompt_tokens
    # The same prompt on a server that never saw the prefix is computed from scratch: the outputs must agree.
    reference_ids, reference_usage = run(tiny_server, greedy(question, 12))
    assert reference_usage.cached_tokens == 0
    assert second_ids == reference_ids
    # And the identical prompt again is almost entirely cached (its last block is recomputed), same output.
    again_ids, again_usage = run(server, greedy(question, 12))
    assert again_usage.cached_tokens >= second_usage.cached_tokens and again_ids == second_ids
    assert first_ids != second_ids or first_usage.prompt_tokens != second_usage.prompt_tokens


def test_a_tiny_kv_pool_preempts_and_every_output_equals_its_solo_run(tiny_server: RunningServer) -> None:
    max_tokens = 24
    solo = [run(tiny_server, greedy(p, max_tokens))[0] for p in CONCURRENT_PROMPTS]
    before = preemptions(tiny_server)
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as pool:
        together = list(pool.map(lambda p: run(tiny_server, greedy(p, max_tokens))[0], CONCURRENT_PROMPTS))
    assert preemptions(tiny_server) > before, "8 sequences of 3 blocks each in 16 blocks must preempt"
    for prompt, want, got in zip(CONCURRENT_PROMPTS, solo, together, strict=True):
        assert got == want, f"output of {prompt!r} changed under preemption"
