"""Worker process entry point: `python -m ringserve.workers.worker_main --rank R --step-ring ... --engine-args JSON`.

Reads StepPlans from the step ring, runs them on the persistent batch, and (one rank: tensor-parallel rank 0 of the
last pipeline stage) writes StepResults to the result ring. Records are the typed binary layouts of
`ringserve._core`; nothing here is pickled.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from ringserve.formats.engine_args import EngineArgs, default_worker_threads, started_process_engine_args
from ringserve.formats.rank_layout import RankLayout
from ringserve.workers.loader import load_model, parse_dtype
from ringserve.workers.model_runner import ModelRunner, freeze_long_lived_objects
from ringserve.workers.parallel import init_distributed
from ringserve.workers.pipeline import PipelineStage, SampledTokens
from ringserve.workers.speculative import make_proposer

_READ_TIMEOUT_S = 0.5  # how often an idle worker checks that its parent is alive
_WRITE_TIMEOUT_S = 0.5
_PR_SET_PDEATHSIG = 1
_MAX_FAILURE_MESSAGE = 4000  # keep WorkerFailed well under any ring's max_record_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This worker's rank and rings, and the engine's EngineArgs (`args.engine`; TP x PP ranks make the world)."""
    p = argparse.ArgumentParser(prog="python -m ringserve.workers.worker_main", description=__doc__)
    p.add_argument("--rank", type=int, default=0, help="rank of this worker (ringserve/formats/rank_layout.py)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = CUDA when available")
    p.add_argument("--step-ring", required=True, help="shared-memory name of the step ring (engine -> workers)")
    p.add_argument("--step-reader", type=int, default=None,
                   help="this worker's reader slot of the step ring (default: its rank)")  # fmt: skip
    p.add_argument("--result-ring", required=True, help="shared-memory name of the result ring (result rank -> engine)")
    p.add_argument("--ranks-on-host", type=int, default=None,
                   help="ranks sharing this host's CPUs, for --worker-threads 0 (default: all: the engine started them "
                        "here)")  # fmt: skip
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the engine) is gone")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator shared by unseeded requests")
    p.add_argument("--engine-args", required=True, help="the EngineArgs JSON (ringserve/formats/engine_args.py)")
    args = p.parse_args(argv)
    args.engine = started_process_engine_args(p, args.engine_args)
    if not 0 <= args.rank < args.engine.world_size:
        p.error(f"--rank {args.rank} is outside [0, {args.engine.world_size}) (--tensor-parallel-size "
                f"{args.engine.tensor_parallel_size} x --pipeline-parallel-size {args.engine.pipeline_parallel_size})")
    if args.ranks_on_host is not None and not 1 <= args.ranks_on_host <= args.engine.world_size:
        p.error(f"--ranks-on-host {args.ranks_on_host} is outside [1, {args.engine.world_size}]")
    return args


def worker_threads(args: argparse.Namespace) -> int:
    """--worker-threads, or for 0 this host's usable CPUs shared among the ranks on it (default_worker_threads)."""
    ranks_here = args.ranks_on_host or args.engine.world_size
    return args.engine.worker_threads or default_worker_threads(len(os.sched_getaffinity(0)), ranks_here)


