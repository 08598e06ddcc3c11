"""The engine configuration: every setting the engine process and its workers share, declared once in `EngineArgs`.

`ringserve serve` adds the flags from it (`add_engine_arguments`) and reads them back (`EngineArgs.from_namespace`);
the frontend resolves the `auto` choices for the model and host it starts an engine for, and the engine process, then
each worker, gets the result as one JSON command-line argument (`to_json`, `EngineArgs.from_json`). Each field's
metadata holds its help text and type; a field with a flag `--the-name` also reads RINGSERVE_THE_NAME.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringserve.formats.cli_env import env_default, env_help, parse_bool
from ringserve.formats.rank_layout import RankLayout
from ringserve.formats.spec_tree import DraftTree

# The decode-latency guard's default: a step that prefills while requests decode may take at most 2x a decode-only
# step (by the engine's estimate; measured steps scatter around it, so the p99 lands near 2.6x on a busy small CPU).
# On a GPU that rarely cuts the token budget (a prefill token costs little next to a step's fixed cost); on a CPU it
# keeps streams within issue #3's 3x inter-token latency while a long prompt is prefilled.
DEFAULT_MAX_STEP_SLOWDOWN = 2.0
MAX_SPECULATIVE_TOKENS = 8
DTYPES = ("float32", "bfloat16", "float16")
DISTRIBUTED_EXECUTORS = ("mp", "ray")
ENGINE_PLACEMENTS = ("local", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's
QUANTIZATIONS = ("auto", "none", "gguf")  # workers/model/quant_ops.py resolves auto
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "triton_paged")  # workers/attention/selection.py builds them
CUDA_GRAPH_MODES = ("auto", "off", "decode", "piecewise")  # workers/model_runner.py resolves auto
# Local worker processes (TP x PP) of one engine: each reads the step ring, which takes at most this many readers
# (kMaxRingReaders in csrc/ringserve/shm_ring.h, exported as _core.MAX_RING_READERS; a test keeps them equal).
MAX_LOCAL_WORKERS = 8
# Ray ranks of one engine: each node's step ring has a reader per rank there and the engine's ring at most one per
# node (a relay), so at most 8 nodes of 8 ranks each; backend/ray_executor.py checks the placement Ray gives.
MAX_RAY_RANKS = MAX_LOCAL_WORKERS * MAX_LOCAL_WORKERS
# Seconds a step's result may take (--step-timeout): vLLM's execute-model timeout.
DEFAULT_STEP_TIMEOUT_S = 300.0
# CPUs that --worker-threads 0 leaves to the frontend and the engine loop (both wake every step): a worker thread
# sharing its core with them is descheduled in the middle of a step's kernels, and the step waits for it.
CPUS_LEFT_TO_FRONTEND_AND_ENGINE = 1


def default_worker_threads(usable_cpus: int, world_size: int) -> int:
    """--worker-threads 0: the usable CPUs less CPUS_LEFT_TO_FRONTEND_AND_ENGINE, divided among the worker
    processes (ranks), at least one each (so one thread on a 2-core machine, three on four)."""
    return max(1, (usable_cpus - CPUS_LEFT_TO_FRONTEND_AND_ENGINE) // max(world_size, 1))


def _setting(default: Any, help_: str, *, choices: tuple[str, ...] | None = None, flag: bool = True) -> Any:
    """A field; `flag=False` for what the frontend fills in per model rather than the operator per server."""
    return field(default=default, metadata={"help": help_, "type": type(default), "choices": choices, "flag": flag})


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """One engine replica's settings. Constructing one checks it: a ValueError names the flag to change."""

    model_path: str = _setting("", "the model's .gguf file or Hugging Face folder (resolved from --model)", flag=False)
    dtype: str = _setting(
        "auto", "weights and activations dtype (default %(default)s = bfloat16 where the CPU has AVX512-BF16 or an "
        "NVIDIA GPU is present, else float32)", choices=("auto", *DTYPES))  # fmt: skip
    tensor_parallel_size: int = _setting(1, "worker processes the model is split across (default %(default)s)")
    pipeline_parallel_size: int = _setting(
        1, "pipeline stages the model's layers are split into, each stage holding its layers' weights and KV cache "
        "on --tensor-parallel-size workers of its own (default %(default)s)")  # fmt: skip
    max_num_seqs: int = _setting(256, "most sequences running in one step (default %(default)s)")
    max_num_batched_tokens: int = _setting(2048, "token budget of one engine step (default %(default)s)")
    max_model_len: int = _setting(0, "context length limit (default: the model's)")
    block_size: int = _setting(16, "tokens per KV cache block (default %(default)s)")
    long_prefill_token_threshold: int = _setting(
        0, "most prompt tokens one request may prefill per step (default %(default)s = no cap)")
    max_step_slowdown: str = _setting(
        "auto", "decode-latency guard: while requests decode, a step's prefill chunks are cut so that its time (fitted "
        "online from measured steps) stays within this many times a decode-only step; running streams keep their "
        "pace while long prompts arrive, at the cost of a later first token for those prompts (default auto: "
        f"{DEFAULT_MAX_STEP_SLOWDOWN:g}, but off where the workers replay decode steps as CUDA graphs: a step that "
        "prefills then runs eagerly and costs several decode steps whatever its chunk, and the guard would only "
        "hold prompts back; 0 = off: only the token budget bounds a step)")  # fmt: skip
    priority_aging_ms: int = _setting(
        1000, "a waiting request's priority value improves by one per this many ms waited, so better-priority "
        "traffic cannot starve it (default %(default)s; 0 = strict priority)")  # fmt: skip
    num_speculative_tokens: int = _setting(
        0, "speculative decoding: draft tokens the workers propose and verify per decode step (default %(default)s = "
        f"off; at most {MAX_SPECULATIVE_TOKENS}); greedy output is unchanged and sampling keeps the model's "
        "distribution")  # fmt: skip
    draft: str = _setting(
        "ngram", "speculative proposer: ngram (prompt lookup, no model), layers:N (the model's first N layers + LM "
        "head) or a draft model path with the same vocabulary (default %(default)s)")  # fmt: skip
    spec_tree: str = _setting(
        "", "multi-candidate speculation: WxD proposes the drafter's top W tokens at each of the first D positions, "
        "then greedy chains down to --num-speculative-tokens, and verifies the whole tree in one pass (e.g. 2x2; "
        "with --draft ngram the branches are what followed different earlier matches; default: one chain)")  # fmt: skip
    spec_max_batch: int = _setting(
        16, "no speculation in a step where more requests run: big batches are compute bound (default %(default)s; "
        "0 = no limit)")  # fmt: skip
    spec_min_acceptance: float = _setting(
        0.25, "a request whose recent draft acceptance rate falls below this decodes without drafts for a while "
        "(default %(default)s)")  # fmt: skip
    prompt_lookup_min: int = _setting(2, "ngram proposer: shortest n-gram matched (default %(default)s)")
    prompt_lookup_max: int = _setting(4, "ngram proposer: longest n-gram matched (default %(default)s)")
    quantization: str = _setting(
        "auto", "GGUF weights on the CPU: gguf keeps Q8_0, Q4_0, Q4_1, Q4_K and Q6_K projection weights in their "
        "blocks and computes with native int8 kernels (inputs quantized per 32 values; AVX2 or portable); none "
        "dequantizes every weight to --dtype; auto (default) = gguf where the CPU has AVX2 and one worker holds the "
        "model, else none (docs/serving.md)", choices=QUANTIZATIONS)  # fmt: skip
    kv_cache_dtype: str = _setting("auto", "KV cache dtype (default %(default)s = the weights')",
                                   choices=("auto", *DTYPES))  # fmt: skip
    attention_backend: str = _setting(
        "auto", "workers' attention kernels (default %(default)s = triton_paged on CUDA when triton is installed, "
        "torch_sdpa on CPU)", choices=ATTENTION_BACKENDS)  # fmt: skip
    cuda_graphs: str = _setting(
        "auto", "CUDA graphs captured at start: decode = decode-only steps as one graph each, for batches up to "
        "--max-num-seqs (triton_paged attention); piecewise = those, and every other step up to "
        "--max-num-batched-tokens replayed in pieces with attention run eagerly between them (docs/gpu.md); off = "
        "eager, like vLLM's --enforce-eager; default %(default)s = piecewise on CUDA with one worker, eager on CPU",
        choices=CUDA_GRAPH_MODES)  # fmt: skip
    async_scheduling: str = _setting(
        "off", "on: plan each step while the workers compute the one before, so scheduling and result handling leave "
        "the step's critical path; outputs are the same (speculative steps and steps that could preempt are planned "
        "after the result, as with off; default %(default)s)", choices=("on", "off"))  # fmt: skip
    step_timeout: float = _setting(
        DEFAULT_STEP_TIMEOUT_S, "seconds the engine waits for a step's result; past that a rank counts as stuck "
        "(alive but deadlocked, stopped, or waiting on a peer): the step's requests end UNAVAILABLE and the replica "
        "is restarted as for a dead worker. A step is at most --max-num-batched-tokens tokens, so raise it only "
        "where one such step can take minutes; loading the model is not a step (default %(default)s; 0 = no "
        "limit)")  # fmt: skip
    enable_prefix_caching: bool = _setting(True, "share the KV blocks of equal prompt prefixes (default on)")
    num_kv_blocks: int = _setting(0, "KV cache size in blocks (default: from --kv-cache-memory-gib)")
    kv_cache_memory_gib: float = _setting(1.0, "KV cache memory budget per worker in GiB (default %(default)s)")
    worker_threads: int = _setting(
        0, "CPU threads per worker process (torch's and the native kernels'; default 0: the usable CPUs less one left "
        "to the frontend and engine, divided among the tensor-parallel ranks, at least one each)")  # fmt: skip
    kv_transfer: str = _setting(
        "auto", "KV transfer backend between prefill and decode servers: shm (same host), nixl (NIXL over UCX: RDMA, "
        "TCP), none; auto = shm for --role prefill/decode, none for both",
        choices=("auto", "none", "shm", "nixl"))  # fmt: skip
    distributed_executor: str = _setting(
        "mp", "how worker ranks are started: mp = processes on this host; ray = Ray actors placed on the nodes of a "
        "running Ray cluster (docs/distributed.md; pip install 'ringserve[ray]')",
        choices=DISTRIBUTED_EXECUTORS)  # fmt: skip
    ray_address: str = _setting(
        "", "--distributed-executor ray: the Ray cluster to join (default: $RAY_ADDRESS, else the cluster running "
        "on this host)")  # fmt: skip
    placement_strategy: str = _setting(
        "PACK", "--distributed-executor ray: Ray placement group strategy of the ranks' bundles (default "
        "%(default)s; SPREAD / STRICT_SPREAD put ranks on different nodes)", choices=PLACEMENT_STRATEGIES)  # fmt: skip
    engine_placement: str = _setting(
        "local", "where each replica's engine process runs: local = on this host, beside the frontend; ray = on a "
        "node of the Ray cluster (needs --distributed-executor ray), its ranks packed with it as processes on that "
        "node, its request and event records carried over one TCP stream (docs/distributed.md)",
        choices=ENGINE_PLACEMENTS)  # fmt: skip
    ray_placement_timeout: float = _setting(
        60.0, "--distributed-executor ray: seconds to wait for the cluster to place the ranks' bundles; then the "
        "engine fails to start with the resources it asked for and those free, and is retried as any failed engine "
        "(default %(default)s)")  # fmt: skip
    eos_token_ids: tuple[int, ...] = _setting((), "the tokenizer's end-of-sequence ids", flag=False)
    model_id: str = _setting("", "the model identity the KV handshake of disaggregation compares", flag=False)
    kv_info_dir: str = _setting("", "where the workers write their KV peer infos (rank<r>.bin)", flag=False)

    def __post_init__(self) -> None:
        if (problem := self._problem()) is not None:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        for f in dataclasses.fields(self):
            if (choices := f.metadata["choices"]) and getattr(self, f.name) not in choices:
                return f"{_flag(f.name)} {getattr(self, f.name)!r}: expected one of {', '.join(choices)}"
        if self.tensor_parallel_size < 1:
            return f"--tensor-parallel-size must be at least 1 (got {self.tensor_parallel_size})"
        if self.pipeline_parallel_size < 1:
            return f"--pipeline-parallel-size must be at least 1 (got {self.pipeline_parallel_size})"
        if (problem := self._rank_count_problem()) is not None:
            return problem
        if self.pipeline_parallel_size > 1 and self.num_speculative_tokens > 0:
            return "--pipeline-parallel-size > 1 does not support speculative decoding (--num-speculative-tokens 0)"
        if self.pipeline_parallel_size > 1 and self.kv_transfer in ("shm", "nixl"):
            return "--pipeline-parallel-size > 1 does not support --kv-transfer (disaggregated prefill and decode)"
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                return f"{_flag(name)} must be at least 1 (got {getattr(self, name)})"
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            return (f"--num-speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0 = off; got "
                    f"{self.num_speculative_tokens})")  # fmt: skip
        if self.spec_max_batch < 0 or not 0.0 <= self.spec_min_acceptance <= 1.0:
            return "--spec-max-batch must be >= 0 and --spec-min-acceptance in [0, 1]"
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            return (f"--prompt-lookup-min ({self.prompt_lookup_min}) must be >= 1 and <= --prompt-lookup-max "
                    f"({self.prompt_lookup_max})")  # fmt: skip
        if self.draft != "ngram" and not self.draft.startswith("layers:") and not Path(self.draft).exists():
            return f"--draft {self.draft!r}: expected ngram, layers:N or an existing draft model path"
        if self.spec_tree:
            if self.num_speculative_tokens == 0:
                return "--spec-tree needs --num-speculative-tokens > 0 (the tree's depth)"
            try:
                self.draft_tree()
            except ValueError as error:
                return str(error)
        if self.max_step_slowdown != "auto":
            try:
                slowdown = float(self.max_step_slowdown)
            except ValueError:
                slowdown = float("nan")
            if not (slowdown == 0 or slowdown >= 1):
                return f"--max-step-slowdown must be 0 (off) or >= 1, or auto (got {self.max_step_slowdown})"
        if self.priority_aging_ms < 0:
            return f"--priority-aging-ms must be >= 0 (0 = strict priority; got {self.priority_aging_ms})"
        if self.distributed_executor == "ray" and importlib.util.find_spec("ray") is None:
            return "--distributed-executor ray needs Ray, which is not installed here: pip install 'ringserve[ray]'"
        if self.engine_placement == "ray" and self.distributed_executor != "ray":
            return "--engine-placement ray needs --distributed-executor ray (the cluster to place the engines on)"
        if self.engine_placement == "ray" and self.kv_transfer in ("shm", "nixl"):
            return "--engine-placement ray does not support --kv-transfer (disaggregated prefill and decode)"
        if self.ray_placement_timeout <= 0:
            return f"--ray-placement-timeout must be > 0 seconds (got {self.ray_placement_timeout})"
        if not 0 <= self.step_timeout < float("inf"):
            return f"--step-timeout must be >= 0 seconds (0 = no limit; got {self.step_timeout})"
        if self.worker_threads < 0:
            return f"--worker-threads must be >= 0 (0 = automatic; got {self.worker_threads})"
        if self.max_model_len < 0 or self.num_kv_blocks < 0 or self.kv_cache_memory_gib <= 0:
            return "--max-model-len and --num-kv-blocks must be >= 0 and --kv-cache-memory-gib > 0"
        return None

    def _rank_count_problem(self) -> str | None:
        """Too many ranks for the step rings' readers (MAX_LOCAL_WORKERS each), whatever the placement."""
        ranks = (f"--tensor-parallel-size {self.tensor_parallel_size} x --pipeline-parallel-size "
                 f"{self.pipeline_parallel_size} = {self.world_size} worker processes")  # fmt: skip
        if self.distributed_executor == "mp" and self.world_size > MAX_LOCAL_WORKERS:
            return (f"{ranks}; one engine starts at most {MAX_LOCAL_WORKERS} on its host (each reads its step ring; "
                    "--distributed-executor ray places more on several nodes)")  # fmt: skip
        if self.distributed_executor == "mp":
            return None
        if self.engine_placement == "ray" and self.world_size > MAX_LOCAL_WORKERS:
            return (f"{ranks} with --engine-placement ray: a replica's ranks are packed on its engine's node, at "
                    f"most {MAX_LOCAL_WORKERS} (each reads its step ring)")  # fmt: skip
        if self.world_size > MAX_RAY_RANKS:
            return (f"{ranks}; one engine has at most {MAX_RAY_RANKS} Ray ranks ({MAX_LOCAL_WORKERS} nodes of "
                    f"{MAX_LOCAL_WORKERS}: a step ring has at most {MAX_LOCAL_WORKERS} readers)")  # fmt: skip
        if self.placement_strategy == "STRICT_SPREAD" and self.world_size > MAX_LOCAL_WORKERS:
            return (f"{ranks} with --placement-strategy STRICT_SPREAD: one rank per node, and the engine's step ring "
                    f"has a reader per node, at most {MAX_LOCAL_WORKERS}; PACK or SPREAD put several ranks on a "
                    "node")  # fmt: skip
        return None

    @property
    def rank_layout(self) -> RankLayout:
        """Where each of the engine's worker ranks sits (--tensor-parallel-size parts in --pipeline-parallel-size
        stages)."""
        return RankLayout(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        """Worker processes of the engine: --tensor-parallel-size ranks in each of --pipeline-parallel-size stages."""
        return self.rank_layout.world_size

    @property
    def result_rank(self) -> int:
        """The one rank that writes step results (RankLayout.result_rank)."""
        return self.rank_layout.result_rank

    def draft_tree(self) -> DraftTree | None:
        """The --spec-tree shape at depth --num-speculative-tokens, or None for one chain."""
        return DraftTree.parse(self.spec_tree, self.num_speculative_tokens) if self.spec_tree else None

    def unresolved(self) -> list[str]:
        """The choices still left to the frontend (`auto`, or 0 = the model's), which a process it starts cannot
        make: it has not read the model, and the frontend describes the model with what it chose."""
        left = [_flag(name) for name in ("dtype", "max_step_slowdown", "kv_transfer") if getattr(self, name) == "auto"]
        return left + (["--max-model-len"] if self.max_model_len == 0 else [])

    # -- serialization: the frontend's command line in, one JSON argument out to each child process ------------

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The flags `add_engine_arguments` added, as parsed; a ValueError names a flag whose value cannot work."""
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if f.metadata["flag"]})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        """What `to_json` wrote; a missing field takes its default. A ValueError names a key that does not fit."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"engine arguments are not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("engine arguments: expected a JSON object")
        known = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(values) - set(known)):
            raise ValueError(f"engine arguments: unknown key(s) {unknown}")
        return cls(**{name: _from_json_value(known[name], value) for name, value in values.items()})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _from_json_value(f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.metadata["type"]
    if kind is tuple:
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"engine arguments: {f.name}: expected {kind.__name__}, got {value!r}")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs flag, vLLM's name where vLLM has the same knob; each default also reads RINGSERVE_<FLAG>."""
    for f in dataclasses.fields(EngineArgs):
        if not f.metadata["flag"]:
            continue
        name, kind = _flag(f.name), f.metadata["type"]
        help_ = f"{f.metadata['help']} {env_help(name)}"
        if kind is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction,
                                default=env_default(name, f.default, parse_bool), help=help_)  # fmt: skip
        else:
            choices = f.metadata["choices"]
            parser.add_argument(name, default=env_default(name, f.default, kind), type=kind,
                                choices=list(choices) if choices else None, help=help_)  # fmt: skip


def started_process_engine_args(parser: argparse.ArgumentParser, text: str) -> EngineArgs:
    """The `--engine-args` JSON of a process the frontend started (the engine, a worker): resolved EngineArgs, or a
    usage error (exit code 2) saying what does not fit."""
    try:
        args = EngineArgs.from_json(text)
    except ValueError as error:
        parser.error(str(error))
    if unresolved := args.unresolved():
        parser.error(f"engine arguments {', '.join(unresolved)} must be resolved by the frontend")
    return args
