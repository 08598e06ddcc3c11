"""`ringserve serve`: this process is the frontend. For each served model it creates the request/event rings of
each engine replica and starts the engine process (which starts its workers); it serves gRPC until SIGTERM/SIGINT,
then drains, stops everything and removes every segment. Models come from `--model` or
`--models-config` at start-up and from TorchServe's RegisterModel at run time."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from ringserve.backend.engine_process import resolve_engine_args
from ringserve.formats.cli_env import env_default, env_help, parse_bool
from ringserve.formats.engine_args import EngineArgs, add_engine_arguments
from ringserve.formats.segments import new_kv_info_dir, reclaim_stale_kv_info_dirs
from ringserve.frontend.api.generation import DEFAULT_MAX_WAITING_REQUESTS, GenerationServicer
from ringserve.frontend.api.security import ServerSecurity, add_server_security_arguments
from ringserve.frontend.api.server import build_catalog_server, describe_model
from ringserve.frontend.catalog import ModelCatalog, ModelError, ModelManager, ModelSpec, ServedModel
from ringserve.frontend.deployment import ModelDeployment
from ringserve.frontend.model_source import EMBEDDED_MODEL_NAME, ModelNotFoundError, ModelSource, resolve_model
from ringserve.frontend.restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S, RestartPolicy
from ringserve.frontend.routing.disagg import model_identity
from ringserve.frontend.text.chat_templates import read_chat_template
from ringserve.frontend.text.tokenizer import ModelTokenizer, load_tokenizer, tokenizer_from_gguf

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from ringserve.frontend.api.server import FrontendServer
    from ringserve.frontend.observability.metrics import ServingMetrics
    from ringserve.frontend.observability.tracing import RequestTracer
    from ringserve.frontend.routing.disagg import DisaggregationServicer

log = logging.getLogger("ringserve.serve")

def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags follow vLLM's names where vLLM has the same knob; each also reads RINGSERVE_<FLAG>."""

    def flag(name: str, default: object, type_: type, help_: str, **kw: object) -> None:
        p.add_argument(name, default=env_default(name, default, type_), type=type_,
                       help=f"{help_} {env_help(name)}", **kw)  # type: ignore[arg-type]  # fmt: skip

    flag("--host", "127.0.0.1", str, "address to listen on (default %(default)s)")
    flag("--port", 50051, int, "gRPC port (default %(default)s)")
    flag("--http-port", 0, int,
         "serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, "
         "/tokenize, /detokenize) on this port, with the gRPC port's TLS and API keys; 0 = off (default)")
    flag("--model", EMBEDDED_MODEL_NAME, str,
         "a .gguf file, a Hugging Face folder, or the embedded model's name (default %(default)s)")
    flag("--served-model-name", "", str, "name clients use in GenerateRequest.model (default: from --model)")
    flag("--chat-template", "", str,
         "a Jinja chat template file for --model's `messages` requests, used instead of the model's own (default: "
         "the model's; for a GGUF without one, RingServe's built-in template of its architecture where there is "
         "one, docs/models.md)")
    add_engine_arguments(p)  # --dtype ... --kv-transfer: the settings each engine replica gets
    flag("--max-waiting-requests", DEFAULT_MAX_WAITING_REQUESTS, int,
         "requests admitted but not yet scheduled by the engine before new ones get RESOURCE_EXHAUSTED; a request "
         "with n > 1 takes n places (default %(default)s; 0 = unbounded)")
    flag("--engine-start-timeout", 600.0, float, "seconds to wait for the model to load (default %(default)s)")
    flag("--shutdown-grace", 5.0, float,
         "seconds in-flight streams get to finish on SIGTERM, and when a model is unregistered or scaled down "
         "(default %(default)s)")
    flag("--max-restarts", DEFAULT_MAX_RESTARTS, int,
         "times an engine replica whose engine or a worker died is started again (backoff 1 s doubling to 60 s) "
         "within --restart-window before its model is FAILED (default %(default)s; 0 = never restart)")
    flag("--restart-window", DEFAULT_RESTART_WINDOW_S, float,
         "seconds over which --max-restarts counts restarts (default %(default)s)")
    flag("--data-parallel-size", 1, int,
         "engine replicas of --model, each with its own workers and KV cache; requests go to the replica with the "
         "fewest outstanding tokens (default %(default)s)")
    flag("--models-config", "", str,
         "a TOML file of models to serve from the start ([[models]] tables: model, name, data_parallel_size, "
         "tensor_parallel_size, dtype, max_model_len, max_num_seqs, kv_cache_memory_gib, num_kv_blocks, "
         "chat_template; optional top-level default_model); replaces --model")
    p.add_argument("--model-management", action=argparse.BooleanOptionalAction,
                   default=env_default("--model-management", True, parse_bool),
                   help="let clients register, scale, unregister and set the default model at run time through "
                        "TorchServe's management API (default on) " + env_help("--model-management"))
    flag("--log-level", "INFO", str, "logging level (default %(default)s)")
    # Observability: tracing is off unless an OTLP endpoint is named; metrics are off unless a port is.
    flag("--otlp-traces-endpoint", otel_traces_endpoint(), str,
         "OTLP collector for request traces, e.g. http://localhost:4317 (gRPC) or http://localhost:4318 "
         "(http/protobuf); empty = tracing off (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
         "OTEL_EXPORTER_OTLP_ENDPOINT)")
    flag("--otlp-protocol", otel_traces_protocol(), str,
         "OTLP transport (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)",
         choices=["grpc", "http/protobuf"])
    p.add_argument("--trace-token-events", action=argparse.BooleanOptionalAction,
                   default=env_default("--trace-token-events", True, parse_bool),
                   help="one event per generated token on the decode span (default on; turn off for very long "
                        f"generations) {env_help('--trace-token-events')}")  # fmt: skip
    flag("--trace-max-span-events", 0, int,
         "most events one span keeps (default 0 = the context length plus headroom, one per token)")
    flag("--metrics-port", 0, int, "serve Prometheus metrics at http://HOST:PORT/metrics; 0 = off (default)")
    flag("--metrics-stats-interval", 1.0, float,
         "seconds between engine stats queries when the engine pushes none (default %(default)s)")
    # Disaggregated prefill/decode (DESIGN.md §8): a router sends prompts to prefill servers and decoding to decode
    # servers; their workers move KV blocks through the --kv-transfer backend (an engine flag, above).
    flag("--role", "both", str, "both = ordinary server; prefill / decode = a disaggregated deployment's part "
         "(default %(default)s)", choices=["both", "prefill", "decode"])
    flag("--kv-pin-timeout", 30.0, float, "seconds a prefill server keeps a request's KV blocks pinned waiting for "
         "the decode server's pull (default %(default)s)")
    add_server_security_arguments(p)  # --tls-*, --api-key(-file), --max-message-size-mib


