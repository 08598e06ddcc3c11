"""EngineClient: routing engine events to request streams, aborts, backpressure and engine failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from fake_rings import FakeRing, core_with_fake_rings, record
from ringserve import _core
from ringserve._core import AbortRequest, AddRequest, FinishReason, Shutdown, StatsQuery
from ringserve.frontend.engine_client import (
    EngineBusyError,
    EngineClient,
    EngineUnavailableError,
    RequestRejectedError,
    SamplingOptions,
)

SAMPLING = _core.SamplingParams(temperature=0.0, seed=9, has_seed=True, min_tokens=3, min_p=0.1,
                                repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.6, num_logprobs=5)
PARAMS = SamplingOptions(max_tokens=4, sampling=SAMPLING, stop_token_ids=(5,), priority=2)


class Rig:
    def __init__(self, request_capacity: int = 1000) -> None:
        self.requests = FakeRing(request_capacity)
        self.events = FakeRing()
        self.client = EngineClient(self.requests, self.events, core=core_with_fake_rings())


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    r.client.start()
    yield r
    await r.client.close()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)  # let the loop see the fd


def out(request_id: int, ids: list[int], finish: FinishReason = FinishReason.NONE) -> _core.RequestOutput:
    return record(_core.RequestOutput, request_id=request_id, new_token_ids=ids, logprobs=[0.0] * len(ids),
                  finish_reason=finish)  # fmt: skip


def events(*outputs: _core.RequestOutput) -> _core.StepEvents:
    return record(_core.StepEvents, outputs=list(outputs))


def aborted(rig: Rig) -> list[int]:
    return [r.request_id for r in rig.requests.written(AbortRequest)]


async def test_outputs_are_routed_to_their_request(rig: Rig) -> None:
    a, b = rig.client.allocate_request_id(), rig.client.allocate_request_id()
    assert a != b
    stream_a = rig.client.generate(a, [1, 2], PARAMS)
    stream_b = rig.client.generate(b, [3], PARAMS)
    first_a = asyncio.ensure_future(stream_a.__anext__())
    first_b = asyncio.ensure_future(stream_b.__anext__())
    await settle()
    adds = rig.requests.written(AddRequest)
    assert [(r.request_id, r.prompt_token_ids) for r in adds] == [(a, [1, 2]), (b, [3])]
    assert (adds[0].seed, adds[0].has_seed, adds[0].stop_token_ids, adds[0].max_tokens) == (9, True, [5], 4)
    assert (adds[0].min_tokens, adds[0].num_logprobs, adds[0].priority, adds[0].temperature) == (3, 5, 2, 0.0)
    floats = (adds[0].min_p, adds[0].repetition_penalty, adds[0].frequency_penalty, adds[0].presence_penalty)
    assert floats == pytest.approx((0.1, 1.3, 0.4, -0.6))  # float32 on the wire
    rig.events.push(events(*[out(b, [30]), out(a, [10])]))
    assert (await first_a).new_token_ids == [10]
    assert (await first_b).new_token_ids == [30]
    rig.events.push(events(*[out(a, [11], FinishReason.LENGTH), out(b, [31], FinishReason.STOP)]))
    assert [o.new_token_ids async for o in stream_a] == [[11]]
    assert [o.new_token_ids async for o in stream_b] == [[31]]
    assert rig.client.num_in_flight == 0
    assert aborted(rig) == []  # finished streams are not aborted


async def test_consumer_stopping_early_aborts_the_request(rig: Rig) -> None:
    rid = rig.client.allocate_request_id()
    stream = rig.client.generate(rid, [1], PARAMS)
    pending = asyncio.ensure_future(stream.__anext__())
    await settle()
    rig.events.push(events(*[out(rid, [7])]))
    await pending
    await stream.aclose()
    assert aborted(rig) == [rid]
    assert rig.client.num_in_flight == 0


async def test_cancelled_consumer_aborts_the_request(rig: Rig) -> None:
    rid = rig.client.allocate_request_id()

    async def consume() -> None:
        async for _ in rig.client.generate(rid, [1], PARAMS):
            pass

    task = asyncio.ensure_future(consume())
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert aborted(rig) == [rid]
    assert rig.client.num_in_flight == 0


async def test_full_request_ring_is_backpressure_and_aborts_are_retried() -> None:
    rig = Rig(request_capacity=1)
    rig.client.start()
    try:
        rid = rig.client.allocate_request_id()
        stream = rig.client.generate(rid, [1], PARAMS)
        pending = asyncio.ensure_future(stream.__anext__())
        await settle()
        with pytest.raises(EngineBusyError) as raised:
            await rig.client.generate(rig.client.allocate_request_id(), [2], PARAMS).__anext__()
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
        assert aborted(rig) == []  # the ring is still full: the abort waits
        rig.requests.records.clear()  # the engine drained the ring
        await settle()
        assert aborted(rig) == [rid]
    finally:
        await rig.client.close()


async def test_rejected_request_raises_with_the_engine_status(rig: Rig) -> None:
    rid = rig.client.allocate_request_id()
    pending = asyncio.ensure_future(rig.client.generate(rid, [1] * 99, PARAMS).__anext__())
    await settle()
    rig.events.push(record(_core.RequestRejected, request_id=rid, status_code=8,
                           message="prompt needs 7 blocks, the cache has 6"))
    with pytest.raises(RequestRejectedError) as raised:
        await pending
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "7 blocks" in raised.value.message


async def test_engine_failure_fails_every_stream_with_unavailable(rig: Rig) -> None:
    failures: list[str] = []
    rig.client.add_failure_listener(failures.append)
    streams = [rig.client.generate(rig.client.allocate_request_id(), [1], PARAMS) for _ in range(3)]
    pending = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await settle()
    rig.events.push(record(_core.EngineFailed, message="worker 0 died", reason=_core.FailureReason.WORKER_DIED))
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, EngineUnavailableError) and "worker 0 died" in r.message for r in results)
    assert failures == ["worker 0 died"]
    assert rig.client.failure == "worker 0 died" and rig.client.failure_reason == _core.FailureReason.WORKER_DIED
    assert aborted(rig) == []  # nobody to abort in a dead engine
    with pytest.raises(EngineUnavailableError):
        await rig.client.generate(rig.client.allocate_request_id(), [1], PARAMS).__anext__()


async def test_stats_reply_is_matched_by_query_id(rig: Rig) -> None:
    pending = asyncio.ensure_future(rig.client.get_stats(timeout=5))
    await settle()
    query = rig.requests.written(StatsQuery)[0].query_id
    rig.events.push(record(_core.EngineStats, query_id=query + 100, num_running=99),
                    record(_core.EngineStats, query_id=query, num_running=3))
    assert (await pending).num_running == 3


async def test_wait_ready_returns_the_ready_event_or_times_out(rig: Rig) -> None:
    with pytest.raises(TimeoutError):
        await rig.client.wait_ready(timeout=0.05)
    pending = asyncio.ensure_future(rig.client.wait_ready(timeout=5))
    await settle()
    rig.events.push(record(_core.EngineReady, max_model_len=2048))
    assert (await pending).max_model_len == 2048
    assert (await rig.client.wait_ready(0)).max_model_len == 2048


async def test_malformed_event_is_dropped_and_serving_continues(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rid = rig.client.allocate_request_id()
    pending = asyncio.ensure_future(rig.client.generate(rid, [1], PARAMS).__anext__())
    await settle()
    rig.events.push_raw(b"garbage")
    rig.events.push(events(*[out(rid, [4])]))
    assert (await pending).new_token_ids == [4]
    assert "malformed engine event" in caplog.text


async def test_shutdown_engine_writes_the_shutdown_record(rig: Rig) -> None:
    assert await rig.client.shutdown_engine(timeout=1)
    assert len(rig.requests.written(Shutdown)) == 1