def die_with_parent(parent_pid: int | None) -> None:
    """PR_SET_PDEATHSIG(SIGTERM), then close the race where the parent died before the prctl."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)


def parent_alive(parent_pid: int | None) -> bool:
    return parent_pid is None or os.getppid() == parent_pid


def write_until_accepted(writer: Any, record: bytes, keep_waiting: Callable[[], bool]) -> bool:
    """A full result ring is backpressure from the engine: wait, but give up if the engine is gone."""
    while not writer.write(record, _WRITE_TIMEOUT_S):
        if not keep_waiting():
            return False
    return True


def encode_result(core: ModuleType, out: Any) -> bytes:
    """StepResult; the top-n arrays are None unless some sampled row asked for alternatives, the speculative
    counts None unless the plan had lookahead."""
    if out.token_counts is None:
        return core.encode_step_result(
            out.step_id, out.slots, out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs
        )
    return core.encode_step_result(
        out.step_id, out.slots, out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs,
        token_counts=out.token_counts, num_proposed=out.num_proposed,
    )  # fmt: skip


def worker_device(name: str, rank: int) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def serve_steps(core: ModuleType, reader: Any, writer: Any, runner: Any, keep_running: Callable[[], bool]) -> int:
    """The step loop; returns the exit code. Raises on a failed step (the caller reports WorkerFailed). Only the
    result rank has a writer: every rank of the last stage sampled the same tokens (same logits, same seeds), and
    the earlier stages sampled none."""
    kv_pull = getattr(core, "KvPull", ())  # () matches nothing: a core (or test double) without disaggregation
    while True:
        record = reader.read(_READ_TIMEOUT_S)
        if record is None:
            if not keep_running():
                return 1
            continue
        command = core.decode_worker_command(record)
        if isinstance(command, core.WorkerShutdown):
            return 0
        if isinstance(command, kv_pull):  # runs before the next plan, which admits its slot
            runner.kv_pulls.append(command)
            continue
        out = runner.execute(command)
        if writer is not None:
            if not write_until_accepted(writer, encode_result(core, out), keep_running):
                return 1


def make_kv_connector(
    engine: EngineArgs, rank: int, model: Any, kv_dtype: torch.dtype | None, device: torch.device
) -> tuple[Any, Any]:
    """With --kv-transfer: the KV cache as views into a shared region, its connector, and this rank's peer info
    written to --kv-info-dir (the frontend hands it out in KV handles). (None, None) otherwise."""
    if engine.kv_transfer == "none":
        return None, None
    if device.type != "cpu":
        raise RuntimeError("--kv-transfer keeps the KV cache in host shared memory; this build supports it on CPU only")
    from ringserve.workers.kv_connector import KvConnector, KvRegion
    from ringserve.workers.model import KVCache
    from ringserve.workers.model_runner import kv_blocks_for_memory

    config = model.config
    dtype = kv_dtype or next(model.parameters()).dtype
    blocks = engine.num_kv_blocks or kv_blocks_for_memory(config, engine.block_size, dtype, engine.kv_cache_memory_gib)
    region = KvRegion(config.num_layers, blocks, engine.block_size, config.num_kv_heads, config.head_dim, dtype,
                      role=f"kv{rank}")  # fmt: skip
    try:
        connector = KvConnector(engine.kv_transfer, region, model_id=engine.model_id, tp_rank=rank,
                                tp_size=engine.tensor_parallel_size)  # fmt: skip
    except BaseException:
        region.unlink()
        raise
    if engine.kv_info_dir:
        path = os.path.join(engine.kv_info_dir, f"rank{rank}.bin")
        with open(path + ".tmp", "wb") as f:
            f.write(connector.info.encode())
        os.replace(path + ".tmp", path)  # readers never see a partial file
    return KVCache(k=region.k, v=region.v), connector


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine: EngineArgs = args.engine
    layout = RankLayout(engine.tensor_parallel_size, engine.pipeline_parallel_size)
    world_size, tp_size = layout.world_size, layout.tensor_parallel_size
    tp_rank, _ = layout.coords(args.rank)
    stage = PipelineStage.of(layout, args.rank) if layout.pipeline_parallel_size > 1 else None
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    # Ctrl-C reaches the whole process group; the engine stops the workers in order (WorkerShutdown), so ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ringserve import _core as core  # built from csrc/; imported here so the rest of workers/ needs no build

    # The result ring has one writer: the result rank. Other ranks report failure by exiting (the engine watches
    # every pid, and the result rank's next collective or receive fails too).
    writer = core.RingWriter(core.ShmRing.attach(args.result_ring)) if args.rank == layout.result_rank else None
    slot = args.rank if args.step_reader is None else args.step_reader
    reader = core.RingReader(core.ShmRing.attach(args.step_ring), slot)

    def keep_running() -> bool:
        return parent_alive(args.parent_pid)

    connector = None
    try:
        threads = worker_threads(args)
        torch.set_num_threads(threads)
        device = worker_device(args.device, args.rank)
        groups = init_distributed(args.rank, world_size, device, pipeline_parallel_size=layout.pipeline_parallel_size)
        dtype = parse_dtype(engine.dtype)
        model = load_model(engine.model_path, dtype, device, tp_rank, tp_size, stage, engine.quantization)
        kv_dtype = None if engine.kv_cache_dtype == "auto" else parse_dtype(engine.kv_cache_dtype)
        kv_cache, connector = make_kv_connector(engine, args.rank, model, kv_dtype, device)  # refused with stages
        runner = ModelRunner(
            model,
            block_size=engine.block_size,
            num_kv_blocks=engine.num_kv_blocks or None,
            kv_cache_memory_gib=engine.kv_cache_memory_gib,
            device=device,
            seed=args.seed,
            kv_cache_dtype=kv_dtype,
            attention_backend=engine.attention_backend,
            kv_cache=kv_cache,
            kv_connector=connector,
            cuda_graphs=engine.cuda_graphs,
            max_graph_batch=engine.max_num_seqs,  # graphs only as large as a step can be
            max_graph_tokens=engine.max_num_batched_tokens,
            sampled_tokens=None if stage is None else SampledTokens(stage, groups.pipeline, device),
        )
        speculation = engine.num_speculative_tokens > 0  # the engine then plans lookahead
        if speculation:
            runner.proposer = make_proposer(
                engine.draft, runner.model, runner.num_kv_blocks, engine.block_size,
                torch.Generator(device).manual_seed(args.seed + 1), engine.prompt_lookup_min, engine.prompt_lookup_max,
                load_draft=lambda path: load_model(path, dtype, device, tp_rank, tp_size),  # refused with stages
                tree=engine.draft_tree(),
            )  # fmt: skip
        print(
            f"worker {args.rank}/{world_size}: {engine.model_path} ({engine.dtype}, KV {engine.kv_cache_dtype}) on "
            f"{device}, {runner.num_kv_blocks} KV blocks of {engine.block_size}, {threads} threads, "
            f"attention {engine.attention_backend}"
            + (f", CUDA graphs for batches up to {runner.graphs.max_batch}" if runner.graphs is not None else "")
            + (f", stage {stage.index} of {stage.num_stages} ({runner.config.num_layers} layers)" if stage else "")
            + (f", speculation {engine.draft}" if speculation else "")
            + (f" tree {engine.spec_tree}" if speculation and engine.spec_tree else ""),
            file=sys.stderr,
            flush=True,
        )
        freeze_long_lived_objects()
        num_kv_blocks = runner.num_kv_blocks
        if world_size > 1:
            # The engine waits for one WorkerReady: it must mean every rank loaded, and its block count must fit
            # every rank (stages with fewer layers fit more blocks in the same memory).
            blocks = torch.tensor([num_kv_blocks], device=device)
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
            num_kv_blocks = int(blocks.item())
        if writer is not None:
            write_until_accepted(writer, core.encode_worker_ready(args.rank, num_kv_blocks), keep_running)
        return serve_steps(core, reader, writer, runner, keep_running)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        if writer is not None:
            message = f"worker {args.rank}: {type(exc).__name__}: {exc}"[:_MAX_FAILURE_MESSAGE]
            write_until_accepted(writer, core.encode_worker_failed(args.rank, message), keep_running)
        return 1
    finally:
        if connector is not None:
            connector.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
