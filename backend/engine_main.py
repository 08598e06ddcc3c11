"""The engine process: `python -m ringserve.backend.engine_main`, started by the frontend (`ringserve serve`).

It creates the step and result rings, starts the worker processes, and runs the C++ step loop
(`ringserve._core.Engine.run`, GIL released) in a thread so the main thread stays free to handle signals.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from types import FrameType

from ringserve import _core
from ringserve.backend.process import die_with_parent, stop_child, worker_environment
from ringserve.formats.segments import RESULT_RING_BYTES, STEP_RING_BYTES, new_segment_name
from ringserve.formats.spec_tree import DraftTree

log = logging.getLogger("ringserve.engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ringserve.backend.engine_main", description="RingServe engine process (started by serve)."
    )
    p.add_argument("--request-ring", required=True, help="shm name of the request ring (created by the frontend)")
    p.add_argument("--event-ring", required=True, help="shm name of the event ring (created by the frontend)")
    p.add_argument("--model", required=True, help="path of the model (GGUF file or Hugging Face folder)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="worker processes (ranks)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of equal prompt prefixes across requests")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request may prefill in a step (0 = no cap)")
    p.add_argument("--max-step-slowdown", type=float, default=0.0,
                   help="while requests decode, cut prefill chunks so a step's estimated time stays within this many "
                        "times a decode-only step (0 = off; otherwise >= 1)")
    p.add_argument("--priority-aging-ms", type=int, default=0,
                   help="a waiting request's priority value improves by one per this many ms waited (0 = strict)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="draft tokens verified per decode step and request (0 = no speculative decoding, at most 8)")
    p.add_argument("--spec-max-batch", type=int, default=16,
                   help="no speculation in a step where more requests run (0 = no limit)")
    p.add_argument("--spec-min-acceptance", type=float, default=0.25,
                   help="a request whose recent draft acceptance falls below this pauses speculation for a while")
    p.add_argument("--draft", default="ngram", help="proposer: ngram, layers:N or a draft model path")
    p.add_argument("--spec-tree", default="", help="WxD: a draft tree instead of a chain (empty = a chain)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram proposer: shortest n-gram matched")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram proposer: longest n-gram matched")
    p.add_argument(
        "--kv-cache-dtype", default=os.environ.get("RINGSERVE_KV_CACHE_DTYPE", "auto"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="KV cache dtype (auto = the weights'); env RINGSERVE_KV_CACHE_DTYPE",
    )  # fmt: skip
    p.add_argument(
        "--attention-backend", default=os.environ.get("RINGSERVE_ATTENTION_BACKEND", "auto"),
        choices=["auto", "torch_sdpa", "triton_paged"],
        help="workers' attention (auto = triton_paged on CUDA, torch_sdpa on CPU); env RINGSERVE_ATTENTION_BACKEND",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graphs", default=os.environ.get("RINGSERVE_CUDA_GRAPHS", "auto"), choices=["auto", "off"],
        help="workers' decode steps as CUDA graphs (auto = on CUDA where they apply); env RINGSERVE_CUDA_GRAPHS",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--eos-token-ids", type=int, nargs="*", default=[])
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV cache size in blocks")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV cache budget when not given in blocks")
    p.add_argument("--worker-start-timeout", type=float, default=600.0)
    p.add_argument("--worker-threads", type=int, default=0,
                   help="torch CPU threads per worker (default 0: the usable CPUs divided among the ranks)")
    p.add_argument("--kv-transfer", choices=("none", "shm", "nixl"), default="none",
                   help="disaggregation: the workers' KV transfer backend")
    p.add_argument("--kv-info-dir", default=None, help="where the workers write their KV peer infos")
    p.add_argument("--model-id", default="", help="model identity the KV handshake compares")
    return p.parse_args(argv)


def worker_command(args: argparse.Namespace, rank: int, step_ring: str, result_ring: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "ringserve.workers.worker_main",
        "--rank", str(rank), "--world-size", str(args.tensor_parallel_size),
        "--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size),
        "--kv-cache-memory-gib", str(args.kv_cache_memory_gib), "--kv-cache-dtype", args.kv_cache_dtype,
        "--attention-backend", args.attention_backend,
        "--cuda-graphs", args.cuda_graphs, "--max-graph-batch", str(args.max_num_seqs),
        "--step-ring", step_ring, "--result-ring", result_ring, "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if args.num_kv_blocks is not None:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.worker_threads > 0:
        cmd += ["--num-threads", str(args.worker_threads)]
    if args.num_speculative_tokens > 0:
        cmd += ["--speculation", "--draft", args.draft, "--prompt-lookup-min", str(args.prompt_lookup_min),
                "--prompt-lookup-max", str(args.prompt_lookup_max)]  # fmt: skip
        if args.spec_tree:
            cmd += ["--spec-tree", args.spec_tree, "--spec-depth", str(args.num_speculative_tokens)]
    if args.kv_transfer != "none":
        cmd += ["--kv-transfer", args.kv_transfer, "--model-id", args.model_id]
        if args.kv_info_dir:
            cmd += ["--kv-info-dir", args.kv_info_dir]
    return cmd


def worker_env(master_port: int) -> dict[str, str]:
    """torch.distributed rendezvous of the tensor-parallel ranks, on loopback (all ranks share this host)."""
    return {**worker_environment(dict(os.environ)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_config(args: argparse.Namespace) -> _core.EngineConfig:
    config = _core.EngineConfig()
    config.block_size = args.block_size
    config.max_num_seqs = args.max_num_seqs
    config.max_num_batched_tokens = args.max_num_batched_tokens
    config.max_model_len = args.max_model_len
    config.eos_token_ids = list(args.eos_token_ids)
    config.enable_prefix_caching = args.enable_prefix_caching
    config.long_prefill_token_threshold = args.long_prefill_token_threshold
    config.max_step_slowdown = args.max_step_slowdown
    config.priority_aging_ms = args.priority_aging_ms
    # The engine reserves lookahead slots: a chain's length, or every node of a draft tree.
    config.num_speculative_tokens = args.num_speculative_tokens
    if args.spec_tree and args.num_speculative_tokens > 0:
        config.num_speculative_tokens = DraftTree.parse(args.spec_tree, args.num_speculative_tokens).num_nodes
    config.spec_max_batch = args.spec_max_batch
    config.spec_min_acceptance = args.spec_min_acceptance
    # num_blocks stays 0: the engine then sizes its pool from the workers' WorkerReady (the blocks they really
    # allocated) and reports ready only once every worker has loaded the model.
    return config


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    die_with_parent()
    if args.tensor_parallel_size < 1:
        log.error("--tensor-parallel-size %d: must be at least 1", args.tensor_parallel_size)
        return 2

    step_ring = _core.ShmRing.create(new_segment_name("step"), STEP_RING_BYTES, args.tensor_parallel_size)
    result_ring = _core.ShmRing.create(new_segment_name("res"), RESULT_RING_BYTES, 1)
    workers: list[subprocess.Popen[bytes]] = []
    engine: _core.Engine | None = None
    failure: list[BaseException] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping the engine", signum)
        if engine is not None:
            engine.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        env = worker_env(free_port())
        for rank in range(args.tensor_parallel_size):
            workers.append(subprocess.Popen(worker_command(args, rank, step_ring.name, result_ring.name), env=env))
        engine = _core.Engine(
            engine_config(args), args.request_ring, args.event_ring, step_ring.name, result_ring.name,
            [w.pid for w in workers],
        )  # fmt: skip

        def run_loop() -> None:
            try:
                engine.run()
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        loop_thread = threading.Thread(target=run_loop, name="engine-loop")
        loop_thread.start()
        while loop_thread.is_alive():
            loop_thread.join(timeout=0.5)  # short joins keep Python signal handlers running
        if failure:
            log.error("engine loop failed: %s", failure[0])
            return 1
        return 0
    finally:
        for w in workers:
            code = stop_child(w, timeout_s=10.0)
            if code not in (0, -signal.SIGTERM):
                log.warning("worker pid %d exited with %d", w.pid, code)
        step_ring.unlink()
        result_ring.unlink()


if __name__ == "__main__":
    sys.exit(main())
