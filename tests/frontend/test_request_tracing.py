"""Request traces from the servicer against a scripted engine with engine timestamps, exported in memory."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator

import grpc
import pytest
from frontend_testkit import CONTEXT_LENGTH, MODEL, Harness, ScriptedEngine, completion_chunks
from observed_engine import TimedEngine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from ringserve.frontend.api.server import build_server
from ringserve.frontend.engine_client import EngineUnavailableError
from ringserve.frontend.observability.timeline import RequestTimeline
from ringserve.frontend.observability.tracing import RequestTracer, TracingSettings, make_exporter, span_limits
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)


class Traced:
    def __init__(self, harness: Harness, exporter: InMemorySpanExporter) -> None:
        self.harness = harness
        self.exporter = exporter

    async def generate(self, request: pb.GenerateRequest, metadata=TRACEPARENT) -> list[pb.GenerateResponse]:
        responses = [r async for r in self.harness.stub.Generate(request, metadata=metadata, timeout=10)]
        await self.settle()
        return responses

    async def settle(self) -> None:
        import asyncio

        for _ in range(3):  # spans are recorded on the loop right after the RPC ends
            await asyncio.sleep(0.01)

    def spans(self) -> dict[str, object]:
        spans = self.exporter.get_finished_spans()
        by_name = {s.name: s for s in spans}
        assert len(by_name) == len(spans), [s.name for s in spans]
        return by_name


async def start_traced(tokenizer: ModelTokenizer, engine: ScriptedEngine,
                       token_events: bool = True) -> Traced:  # fmt: skip
    exporter = InMemorySpanExporter()
    settings = TracingSettings(endpoint="memory", token_events=token_events, replica="test:1")
    provider = TracerProvider(span_limits=span_limits(settings, CONTEXT_LENGTH))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=tokenizer.vocab_size)
    server = build_server(engine, tokenizer, info, port=0, tracer=RequestTracer(provider, settings))
    await server.start()
    return Traced(Harness(server, engine, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")), exporter)


@pytest.fixture
async def traced(tiny_tokenizer: ModelTokenizer) -> AsyncIterator[Traced]:
    t = await start_traced(tiny_tokenizer, TimedEngine(completion_chunks(tiny_tokenizer), chunk=4))
    yield t
    await t.harness.channel.close()
    await t.harness.server.stop(grace=None)


def text_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello world, hello", request_id="r-1", sampling=pb.SamplingParams(**sampling))


async def test_the_request_span_continues_the_callers_trace_and_parents_each_stage(traced: Traced) -> None:
    await traced.generate(text_request(max_tokens=8, temperature=0.5, top_p=0.8))
    spans = traced.spans()
    assert set(spans) == {"ringserve.generate", "tokenize", "queue", "prefill", "decode"}
    root = spans["ringserve.generate"]
    assert root.kind is SpanKind.SERVER
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_SPAN_ID
    for name in ("tokenize", "queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == MODEL
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (8, 0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.8)
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["ringserve.request_id"] == attrs["gen_ai.response.id"] == "r-1"
    assert attrs["ringserve.replica"] == "test:1"
    assert root.status.status_code is StatusCode.UNSET


async def test_without_a_traceparent_the_request_starts_its_own_trace(traced: Traced) -> None:
    await traced.generate(text_request(max_tokens=8), metadata=())
    root = traced.spans()["ringserve.generate"]
    assert root.parent is None
    assert f"{root.context.trace_id:032x}" != TRACE_ID


async def test_a_caller_that_does_not_sample_gets_no_spans(traced: Traced) -> None:
    await traced.generate(text_request(max_tokens=8), metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-00"),))
    assert traced.exporter.get_finished_spans() == ()


async def test_span_times_are_the_engines_and_nest_inside_the_rpc(traced: Traced) -> None:
    responses = await traced.generate(text_request(max_tokens=8))
    s = traced.spans()
    root, tokenize, queue, prefill, decode = (s[n] for n in ("ringserve.generate", "tokenize", "queue", "prefill",
                                                             "decode"))  # fmt: skip
    assert root.start_time == tokenize.start_time <= tokenize.end_time <= queue.start_time
    assert queue.end_time == prefill.start_time < prefill.end_time == decode.start_time <= decode.end_time
    assert decode.end_time < root.end_time
    assert root.attributes["gen_ai.usage.output_tokens"] == sum(len(r.token_ids) for r in responses)


async def test_decode_has_one_event_per_token_with_emit_receive_and_send_times(traced: Traced,
                                                                               tiny_tokenizer) -> None:
    responses = await traced.generate(text_request(max_tokens=8))
    decode = traced.spans()["decode"]
    tokens = [e for e in decode.events if e.name == "token"]
    generated = [t for r in responses for t in r.token_ids]
    assert [e.attributes["ringserve.token.id"] for e in tokens] == generated
    assert [e.attributes["ringserve.token.index"] for e in tokens] == list(range(len(generated)))
    previous_emit = None
    for event in tokens:
        a = event.attributes
        emit = a["ringserve.token.engine_emit_time_ns"]
        assert event.timestamp == emit
        assert emit < a["ringserve.token.frontend_receive_time_ns"] <= a["ringserve.token.send_time_ns"]
        if previous_emit is None:
            assert "ringserve.token.inter_token_latency_ns" not in a
        else:  # tokens of one engine output share its emit time, so their latency after the first is 0
            assert a["ringserve.token.inter_token_latency_ns"] == emit - previous_emit >= 0
        previous_emit = emit


async def test_prefill_has_one_event_per_reported_chunk(traced: Traced) -> None:
    await traced.generate(text_request(max_tokens=8))
    prefill = traced.spans()["prefill"]
    chunks = [e.attributes for e in prefill.events]
    prompt_tokens = traced.harness.engine.submitted[0][1]
    assert [c["ringserve.chunk.tokens"] for c in chunks] == [min(4, len(prompt_tokens) - i)
                                                              for i in range(0, len(prompt_tokens), 4)]
    assert chunks[-1]["ringserve.chunk.computed_tokens"] == len(prompt_tokens)


async def test_token_events_can_be_turned_off(tiny_tokenizer: ModelTokenizer) -> None:
    t = await start_traced(tiny_tokenizer, TimedEngine(completion_chunks(tiny_tokenizer)), token_events=False)
    try:
        await t.generate(text_request(max_tokens=8))
        decode = t.spans()["decode"]
        assert decode.events == ()
        assert decode.attributes["gen_ai.usage.output_tokens"] > 0
    finally:
        await t.harness.channel.close()
        await t.harness.server.stop(grace=None)


async def test_a_rejected_request_is_an_error_span_with_the_exception(traced: Traced) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await traced.generate(text_request(max_tokens=8, top_p=1.5))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    await traced.settle()
    spans = traced.spans()
    root = spans["ringserve.generate"]
    assert root.status.status_code is StatusCode.ERROR
    assert "top_p" in root.status.description
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [e.name for e in root.events] == ["exception"]
    assert "queue" not in spans


async def test_an_engine_failure_is_an_error_span(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine([[1]], error=EngineUnavailableError("engine failed: worker died"))
    t = await start_traced(tiny_tokenizer, engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError):
            await t.generate(text_request(max_tokens=8))
        await t.settle()
        root = t.spans()["ringserve.generate"]
        assert root.status.status_code is StatusCode.ERROR
        assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert root.events[0].attributes["exception.type"].endswith("EngineUnavailableError")
    finally:
        await t.harness.channel.close()
        await t.harness.server.stop(grace=None)


def test_a_failed_timeline_keeps_the_errors_text_not_the_exception_and_its_frames() -> None:
    class Refusal(ValueError):  # a Python subclass: built-in exceptions take no weak references
        pass

    timeline = RequestTimeline(MODEL)

    def refuse() -> weakref.ref[Refusal]:
        try:
            raise Refusal("top_p must be in (0, 1]")
        except Refusal as error:
            timeline.fail(grpc.StatusCode.INVALID_ARGUMENT, error)
            return weakref.ref(error)

    gc.disable()  # without the cycle collector, only plain reference counting may free it
    try:
        error = refuse()
        assert error() is None
    finally:
        gc.enable()
    assert (timeline.error_type, timeline.error_message) == ("Refusal", "top_p must be in (0, 1]")


def test_span_limits_fit_one_event_per_token_of_the_longest_generation() -> None:
    settings = TracingSettings(endpoint="x")
    assert span_limits(settings, 8192).max_events >= 8192
    assert span_limits(TracingSettings(endpoint="x", max_span_events=50), 8192).max_events == 50


def test_http_exporter_posts_to_the_collectors_traces_path() -> None:
    exporter = make_exporter(TracingSettings(endpoint="http://collector:4318", protocol="http/protobuf"))
    assert exporter._endpoint == "http://collector:4318/v1/traces"
    exporter.shutdown()
    with pytest.raises(ValueError, match="grpc"):
        make_exporter(TracingSettings(endpoint="x", protocol="thrift"))


async def test_speculative_steps_are_decode_span_events_and_usage(tiny_tokenizer: ModelTokenizer) -> None:
    chunks = completion_chunks(tiny_tokenizer)
    t = await start_traced(tiny_tokenizer, TimedEngine(chunks, chunk=4, spec=(4, 3)), token_events=False)
    try:
        responses = await t.generate(text_request())
        usage = responses[-1].usage
        verify_steps = len(chunks) - 1
        assert usage.spec_proposed_tokens == 4 * verify_steps and usage.spec_accepted_tokens == 3 * verify_steps
        decode = t.spans()["decode"]
        events = [e for e in decode.events if e.name == "spec_verify"]
        assert len(events) == verify_steps
        assert events[0].attributes["ringserve.spec.accepted_tokens"] == 3
        assert decode.attributes["ringserve.spec.acceptance_rate"] == pytest.approx(0.75)
        assert decode.attributes["ringserve.spec.mean_accepted_length"] == pytest.approx(4.0)
    finally:
        await t.harness.channel.close()
        await t.harness.server.stop(grace=None)
