"""OpenTelemetry traces of Generate RPCs: one SERVER span per RPC, joined to the caller's W3C trace context, with
child spans tokenize, queue, prefill (an event per prefill chunk) and decode (an event per generated token).

Spans are built after the RPC ends from its `RequestTimeline`, with the engine's own timestamps as span times, so
the token path pays only list appends while tracing is on and nothing at all while it is off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from ringserve.frontend.observability.timeline import RequestTimeline

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
TRACER_NAME = "ringserve.frontend"
PROVIDER_NAME = "ringserve"  # gen_ai.provider.name: the serving system, as vLLM reports "vllm"
_W3C = TraceContextTextMapPropagator()
# Room left on top of one event per token for prefill chunk and preemption events.
_EVENT_HEADROOM = 256


@dataclass(frozen=True)
class TracingSettings:
    """Where and how spans are exported; built from CLI flags that default to the standard OTEL_* variables."""

    endpoint: str  # OTLP collector; empty = tracing off
    protocol: str = "grpc"  # grpc | http/protobuf
    token_events: bool = True
    max_span_events: int = 0  # 0 = one per token up to the context length, plus headroom
    replica: str = ""  # which frontend served the request (host:port)
    tensor_parallel_size: int = 1

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def make_exporter(settings: TracingSettings) -> SpanExporter:
    """An OTLP span exporter; headers, timeout, compression and certificates come from the OTEL_* variables."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        # The exporter takes http:// as "no TLS"; a bare host:port is treated the same on loopback setups.
        endpoint = settings.endpoint
        insecure = endpoint.startswith("http://") or "://" not in endpoint
        return GrpcExporter(endpoint=endpoint, insecure=insecure)
    if settings.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        endpoint = settings.endpoint if "://" in settings.endpoint else f"http://{settings.endpoint}"
        if urlparse(endpoint).path in ("", "/"):  # a collector base address: traces go to its /v1/traces
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unknown OTLP protocol {settings.protocol!r}; use one of {', '.join(PROTOCOLS)}")


def make_resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME win; otherwise the service is called ringserve."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "ringserve"}))
    return resource


def span_limits(settings: TracingSettings, context_length: int) -> SpanLimits:
    """Enough events for one per generated token: a generation is never longer than the context."""
    max_events = settings.max_span_events or max(context_length, 1) + _EVENT_HEADROOM
    return SpanLimits(max_events=max_events)


_RPC_SERVICES = {"Generate": "ringserve.v1.Generation"}


