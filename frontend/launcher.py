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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ringserve.backend.process import stop_child, wait_for_exit
from ringserve.backend.segments import EVENT_RING_BYTES, REQUEST_RING_BYTES, new_segment_name
from ringserve.frontend.cli_env import env_default, env_help, parse_bool
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
    flag("--num-speculative-tokens", 0, int,
         "speculative decoding: draft tokens the workers propose and verify per decode step (default %(default)s = "
         "off; at most 8); greedy output is unchanged and sampling keeps the model's distribution")
    flag("--draft", "ngram", str,
         "speculative proposer: ngram (prompt lookup, no model), layers:N (the model's first N layers + LM head) or "
         "a draft model path with the same vocabulary (default %(default)s)")
    flag("--spec-max-batch", 16, int,
         "no speculation in a step where more requests run: big batches are compute bound (default %(default)s; "
         "0 = no limit)")
    flag("--spec-min-acceptance", 0.25, float,
         "a request whose recent draft acceptance rate falls below this decodes without drafts for a while "
         "(default %(default)s)")
    flag("--prompt-lookup-min", 2, int, "ngram proposer: shortest n-gram matched (default %(default)s)")
    flag("--prompt-lookup-max", 4, int, "ngram proposer: longest n-gram matched (default %(default)s)")
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
        "--num-speculative-tokens", str(args.num_speculative_tokens), "--draft", args.draft,
        "--spec-max-batch", str(args.spec_max_batch), "--spec-min-acceptance", str(args.spec_min_acceptance),
        "--prompt-lookup-min", str(args.prompt_lookup_min), "--prompt-lookup-max", str(args.prompt_lookup_max),
        "--kv-cache-dtype", args.kv_cache_dtype, "--attention-backend", args.attention_backend,
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
        "--eos-token-ids", *map(str, eos_token_ids),
    ]  # fmt: skip
    if args.num_kv_blocks > 0:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return cmd


def check_serve_arguments(args: argparse.Namespace) -> str | None:
    """An error message saying what to change, or None."""
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1 (got {args.tensor_parallel_size})"
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})"
    if args.max_waiting_requests < 0:
        return f"--max-waiting-requests must be >= 0 (0 = unbounded; got {args.max_waiting_requests})"
    if not 0 <= args.num_speculative_tokens <= 8:
        return f"--num-speculative-tokens must be in [0, 8] (0 = off; got {args.num_speculative_tokens})"
    if args.spec_max_batch < 0 or not 0.0 <= args.spec_min_acceptance <= 1.0:
        return "--spec-max-batch must be >= 0 and --spec-min-acceptance in [0, 1]"
    if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        return (f"--prompt-lookup-min ({args.prompt_lookup_min}) must be >= 1 and <= --prompt-lookup-max "
                f"({args.prompt_lookup_max})")  # fmt: skip
    if args.draft != "ngram" and not args.draft.startswith("layers:") and not Path(args.draft).exists():
        return f"--draft {args.draft!r}: expected ngram, layers:N or an existing draft model path"
    if args.priority_aging_ms < 0:
        return f"--priority-aging-ms must be >= 0 (0 = strict priority; got {args.priority_aging_ms})"
    if args.max_model_len < 0 or args.num_kv_blocks < 0 or args.kv_cache_memory_gib <= 0:
        return "--max-model-len and --num-kv-blocks must be >= 0 and --kv-cache-memory-gib > 0"
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