def otel_traces_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP traces endpoint the standard OpenTelemetry variables name, or '' (tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def otel_traces_protocol(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"


def model_metadata(source: ModelSource) -> tuple[str, int, ModelTokenizer]:
    """(architecture, context length, tokenizer) from the model's own files; one GGUF read serves both."""
    if source.path.suffix == ".gguf":
        from ringserve.formats.gguf_file import GGUFFile

        reader = GGUFFile(source.path)
        arch_field = reader.get_field("general.architecture")
        if arch_field is None:
            raise ModelNotFoundError(f"{source.path}: no general.architecture in the GGUF metadata")
        arch = str(arch_field.contents())
        ctx_field = reader.get_field(f"{arch}.context_length")
        context_length = int(ctx_field.contents()) if ctx_field is not None else 2048
        return arch, context_length, tokenizer_from_gguf(reader)
    config = json.loads((source.path / "config.json").read_text())
    arch = str((config.get("architectures") or [config.get("model_type", "llama")])[0])
    return arch, int(config.get("max_position_embeddings", 2048)), load_tokenizer(source.path)


def kv_transfer_backend(args: argparse.Namespace) -> str:
    choice = args.kv_transfer
    if choice == "auto":
        return "none" if args.role == "both" else "shm"
    return choice


def serve_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine flags of `ringserve serve`, with --kv-transfer auto made for --role. A ValueError names a flag."""
    return dataclasses.replace(EngineArgs.from_namespace(args), kv_transfer=kv_transfer_backend(args))


def check_serve_arguments(args: argparse.Namespace) -> str | None:
    """An error message saying what to change, or None; EngineArgs checks the engine flags."""
    if args.data_parallel_size < 1:
        return f"--data-parallel-size must be at least 1 (got {args.data_parallel_size})"
    try:
        serve_engine_args(args)
    except ValueError as error:
        return str(error)
    if not 0 <= args.http_port <= 65535 or (args.http_port and args.http_port in (args.port, args.metrics_port)):
        return (f"--http-port must be a free port in 1..65535 other than --port and --metrics-port, or 0 (off); got "
                f"{args.http_port}")
    if args.max_waiting_requests < 0:
        return f"--max-waiting-requests must be >= 0 (0 = unbounded; got {args.max_waiting_requests})"
    if args.role != "both" and kv_transfer_backend(args) == "none":
        return f"--role {args.role} needs a KV transfer backend: --kv-transfer shm or nixl"
    if kv_transfer_backend(args) != "none" and (args.models_config or args.data_parallel_size > 1):
        return ("a disaggregated server (--role prefill/decode or --kv-transfer) serves one model with one engine "
                "replica: drop --models-config and --data-parallel-size, and run more servers behind the router")
    if args.chat_template and args.models_config:
        return "--chat-template is for --model; give each [[models]] table of --models-config its own chat_template"
    if args.kv_pin_timeout <= 0:
        return f"--kv-pin-timeout must be > 0 seconds (got {args.kv_pin_timeout})"
    try:
        RestartPolicy(args.max_restarts, args.restart_window)
    except ValueError as error:
        return str(error)
    return None


def start_tracing(args: argparse.Namespace, context_length: int) -> RequestTracer | None:
    """The request tracer when an OTLP endpoint is set; the SDK is imported only then."""
    if not args.otlp_traces_endpoint:
        return None
    from ringserve.frontend.observability.tracing import RequestTracer, TracingSettings

    settings = TracingSettings(endpoint=args.otlp_traces_endpoint, protocol=args.otlp_protocol,
                               token_events=args.trace_token_events, max_span_events=args.trace_max_span_events,
                               replica=f"{args.host}:{args.port}", tensor_parallel_size=args.tensor_parallel_size)
    tracer = RequestTracer.from_settings(settings, context_length)
    log.info("tracing to %s over OTLP/%s (token events %s)", settings.endpoint, settings.protocol,
             "on" if settings.token_events else "off")  # fmt: skip
    return tracer


def start_metrics(args: argparse.Namespace, model_name: str) -> tuple[ServingMetrics | None, Any]:
    """(the metrics of the first model, their HTTP server) when --metrics-port is set, else Nones; every other
    model's come from `.for_model(name)` and share the registry and the endpoint."""
    if not args.metrics_port:
        return None, None
    from ringserve.frontend.observability.metrics import ServingMetrics, serve_metrics

    metrics = ServingMetrics(model_name)
    http = serve_metrics(metrics, args.host, args.metrics_port)
    log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    return metrics, http


async def stop_observability(tracer: RequestTracer | None, metrics_http: Any) -> None:
    if metrics_http is not None:
        metrics_http.shutdown()
    if tracer is not None:
        def flush_and_stop() -> None:
            tracer.provider.force_flush(5000)
            tracer.shutdown()

        # Export what is still queued; an unreachable collector must not hold the shutdown for long.
        try:
            await asyncio.wait_for(asyncio.to_thread(flush_and_stop), 8.0)
        except asyncio.TimeoutError:
            log.warning("could not export the last traces within 8 s")


@dataclass
class LoadedMetadata:
    source: ModelSource
    architecture: str
    context_length: int
    tokenizer: ModelTokenizer


_CONFIG_KEYS = {"name", "model", "data_parallel_size", "tensor_parallel_size", "dtype", "max_model_len",
                "max_num_seqs", "kv_cache_memory_gib", "num_kv_blocks", "chat_template"}  # fmt: skip


def load_models_config(path: str) -> tuple[list[ModelSpec], str | None]:
    """The `--models-config` TOML file: `[[models]]` tables and an optional top-level `default_model`.

    Each table: `model` (a .gguf file, a Hugging Face folder or the embedded model's name; required), `name`
    (default: from the file), any of data_parallel_size, tensor_parallel_size, dtype, max_model_len,
    max_num_seqs, kv_cache_memory_gib, num_kv_blocks (default: the server's flags), and chat_template (a Jinja file;
    default: the model's). Errors name the entry and key.
    """
    try:
        with open(path, "rb") as file:
            config = tomllib.load(file)
    except OSError as exc:
        raise ValueError(f"--models-config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-config {path}: not valid TOML: {exc}") from None
    unknown = set(config) - {"models", "default_model"}
    if unknown:
        raise ValueError(f"--models-config {path}: unknown top-level key(s) {sorted(unknown)}; expected [[models]] "
                         "tables and default_model")  # fmt: skip
    entries = config.get("models")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--models-config {path}: needs at least one [[models]] table")
    specs: list[ModelSpec] = []
    for index, entry in enumerate(entries):
        where = f"--models-config {path}: models[{index}]"
        if bad := set(entry) - _CONFIG_KEYS:
            raise ValueError(f"{where}: unknown key(s) {sorted(bad)}; known: {', '.join(sorted(_CONFIG_KEYS))}")
        if not isinstance(entry.get("model"), str):
            raise ValueError(f"{where}: `model` (a .gguf file, a Hugging Face folder or {EMBEDDED_MODEL_NAME!r}) "
                             "is required")  # fmt: skip
        template = entry.get("chat_template")
        if template is not None:
            if not isinstance(template, str):
                raise ValueError(f"{where}: chat_template must be the path of a Jinja file")
            read_chat_template(template, f"{where}: chat_template")
        try:
            source = resolve_model(entry["model"], entry.get("name") or None)
            options = {k: v for k, v in entry.items() if k not in ("name", "model", "data_parallel_size")}
            specs.append(ModelSpec(name=source.name, path=str(source.path),
                                   replicas=int(entry.get("data_parallel_size", 1)), **options))
        except ModelError as exc:
            raise ValueError(f"{where}: {exc.message}") from None
        except (ModelNotFoundError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--models-config {path}: model names must be unique (got {names})")
    default = config.get("default_model")
    if default is not None and default not in names:
        raise ValueError(f"--models-config {path}: default_model {default!r} is not one of {names}")
    return specs, default


def engine_args_for_model(settings: EngineArgs, source: ModelSource, eos_token_ids: Sequence[int],
                          context_length: int) -> EngineArgs:  # fmt: skip
    """`settings` made for one model: its path and end-of-sequence ids, the `auto` choices resolved for it and this
    host, and the identity the KV handshake compares where KV blocks move between servers."""
    settings = dataclasses.replace(settings, model_path=str(source.path), eos_token_ids=tuple(eos_token_ids))
    settings = resolve_engine_args(settings, context_length)
    if settings.kv_transfer == "none":
        return settings
    return dataclasses.replace(settings, model_id=model_identity(str(source.path), source.name, settings.dtype))


class ModelLauncher:
    """Starts a model's engine replicas for the ModelManager (startup models and RegisterModel alike)."""

    def __init__(self, args: argparse.Namespace, engine: EngineArgs, catalog: ModelCatalog,
                 tracer: RequestTracer | None, metrics: ServingMetrics | None) -> None:  # fmt: skip
        self._args = args
        self._engine = engine
        self._catalog = catalog
        self._tracer = tracer
        self._metrics = metrics
        self._metadata: dict[str, LoadedMetadata] = {}

    def remember(self, metadata: LoadedMetadata) -> None:
        """Metadata read before the event loop started, so a startup model is not read twice."""
        self._metadata[str(metadata.source.path)] = metadata

    def settings(self, spec: ModelSpec) -> EngineArgs:
        """The server's engine flags with the spec's own settings over them."""
        overrides = {name: getattr(spec, name) for name in ("tensor_parallel_size", "dtype", "max_model_len",
                                                            "max_num_seqs", "kv_cache_memory_gib", "num_kv_blocks")
                     if getattr(spec, name) is not None}  # fmt: skip
        try:
            return dataclasses.replace(self._engine, **overrides)
        except ValueError as error:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None

    async def load(self, spec: ModelSpec, model: ServedModel) -> None:
        settings = self.settings(spec)
        metadata = self._metadata.pop(spec.path, None)
        if metadata is None:
            try:
                metadata = await asyncio.to_thread(read_metadata, spec.path, spec.name, spec.chat_template)
            except (ModelNotFoundError, OSError, ValueError) as exc:
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"url: {exc}") from None
        source, tokenizer = metadata.source, metadata.tokenizer
        settings = engine_args_for_model(settings, source, tokenizer.eos_token_ids, metadata.context_length)
        dtype = settings.dtype
        deployment = ModelDeployment(name=spec.name, url=str(source.path), tokenizer=tokenizer, engine_args=settings,
                                     start_timeout_s=self._args.engine_start_timeout,
                                     log_level=self._args.log_level, max_restarts=self._args.max_restarts,
                                     restart_window_s=self._args.restart_window)  # fmt: skip
        model.deployment, model.url, model.max_num_seqs = deployment, str(source.path), settings.max_num_seqs
        try:
            log.info("loading model %s from %s (%d engine replica(s), tensor parallel %d)", spec.name, source.path,
                     spec.replicas, settings.tensor_parallel_size)  # fmt: skip
            replica = await deployment.add_replica()
            info = describe_model(spec.name, metadata.architecture, dtype, settings.tensor_parallel_size,
                                  replica.ready, tokenizer)  # fmt: skip
            deployment.info = info
            if spec.replicas > 1:
                await deployment.scale(spec.replicas, 0.0)
        except BaseException:
            await deployment.stop(0.0)
            raise
        metrics = None
        if self._metrics is not None:
            from ringserve.frontend.observability.metrics import EngineStatsFeed

            metrics = self._metrics if self._metrics.model_name == spec.name else self._metrics.for_model(spec.name)
            model.metrics = metrics
            model.stats_feed = EngineStatsFeed(deployment, metrics, self._args.metrics_stats_interval)
            model.stats_feed.start()
            deployment.add_restart_listener(metrics.observe_engine_restart)
        servicer = GenerationServicer(deployment, tokenizer, info, tracer=self._tracer, metrics=metrics,
                                      max_waiting_requests=self._args.max_waiting_requests)
        self._catalog.attach(model, servicer, deployment, info)
        deployment.add_state_listener(self._catalog.changed)  # health follows restarts
        log.info("model %s is serving (%d KV blocks of %d tokens per replica)", spec.name,
                 replica.ready.num_total_blocks, replica.ready.block_size)  # fmt: skip


def read_metadata(model: str, served_name: str | None = None, chat_template: str | None = None) -> LoadedMetadata:
    """The model's metadata; `chat_template` (a Jinja file) replaces the chat template its files carry, if any."""
    source = resolve_model(model, served_name)
    architecture, context_length, tokenizer = model_metadata(source)
    if chat_template:
        source_text = read_chat_template(chat_template)
        tokenizer = dataclasses.replace(tokenizer, chat_template_source=source_text, chat_template_builtin=None)
    elif tokenizer.chat_template_builtin:
        log.info("%s has no chat template; `messages` use RingServe's built-in %s template (--chat-template FILE "
                 "overrides it)", source.path, tokenizer.chat_template_builtin)  # fmt: skip
    return LoadedMetadata(source, architecture, context_length, tokenizer)


def startup_models(args: argparse.Namespace) -> tuple[list[ModelSpec], str | None]:
    """The models to serve from the start: `--models-config`'s, else `--model` (with --data-parallel-size)."""
    if args.models_config:
        return load_models_config(args.models_config)
    source = resolve_model(args.model, args.served_model_name or None)
    try:
        return [ModelSpec(name=source.name, path=str(source.path), replicas=args.data_parallel_size,
                          chat_template=args.chat_template or None)], None
    except ModelError as exc:
        raise ValueError(exc.message) from None


async def serve_until_stopped(args: argparse.Namespace, specs: list[ModelSpec], default_model: str | None,
                              metadata: list[LoadedMetadata], security: ServerSecurity | None = None,
                              engine: EngineArgs | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_wait = asyncio.create_task(stop.wait())
    tracer = start_tracing(args, max(m.context_length for m in metadata))
    metrics, metrics_http = start_metrics(args, specs[0].name)
    catalog = ModelCatalog()
    engine = engine if engine is not None else serve_engine_args(args)
    launcher = ModelLauncher(args, engine, catalog, tracer, metrics)
    for loaded in metadata:
        launcher.remember(loaded)
    manager = ModelManager(catalog, launcher.load, drain_s=args.shutdown_grace,
                           runtime_changes=args.model_management)
    server = build_catalog_server(manager, args.host, args.port, security=security)
    if args.http_port:
        server.add_http(args.host, args.http_port, security)
    disaggregation = add_disaggregation(server, args)
    server.starting = True
    try:
        await server.start()  # health answers NOT_SERVING while the models load
        log.info("gRPC port %d: %s", server.port, (security or ServerSecurity()).describe())
        if server.http is not None:
            log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if server.http.tls else "http",
                     args.host, server.http.port)  # fmt: skip
        for spec in specs:
            registration = asyncio.create_task(manager.register(spec))
            await asyncio.wait({registration, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not registration.done():  # stopped by a signal while loading
                registration.cancel()
                await asyncio.gather(registration, return_exceptions=True)
                return 0
            if (error := registration.exception()) is not None:
                log.error("%s", getattr(error, "message", error))
                return 1
        if default_model:
            manager.set_default(default_model)
        bind_disaggregation(disaggregation, catalog.get(specs[0].name), args)
        server.started()
        await stop_wait
        log.info("stopping: draining in-flight streams for up to %.1f s", args.shutdown_grace)
        await server.stop(args.shutdown_grace)
        return 0
    finally:
        stop_wait.cancel()
        if not server.stopping:
            await server.stop(0)
        await manager.stop_all(0.0)
        await stop_observability(tracer, metrics_http)


def add_disaggregation(server: FrontendServer, args: argparse.Namespace) -> DisaggregationServicer:
    """The internal Disaggregation service (bound to the model once it is loaded): it must exist before the start."""
    from ringserve.frontend.routing.disagg import DisaggregationServicer
    from ringserve.internal import disagg_pb2_grpc

    servicer = DisaggregationServicer(None, None, args.role, None)
    disagg_pb2_grpc.add_DisaggregationServicer_to_server(servicer, server.server)
    return servicer


def bind_disaggregation(servicer: DisaggregationServicer, model: ServedModel, args: argparse.Namespace) -> None:
    """Give the service the model's engine (a disaggregated server runs one model, one replica) and KV peer infos."""
    from ringserve.frontend.routing.disagg import LocalKv, read_worker_infos

    assert model.deployment is not None and model.servicer is not None
    replica = model.deployment.replicas[0]
    transfer = kv_transfer_backend(args)
    kv = None
    if transfer != "none":
        infos = read_worker_infos(args.kv_info_dir, model.describe().tensor_parallel_size)
        kv = LocalKv(transfer, infos, replica.ready.block_size, args.kv_pin_timeout)
    servicer.bind(model.servicer, replica.client, kv)
    if args.role != "both" or kv is not None:
        log.info("role %s, KV transfer %s, engine id %s", args.role, transfer, servicer.engine_id)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (error := check_serve_arguments(args)) is not None:
        print(f"ringserve serve: {error}", file=sys.stderr)
        return 2
    try:
        security = ServerSecurity.from_args(args)  # before the model loads: a bad TLS/key setting fails fast
        specs, default_model = startup_models(args)
        metadata = [read_metadata(spec.path, spec.name, spec.chat_template) for spec in specs]
    except (ModelNotFoundError, OSError, ValueError) as exc:
        print(f"ringserve serve: {exc}", file=sys.stderr)
        return 2

    from ringserve import _core

    for name in [*_core.reclaim_stale_segments(), *reclaim_stale_kv_info_dirs()]:
        log.info("removed %s, left by a process that died", name)
    engine = serve_engine_args(args)
    args.kv_info_dir = ""
    if engine.kv_transfer != "none":
        args.kv_info_dir = new_kv_info_dir()  # the workers' KV peer infos; the engine removes it if we die first
        engine = dataclasses.replace(engine, kv_info_dir=args.kv_info_dir)
    try:
        return asyncio.run(serve_until_stopped(args, specs, default_model, metadata, security, engine))
    finally:
        if args.kv_info_dir:
            shutil.rmtree(args.kv_info_dir, ignore_errors=True)
