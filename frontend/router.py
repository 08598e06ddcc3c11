"""`ringserve router`: the public API (ringserve.v1 Generation, TorchServe inference) in front of prefill and
decode servers (DESIGN.md §8).

Per request: pick the prefill server and the decode server with the fewest outstanding tokens, ask the prefill
server for the first token and a KV handle, then stream the decode server's GenerateFromKv (which starts with that
token) back to the client. The prefill server's pinned blocks are released once the decode server answered past
its first message (its workers have pulled them) or failed. W3C trace context (traceparent/tracestate) is passed
on to both servers, so their spans join the caller's trace.

Failures: a prefill server that is unreachable or fails makes the request fall back to an ordinary Generate on
the decode server (it computes the prompt itself); a decode server that fails ends the request with UNAVAILABLE
and a message naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from ringserve.frontend.torchserve import TorchServeInferenceServicer
from ringserve.internal import disagg_pb2 as dpb
from ringserve.internal import disagg_pb2_grpc as dpb_grpc
from ringserve.torchserve import inference_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("ringserve.router")

_FORWARDED_METADATA = frozenset(("traceparent", "tracestate", "authorization", "x-api-key"))
_FALLBACK_CODES = frozenset((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED))  # fmt: skip
_RELEASE_TIMEOUT_S = 5.0


@dataclass
class Upstream:
    """One prefill or decode server and the tokens the router has in flight on it."""

    address: str
    channel: grpc.aio.Channel
    generation: pb_grpc.GenerationStub
    disagg: dpb_grpc.DisaggregationStub
    outstanding_tokens: int = 0

    @classmethod
    def connect(cls, address: str) -> Upstream:
        channel = grpc.aio.insecure_channel(address)
        return cls(address, channel, pb_grpc.GenerationStub(channel), dpb_grpc.DisaggregationStub(channel))


def least_loaded(upstreams: Sequence[Upstream]) -> Upstream:
    """Fewest outstanding tokens; ties go to the first listed."""
    return min(upstreams, key=lambda u: u.outstanding_tokens)


def estimate_prompt_tokens(request: pb.GenerateRequest) -> int:
    """A cheap load estimate without a tokenizer: ~4 bytes per token of text."""
    if request.HasField("token_ids"):
        return len(request.token_ids.ids)
    if request.HasField("messages"):
        return sum(len(m.content) for m in request.messages.messages) // 4 + 1
    return len(request.text) // 4 + 1


@dataclass
class RouterServicer(pb_grpc.GenerationServicer):
    prefill: list[Upstream]
    decode: list[Upstream]
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        metadata = tuple((k, v) for k, v in context.invocation_metadata() or () if k in _FORWARDED_METADATA)
        prompt_cost = estimate_prompt_tokens(request)
        decode_cost = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 256
        decode = least_loaded(self.decode)
        decode.outstanding_tokens += decode_cost
        prefill: Upstream | None = None
        try:
            pre = None
            if request.sampling.n <= 1:
                prefill = least_loaded(self.prefill)
                prefill.outstanding_tokens += prompt_cost
                try:
                    pre = await prefill.disagg.Prefill(dpb.PrefillRequest(request=request), metadata=metadata)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in _FALLBACK_CODES:
                        await context.abort(error.code(), error.details() or "prefill failed")
                    log.warning("prefill server %s failed (%s: %s); the decode server computes the prompt",
                                prefill.address, error.code().name, error.details())  # fmt: skip
                finally:
                    prefill.outstanding_tokens -= prompt_cost
            if pre is None:  # n > 1 or no prefill server: an ordinary request on the decode server
                stream = decode.generation.Generate(request, metadata=metadata)
            else:
                stream = decode.disagg.GenerateFromKv(
                    dpb.GenerateFromKvRequest(request=request, prefill=pre), metadata=metadata
                )
            async for response in self._relay(stream, decode, pre, prefill, context):
                yield response
        finally:
            decode.outstanding_tokens -= decode_cost

    async def _relay(self, stream: Any, decode: Upstream, pre: dpb.PrefillResponse | None, prefill: Upstream | None,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        released = pre is None
        count = 0
        try:
            async for response in stream:
                count += 1
                # The first message is the prefill's token; the second comes after the step that pulled the KV.
                if count == 2 and not released:
                    released = True
                    self._release(prefill, pre)
                yield response
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and context.cancelled():
                raise asyncio.CancelledError from None
            code = error.code() if error.code() not in _FALLBACK_CODES else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"decode server {decode.address}: {error.details() or error.code().name}")
        finally:
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
        upstream = least_loaded(self.decode)
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
    p.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")


async def serve_router(args: argparse.Namespace, ready: asyncio.Event | None = None) -> int:
    prefill = [Upstream.connect(a) for a in args.prefill]
    decode = [Upstream.connect(a) for a in args.decode]
    servicer = RouterServicer(prefill, decode)
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
    return 0


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_router(args))
