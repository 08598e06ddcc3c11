"""`ringserve router`: the public API (ringserve.v1 Generation, TorchServe inference) in front of prefill and
decode servers (DESIGN.md §8).

Per request: pick the prefill server and the decode server with the fewest outstanding tokens, ask the prefill
server for the first token and a KV handle, then stream the decode server's GenerateFromKv (which starts with that
token) back to the client. The prefill server's pinned blocks are released once the decode server answered past
its first message (its workers have pulled them) or failed.

Tracing (with --otlp-traces-endpoint): a SERVER span `ringserve.router.generate`, joined to the caller's W3C trace
context, with CLIENT spans `prefill` (the Prefill call) and `decode` (the decode server's stream) and a `kv_transfer`
span from the GenerateFromKv call to the decode server's second message, the first one computed after its workers
pulled the blocks (so it also holds that first decode step). Each upstream call carries its own span as
`traceparent`, so the prefill and decode servers' spans nest under it in one trace. Without an endpoint the
caller's trace context is passed on unchanged.

Failures: a prefill server that is unreachable or fails makes the request fall back to an ordinary Generate on
the decode server (it computes the prompt itself); a decode server that fails ends the request with UNAVAILABLE
and a message naming it, and while it cannot be reached (its last request failed to connect, or its channel is
failing to) new requests go to the other decode servers.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import hashlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from ringserve.frontend.api.torchserve import TorchServeInferenceServicer
from ringserve.frontend.launcher import otel_traces_endpoint, otel_traces_protocol
from ringserve.internal import disagg_pb2 as dpb
from ringserve.internal import disagg_pb2_grpc as dpb_grpc
from ringserve.torchserve import inference_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("ringserve.router")

_FORWARDED_METADATA = frozenset(("traceparent", "tracestate", "authorization", "x-api-key"))
_FALLBACK_CODES = frozenset((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED))  # fmt: skip
_RELEASE_TIMEOUT_S = 5.0
_UNREACHABLE_S = 10.0  # a decode server whose request failed with UNAVAILABLE is passed over this long

_W3C = TraceContextTextMapPropagator()


@dataclass
class Upstream:
    """One prefill or decode server and the tokens the router has in flight on it."""

    address: str
    channel: grpc.aio.Channel
    generation: pb_grpc.GenerationStub
    disagg: dpb_grpc.DisaggregationStub
    outstanding_tokens: int = 0
    unreachable_at: float | None = None  # time.monotonic() of its last UNAVAILABLE, None once it answers again

    def reachable(self, now: float) -> bool:
        if self.unreachable_at is not None and now - self.unreachable_at < _UNREACHABLE_S:
            return False
        state = self.channel.get_state() if self.channel is not None else None
        return state != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    @classmethod
    def connect(cls, address: str) -> Upstream:
        channel = grpc.aio.insecure_channel(address)
        return cls(address, channel, pb_grpc.GenerationStub(channel), dpb_grpc.DisaggregationStub(channel))


def least_loaded(upstreams: Sequence[Upstream]) -> Upstream:
    """Fewest outstanding tokens; ties go to the first listed."""
    return min(upstreams, key=lambda u: u.outstanding_tokens)


def choose_decode(upstreams: Sequence[Upstream]) -> Upstream:
    """The least loaded of the reachable decode servers (of all of them when none is, so the request still gets a
    clear error)."""
    now = time.monotonic()
    return least_loaded([u for u in upstreams if u.reachable(now)] or upstreams)


def prompt_prefix(request: pb.GenerateRequest, chars: int) -> bytes:
    """The leading prompt content that prefix caching could share (empty when there is none to go by)."""
    if request.HasField("token_ids"):
        return array.array("i", request.token_ids.ids[: max(chars // 4, 1)]).tobytes()
    if request.HasField("messages"):
        text = "\x1e".join(f"{m.role}\x1f{m.content}" for m in request.messages.messages)
    else:
        text = request.text
    return text[:chars].encode()


def choose_prefill(upstreams: Sequence[Upstream], prefix: bytes, slack_tokens: int) -> tuple[Upstream, str]:
    """Prefix-cache-aware choice: requests that start alike go to the same prefill server (rendezvous hashing of
    the prompt's leading content over the servers), so its prefix cache serves them, unless that server has more
    than `slack_tokens` outstanding beyond the least loaded one; then the least loaded. Returns (server, reason)."""
    least = least_loaded(upstreams)
    if len(upstreams) == 1 or not prefix or slack_tokens < 0:
        return least, "least_loaded"
    preferred = max(upstreams, key=lambda u: hashlib.blake2b(prefix + u.address.encode(), digest_size=8).digest())
    if preferred.outstanding_tokens - least.outstanding_tokens > slack_tokens:
        return least, "least_loaded"
    return preferred, "prefix_affinity"


def estimate_prompt_tokens(request: pb.GenerateRequest) -> int:
    """A cheap load estimate without a tokenizer: ~4 bytes per token of text."""
    if request.HasField("token_ids"):
        return len(request.token_ids.ids)
    if request.HasField("messages"):
        return sum(len(m.content) for m in request.messages.messages) // 4 + 1
    return len(request.text) // 4 + 1


class RouterTrace:
    """The router's spans of one request; every method is a no-op when tracing is off (no tracer)."""

    def __init__(self, tracer: Tracer | None, metadata: tuple[tuple[str, str], ...]) -> None:
        self._tracer = tracer
        self._metadata = metadata
        self._root: Span | None = None
        self._context: Any = None
        self._transfer: Span | None = None

    @classmethod
    def start(cls, tracer: Tracer | None, request: pb.GenerateRequest,
              metadata: tuple[tuple[str, str], ...]) -> RouterTrace:  # fmt: skip
        trace = cls(tracer, metadata)
        if tracer is not None:
            from opentelemetry import trace as otel
            from opentelemetry.trace import SpanKind

            parent = _W3C.extract({k: v for k, v in metadata if k in ("traceparent", "tracestate")})
            trace._root = tracer.start_span("ringserve.router.generate", context=parent, kind=SpanKind.SERVER,
                                            attributes={"rpc.system": "grpc", "rpc.method": "Generate",
                                                        "rpc.service": "ringserve.v1.Generation",
                                                        "gen_ai.request.model": request.model})  # fmt: skip
            trace._context = otel.set_span_in_context(trace._root)
        return trace

    def attribute(self, key: str, value: Any) -> None:
        if self._root is not None:
            self._root.set_attribute(key, value)

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        if self._root is not None:
            self._root.add_event(name, attributes)

    def child(self, name: str, address: str) -> Span | None:
        if self._tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        host, _, port = address.rpartition(":")
        return self._tracer.start_span(name, context=self._context, kind=SpanKind.CLIENT,
                                       attributes={"server.address": host, "server.port": int(port or 0)})  # fmt: skip

    def metadata(self, span: Span | None) -> tuple[tuple[str, str], ...]:
        """The metadata for an upstream call: the caller's, with `span` as the trace parent when tracing."""
        if span is None:
            return self._metadata
        from opentelemetry import trace as otel

        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=otel.set_span_in_context(span))
        kept = tuple((k, v) for k, v in self._metadata if k not in ("traceparent", "tracestate"))
        return kept + tuple(carrier.items())

    def end(self, span: Span | None, *, error: grpc.aio.AioRpcError | None = None, **attributes: int) -> None:
        if span is None or not span.is_recording():
            return
        from opentelemetry.trace import Status, StatusCode

        for key, value in attributes.items():
            span.set_attribute(f"ringserve.{key}", value)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{error.code().name}: {error.details()}"))
            span.set_attribute("rpc.grpc.status_code", error.code().value[0])
        span.end()

    def start_transfer(self, pre: dpb.PrefillResponse) -> None:
        if self._tracer is None:
            return
        handle = pre.handle
        self._transfer = self._tracer.start_span("kv_transfer", context=self._context, attributes={
            "ringserve.kv.backend": handle.backend, "ringserve.kv.blocks": len(handle.block_ids),
            "ringserve.kv.tokens": handle.num_tokens, "ringserve.kv.block_size": handle.block_size,
            "ringserve.kv.tensor_parallel_size": handle.tensor_parallel_size,
            "ringserve.kv.includes_first_decode_step": True,
        })  # fmt: skip

    def end_transfer(self) -> None:
        if self._transfer is not None:
            self._transfer.end()
            self._transfer = None

    def fail(self, error: BaseException) -> None:
        if self._root is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            self._root.set_status(Status(StatusCode.ERROR, "CANCELLED"))
        else:
            self._root.record_exception(error)
            self._root.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))

    def finish(self) -> None:
        if self._transfer is not None:  # the stream ended before the decode server's second message
            self._transfer.set_attribute("ringserve.kv.completed", False)
            self.end_transfer()
        if self._root is not None:
            self._root.end()


