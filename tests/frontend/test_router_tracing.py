"""The router's trace: one SERVER span joined to the caller's trace, CLIENT spans for the prefill and decode calls
whose contexts the upstream servers receive as their traceparent, and a kv_transfer span up to the decode server's
second message. Upstream servers are in-process fakes of the Disaggregation and Generation services."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from ringserve.frontend.routing.router import RouterServicer, Upstream
from ringserve.internal import disagg_pb2 as dpb
from ringserve.internal import disagg_pb2_grpc as dpb_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_PARENT = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


def traceparent(context: grpc.aio.ServicerContext) -> str:
    return dict(context.invocation_metadata() or ()).get("traceparent", "")


class FakeUpstream(dpb_grpc.DisaggregationServicer, pb_grpc.GenerationServicer):
    """A prefill and decode server in one: records the traceparent of each call."""

    def __init__(self, fail_prefill: bool = False) -> None:
        self.fail_prefill = fail_prefill
        self.seen: dict[str, str] = {}
        self.released: list[int] = []

    async def Prefill(self, request: dpb.PrefillRequest, context: grpc.aio.ServicerContext) -> dpb.PrefillResponse:
        self.seen["Prefill"] = traceparent(context)
        if self.fail_prefill:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill engine died")
        handle = dpb.KvHandle(engine_id="e", request_id=7, block_ids=[3, 4, 5], num_tokens=40, block_size=16,
                              tensor_parallel_size=1, backend="shm")  # fmt: skip
        return dpb.PrefillResponse(handle=handle, prompt_token_ids=list(range(40)), first_token_id=1,
                                   num_cached_tokens=16)  # fmt: skip

    async def GenerateFromKv(self, request: dpb.GenerateFromKvRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        self.seen["GenerateFromKv"] = traceparent(context)
        for token in (1, 2, 3):
            yield pb.GenerateResponse(token_ids=[token], text=str(token))

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        self.seen["Generate"] = traceparent(context)
        for token in (1, 2):
            yield pb.GenerateResponse(token_ids=[token], text=str(token))

    async def ReleaseKv(self, request: dpb.ReleaseKvRequest,
                        context: grpc.aio.ServicerContext) -> dpb.ReleaseKvResponse:  # fmt: skip
        self.released.append(request.request_id)
        return dpb.ReleaseKvResponse(released=True)


async def serve(*servicers: Any, adders: tuple[Any, ...]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for servicer, add in zip(servicers, adders, strict=True):
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


async def route(exporter: InMemorySpanExporter, upstream: FakeUpstream) -> list[pb.GenerateResponse]:
    backend, address = await serve(upstream, upstream, adders=(dpb_grpc.add_DisaggregationServicer_to_server,
                                                               pb_grpc.add_GenerationServicer_to_server))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router = RouterServicer([Upstream.connect(address)], [Upstream.connect(address)], provider.get_tracer("test"))
    front, front_address = await serve(router, adders=(pb_grpc.add_GenerationServicer_to_server,))
    try:
        async with grpc.aio.insecure_channel(front_address) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="hi", model="m"),
                                                             metadata=(("traceparent", CALLER_PARENT),))  # fmt: skip
            return [response async for response in call]
    finally:
        await front.stop(0)
        await backend.stop(0)


def by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {span.name: span for span in exporter.get_finished_spans()}


def span_parent(header: str) -> str:
    return header.split("-")[2]


async def test_one_trace_holds_the_router_its_upstream_calls_and_the_kv_transfer(exporter) -> None:
    upstream = FakeUpstream()
    responses = await route(exporter, upstream)
    assert [r.token_ids[0] for r in responses] == [1, 2, 3]
    spans = by_name(exporter)
    assert set(spans) == {"ringserve.router.generate", "prefill", "kv_transfer", "decode"}
    root = spans["ringserve.router.generate"]
    assert root.kind == SpanKind.SERVER and format(root.context.trace_id, "032x") == CALLER_TRACE
    assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
    for name in ("prefill", "kv_transfer", "decode"):
        assert spans[name].context.trace_id == root.context.trace_id
        assert spans[name].parent.span_id == root.context.span_id
    # Each upstream server's spans would nest under the router's call span: it got that span as its parent.
    assert span_parent(upstream.seen["Prefill"]) == format(spans["prefill"].context.span_id, "016x")
    assert span_parent(upstream.seen["GenerateFromKv"]) == format(spans["decode"].context.span_id, "016x")
    transfer = spans["kv_transfer"]
    assert transfer.attributes["ringserve.kv.blocks"] == 3 and transfer.attributes["ringserve.kv.tokens"] == 40
    assert spans["prefill"].attributes["ringserve.cached_tokens"] == 16
    assert spans["decode"].attributes["ringserve.completion_tokens"] == 3
    assert spans["prefill"].start_time < transfer.start_time <= transfer.end_time <= spans["decode"].end_time
    assert upstream.released == [7]


async def test_a_failed_prefill_shows_as_an_error_and_the_decode_server_computes_the_prompt(exporter) -> None:
    upstream = FakeUpstream(fail_prefill=True)
    responses = await route(exporter, upstream)
    assert [r.token_ids[0] for r in responses] == [1, 2]
    spans = by_name(exporter)
    assert set(spans) == {"ringserve.router.generate", "prefill", "decode"}  # no transfer happened
    assert spans["prefill"].status.status_code == StatusCode.ERROR
    assert [e.name for e in spans["ringserve.router.generate"].events] == ["prefill_fallback"]
    assert span_parent(upstream.seen["Generate"]) == format(spans["decode"].context.span_id, "016x")
