"""`ringserve serve`: this process is the frontend; it creates the request/event rings, starts the engine process
(which starts the workers), serves gRPC until SIGTERM/SIGINT, then stops everything and removes every segment."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ringserve.backend.process import stop_child, wait_for_exit
from ringserve.backend.segments import EVENT_RING_BYTES, REQUEST_RING_BYTES, new_segment_name
from ringserve.frontend.cli_env import env_default, env_help, parse_bool
from ringserve.frontend.disagg import model_identity
from ringserve.frontend.engine_client import EngineClient
from ringserve.frontend.model_source import EMBEDDED_MODEL_NAME, ModelNotFoundError, ModelSource, resolve_model
from ringserve.frontend.security import ServerSecurity, add_server_security_arguments
from ringserve.frontend.server import DEFAULT_MAX_WAITING_REQUESTS, build_server, describe_model
from ringserve.frontend.tokenizer import ModelTokenizer, load_tokenizer, tokenizer_from_gguf

if TYPE_CHECKING:
    from ringserve.frontend.metrics import ServingMetrics
    from ringserve.frontend.tracing import RequestTracer

log = logging.getLogger("ringserve.serve")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags follow vLLM's names where vLLM has the same knob; each also reads RINGSERVE_<FLAG>."""

    def flag(name: str, default: object, type_: type, help_: str, **kw: object) -> None:
        p.add_argument(name, default=env_default(name, default, type_), type=type_,
                       help=f"{help_} {env_help(name)}", **kw)  # type: ignore[arg-type]  # fmt: skip

    flag("--host", "127.0.0.1", str, "address to listen on (default %(default)s)")
    flag("--port", 50051, int, "gRPC port (default %(default)s)")
    flag("--model", EMBEDDED_MODEL_NAME, str,
         "a .gguf file, a Hugging Face folder, or the embedded model's name (default %(default)s)")
    flag("--served-model-name", "", str, "name clients use in GenerateRequest.model (default: from --model)")
    flag("--dtype", "auto", str, "weights and activations dtype (default %(default)s = float32 on CPU)",
         choices=["auto", "float32", "bfloat16", "float16"])
    flag("--tensor-parallel-size", 1, int, "worker processes the model is split across (default %(default)s)")
    flag("--max-num-seqs", 256, int, "most sequences running in one step (default %(default)s)")
    flag("--max-num-batched-tokens", 2048, int, "token budget of one engine step (default %(default)s)")
    flag("--max-waiting-requests", DEFAULT_MAX_WAITING_REQUESTS, int,
         "requests admitted but not yet scheduled by the engine before new ones get RESOURCE_EXHAUSTED; a request "
         "with n > 1 takes n places (default %(default)s; 0 = unbounded)")
    flag("--max-model-len", 0, int, "context length limit (default: the model's)")
    flag("--block-size", 16, int, "tokens per KV cache block (default %(default)s)")
    flag("--long-prefill-token-threshold", 0, int,
         "most prompt tokens one request may prefill per step (default %(default)s = no cap)")
    flag("--priority-aging-ms", 1000, int,
         "a waiting request's priority value improves by one per this many ms waited, so better-priority traffic "
         "cannot starve it (default %(default)s; 0 = strict priority)")
    flag("--kv-cache-dtype", "auto", str, "KV cache dtype (default %(default)s = the weights')",
         choices=["auto", "float32", "bfloat16", "float16"])
    flag("--attention-backend", "auto", str,
         "workers' attention kernels (default %(default)s = triton_paged on CUDA when triton is installed, "
         "torch_sdpa on CPU)", choices=["auto", "torch_sdpa", "triton_paged"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env_default("--enable-prefix-caching", True, parse_bool),
                   help="share the KV blocks of equal prompt prefixes (default on) "
                        + env_help("--enable-prefix-caching"))
    flag("--num-kv-blocks", 0, int, "KV cache size in blocks (default: from --kv-cache-memory-gib)")
    flag("--kv-cache-memory-gib", 1.0, float, "KV cache memory budget per worker in GiB (default %(default)s)")
    flag("--engine-start-timeout", 600.0, float, "seconds to wait for the model to load (default %(default)s)")
    flag("--shutdown-grace", 5.0, float, "seconds in-flight streams get to finish on SIGTERM (default %(default)s)")
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
    # servers; their workers move KV blocks through the --kv-transfer backend.
    flag("--role", "both", str, "both = ordinary server; prefill / decode = a disaggregated deployment's part "
         "(default %(default)s)", choices=["both", "prefill", "decode"])
    flag("--kv-transfer", "auto", str, "KV transfer backend between prefill and decode servers: shm (same host), "
         "nixl (NIXL over UCX: RDMA, TCP), none; auto = shm for --role prefill/decode, none for both",
         choices=["auto", "none", "shm", "nixl"])
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
        from gguf import GGUFReader

        reader = GGUFReader(str(source.path))
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


def engine_command(args: argparse.Namespace, source: ModelSource, dtype: str, max_model_len: int,
                   eos_token_ids: list[int], request_ring: str, event_ring: str) -> list[str]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "ringserve.backend.engine_main",
        "--request-ring", request_ring, "--event-ring", event_ring, "--model", str(source.path), "--dtype", dtype,
        "--tensor-parallel-size", str(args.tensor_parallel_size), "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(max_model_len), "--kv-cache-memory-gib", str(args.kv_cache_memory_gib),
        "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
        "--priority-aging-ms", str(args.priority_aging_ms),
        "--kv-cache-dtype", args.kv_cache_dtype, "--attention-backend", args.attention_backend,
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
        "--eos-token-ids", *map(str, eos_token_ids),
    ]  # fmt: skip
    if args.num_kv_blocks > 0:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    transfer = kv_transfer_backend(args)
    if transfer != "none":
        cmd += ["--kv-transfer", transfer, "--kv-info-dir", args.kv_info_dir,
                "--model-id", model_identity(str(source.path), source.name, dtype)]  # fmt: skip
    return cmd


