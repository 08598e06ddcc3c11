"""EngineClient over real shared-memory rings from `ringserve._core` (skipped until the extension is built)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator

import grpc
import pytest
from ringserve import _core
from ringserve.formats.segments import new_segment_name
from ringserve.frontend.api.server import build_server, describe_model
from ringserve.frontend.engine_client import EngineClient, SamplingOptions
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

core = pytest.importorskip("ringserve._core")


@pytest.fixture
def rings() -> Iterator[tuple[object, object]]:
    request_ring = core.ShmRing.create(new_segment_name("req"), 1 << 16)
    event_ring = core.ShmRing.create(new_segment_name("evt"), 1 << 16)
    try:
        yield request_ring, event_ring
    finally:
        request_ring.unlink()
        event_ring.unlink()


async def read_record(reader: object) -> bytes:
    for _ in range(500):
        record = reader.try_read()  # type: ignore[attr-defined]
        if record is not None:
            return bytes(record)
        await asyncio.sleep(0.01)
    raise AssertionError("no record arrived on the request ring")


def header(record: bytes) -> tuple[int, int, int]:
    return struct.unpack_from("<IHH", record)


async def test_request_and_abort_records_reach_the_request_ring(rings: tuple[object, object]) -> None:
    request_ring, event_ring = rings
    engine_side = core.RingReader(core.ShmRing.attach(request_ring.name))  # type: ignore[attr-defined]
    client = EngineClient(request_ring, event_ring)
    client.start()
    try:
        request_id = client.allocate_request_id()
        seeded = SamplingOptions(max_tokens=4, sampling=_core.SamplingParams(seed=5, has_seed=True))
        stream = client.generate(request_id, [1, 2, 3], seeded)
        first = asyncio.ensure_future(stream.__anext__())
        add = await read_record(engine_side)
        length, kind, _version = header(add)
        assert length == len(add)
        assert kind == header(core.encode_add_request(core.AddRequest()))[1]
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        assert await read_record(engine_side) == core.encode_abort_request(request_id)
        assert client.num_in_flight == 0
    finally:
        await client.close()


class RingEcho:
    """A stand-in engine on the far side of real rings: answers each AddRequest with its prompt's ids, one token
    per step, then LENGTH; answers StatsQuery; records aborts."""

    def __init__(self, request_ring: object, event_ring: object) -> None:
        self.reader = core.RingReader(core.ShmRing.attach(request_ring.name))  # type: ignore[attr-defined]
        self.writer = core.RingWriter(core.ShmRing.attach(event_ring.name))  # type: ignore[attr-defined]
        self.aborted: list[int] = []
        self.requests: list[object] = []

    def emit(self, event: object) -> None:
        assert self.writer.try_write(core.encode_record(event))

    async def run(self) -> None:
        ready = core.EngineReady()
        ready.num_total_blocks, ready.block_size, ready.max_model_len = 100, 16, 64
        self.emit(ready)
        while True:
            raw = self.reader.try_read()
            if raw is None:
                await asyncio.sleep(0.005)
                continue
            record = core.decode_request_record(raw)
            if isinstance(record, core.AddRequest):
                self.requests.append(record)
                ids = list(record.prompt_token_ids)
                for index, token in enumerate(ids):
                    output = core.RequestOutput()
                    output.request_id, output.new_token_ids, output.logprobs = record.request_id, [token], [-1.0]
                    last = index == len(ids) - 1
                    output.finish_reason = core.FinishReason.LENGTH if last else core.FinishReason.NONE
                    step = core.StepEvents()
                    step.outputs = [output]
                    self.emit(step)
                    await asyncio.sleep(0)
            elif isinstance(record, core.AbortRequest):
                self.aborted.append(record.request_id)
            elif isinstance(record, core.StatsQuery):
                stats = core.EngineStats()
                stats.query_id, stats.num_running = record.query_id, 7
                self.emit(stats)


async def test_generate_round_trips_through_real_rings_and_grpc(rings: tuple[object, object],
                                                                tiny_tokenizer: ModelTokenizer) -> None:
    request_ring, event_ring = rings
    echo = RingEcho(request_ring, event_ring)
    echo_task = asyncio.ensure_future(echo.run())
    client = EngineClient(request_ring, event_ring)
    client.start()
    ready = await client.wait_ready(timeout=10)
    info = describe_model("tiny", "llama", "float32", 1, ready, tiny_tokenizer)
    server = build_server(client, tiny_tokenizer, info, port=0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.GenerationStub(channel)
        text = "héllo 😀"
        request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=30, seed=4))
        responses = [r async for r in stub.Generate(request, timeout=10)]
        assert "".join(r.text for r in responses) == text  # the echo engine returns the prompt
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        added = echo.requests[-1]
        assert (added.max_tokens, added.seed, added.has_seed) == (30, 4, True)
        assert (await stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)).num_running == 7
        assert echo.aborted == []
    finally:
        await channel.close()
        await server.stop(grace=None)
        await client.close()
        echo_task.cancel()
        await asyncio.gather(echo_task, return_exceptions=True)
