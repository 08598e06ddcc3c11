"""`ringserve serve`: this process is the frontend. For each served model it creates the request/event rings of
each engine replica and starts the engine process (which starts its workers); it serves gRPC until SIGTERM/SIGINT,
then drains, stops everything and removes every segment. Models come from `--model` or
`--models-config` at start-up and from TorchServe's RegisterModel at run time."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from ringserve.frontend.catalog import ModelCatalog, ModelError, ModelManager, ModelSpec, ServedModel
from ringserve.frontend.cli_env import env_default, env_help, parse_bool
from ringserve.frontend.deployment import ModelDeployment
from ringserve.frontend.disagg import model_identity
from ringserve.frontend.model_source import EMBEDDED_MODEL_NAME, ModelNotFoundError, ModelSource, resolve_model
from ringserve.frontend.security import ServerSecurity, add_server_security_arguments
from ringserve.frontend.server import (
    DEFAULT_MAX_WAITING_REQUESTS,
    GenerationServicer,
    build_catalog_server,
    describe_model,
)
from ringserve.frontend.tokenizer import ModelTokenizer, load_tokenizer, tokenizer_from_gguf
from ringserve.v1 import generation_pb2 as pb

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from ringserve.frontend.disagg import DisaggregationServicer
    from ringserve.frontend.metrics import ServingMetrics
    from ringserve.frontend.server import FrontendServer
    from ringserve.frontend.tracing import RequestTracer

log = logging.getLogger("ringserve.serve")

# The decode-latency guard's default: a step that prefills while requests decode may take at most 2x a decode-only
# step (by the engine's estimate; measured steps scatter around it, so the p99 lands near 2.6x on a busy small CPU).
# On a GPU that rarely cuts the token budget (a prefill token costs little next to a step's fixed cost); on a CPU it
# keeps streams within issue #3's 3x inter-token latency while a long prompt is prefilled.
DEFAULT_MAX_STEP_SLOWDOWN = 2.0


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
    flag("--dtype", "auto", str, "weights and activations dtype (default %(default)s = bfloat16 where the CPU has "
         "AVX512-BF16 or an NVIDIA GPU is present, else float32)", choices=["auto", "float32", "bfloat16", "float16"])
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
    flag("--max-step-slowdown", "auto", str,
         "decode-latency guard: while requests decode, a step's prefill chunks are cut so that its time (fitted "
         "online from measured steps) stays within this many times a decode-only step; running streams keep their "
         f"pace while long prompts arrive, at the cost of a later first token for those prompts (default auto: "
         f"{DEFAULT_MAX_STEP_SLOWDOWN:g}, but off where the workers replay decode steps as CUDA graphs: a step that "
         "prefills then runs eagerly and costs several decode steps whatever its chunk, and the guard would only "
         "hold prompts back; 0 = off: only the token budget bounds a step)")
    flag("--priority-aging-ms", 1000, int,
         "a waiting request's priority value improves by one per this many ms waited, so better-priority traffic "
         "cannot starve it (default %(default)s; 0 = strict priority)")
    flag("--num-speculative-tokens", 0, int,
         "speculative decoding: draft tokens the workers propose and verify per decode step (default %(default)s = "
         "off; at most 8); greedy output is unchanged and sampling keeps the model's distribution")
    flag("--draft", "ngram", str,
         "speculative proposer: ngram (prompt lookup, no model), layers:N (the model's first N layers + LM head) or "
         "a draft model path with the same vocabulary (default %(default)s)")
    flag("--spec-tree", "", str,
         "multi-candidate speculation: WxD proposes the drafter's top W tokens at each of the first D positions, "
         "then greedy chains down to --num-speculative-tokens, and verifies the whole tree in one pass (e.g. 2x2; "
         "with --draft ngram the branches are what followed different earlier matches; default: one chain)")
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
    flag("--cuda-graphs", "auto", str,
         "decode steps as CUDA graphs captured at start, for batches up to --max-num-seqs (default %(default)s = on "
         "CUDA with triton_paged attention and one worker; off = eager, like vLLM's --enforce-eager)",
         choices=["auto", "off"])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env_default("--enable-prefix-caching", True, parse_bool),
                   help="share the KV blocks of equal prompt prefixes (default on) "
                        + env_help("--enable-prefix-caching"))
    flag("--num-kv-blocks", 0, int, "KV cache size in blocks (default: from --kv-cache-memory-gib)")
    flag("--kv-cache-memory-gib", 1.0, float, "KV cache memory budget per worker in GiB (default %(default)s)")
    flag("--worker-threads", 0, int,
         "torch CPU threads per worker process (default 0: the usable CPUs divided among the tensor-parallel ranks; "
         "on a machine shared with other busy processes fewer threads avoid stalls)")
    flag("--engine-start-timeout", 600.0, float, "seconds to wait for the model to load (default %(default)s)")
    flag("--shutdown-grace", 5.0, float,
         "seconds in-flight streams get to finish on SIGTERM, and when a model is unregistered or scaled down "
         "(default %(default)s)")
    flag("--data-parallel-size", 1, int,
         "engine replicas of --model, each with its own workers and KV cache; requests go to the replica with the "
         "fewest outstanding tokens (default %(default)s)")
    flag("--models-config", "", str,
         "a TOML file of models to serve from the start ([[models]] tables: model, name, data_parallel_size, "
         "tensor_parallel_size, dtype, max_model_len, max_num_seqs, kv_cache_memory_gib, num_kv_blocks; optional "
         "top-level default_model); replaces --model")
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


def engine_command(args: argparse.Namespace, source: ModelSource, dtype: str, max_model_len: int,
                   eos_token_ids: list[int], request_ring: str, event_ring: str) -> list[str]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "ringserve.backend.engine_main",
        "--request-ring", request_ring, "--event-ring", event_ring, "--model", str(source.path), "--dtype", dtype,
        "--tensor-parallel-size", str(args.tensor_parallel_size), "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(max_model_len), "--kv-cache-memory-gib", str(args.kv_cache_memory_gib),
        "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
        "--max-step-slowdown", str(resolve_max_step_slowdown(args)),
        "--priority-aging-ms", str(args.priority_aging_ms),
        "--num-speculative-tokens", str(args.num_speculative_tokens), "--draft", args.draft,
        "--spec-tree", args.spec_tree,
        "--spec-max-batch", str(args.spec_max_batch), "--spec-min-acceptance", str(args.spec_min_acceptance),
        "--prompt-lookup-min", str(args.prompt_lookup_min), "--prompt-lookup-max", str(args.prompt_lookup_max),
        "--kv-cache-dtype", args.kv_cache_dtype, "--attention-backend", args.attention_backend,
        "--cuda-graphs", args.cuda_graphs,
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
        "--eos-token-ids", *map(str, eos_token_ids),
    ]  # fmt: skip
    if args.num_kv_blocks > 0:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.worker_threads > 0:
        cmd += ["--worker-threads", str(args.worker_threads)]
    transfer = kv_transfer_backend(args)
    if transfer != "none":
        cmd += ["--kv-transfer", transfer, "--kv-info-dir", args.kv_info_dir,
                "--model-id", model_identity(str(source.path), source.name, dtype)]  # fmt: skip
    return cmd


def native_bf16_cpu() -> bool:
    """True when this CPU runs the workers' native bf16 kernels (AVX512-BF16), which make bf16 the fast CPU dtype."""
    try:
        from ringserve import _kernels
    except ImportError:
        return False
    return bool(_kernels.has_avx512_bf16())


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver is loaded (the workers then run on CUDA), found without importing torch here."""
    return Path("/proc/driver/nvidia/version").exists()


def decode_graphs_expected(args: argparse.Namespace) -> bool:
    """The workers will replay decode steps as CUDA graphs (workers/cuda_graphs.py and ModelRunner: an NVIDIA GPU,
    --cuda-graphs auto, the Triton paged attention, one rank, no speculation, a KV cache of the worker's own)."""
    return (nvidia_gpu_present() and args.cuda_graphs == "auto" and args.attention_backend in ("auto", "triton_paged")
            and importlib.util.find_spec("triton") is not None and args.tensor_parallel_size == 1
            and args.num_speculative_tokens == 0 and kv_transfer_backend(args) == "none")  # fmt: skip


def resolve_max_step_slowdown(args: argparse.Namespace) -> float:
    """--max-step-slowdown auto: the default guard, or none where decode steps are CUDA graphs. Measured on an H200
    (benchmarks/serve.py, 1B shape, 64 streams): with graphs and the guard at 2, steps that prefill (eager, ~15 ms
    more than a graph replay) were held to the guard's floor and the p99 first token took 8.5 s; with graphs and no
    guard, 74 ms. Raises ValueError for a value that is not a number."""
    value = str(args.max_step_slowdown)
    if value == "auto":
        return 0.0 if decode_graphs_expected(args) else DEFAULT_MAX_STEP_SLOWDOWN
    return float(value)


def resolve_dtype(choice: str) -> str:
    """--dtype auto: bfloat16 where it is the fast exact-enough choice (a GPU, or a CPU with the native bf16
    kernels), else float32 (bf16 arithmetic without AVX512-BF16 is emulated and slower than float32)."""
    if choice != "auto":
        return choice
    return "bfloat16" if nvidia_gpu_present() or native_bf16_cpu() else "float32"


def kv_transfer_backend(args: argparse.Namespace) -> str:
    choice = getattr(args, "kv_transfer", "none")
    if choice == "auto":
        return "none" if getattr(args, "role", "both") == "both" else "shm"
    return choice


def check_serve_arguments(args: argparse.Namespace) -> str | None:
    """An error message saying what to change, or None."""
    if getattr(args, "data_parallel_size", 1) < 1:
        return f"--data-parallel-size must be at least 1 (got {args.data_parallel_size})"
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
    if getattr(args, "spec_tree", ""):
        from ringserve.formats.spec_tree import DraftTree

        if args.num_speculative_tokens == 0:
            return "--spec-tree needs --num-speculative-tokens > 0 (the tree's depth)"
        try:
            DraftTree.parse(args.spec_tree, args.num_speculative_tokens)
        except ValueError as error:
            return str(error)
    try:
        slowdown = resolve_max_step_slowdown(args)
    except ValueError:
        slowdown = float("nan")
    if not (slowdown == 0 or slowdown >= 1):
        return f"--max-step-slowdown must be 0 (off) or >= 1, or auto (got {args.max_step_slowdown})"
    if args.priority_aging_ms < 0:
        return f"--priority-aging-ms must be >= 0 (0 = strict priority; got {args.priority_aging_ms})"
    if getattr(args, "worker_threads", 0) < 0:
        return f"--worker-threads must be >= 0 (0 = automatic; got {args.worker_threads})"
    if args.max_model_len < 0 or args.num_kv_blocks < 0 or args.kv_cache_memory_gib <= 0:
        return "--max-model-len and --num-kv-blocks must be >= 0 and --kv-cache-memory-gib > 0"
    if args.role != "both" and kv_transfer_backend(args) == "none":
        return f"--role {args.role} needs a KV transfer backend: --kv-transfer shm or nixl"
    if kv_transfer_backend(args) != "none" and (getattr(args, "models_config", "")
                                                or getattr(args, "data_parallel_size", 1) > 1):
        return ("a disaggregated server (--role prefill/decode or --kv-transfer) serves one model with one engine "
                "replica: drop --models-config and --data-parallel-size, and run more servers behind the router")
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


def start_metrics(args: argparse.Namespace, model_name: str) -> tuple[ServingMetrics | None, Any]:
    """(the metrics of the first model, their HTTP server) when --metrics-port is set, else Nones; every other
    model's come from `.for_model(name)` and share the registry and the endpoint."""
    if not args.metrics_port:
        return None, None
    from ringserve.frontend.metrics import ServingMetrics, serve_metrics

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
                "max_num_seqs", "kv_cache_memory_gib", "num_kv_blocks"}  # fmt: skip


