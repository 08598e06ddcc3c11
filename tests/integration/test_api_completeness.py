"""Issue #6 API on the real model: stop strings, n, cache_salt, Detokenize, ListModels, priority order and the
waiting-queue bound."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 120.0
# Over 40 tokens: two full 16-token blocks that a later request with the same prompt (and salt) can reuse.
LONG_PROMPT = (
    "The harbour ledger lists the boats by name, length and owner: the Gull, nine metres, owned by Ada Marsh; "
    "the Heron, eleven metres, owned by Tomas Reyes; the Puffin, seven metres, owned by the Lund family. Summary:"
)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.GenerationStub]:
    with server.channel() as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def greedy(text: str, max_tokens: int, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True, **sampling))


def wait_for_idle_engine(stub: pb_grpc.GenerationStub) -> pb.EngineStats:
    """Every request finished or aborted in the engine and every block back in the pool."""
    deadline = time.monotonic() + 30
    while True:
        stats = stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)
        if stats.num_running == stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
            return stats
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.05)


def test_stop_string_spanning_tokens_cuts_the_text_and_ends_the_engine_request(stub: pb_grpc.GenerationStub) -> None:
    base = generate(stub, greedy("The capital of France is", 16))
    ids = [t for r in base for t in r.token_ids]
    text = "".join(r.text for r in base)
    prefixes = [stub.Detokenize(pb.DetokenizeRequest(token_ids=ids[:k]), timeout=10).text for k in range(len(ids))]
    # A stop string made of the last two characters of one token and the first two of the next.
    boundary = next(len(prefixes[k]) for k in range(2, len(ids))
                    if len(prefixes[k]) - len(prefixes[k - 1]) >= 2 and len(text) - len(prefixes[k]) >= 2)
    stop = text[boundary - 2:boundary + 2]
    cut = text.find(stop)

    stopped = generate(stub, greedy("The capital of France is", 16, stop=[stop, "never appears"]))
    assert "".join(r.text for r in stopped) == text[:cut]
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
    stopped_ids = [t for r in stopped for t in r.token_ids]
    assert stopped_ids == ids[:len(stopped_ids)] and len(stopped_ids) < 16
    assert stopped[-1].usage.completion_tokens == len(stopped_ids)
    wait_for_idle_engine(stub)  # aborted in the engine: its blocks are back

    kept = generate(stub, greedy("The capital of France is", 16, stop=[stop], include_stop_str_in_output=True))
    assert "".join(r.text for r in kept) == text[:cut + len(stop)]
    assert kept[-1].finish_reason == pb.FINISH_REASON_STOP


def test_n_greedy_samples_share_the_prompt_blocks_and_match(stub: pb_grpc.GenerationStub) -> None:
    request = greedy(LONG_PROMPT, 6, n=3)
    request.cache_salt = uuid.uuid4().hex  # nothing from earlier tests is cached for this request
    responses = generate(stub, request)
    finals = {r.index: r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert sorted(finals) == [0, 1, 2]
    texts = ["".join(r.text for r in responses if r.index == i) for i in range(3)]
    assert texts[0] and texts == [texts[0]] * 3
    prompt_tokens = finals[0].usage.prompt_tokens
    full_blocks = (prompt_tokens - 1) // 16 * 16  # the last prompt token is always computed
    assert prompt_tokens > 32 and finals[0].usage.cached_tokens == 0
    assert [finals[i].usage.cached_tokens for i in (1, 2)] == [full_blocks, full_blocks]
    assert all(finals[i].usage.completion_tokens == 6 and finals[i].finish_reason == pb.FINISH_REASON_LENGTH
               for i in range(3))


def test_n_seeded_samples_differ(stub: pb_grpc.GenerationStub) -> None:
    request = pb.GenerateRequest(text="Write a word:", sampling=pb.SamplingParams(
        max_tokens=8, temperature=1.0, ignore_eos=True, seed=11, n=4))
    responses = generate(stub, request)
    completions = {i: tuple(t for r in responses if r.index == i for t in r.token_ids) for i in range(4)}
    assert all(len(ids) == 8 for ids in completions.values())
    assert len(set(completions.values())) > 1


def test_cache_salt_keeps_prefix_cache_blocks_apart(stub: pb_grpc.GenerationStub) -> None:
    prompt = f"{uuid.uuid4().hex} {LONG_PROMPT}"

    def cached_tokens(salt: str) -> int:
        request = greedy(prompt, 1)
        request.cache_salt = salt
        return generate(stub, request)[-1].usage.cached_tokens

    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-b") == 0  # same prompt, other salt: nothing shared
    assert cached_tokens("") == 0
    assert cached_tokens("tenant-a") > 0
    assert cached_tokens("") > 0


def test_detokenize_inverts_tokenize_and_rejects_unknown_ids(stub: pb_grpc.GenerationStub) -> None:
    text = "héllo 😀 wörld"
    ids = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=False), timeout=10).token_ids
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text == text
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, info.vocab_size]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in raised.value.details()


def test_list_models_and_model_info_describe_the_served_model(stub: pb_grpc.GenerationStub) -> None:
    listing = stub.ListModels(pb.ListModelsRequest(), timeout=10)
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert list(listing.models) == [info] and listing.default_model == info.model
    assert info.state == pb.MODEL_STATE_READY
    assert (info.architecture, info.context_length, info.dtype, info.tensor_parallel_size, info.block_size) == (
        "llama", 8192, "float32", 1, 16)
    assert info.kv_capacity_tokens == 256 * 16  # the session server's --num-kv-blocks 256


@pytest.fixture(scope="module")
def one_seq_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("one_seq"), "--max-num-seqs", "1",
                       "--max-waiting-requests", "2", "--num-kv-blocks", "128")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


def test_priority_orders_waiting_requests_and_the_waiting_queue_is_bounded(one_seq_server: RunningServer) -> None:
    with one_seq_server.channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        running = stub.Generate(greedy("Count slowly:", 400), timeout=TIMEOUT_S)
        assert next(running).token_ids  # it runs; with --max-num-seqs 1 everything after it waits
        finished: list[str] = []

        def consume(name: str, priority: int) -> None:
            request = greedy("Hello", 3)
            request.priority = priority
            responses = generate(stub, request)
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
            finished.append(name)

        threads = [threading.Thread(target=consume, args=args) for args in (("low", 10), ("high", -10))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10).num_waiting < 2:
            assert time.monotonic() < deadline, "the two requests never reached the engine's waiting queue"
            time.sleep(0.02)

        with pytest.raises(grpc.RpcError) as raised:  # two wait already: --max-waiting-requests 2
            generate(stub, greedy("Hello", 3))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-waiting-requests" in raised.value.details()

        running.cancel()  # frees the one running slot: the waiting requests run, best priority first
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert finished == ["high", "low"]
        wait_for_idle_engine(stub)
