"""`SamplingParams.n`: several completions of one prompt, fanned out to the engine after the first one's prefill."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from frontend_testkit import COMPLETION, Harness, ScriptedEngine, completion_chunks, start_harness, until
from ringserve.frontend.engine_client import SamplingOptions
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


class LoggingEngine(ScriptedEngine):
    """Records ("submit", id) when a request reaches the engine and ("output", id) for each output it streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int]] = []

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[Any]:
        self.log.append(("submit", request_id))
        async for output in super().generate(request_id, prompt_ids, params):
            self.log.append(("output", request_id))
            yield output


async def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request, timeout=10)]


def request_n(n: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi there", sampling=pb.SamplingParams(n=n, max_tokens=8, **sampling))


@pytest.fixture
async def harness(tiny_tokenizer: ModelTokenizer) -> AsyncIterator[Harness]:
    h = await start_harness(tiny_tokenizer, LoggingEngine(completion_chunks(tiny_tokenizer)))
    yield h
    await h.channel.close()
    await h.server.stop(grace=None)


async def test_each_sample_streams_under_its_index_and_ends_with_its_own_usage(
        harness: Harness, tiny_tokenizer: ModelTokenizer) -> None:  # fmt: skip
    responses = await collect(harness.stub, request_n(3))
    expected_ids = tiny_tokenizer.encode(COMPLETION, add_special_tokens=False)
    assert {r.index for r in responses} == {0, 1, 2}
    for index in range(3):
        mine = [r for r in responses if r.index == index]
        assert "".join(r.text for r in mine) == COMPLETION
        assert [t for r in mine for t in r.token_ids] == expected_ids
        assert [r.finish_reason != pb.FINISH_REASON_UNSPECIFIED for r in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert mine[-1].usage.completion_tokens == len(expected_ids)
        assert mine[-1].usage.prompt_tokens == len(tiny_tokenizer.encode("hi there"))
    assert len(harness.engine.submitted) == 3
    assert harness.server.servicer.num_waiting == 0


async def test_other_samples_are_submitted_once_sample_0_has_output(harness: Harness) -> None:
    await collect(harness.stub, request_n(3))
    log = harness.engine.log  # type: ignore[attr-defined]
    first_id = log[0][1]
    assert log[0] == ("submit", first_id)
    first_output = log.index(("output", first_id))
    other_submits = [position for position, (kind, rid) in enumerate(log) if kind == "submit" and rid != first_id]
    assert len(other_submits) == 2 and min(other_submits) > first_output


async def test_sample_i_uses_seed_plus_i(harness: Harness) -> None:
    await collect(harness.stub, request_n(3, seed=2**64 - 2))
    assert sorted(params.seed for _, _, params in harness.engine.submitted) == [0, 2**64 - 2, 2**64 - 1]
    await collect(harness.stub, request_n(2))
    assert [params.seed for _, _, params in harness.engine.submitted[-2:]] == [None, None]


async def test_greedy_n_is_allowed(harness: Harness) -> None:
    responses = await collect(harness.stub, request_n(2, temperature=0.0))
    texts = ["".join(r.text for r in responses if r.index == index) for index in range(2)]
    assert texts == [COMPLETION, COMPLETION]


async def test_each_sample_is_cut_by_its_own_stop_string_match(harness: Harness) -> None:
    responses = await collect(harness.stub, request_n(2, stop=["o 😀"]))
    for index in range(2):
        mine = [r for r in responses if r.index == index]
        assert "".join(r.text for r in mine) == "hell"
        assert mine[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("n", [0, -1, 17])
async def test_n_out_of_range_is_invalid_argument(harness: Harness, n: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(harness.stub, request_n(n))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n" in raised.value.details()
    assert not harness.engine.submitted


async def test_cancelling_the_call_aborts_every_sample(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=1)
    h = await start_harness(tiny_tokenizer, engine)
    try:
        call = h.stub.Generate(request_n(3))
        seen: set[int] = set()
        while len(seen) < 3:  # one message from each sample: all three are in the engine, hanging
            seen.add((await call.read()).index)
        call.cancel()
        await until(lambda: len(engine.aborted) == 3)
        assert sorted(engine.aborted) == sorted(rid for rid, _, _ in engine.submitted)
        await until(lambda: h.server.servicer.num_waiting == 0)
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_deadline_before_sample_0_has_output_submits_no_other_sample(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=0)
    h = await start_harness(tiny_tokenizer, engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in h.stub.Generate(request_n(4), timeout=0.5):
                pass
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: len(engine.aborted) == 1)
        assert len(engine.submitted) == 1
        await until(lambda: h.server.servicer.num_waiting == 0)  # the 3 unsent samples' places are released
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)
