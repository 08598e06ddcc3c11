"""The OpenAI-compatible HTTP API (`--http-port`): FastAPI on uvicorn, inside the frontend's event loop.

`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (and `/v1/models/{id}`), and vLLM's
`GET /health`, `POST /tokenize` and `POST /detokenize`. Each generation request is translated into `ringserve.v1`
GenerateRequests (openai_requests.py) and served by the catalog's own Generate, so validation, the waiting queue,
tracing, metrics, cancellation and draining are the gRPC API's; an `HttpCall` stands in for the gRPC context, turning
a refusal into an `ApiError` (status and OpenAI error body) and handing Generate the caller's `traceparent`.

A client that disconnects (mid-stream or while a non-streamed completion runs) cancels its handler, which closes
the Generate streams and so aborts its requests in the engine. API keys and TLS are the gRPC port's settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, cast

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from ringserve.frontend.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ringserve.frontend.api.openai_requests import (
    CHAT_RENAMES,
    DETOKENIZE_RENAMES,
    ApiError,
    chat_request,
    completion_requests,
    invalid,
    parse_body,
)
from ringserve.frontend.api.openai_responses import (
    DONE,
    ChatFormat,
    Choices,
    CompletionFormat,
    RequestMeta,
    TokenTexts,
    sse,
)
from ringserve.frontend.api.security import ApiKeyInterceptor, ServerSecurity
from ringserve.frontend.api.validation import RequestError
from ringserve.frontend.catalog import ModelError
from ringserve.v1 import generation_pb2 as pb
from starlette.exceptions import HTTPException

if TYPE_CHECKING:
    from ringserve.frontend.api.generation import CatalogServicer, GenerationServicer
    from ringserve.frontend.catalog import ModelCatalog

log = logging.getLogger("ringserve.frontend.http")
API = "openai"  # the `api` label of this front door's requests in metrics and traces
_JSON = "application/json"
_TRACE_HEADERS = ("traceparent", "tracestate")
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Frontend(Protocol):
    """What the API reads of the frontend server (api/server.py's FrontendServer)."""

    @property
    def catalog(self) -> ModelCatalog: ...

    serving: bool  # the default model serves and the server is neither starting nor stopping
    stopping: bool


class HttpCall:
    """What Generate needs of a gRPC servicer context, for a request that came over HTTP."""

    api = API

    def __init__(self, headers: Any, renames: Mapping[str, str] | None = None) -> None:
        self._metadata = tuple((name, headers[name]) for name in _TRACE_HEADERS if name in headers)
        self._renames = renames  # the endpoint's own names of ringserve.v1 fields, for the errors' `param`

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise ApiError.from_status(code, details)

    async def refuse(self, rejection: RequestError) -> NoReturn:
        raise ApiError.from_rejection(rejection, self._renames)


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


@contextlib.asynccontextmanager
async def cancelled_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Run the body in this task and cancel it when the client disconnects (raising ClientGone). The request body
    must have been read: every message left is the disconnect."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled here
            task.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()


async def merged(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(stream index, response) of every stream as they come; closing this closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for response in only:
                yield 0, response
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    queue.put_nowait((index, response))
        except Exception as error:  # handed to the reader, which fails the request with it
            queue.put_nowait(error)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventStream(Response):
    """A completion streamed as Server-Sent Events: the first chunk (already made, so a refusal could still be an
    HTTP status), the rest as they come, the usage chunk if asked for, then `data: [DONE]`. An error after the
    first chunk is sent as an `error` event."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes], request_id: str) -> None:
        # Not Response.__init__: that declares a Content-Length, and a stream has none (chunked transfer).
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-request-id", request_id.encode())]
        self._first = first
        self._rest = rest

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        async with contextlib.aclosing(self._rest) as rest:
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async with cancelled_on_disconnect(receive):
                    await body(self._first)
                    async for event in rest:
                        await body(event)
                await body(b"", more=False)
            except (ClientGone, OSError):  # uvicorn raises an OSError when sending to a closed connection
                return
            except Exception as exc:  # ApiError: the engine failed, or the drain's grace period ended
                error = exc if isinstance(exc, ApiError) else _internal_error(exc)
                with contextlib.suppress(OSError):
                    await body(sse(json.dumps(error.body())) + DONE, more=False)


def _internal_error(exc: BaseException) -> ApiError:
    request_id = secrets.token_hex(8)
    log.error("internal error in the OpenAI API (request id %s)", request_id, exc_info=exc)
    return ApiError(500, f"internal error (request id {request_id}); the server log has the details",
                    code="internal_error")


def _json(body: Any, status: int = 200) -> Response:
    return Response(body.model_dump_json() if hasattr(body, "model_dump_json") else json.dumps(body), status,
                    media_type=_JSON)


class OpenAIApi:
    """The routes, over the frontend's catalog and its Generate."""

    def __init__(self, frontend: Frontend, generation: CatalogServicer, security: ServerSecurity) -> None:
        self._frontend = frontend
        self._generation = generation
        self._keys = ApiKeyInterceptor(security.api_keys) if security.api_keys else None
        self._max_body = security.max_message_bytes
        self._texts: dict[int, TokenTexts] = {}  # per tokenizer (by id)

    def app(self) -> FastAPI:
        app = FastAPI(title="RingServe OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
        authorized = [Depends(self._authorize)]
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"], dependencies=authorized)
        app.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"], dependencies=authorized)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=authorized)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=authorized)
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"], dependencies=authorized)
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"], dependencies=authorized)
        app.add_exception_handler(ApiError, _error_response)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, _unexpected_error_response)
        return app

    # -- routes -------------------------------------------------------------------------------------------------

    async def health(self) -> Response:
        frontend = self._frontend
        if frontend.serving and not frontend.stopping:
            return Response(status_code=200)
        why = "the server is draining" if frontend.stopping else "the model is not ready"
        return _error_response(None, ApiError(503, why, code="unavailable"))

    async def list_models(self) -> Response:
        return _json(ModelList(data=[self._card(model.describe()) for model in self._frontend.catalog.models()]))

    async def get_model(self, model: str) -> Response:
        try:
            return _json(self._card(self._frontend.catalog.get(model).describe()))
        except ModelError as error:
            raise ApiError.from_status(error.code, error.message, "model") from None

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = parse_body(await self._body(request), ChatCompletionRequest)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generate = chat_request(body, request_id)
        servicer = self._servicer(generate.model)
        meta = RequestMeta(request_id, generate.model or self._default_model(), generate.sampling.n or 1)
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        output = ChatFormat(Choices(meta, 1), self._token_texts(servicer), bool(body.logprobs), include_usage)
        renames = CHAT_RENAMES if body.max_completion_tokens is None else {
            **CHAT_RENAMES, "sampling.max_tokens": "max_completion_tokens"}
        return await self._respond(request, [generate], output, bool(body.stream), renames)

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = parse_body(await self._body(request), CompletionRequest)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generates = completion_requests(body, request_id)
        servicer = self._servicer(generates[0].model)
        meta = RequestMeta(request_id, generates[0].model or self._default_model(), generates[0].sampling.n or 1)
        echoed = [self._prompt_text(servicer, g) for g in generates] if body.echo else None
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        output = CompletionFormat(Choices(meta, len(generates)), self._token_texts(servicer),
                                  body.logprobs is not None, include_usage, echoed)  # fmt: skip
        return await self._respond(request, generates, output, bool(body.stream))

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = parse_body(await self._body(request), TokenizeRequest)
        tokenize = pb.TokenizeRequest(model=body.model or "")
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "set exactly one of prompt (text) and messages (chat)")
        if body.prompt is not None:
            tokenize.text = body.prompt
        else:
            generate = chat_request(ChatCompletionRequest(messages=body.messages or []), "")
            tokenize.messages.CopyFrom(generate.messages)
            if body.add_generation_prompt is not None:
                tokenize.messages.add_generation_prompt = body.add_generation_prompt
        if body.add_special_tokens is not None:
            tokenize.add_special_tokens = body.add_special_tokens
        servicer = self._servicer(tokenize.model)
        reply = await servicer.Tokenize(tokenize, cast(Any, HttpCall(request.headers)))
        info = self._frontend.catalog.get(tokenize.model).describe()
        return _json(TokenizeResponse(count=len(reply.token_ids), max_model_len=info.context_length,
                                      tokens=list(reply.token_ids)))  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = parse_body(await self._body(request), DetokenizeRequest)
        if not all(0 <= t < 2**32 for t in body.tokens):
            raise invalid("tokens", "tokens must be non-negative token ids")
        detokenize = pb.DetokenizeRequest(model=body.model or "", token_ids=body.tokens)
        call = HttpCall(request.headers, DETOKENIZE_RENAMES)
        reply = await self._servicer(detokenize.model).Detokenize(detokenize, cast(Any, call))
        return _json(DetokenizeResponse(prompt=reply.text))

    # -- generation ---------------------------------------------------------------------------------------------

    async def _respond(self, request: Request, generates: list[pb.GenerateRequest],
                       output: ChatFormat | CompletionFormat, stream: bool,
                       renames: Mapping[str, str] | None = None) -> Response:  # fmt: skip
        call = HttpCall(request.headers, renames)
        responses = merged([self._generation.Generate(g, cast(Any, call)) for g in generates])
        request_id = output.choices.meta.id
        if not stream:
            try:
                async with cancelled_on_disconnect(request.receive), contextlib.aclosing(responses) as each:
                    async for prompt, response in each:
                        output.add(prompt, response)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            return Response(output.body().model_dump_json(), media_type=_JSON, headers={"x-request-id": request_id})
        try:  # the first chunk before the headers: a refusal (bad field, queue full, draining) is still a status
            async with cancelled_on_disconnect(request.receive):
                prompt, response = await anext(responses)
        except ClientGone:
            await responses.aclose()
            return Response(status_code=499)
        except BaseException:
            await responses.aclose()
            raise

        async def rest() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(responses) as each:
                async for index, item in each:
                    yield output.chunk(index, item)
            usage = output.usage_chunk()
            yield (usage + DONE) if usage is not None else DONE

        return EventStream(output.chunk(prompt, response), rest(), request_id)

    # -- helpers ------------------------------------------------------------------------------------------------

    async def _authorize(self, request: Request) -> None:
        if self._keys is None:
            return
        header = request.headers.get("authorization")
        if header is None:
            raise ApiError(401, "missing API key: send the header `Authorization: Bearer <api key>`",
                           code="invalid_api_key")
        problem = self._keys.check([("authorization", header)])
        if problem is not None:
            raise ApiError(401, problem.replace("authorization metadata", "Authorization header"),
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 past the server's message size limit (--max-message-size-mib)."""
        limit = self._max_body
        length = request.headers.get("content-length", "")
        too_large = ApiError(413, f"the request body is larger than the server's limit of {limit >> 20} MiB "
                                  "(--max-message-size-mib)", code="request_too_large")  # fmt: skip
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _servicer(self, model: str) -> GenerationServicer:
        try:
            return cast("GenerationServicer", self._frontend.catalog.servicer_for(model))
        except ModelError as error:
            raise ApiError.from_status(error.code, error.message, "model") from None

    def _default_model(self) -> str:
        return self._frontend.catalog.default_name or ""

    def _token_texts(self, servicer: GenerationServicer) -> TokenTexts:
        tokenizer = servicer.tokenizer
        texts = self._texts.get(id(tokenizer))
        if texts is None:
            texts = self._texts[id(tokenizer)] = TokenTexts(tokenizer)
        return texts

    @staticmethod
    def _prompt_text(servicer: GenerationServicer, generate: pb.GenerateRequest) -> str:
        if generate.HasField("text"):
            return generate.text
        return servicer.tokenizer.decode(list(generate.token_ids.ids), skip_special_tokens=False)

    @staticmethod
    def _card(info: pb.ModelInfo) -> ModelCard:
        return ModelCard(id=info.model, created=0, root=info.model, max_model_len=info.context_length or None)


def _error_response(_: Request | None, error: ApiError) -> Response:
    return Response(json.dumps(error.body()), error.status, media_type=_JSON)


def _http_error_response(_: Request, exc: HTTPException) -> Response:
    error = ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return Response(json.dumps(error.body()), exc.status_code, media_type=_JSON, headers=exc.headers)


def _unexpected_error_response(_: Request, exc: Exception) -> Response:
    return _error_response(None, _internal_error(exc))


# -- the server ---------------------------------------------------------------------------------------------------


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in someone else's event loop: the frontend owns SIGTERM/SIGINT (they start its drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class OpenAIHttpServer:
    """The HTTP port: bound at construction (so a busy port fails start-up), served once `start()` is awaited."""

    def __init__(self, frontend: Frontend, generation: CatalogServicer, host: str, port: int,
                 security: ServerSecurity | None = None) -> None:  # fmt: skip
        security = security or ServerSecurity()
        self._socket = _bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self.tls = security.tls
        app = OpenAIApi(frontend, generation, security).app()
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, **_tls_settings(security))  # fmt: skip
        self._server = _EmbeddedUvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:  # start-up is a few loop turns; a failure ends the task
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on port {self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the port; connections still open get a second to finish."""
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {exc.strerror or exc}; pick another --http-port") \
            from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _tls_settings(security: ServerSecurity) -> dict[str, Any]:
    if not security.tls:
        return {}
    settings: dict[str, Any] = {"ssl_certfile": security.certificate_file, "ssl_keyfile": security.key_file}
    if security.mutual_tls:
        settings |= {"ssl_ca_certs": security.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return settings