@dataclass
class RouterServicer(pb_grpc.GenerationServicer):
    prefill: list[Upstream]
    decode: list[Upstream]
    tracer: Tracer | None = None
    prefix_chars: int = 512  # leading prompt characters that pick the prefill server (0 = least loaded only)
    prefix_slack_tokens: int = 8192  # how much busier than the least loaded the prefix's server may be
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        metadata = tuple((k, v) for k, v in context.invocation_metadata() or () if k in _FORWARDED_METADATA)
        trace = RouterTrace.start(self.tracer, request, metadata)
        prompt_cost = estimate_prompt_tokens(request)
        decode_cost = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 256
        decode = choose_decode(self.decode)
        decode.outstanding_tokens += decode_cost
        trace.attribute("ringserve.router.decode_server", decode.address)
        prefill: Upstream | None = None
        try:
            pre = None
            if request.sampling.n <= 1:
                prefix = prompt_prefix(request, self.prefix_chars) if self.prefix_chars > 0 else b""
                prefill, reason = choose_prefill(self.prefill, prefix, self.prefix_slack_tokens)
                trace.attribute("ringserve.router.prefill_choice", reason)
                prefill.outstanding_tokens += prompt_cost
                span = trace.child("prefill", prefill.address)
                try:
                    pre = await prefill.disagg.Prefill(dpb.PrefillRequest(request=request),
                                                       metadata=trace.metadata(span))  # fmt: skip
                    trace.end(span, cached_tokens=pre.num_cached_tokens, prompt_tokens=len(pre.prompt_token_ids))
                except grpc.aio.AioRpcError as error:
                    trace.end(span, error=error)
                    if error.code() not in _FALLBACK_CODES:
                        await context.abort(error.code(), error.details() or "prefill failed")
                    log.warning("prefill server %s failed (%s: %s); the decode server computes the prompt",
                                prefill.address, error.code().name, error.details())  # fmt: skip
                    trace.event("prefill_fallback", {"ringserve.router.prefill_error": error.code().name})
                finally:
                    prefill.outstanding_tokens -= prompt_cost
            span = trace.child("decode", decode.address)
            if pre is None:  # n > 1 or no prefill server: an ordinary request on the decode server
                stream = decode.generation.Generate(request, metadata=trace.metadata(span))
            else:
                trace.start_transfer(pre)
                stream = decode.disagg.GenerateFromKv(
                    dpb.GenerateFromKvRequest(request=request, prefill=pre), metadata=trace.metadata(span)
                )
            async for response in self._relay(stream, decode, pre, prefill, context, trace, span):
                yield response
        except BaseException as error:
            trace.fail(error)
            raise
        finally:
            decode.outstanding_tokens -= decode_cost
            trace.finish()

    async def _relay(self, stream: Any, decode: Upstream, pre: dpb.PrefillResponse | None, prefill: Upstream | None,
                     context: grpc.aio.ServicerContext, trace: RouterTrace,
                     span: Span | None) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        released = pre is None
        count = 0
        tokens = 0
        try:
            async for response in stream:
                decode.unreachable_at = None
                count += 1
                tokens += len(response.token_ids)
                # The first message is the prefill's token; the second comes after the step that pulled the KV.
                if count == 2 and not released:
                    released = True
                    self._release(prefill, pre)
                    trace.end_transfer()
                yield response
            trace.end(span, completion_tokens=tokens)
        except grpc.aio.AioRpcError as error:
            trace.end(span, error=error)
            if error.code() == grpc.StatusCode.CANCELLED and context.cancelled():
                raise asyncio.CancelledError from None
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                decode.unreachable_at = time.monotonic()
            code = error.code() if error.code() not in _FALLBACK_CODES else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"decode server {decode.address}: {error.details() or error.code().name}")
        finally:
            trace.end(span)
            stream.cancel()
            if not released:
                self._release(prefill, pre)

    def _release(self, prefill: Upstream | None, pre: dpb.PrefillResponse | None) -> None:
        if prefill is None or pre is None:
            return
        request = dpb.ReleaseKvRequest(engine_id=pre.handle.engine_id, request_id=pre.handle.request_id)

        async def release() -> None:
            try:
                await prefill.disagg.ReleaseKv(request, timeout=_RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:  # the pin times out on the prefill server instead
                log.warning("could not release KV on %s: %s", prefill.address, error.details())

        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        upstream = choose_decode(self.decode)
        try:
            return await getattr(upstream.generation, method)(request)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), f"{upstream.address}: {error.details()}")

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("Tokenize", request, context)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("Detokenize", request, context)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("GetModelInfo", request, context)

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("ListModels", request, context)

    async def GetEngineStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary("GetEngineStats", request, context)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="HOST:PORT", help="prefill servers")
    p.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT", help="decode servers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (default %(default)s)")
    p.add_argument("--prefix-affinity-chars", type=int, default=512,
                   help="requests whose first N prompt characters agree go to the same prefill server, so its "
                        "prefix cache serves them (default %(default)s; 0 = least outstanding tokens only)")
    p.add_argument("--prefix-affinity-slack", type=int, default=8192,
                   help="tokens a prefix's prefill server may have outstanding beyond the least loaded one before "
                        "the request goes to the least loaded instead (default %(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")
    p.add_argument("--otlp-traces-endpoint", default=otel_traces_endpoint(),
                   help="OTLP collector for the router's spans; empty = off (default: "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)")  # fmt: skip
    p.add_argument("--otlp-protocol", default=otel_traces_protocol(), choices=["grpc", "http/protobuf"],
                   help="OTLP transport (default: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else grpc)")