def kv_transfer_backend(args: argparse.Namespace) -> str:
    choice = getattr(args, "kv_transfer", "none")
    if choice == "auto":
        return "none" if getattr(args, "role", "both") == "both" else "shm"
    return choice


def check_serve_arguments(args: argparse.Namespace) -> str | None:
    """An error message saying what to change, or None."""
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1 (got {args.tensor_parallel_size})"
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})"
    if args.max_waiting_requests < 0:
        return f"--max-waiting-requests must be >= 0 (0 = unbounded; got {args.max_waiting_requests})"
    if args.priority_aging_ms < 0:
        return f"--priority-aging-ms must be >= 0 (0 = strict priority; got {args.priority_aging_ms})"
    if args.max_model_len < 0 or args.num_kv_blocks < 0 or args.kv_cache_memory_gib <= 0:
        return "--max-model-len and --num-kv-blocks must be >= 0 and --kv-cache-memory-gib > 0"
    if args.role != "both" and kv_transfer_backend(args) == "none":
        return f"--role {args.role} needs a KV transfer backend: --kv-transfer shm or nixl"
    if args.kv_pin_timeout <= 0:
        return f"--kv-pin-timeout must be > 0 seconds (got {args.kv_pin_timeout})"
    return None


def start_tracing(args: argparse.Namespace, context_length: int) -> RequestTracer | None:
    """The request tracer when an OTLP endpoint is set; the SDK is imported only then."""
    if not args.otlp_traces_endpoint:
        return None
    from ringserve.frontend.tracing import RequestTracer, TracingSettings

    settings = TracingSettings(endpoint=args.otlp_traces_endpoint, protocol=args.otlp_protocol,
                               token_events=args.trace_token_events, max_span_events=args.trace_max_span_events,
                               replica=f"{args.host}:{args.port}", tensor_parallel_size=args.tensor_parallel_size)
    tracer = RequestTracer.from_settings(settings, context_length)
    log.info("tracing to %s over OTLP/%s (token events %s)", settings.endpoint, settings.protocol,
             "on" if settings.token_events else "off")  # fmt: skip
    return tracer


def start_metrics(args: argparse.Namespace, model_name: str,
                  client: EngineClient) -> tuple[ServingMetrics | None, Any, Any]:  # fmt: skip
    """(metrics, their HTTP server, the engine stats feed) when --metrics-port is set, else Nones."""
    if not args.metrics_port:
        return None, None, None
    from ringserve.frontend.metrics import EngineStatsFeed, ServingMetrics, serve_metrics

    metrics = ServingMetrics(model_name)
    http = serve_metrics(metrics, args.host, args.metrics_port)
    feed = EngineStatsFeed(client, metrics, args.metrics_stats_interval)
    feed.start()
    log.info("Prometheus metrics on http://%s:%d/metrics", args.host, args.metrics_port)
    return metrics, http, feed


async def stop_observability(tracer: RequestTracer | None, metrics_http: Any, stats_feed: Any) -> None:
    if stats_feed is not None:
        await stats_feed.stop()
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