class RequestTracer:
    """Turns finished RequestTimelines into spans on a TracerProvider (which owns export and sampling)."""

    def __init__(self, provider: TracerProvider, settings: TracingSettings) -> None:
        self.provider = provider
        self.settings = settings
        self._tracer = provider.get_tracer(TRACER_NAME)

    @classmethod
    def from_settings(cls, settings: TracingSettings, context_length: int,
                      exporter: SpanExporter | None = None) -> RequestTracer:
        """The sampler comes from OTEL_TRACES_SAMPLER(_ARG), batching from OTEL_BSP_* (the SDK reads both)."""
        provider = TracerProvider(resource=make_resource(), span_limits=span_limits(settings, context_length),
                                  shutdown_on_exit=False)  # the launcher flushes on its own shutdown path
        provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(settings)))
        return cls(provider, settings)

    def shutdown(self) -> None:
        """Flush what is queued and stop the export thread."""
        self.provider.shutdown()

    def record(self, t: RequestTimeline) -> None:
        """Emit the spans of one finished RPC."""
        parent = _W3C.extract(t.parent_headers) if t.parent_headers else None
        name = "ringserve.prefill" if t.rpc_method == "Prefill" else "ringserve.generate"
        server = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                         start_time=t.rpc_start_ns, attributes=self._request_attributes(t))
        if not server.is_recording():  # sampled out (e.g. the caller's trace is not sampled)
            return
        context = trace.set_span_in_context(server)
        if t.tokenize_end_ns:
            self._tracer.start_span("tokenize", context, start_time=t.rpc_start_ns,
                                    attributes={"gen_ai.usage.input_tokens": t.prompt_tokens}).end(t.tokenize_end_ns)
        if t.engine_arrival_ns and t.first_scheduled_ns:
            self._tracer.start_span("queue", context, start_time=t.engine_arrival_ns).end(t.first_scheduled_ns)
        if t.kv_pull_blocks:
            if t.first_scheduled_ns and t.kv_pulled_ns:
                # The prompt's KV came from the prefill server: the workers pulled it at the start of the step that
                # admitted the request (engine times: that step planned -> its output, which includes one decode).
                self._tracer.start_span("kv_transfer", context, start_time=t.first_scheduled_ns, attributes={
                    "ringserve.kv.direction": "pull", "ringserve.kv.blocks": t.kv_pull_blocks,
                    "ringserve.kv.tokens": t.prompt_tokens}).end(t.kv_pulled_ns)  # fmt: skip
        elif t.first_scheduled_ns and t.first_token_ns:
            self._prefill_span(t, context)
        if t.first_token_ns:
            self._decode_span(t, context)
        self._finish_server_span(server, t)

    def _request_attributes(self, t: RequestTimeline) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if t.chat else "text_completion",
            "gen_ai.provider.name": PROVIDER_NAME,
            "gen_ai.system": PROVIDER_NAME,  # the older conventions' name for the provider
            "gen_ai.request.model": t.model,
            "rpc.system": "grpc",
            "rpc.service": _RPC_SERVICES.get(t.rpc_method, "ringserve.internal.Disaggregation"),
            "rpc.method": t.rpc_method,
            "ringserve.request_id": t.request_id,
            "ringserve.api": t.api,  # the front door: ringserve (gRPC), openai (HTTP), ...
            "ringserve.replica": self.settings.replica,
            "ringserve.tensor_parallel_size": self.settings.tensor_parallel_size,
        }
        if t.params is not None:
            attributes["gen_ai.request.max_tokens"] = t.params.max_tokens
            attributes["gen_ai.request.temperature"] = t.params.sampling.temperature
            attributes["gen_ai.request.top_p"] = t.params.sampling.top_p
            if t.params.sampling.top_k:
                attributes["gen_ai.request.top_k"] = t.params.sampling.top_k
            if t.params.seed is not None:
                attributes["gen_ai.request.seed"] = t.params.seed
        return attributes

    def _prefill_span(self, t: RequestTimeline, context: Any) -> None:
        span = self._tracer.start_span("prefill", context, start_time=t.first_scheduled_ns, attributes={
            "ringserve.prompt_tokens": t.prompt_tokens, "ringserve.cached_tokens": t.num_cached_tokens})
        if t.prefill_chunks:
            for emit, scheduled, computed, cached in t.prefill_chunks:
                span.add_event("prefill_chunk", {"ringserve.chunk.tokens": scheduled,
                                                 "ringserve.chunk.computed_tokens": computed,
                                                 "ringserve.chunk.cached_tokens": cached}, emit or None)
        else:  # the engine does not report chunks: the whole uncached prompt is one
            span.add_event("prefill_chunk", {"ringserve.chunk.tokens": t.prompt_tokens - t.num_cached_tokens,
                                             "ringserve.chunk.computed_tokens": t.prompt_tokens,
                                             "ringserve.chunk.cached_tokens": t.num_cached_tokens}, t.first_token_ns)
        span.end(t.first_token_ns)

    def _decode_span(self, t: RequestTimeline, context: Any) -> None:
        end = max(t.last_emit_ns, t.first_token_ns)
        attributes = {"gen_ai.usage.output_tokens": t.completion_tokens}
        if t.spec_steps:
            proposed, accepted = t.spec_proposed_tokens, t.spec_accepted_tokens
            attributes.update({"ringserve.spec.proposed_tokens": proposed, "ringserve.spec.accepted_tokens": accepted,
                               "ringserve.spec.acceptance_rate": accepted / proposed,
                               "ringserve.spec.mean_accepted_length": 1 + accepted / len(t.spec_steps)})
        span = self._tracer.start_span("decode", context, start_time=t.first_token_ns, attributes=attributes)
        for emit, proposed, accepted in t.spec_steps:  # one per verification step, even without token events
            span.add_event("spec_verify", {"ringserve.spec.proposed_tokens": proposed,
                                           "ringserve.spec.accepted_tokens": accepted}, emit or None)
        if self.settings.token_events:
            index = 0
            previous = 0
            for ids, emit, received, sent in zip(t.token_ids, t.emit_ns, t.receive_ns, t.send_ns, strict=True):
                for token_id in ids:
                    attributes = {"ringserve.token.index": index, "ringserve.token.id": token_id,
                                  "ringserve.token.engine_emit_time_ns": emit,
                                  "ringserve.token.frontend_receive_time_ns": received,
                                  "ringserve.token.send_time_ns": sent}
                    if index:  # the first token's latency is the TTFT, on the server span
                        attributes["ringserve.token.inter_token_latency_ns"] = emit - previous
                    span.add_event("token", attributes, emit or None)
                    previous = emit
                    index += 1
        span.end(end)

    def _finish_server_span(self, server: Any, t: RequestTimeline) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": t.prompt_tokens,
            "gen_ai.usage.output_tokens": t.completion_tokens,
            "ringserve.cached_tokens": t.num_cached_tokens,
            "ringserve.preemptions": t.num_preemptions,
        }
        if t.request_id:
            attributes["gen_ai.response.id"] = t.request_id
        if t.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = (t.finish_reason,)
        if t.first_token_ns:
            attributes["ringserve.time_to_first_token_ns"] = t.first_token_ns - t.rpc_start_ns
        code = t.error_code or grpc.StatusCode.OK
        attributes["rpc.grpc.status_code"] = code.value[0]
        server.set_attributes(attributes)
        if t.error_code is not None and code is not grpc.StatusCode.CANCELLED:
            # The exception event of OpenTelemetry's semantic conventions, from the text the timeline kept.
            event = {"exception.type": t.error_type, "exception.message": t.error_message, "exception.escaped": "False"}
            server.add_event("exception", event, timestamp=t.end_ns)
            server.set_status(Status(StatusCode.ERROR, f"{code.name}: {t.error_message}"))
        server.end(t.end_ns)