def load_models_config(path: str) -> tuple[list[ModelSpec], str | None]:
    """The `--models-config` TOML file: `[[models]]` tables and an optional top-level `default_model`.

    Each table: `model` (a .gguf file, a Hugging Face folder or the embedded model's name; required), `name`
    (default: from the file), and any of data_parallel_size, tensor_parallel_size, dtype, max_model_len,
    max_num_seqs, kv_cache_memory_gib, num_kv_blocks (default: the server's flags). Errors name the entry and key.
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


class ModelLauncher:
    """Starts a model's engine replicas for the ModelManager (startup models and RegisterModel alike)."""

    def __init__(self, args: argparse.Namespace, catalog: ModelCatalog, tracer: RequestTracer | None,
                 metrics: ServingMetrics | None) -> None:  # fmt: skip
        self._args = args
        self._catalog = catalog
        self._tracer = tracer
        self._metrics = metrics
        self._metadata: dict[str, LoadedMetadata] = {}

    def remember(self, metadata: LoadedMetadata) -> None:
        """Metadata read before the event loop started, so a startup model is not read twice."""
        self._metadata[str(metadata.source.path)] = metadata

    def settings(self, spec: ModelSpec) -> argparse.Namespace:
        """The server's flags with the spec's own settings over them."""
        overrides = {name: getattr(spec, name) for name in ("tensor_parallel_size", "dtype", "max_model_len",
                                                            "max_num_seqs", "kv_cache_memory_gib", "num_kv_blocks")
                     if getattr(spec, name) is not None}  # fmt: skip
        return argparse.Namespace(**{**vars(self._args), **overrides})

    async def load(self, spec: ModelSpec, model: ServedModel) -> None:
        settings = self.settings(spec)
        if (error := check_serve_arguments(settings)) is not None:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, error)
        metadata = self._metadata.pop(spec.path, None)
        if metadata is None:
            try:
                metadata = await asyncio.to_thread(read_metadata, spec.path, spec.name)
            except (ModelNotFoundError, OSError, ValueError) as exc:
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"url: {exc}") from None
        source, tokenizer = metadata.source, metadata.tokenizer
        dtype = resolve_dtype(settings.dtype)
        max_model_len = min(settings.max_model_len or metadata.context_length, metadata.context_length)

        def command(request_ring: str, event_ring: str) -> list[str]:
            return engine_command(settings, source, dtype, max_model_len, tokenizer.eos_token_ids, request_ring,
                                  event_ring)  # fmt: skip

        deployment = ModelDeployment(name=spec.name, url=str(source.path), tokenizer=tokenizer, command=command,
                                     start_timeout_s=settings.engine_start_timeout, log_level=settings.log_level)
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
            from ringserve.frontend.metrics import EngineStatsFeed

            metrics = self._metrics if self._metrics.model_name == spec.name else self._metrics.for_model(spec.name)
            model.metrics = metrics
            model.stats_feed = EngineStatsFeed(deployment, metrics, settings.metrics_stats_interval)
            model.stats_feed.start()
        servicer = GenerationServicer(deployment, tokenizer, info, tracer=self._tracer, metrics=metrics,
                                      max_waiting_requests=settings.max_waiting_requests)
        self._catalog.attach(model, servicer, deployment, info)
        log.info("model %s is serving (%d KV blocks of %d tokens per replica)", spec.name,
                 replica.ready.num_total_blocks, replica.ready.block_size)  # fmt: skip


