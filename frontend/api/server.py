"""The frontend's gRPC server: the Generation service over a model catalog, TorchServe's services, KServe v2's
GRPCInferenceService, health and reflection, on one grpc.aio server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from ringserve.frontend.api.generation import (
    DEFAULT_MAX_WAITING_REQUESTS,
    CatalogServicer,
    GenerationServicer,
    OpenStreams,
)
from ringserve.frontend.api.kserve import SERVICE_NAME as KSERVE_SERVICE_NAME
from ringserve.frontend.api.kserve import KServeInferenceServicer
from ringserve.frontend.api.security import ServerSecurity
from ringserve.frontend.api.torchserve import (
    INFERENCE_SERVICE_NAME,
    MANAGEMENT_SERVICE_NAME,
    TorchServeInferenceServicer,
    TorchServeManagementServicer,
)
from ringserve.frontend.api.validation import DEFAULT_MAX_TOKENS
from ringserve.frontend.catalog import ModelCatalog, ModelManager, ModelServicer, ServedModel
from ringserve.frontend.engine_client import EngineError, GenerationEngine
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.kserve import grpc_service_pb2_grpc as kserve_pb2_grpc
from ringserve.torchserve import inference_pb2_grpc, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the servicer only calls them; importing them pulls in the OpenTelemetry SDK / prometheus-client
    from ringserve.frontend.api.openai_http import OpenAIHttpServer
    from ringserve.frontend.observability.metrics import ServingMetrics
    from ringserve.frontend.observability.tracing import RequestTracer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


def describe_model(name: str, architecture: str, dtype: str, tensor_parallel_size: int, ready: Any,
                   tokenizer: ModelTokenizer, vocab_size: int = 0) -> pb.ModelInfo:
    """The served model's ModelInfo from the engine's EngineReady (context length, block size, KV blocks)."""
    info = pb.ModelInfo(model=name, architecture=architecture, context_length=ready.max_model_len, dtype=dtype,
                        tensor_parallel_size=tensor_parallel_size, block_size=ready.block_size,
                        kv_capacity_tokens=ready.num_total_blocks * ready.block_size,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=vocab_size or tokenizer.vocab_size)
    if tokenizer.bos_token_id is not None:
        info.bos_token_id = tokenizer.bos_token_id
    return info


@dataclass
class FrontendServer:
    """A built (not yet started) gRPC server over a model catalog, and the parts the launcher drives.

    Health: the whole server ("") and each service name report SERVING while the default model does; each model's
    name reports that model's own state. Everything turns NOT_SERVING when the server starts stopping.
    """

    server: grpc.aio.Server
    port: int  # the bound port (useful with port 0)
    health: health_aio.HealthServicer
    manager: ModelManager
    serving: bool = False  # what health reports for the whole server
    services: tuple[str, ...] = ()  # gRPC service names whose health follows the whole server's
    stopping: bool = False
    starting: bool = False  # set while the start-up models load: the server is not ready until all are
    open_streams: OpenStreams | None = None  # the Generate streams a drain waits for
    generation: CatalogServicer | None = None  # ringserve.v1 Generation over the catalog, which every API serves by
    http: OpenAIHttpServer | None = None  # the OpenAI-compatible HTTP API, when --http-port is set
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)
    _health_names: set[str] = field(default_factory=set, repr=False)

    @property
    def catalog(self) -> ModelCatalog:
        return self.manager.catalog

    @property
    def servicer(self) -> ModelServicer:
        """The default model's GenerationServicer."""
        servicer = self.catalog.get("").servicer
        assert servicer is not None, "the default model is still loading"
        return servicer

    @property
    def engine(self) -> GenerationEngine:
        engine = self.catalog.get("").engine
        assert engine is not None, "the default model is still loading"
        return engine

    def add_http(self, host: str, port: int, security: ServerSecurity | None = None) -> int:
        """Serve the OpenAI-compatible HTTP API on `port` too (bound now, served from `start`); the bound port."""
        from ringserve.frontend.api.openai_http import OpenAIHttpServer  # FastAPI and uvicorn load only if used

        assert self.generation is not None
        self.http = OpenAIHttpServer(self, self.generation, host, port, security)
        return self.http.port

    async def start(self) -> None:
        """Start serving; health follows the models (NOT_SERVING until the default one's engine is ready)."""
        await self._refresh_health()  # the health servicer starts out SERVING
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        self.catalog.add_listener(self._health_changed)
        for model in self.catalog.models():
            if model.engine is not None and not model.ready:
                self._spawn(self._mark_ready_when_ready(model))

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain: report NOT_SERVING and refuse new requests (UNAVAILABLE, the server is draining; HTTP 503) while
        the ports still accept; let in-flight streams (gRPC and HTTP) finish for up to `grace` seconds, end the rest
        with UNAVAILABLE saying the server is draining, then stop the gRPC and HTTP servers."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        self.catalog.draining = True
        await self.health.enter_graceful_shutdown()
        if self.open_streams is not None and grace is not None:
            await self.open_streams.drain(grace, f"the server is draining (shutting down): its {grace:g} s grace "
                                                 "period ended before this stream finished; retry on another "
                                                 "replica")  # fmt: skip
            grace = min(grace, 1.0)  # what is left: unary RPCs, which are short
        await self.server.stop(grace)
        if self.http is not None:
            await self.http.stop()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _mark_ready_when_ready(self, model: ServedModel) -> None:
        assert model.engine is not None
        try:
            await model.engine.wait_ready(None)
        except EngineError:
            self.catalog.changed()  # failed while starting
            return
        self.catalog.mark_ready(model)

    def started(self) -> None:
        """The start-up models are loaded: health may turn SERVING."""
        self.starting = False
        self._health_changed()

    def _health_changed(self) -> None:
        if not self.stopping:
            self._spawn(self._refresh_health())

    async def _refresh_health(self) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        models = {model.name: model.serving for model in self.catalog.models()}
        default = self.catalog.default_name
        self.serving = not (self.stopping or self.starting) and default is not None and models.get(default, False)
        statuses = {name: serving if ok and not self.stopping else not_serving for name, ok in models.items()}
        for name in self._health_names - statuses.keys():  # unregistered models
            statuses[name] = not_serving
        for name in ("", *self.services):
            statuses[name] = serving if self.serving else not_serving
        self._health_names |= statuses.keys()
        for name, status in statuses.items():
            await self.health.set(name, status)


