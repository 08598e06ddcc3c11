"""Traces through real processes: a client's traceparent -> frontend spans with engine times -> an OTLP/gRPC receiver
running in this test process."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
MAX_TOKENS = 12


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span, flattened, with its attributes and events decoded."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._changed = threading.Condition()

    def Export(self, request, context):
        with self._changed:
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(), "kind": span.kind, "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano, "attributes": attributes_of(span.attributes),
                            "events": [(e.name, e.time_unix_nano, attributes_of(e.attributes)) for e in span.events],
                            "status": span.status.code, "resource": resource,
                        })  # fmt: skip
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, names: set[str], timeout_s: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not names <= {s["name"] for s in self.spans}:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"spans {names} not all exported; got {[s['name'] for s in self.spans]}"
                self._changed.wait(remaining)
            return list(self.spans)


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def attributes_of(key_values) -> dict:
    return {kv.key: any_value(kv.value) for kv in key_values}


@pytest.fixture
def receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    collector = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(0)


def stream_with_traceparent(server, max_tokens: int = MAX_TOKENS) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(text="The capital of France is", request_id="traced-1",
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=0.9,
                                                            ignore_eos=True))  # fmt: skip
    metadata = (("traceparent", f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"), ("tracestate", "vendor=1"))
    with server.channel() as channel:
        from ringserve.v1 import generation_pb2_grpc

        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=120))


def test_a_streamed_request_is_one_trace_joined_to_the_clients(model_path: Path, tmp_path: Path, receiver) -> None:
    collector, port = receiver
    with start_server(model_path, tmp_path, "--otlp-traces-endpoint", f"http://127.0.0.1:{port}",
                      "--num-kv-blocks", "64", "--max-num-batched-tokens", "4") as server:  # fmt: skip
        # A 4-token budget chunks the prompt, so the prefill has several chunks when the engine reports them.
        responses = stream_with_traceparent(server)
        spans = collector.wait_for({"ringserve.generate", "tokenize", "queue", "prefill", "decode"})
        assert server.stop() == 0
    generated = [t for r in responses for t in r.token_ids]
    assert len(generated) == MAX_TOKENS

    # One trace, the client's, with the span tree generate -> {tokenize, queue, prefill, decode}.
    assert {s["trace_id"] for s in spans} == {CLIENT_TRACE_ID}
    by_name = {s["name"]: s for s in spans}
    assert len(spans) == len(by_name) == 5
    root = by_name["ringserve.generate"]
    assert root["parent"] == CLIENT_SPAN_ID
    assert root["kind"] == 2  # SPAN_KIND_SERVER
    for child in ("tokenize", "queue", "prefill", "decode"):
        assert by_name[child]["parent"] == root["span_id"]
    assert root["resource"]["service.name"] == "ringserve"

    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "ringserve"
    assert attributes["gen_ai.request.model"] == model_path.stem
    assert attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens > 0
    assert attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["ringserve.request_id"] == "traced-1"
    assert attributes["ringserve.replica"] == server.address
    assert attributes["ringserve.tensor_parallel_size"] == 1
    assert attributes["ringserve.cached_tokens"] == 0
    assert attributes["ringserve.preemptions"] == 0
    assert attributes["rpc.grpc.status_code"] == 0

    # Exactly one event per generated token, in order, with monotone times.
    events = [e for e in by_name["decode"]["events"] if e[0] == "token"]
    assert [e[2]["ringserve.token.index"] for e in events] == list(range(MAX_TOKENS))
    assert [e[2]["ringserve.token.id"] for e in events] == generated
    emits = [e[2]["ringserve.token.engine_emit_time_ns"] for e in events]
    for name, attrs in ((e[0], e[2]) for e in events):
        assert name == "token"
        emit = attrs["ringserve.token.engine_emit_time_ns"]
        assert emit <= attrs["ringserve.token.frontend_receive_time_ns"] <= attrs["ringserve.token.send_time_ns"]
    assert emits == sorted(emits) and len(set(emits)) == MAX_TOKENS  # one token per engine step here
    assert [e[2]["ringserve.token.inter_token_latency_ns"] for e in events[1:]] == [
        b - a for a, b in itertools.pairwise(emits)]  # fmt: skip
    sends = [e[2]["ringserve.token.send_time_ns"] for e in events]
    assert sends == sorted(sends)

    # Prefill: the 4-token step budget computes the prompt in ceil(prompt / 4) chunks, one event each.
    chunks = [e[2] for e in by_name["prefill"]["events"] if e[0] == "prefill_chunk"]
    prompt_tokens = attributes["gen_ai.usage.input_tokens"]
    starts = range(0, prompt_tokens, 4)
    assert [c["ringserve.chunk.tokens"] for c in chunks] == [min(4, prompt_tokens - i) for i in starts]
    assert [c["ringserve.chunk.computed_tokens"] for c in chunks] == [min(i + 4, prompt_tokens) for i in starts]

    # Engine times bracket the frontend's: RPC start <= tokenized <= engine arrival <= scheduled <= first token
    # <= last token <= RPC end, and the child spans tile the engine's part of it.
    tokenize, queue, prefill, decode = (by_name[n] for n in ("tokenize", "queue", "prefill", "decode"))
    assert root["start"] == tokenize["start"] <= tokenize["end"] <= queue["start"] <= queue["end"]
    # The engine stamps the first token when it appends it, its step's emit time a moment later.
    assert queue["end"] == prefill["start"] <= prefill["end"] == decode["start"] <= emits[0]
    assert decode["end"] == emits[-1] <= sends[-1] <= root["end"]