async def serve_until_stopped(args: argparse.Namespace, source: ModelSource, dtype: str, arch: str,
                              tokenizer: ModelTokenizer, client: EngineClient, engine: subprocess.Popen[bytes],
                              security: ServerSecurity | None = None) -> int:  # fmt: skip
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine_exit = asyncio.create_task(wait_for_exit(engine))
    tracer: RequestTracer | None = None
    metrics_http: Any = None
    stats_feed: Any = None
    stop_wait = asyncio.create_task(stop.wait())
    client.start()
    try:
        ready_task = asyncio.create_task(client.wait_ready(args.engine_start_timeout))
        await asyncio.wait({ready_task, engine_exit, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not ready_task.done():
            ready_task.cancel()
            if engine_exit.done():
                log.error("the engine exited with code %s while loading the model", engine_exit.result())
                return 1
            return 0  # stopped by a signal while loading
        ready = ready_task.result()
        info = describe_model(source.name, arch, dtype, args.tensor_parallel_size, ready, tokenizer)
        tracer = start_tracing(args, info.context_length)
        metrics, metrics_http, stats_feed = start_metrics(args, info.model, client)
        server = build_server(client, tokenizer, info, args.host, args.port, tracer=tracer, metrics=metrics,
                              model_url=str(source.path), max_num_seqs=args.max_num_seqs, security=security,
                              max_waiting_requests=args.max_waiting_requests)
        add_disaggregation(server, client, args, ready)
        await server.start()
        log.info("serving %s on %s:%d (%d KV blocks of %d tokens)", source.name, args.host, server.port,
                 ready.num_total_blocks, ready.block_size)  # fmt: skip
        log.info("gRPC port: %s", (security or ServerSecurity()).describe())
        await asyncio.wait({engine_exit, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if engine_exit.done():
            # Fail every stream now (UNAVAILABLE), but keep answering: health says NOT_SERVING and new requests get
            # UNAVAILABLE until an operator or orchestrator stops this process, instead of connections refused.
            client.fail(f"the engine process exited with code {engine_exit.result()}; restart the server")
            log.error("the engine exited with code %s; serving NOT_SERVING until stopped", engine_exit.result())
            await stop_wait
            await server.stop(args.shutdown_grace)
            return 1
        log.info("stopping: draining in-flight streams for up to %.1f s", args.shutdown_grace)
        await server.stop(args.shutdown_grace)
        if client.failure is not None:  # the engine reported a fatal error (e.g. a worker died)
            log.error("stopped after an engine failure: %s", client.failure)
            return 1
        await client.shutdown_engine(timeout=5.0)
        return 0
    finally:
        stop_wait.cancel()
        engine_exit.cancel()
        await client.close()
        await stop_observability(tracer, metrics_http, stats_feed)


def add_disaggregation(server: Any, client: EngineClient, args: argparse.Namespace, ready: Any) -> None:
    """The internal Disaggregation service, with this server's role and its workers' KV peer infos."""
    from ringserve.frontend.disagg import DisaggregationServicer, LocalKv, read_worker_infos
    from ringserve.internal import disagg_pb2_grpc

    transfer = kv_transfer_backend(args)
    kv = None
    if transfer != "none":
        infos = read_worker_infos(args.kv_info_dir, args.tensor_parallel_size)
        kv = LocalKv(transfer, infos, ready.block_size, args.kv_pin_timeout)
    servicer = DisaggregationServicer(server.servicer, client, args.role, kv)
    disagg_pb2_grpc.add_DisaggregationServicer_to_server(servicer, server.server)
    if args.role != "both" or kv is not None:
        log.info("role %s, KV transfer %s, engine id %s", args.role, transfer, servicer.engine_id)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (error := check_serve_arguments(args)) is not None:
        print(f"ringserve serve: {error}", file=sys.stderr)
        return 2
    try:
        security = ServerSecurity.from_args(args)  # before the model loads: a bad TLS/key setting fails fast
        source = resolve_model(args.model, args.served_model_name or None)
        arch, context_length, tokenizer = model_metadata(source)
    except (ModelNotFoundError, OSError, ValueError) as exc:
        print(f"ringserve serve: {exc}", file=sys.stderr)
        return 2
    dtype = "float32" if args.dtype == "auto" else args.dtype
    max_model_len = min(args.max_model_len or context_length, context_length)

    from ringserve import _core

    for name in _core.reclaim_stale_segments():
        log.info("removed stale shared-memory segment %s left by a dead process", name)
    kv_info_dir = tempfile.TemporaryDirectory(prefix="ringserve-kv-")  # the workers' KV peer infos
    args.kv_info_dir = kv_info_dir.name
    request_ring = _core.ShmRing.create(new_segment_name("req"), REQUEST_RING_BYTES, 1)
    event_ring = _core.ShmRing.create(new_segment_name("evt"), EVENT_RING_BYTES, 1)
    engine: subprocess.Popen[bytes] | None = None
    try:
        cmd = engine_command(args, source, dtype, max_model_len, tokenizer.eos_token_ids,
                             request_ring.name, event_ring.name)  # fmt: skip
        engine = subprocess.Popen(cmd, env={**os.environ, "RINGSERVE_LOG_LEVEL": args.log_level.upper()})
        client = EngineClient(request_ring, event_ring)
        return asyncio.run(serve_until_stopped(args, source, dtype, arch, tokenizer, client, engine, security))
    finally:
        if engine is not None:
            stop_child(engine, timeout_s=15.0)
        request_ring.unlink()
        event_ring.unlink()
        kv_info_dir.cleanup()