def build_server(engine: GenerationEngine, tokenizer: ModelTokenizer, model_info: pb.ModelInfo,
                 host: str = "127.0.0.1", port: int = 50051, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_concurrent_rpcs: int | None = None, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None, model_url: str = "",
                 max_num_seqs: int = 0, security: ServerSecurity | None = None,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS) -> FrontendServer:
    """A server for one model whose engine the caller runs (tests, embedding); see `build_catalog_server`.

    `model_info.model` is the served name; `context_length`, `kv_capacity_tokens` and `vocab_size` (0 = take the
    tokenizer's) drive validation; `model_url` and `max_num_seqs` are what TorchServe's DescribeModel reports.
    Health is NOT_SERVING until the engine is ready. `max_waiting_requests` bounds the requests admitted but not yet
    scheduled by the engine (0 = unbounded).
    """
    catalog = ModelCatalog()
    servicer = GenerationServicer(engine, tokenizer, model_info, default_max_tokens, tracer=tracer, metrics=metrics,
                                  max_waiting_requests=max_waiting_requests)
    model = catalog.add(ServedModel(name=model_info.model, url=model_url, max_num_seqs=max_num_seqs))
    catalog.attach(model, servicer, engine, model_info, ready=False)
    return build_catalog_server(ModelManager(catalog), host, port, max_concurrent_rpcs=max_concurrent_rpcs,
                                security=security)


def build_catalog_server(manager: ModelManager, host: str = "127.0.0.1", port: int = 50051, *,
                         max_concurrent_rpcs: int | None = None,
                         security: ServerSecurity | None = None) -> FrontendServer:  # fmt: skip
    """A grpc.aio server with ringserve.v1 Generation over every model of `manager.catalog`, TorchServe's inference
    and management services, KServe v2's GRPCInferenceService, grpc.health.v1 (per model and overall) and reflection.

    Call from inside the running event loop; then `await result.start()`. Raises OSError when the address cannot
    be bound. `security` sets TLS, API keys and message size limits (default: plaintext, no keys, 64 MiB).
    """
    security = security or ServerSecurity()
    server = grpc.aio.server(maximum_concurrent_rpcs=max_concurrent_rpcs, interceptors=security.interceptors(),
                             options=security.options())
    generation = CatalogServicer(manager.catalog)
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    frontend = FrontendServer(server=server, port=0, health=health, manager=manager,
                              open_streams=generation.open_streams, generation=generation,
                              services=(SERVICE_NAME, INFERENCE_SERVICE_NAME, MANAGEMENT_SERVICE_NAME,
                                        KSERVE_SERVICE_NAME))
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
        TorchServeInferenceServicer(generation.Generate, lambda: frontend.serving), server)
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(TorchServeManagementServicer(manager), server)
    kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeInferenceServicer(manager.catalog, generation.Generate, lambda: frontend.serving), server)
    service_names = (SERVICE_NAME, INFERENCE_SERVICE_NAME, MANAGEMENT_SERVICE_NAME, KSERVE_SERVICE_NAME,
                     health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = security.add_port(server, address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}; pick another --host/--port") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}; pick another --host/--port")
    frontend.port = bound
    return frontend
