"""The last line of every RPC: what grpc would otherwise answer with UNKNOWN gets a clear status.

`RequestBoundaryInterceptor` wraps every handler of the server once, at its first call:
- it parses the request bytes itself, so bytes that are not a valid message (corrupt wire format, a string field
  holding invalid UTF-8) get INVALID_ARGUMENT naming the method;
- any exception that escapes a handler (a bug: every expected failure has its own status) becomes INTERNAL with a
  request id, and the traceback is logged under that id; the exception's own text never reaches the client.
A handler's `context.abort` and cancellation pass through unchanged.
"""

from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

log = logging.getLogger("ringserve.frontend")


class RequestBoundaryInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # per method: handlers are fixed once registered

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = _bounded_handler(handler, method)
        return wrapped


async def internal_error(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> NoReturn:
    """Answer INTERNAL for an unexpected exception, logging its traceback under a request id the client sees."""
    request_id = secrets.token_hex(8)
    log.error("internal error in %s (request id %s)", method, request_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"internal error (request id {request_id}); the server log has the details")


def _forget_frames(aborted: grpc.aio.AbortError) -> None:
    """Let go of the frames an abort passed through, and the exceptions it was raised while handling.

    grpc keeps the AbortError in the call's state (it raises it again, from its own code, to send the status), and
    the handler's frames on its traceback hold the context, which holds that state: a reference cycle that kept the
    request (a 10 MiB prompt, say) alive until the cycle collector happened to run, so refused requests piled up
    in memory. With the traceback and context dropped here, and the exception not raised again from this frame, the
    request is freed when the call ends."""
    aborted.__traceback__ = None
    aborted.__context__ = None
    aborted.__cause__ = None


def _bounded_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    serialize = handler.response_serializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # protobuf raises DecodeError; any parser failure is the request's fault
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {method} message: {exc}")

    async def each_parsed(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for raw in raws:
            yield await parsed(raw, context)

    async def guarded(call: Awaitable[Any], context: grpc.aio.ServicerContext) -> Any:
        try:
            return await call
        except grpc.aio.AbortError as aborted:  # the handler's own status
            _forget_frames(aborted)
            return None
        except Exception as exc:
            await internal_error(context, method, exc)

    if not handler.request_streaming and not handler.response_streaming:
        unary_unary = handler.unary_unary

        async def call_unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await guarded(unary_unary(await parsed(raw, context), context), context)

        return grpc.unary_unary_rpc_method_handler(call_unary_unary, response_serializer=serialize)
    if not handler.request_streaming:
        unary_stream = handler.unary_stream
        if not inspect.isasyncgenfunction(unary_stream):  # writes with context.write (e.g. Health.Watch)

            async def write_unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                await guarded(unary_stream(await parsed(raw, context), context), context)

            return grpc.unary_stream_rpc_method_handler(write_unary_stream, response_serializer=serialize)

        async def call_unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await parsed(raw, context)
            try:
                async for response in unary_stream(request, context):
                    yield response
            except grpc.aio.AbortError as aborted:
                _forget_frames(aborted)
            except Exception as exc:
                await internal_error(context, method, exc)

        return grpc.unary_stream_rpc_method_handler(call_unary_stream, response_serializer=serialize)
    if not handler.response_streaming:
        stream_unary = handler.stream_unary

        async def call_stream_unary(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await guarded(stream_unary(each_parsed(raws, context), context), context)

        return grpc.stream_unary_rpc_method_handler(call_stream_unary, response_serializer=serialize)
    stream_stream = handler.stream_stream
    if not inspect.isasyncgenfunction(stream_stream):

        async def write_stream_stream(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            await guarded(stream_stream(each_parsed(raws, context), context), context)

        return grpc.stream_stream_rpc_method_handler(write_stream_stream, response_serializer=serialize)

    async def call_stream_stream(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in stream_stream(each_parsed(raws, context), context):
                yield response
        except grpc.aio.AbortError as aborted:
            _forget_frames(aborted)
        except Exception as exc:
            await internal_error(context, method, exc)

    return grpc.stream_stream_rpc_method_handler(call_stream_stream, response_serializer=serialize)