def read_metadata(model: str, served_name: str | None = None) -> LoadedMetadata:
    source = resolve_model(model, served_name)
    architecture, context_length, tokenizer = model_metadata(source)
    return LoadedMetadata(source, architecture, context_length, tokenizer)


def startup_models(args: argparse.Namespace) -> tuple[list[ModelSpec], str | None]:
    """The models to serve from the start: `--models-config`'s, else `--model` (with --data-parallel-size)."""
    if args.models_config:
        return load_models_config(args.models_config)
    source = resolve_model(args.model, args.served_model_name or None)
    try:
        return [ModelSpec(name=source.name, path=str(source.path), replicas=args.data_parallel_size)], None
    except ModelError as exc:
        raise ValueError(exc.message) from None


async def serve_until_stopped(args: argparse.Namespace, specs: list[ModelSpec], default_model: str | None,
                              metadata: list[LoadedMetadata], security: ServerSecurity | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_wait = asyncio.create_task(stop.wait())
    tracer = start_tracing(args, max(m.context_length for m in metadata))
    metrics, metrics_http = start_metrics(args, specs[0].name)
    catalog = ModelCatalog()
    launcher = ModelLauncher(args, catalog, tracer, metrics)
    for loaded in metadata:
        launcher.remember(loaded)
    manager = ModelManager(catalog, launcher.load, drain_s=args.shutdown_grace,
                           runtime_changes=args.model_management)
    server = build_catalog_server(manager, args.host, args.port, security=security)
    disaggregation = add_disaggregation(server, args)
    server.starting = True
    try:
        await server.start()  # health answers NOT_SERVING while the models load
        log.info("gRPC port %d: %s", server.port, (security or ServerSecurity()).describe())
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
        # Engines that died while serving (a model that failed to register was already answered for).
        failed = [m.name for m in catalog.models() if m.state == pb.MODEL_STATE_FAILED and m.load_error is None]
        await server.stop(args.shutdown_grace)
        if failed:  # an engine or worker died: say so in the exit code
            log.error("stopped after the engine of model(s) %s failed", ", ".join(failed))
            return 1
        return 0
    finally:
        stop_wait.cancel()
        if not server.stopping:
            await server.stop(0)
        await manager.stop_all(0.0)
        await stop_observability(tracer, metrics_http)


def add_disaggregation(server: FrontendServer, args: argparse.Namespace) -> DisaggregationServicer:
    """The internal Disaggregation service (bound to the model once it is loaded): it must exist before the start."""
    from ringserve.frontend.disagg import DisaggregationServicer
    from ringserve.internal import disagg_pb2_grpc

    servicer = DisaggregationServicer(None, None, args.role, None)
    disagg_pb2_grpc.add_DisaggregationServicer_to_server(servicer, server.server)
    return servicer


def bind_disaggregation(servicer: DisaggregationServicer, model: ServedModel, args: argparse.Namespace) -> None:
    """Give the service the model's engine (a disaggregated server runs one model, one replica) and KV peer infos."""
    from ringserve.frontend.disagg import LocalKv, read_worker_infos

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
        metadata = [read_metadata(spec.path, spec.name) for spec in specs]
    except (ModelNotFoundError, OSError, ValueError) as exc:
        print(f"ringserve serve: {exc}", file=sys.stderr)
        return 2

    from ringserve import _core

    for name in _core.reclaim_stale_segments():
        log.info("removed stale shared-memory segment %s left by a dead process", name)
    kv_info_dir = tempfile.TemporaryDirectory(prefix="ringserve-kv-")  # the workers' KV peer infos
    args.kv_info_dir = kv_info_dir.name
    try:
        return asyncio.run(serve_until_stopped(args, specs, default_model, metadata, security))
    finally:
        kv_info_dir.cleanup()