async def serve_router(args: argparse.Namespace, ready: asyncio.Event | None = None) -> int:
    prefill = [Upstream.connect(a) for a in args.prefill]
    decode = [Upstream.connect(a) for a in args.decode]
    provider = None
    if args.otlp_traces_endpoint:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from ringserve.frontend.observability.tracing import TracingSettings, make_exporter, make_resource

        provider = TracerProvider(resource=make_resource(), shutdown_on_exit=False)
        settings = TracingSettings(endpoint=args.otlp_traces_endpoint, protocol=args.otlp_protocol)
        provider.add_span_processor(BatchSpanProcessor(make_exporter(settings)))
        log.info("tracing to %s over OTLP/%s", settings.endpoint, settings.protocol)
    servicer = RouterServicer(prefill, decode, provider.get_tracer("ringserve.router") if provider else None,
                              prefix_chars=args.prefix_affinity_chars, prefix_slack_tokens=args.prefix_affinity_slack)
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
        TorchServeInferenceServicer(servicer.Generate, lambda: True), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        print(f"ringserve router: cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 2
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("router on %s:%d: prefill %s, decode %s", args.host, port, args.prefill, args.decode)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    await server.stop(5.0)
    for upstream in prefill + decode:
        with contextlib.suppress(Exception):
            await upstream.channel.close()
    if provider is not None:
        await asyncio.to_thread(provider.force_flush, 5000)
        provider.shutdown()
    return 0


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_router(args))
