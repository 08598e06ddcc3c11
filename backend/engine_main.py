"""The engine process: `python -m ringserve.backend.engine_main`, started by the frontend (`ringserve serve`).

It creates the step and result rings, starts the worker processes, and runs the C++ step loop
(`ringserve._core.Engine.run`, GIL released) in a thread so the main thread stays free to handle signals.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from ringserve import _core
from ringserve.backend.process import die_with_parent, stop_children, worker_environment
from ringserve.formats.engine_args import EngineArgs, started_process_engine_args
from ringserve.formats.segments import RESULT_RING_BYTES, STEP_RING_BYTES, new_segment_name

if TYPE_CHECKING:
    from ringserve.backend.ray_executor import RayExecutor

log = logging.getLogger("ringserve.engine")

RANK_EXIT_WAIT_S = 10.0  # for the ranks to exit on WorkerShutdown after a Shutdown, before SIGTERM (then SIGKILL)
RANK_STOP_GRACE_S = 2.0  # the same after the engine failed: a rank may be stuck, the rest waiting on it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The rings this engine talks through and its EngineArgs (`args.engine`), which must be resolved."""
    p = argparse.ArgumentParser(
        prog="python -m ringserve.backend.engine_main", description="RingServe engine process (started by serve)."
    )
    p.add_argument("--request-ring", required=True, help="shm name of the request ring (created by the frontend)")
    p.add_argument("--event-ring", required=True, help="shm name of the event ring (created by the frontend)")
    p.add_argument("--engine-args", required=True, help="the EngineArgs JSON (ringserve/formats/engine_args.py)")
    args = p.parse_args(argv)
    args.engine = started_process_engine_args(p, args.engine_args)
    return args


def worker_command(engine: EngineArgs, rank: int, step_ring: str, result_ring: str) -> list[str]:
    return [sys.executable, "-m", "ringserve.workers.worker_main", "--rank", str(rank), "--step-ring", step_ring,
            "--result-ring", result_ring, "--parent-pid", str(os.getpid()),
            "--engine-args", engine.to_json()]  # fmt: skip


def worker_env(master_port: int) -> dict[str, str]:
    """torch.distributed rendezvous of the worker ranks (TP x PP), on loopback (all ranks share this host)."""
    return {**worker_environment(dict(os.environ)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_config(args: EngineArgs) -> _core.EngineConfig:
    config = _core.EngineConfig()
    config.block_size = args.block_size
    config.max_num_seqs = args.max_num_seqs
    config.max_num_batched_tokens = args.max_num_batched_tokens
    config.max_model_len = args.max_model_len
    config.eos_token_ids = list(args.eos_token_ids)
    config.enable_prefix_caching = args.enable_prefix_caching
    config.long_prefill_token_threshold = args.long_prefill_token_threshold
    config.max_step_slowdown = float(args.max_step_slowdown)
    config.priority_aging_ms = args.priority_aging_ms
    config.async_scheduling = args.async_scheduling == "on"
    config.step_timeout_s = args.step_timeout
    # The engine reserves lookahead slots: a chain's length, or every node of a draft tree.
    tree = args.draft_tree() if args.num_speculative_tokens > 0 else None
    config.num_speculative_tokens = tree.num_nodes if tree is not None else args.num_speculative_tokens
    config.spec_max_batch = args.spec_max_batch
    config.spec_min_acceptance = args.spec_min_acceptance
    # num_blocks stays 0: the engine then sizes its pool from the workers' WorkerReady (the blocks they really
    # allocated) and reports ready only once every worker has loaded the model.
    return config


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    engine_args: EngineArgs = args.engine
    if engine_args.async_scheduling == "on" and engine_args.num_speculative_tokens > 0:
        # A speculative step's accepted count is known only from its result (Scheduler::can_plan_ahead).
        log.info("async scheduling: with speculative decoding each step is planned after the previous step's result")
    die_with_parent()
    parent_pid = os.getppid()

    # Every rank of every pipeline stage reads each step (ringserve/formats/rank_layout.py numbers them).
    # --distributed-executor ray places the ranks first: the step ring has a reader per rank on this node and one per
    # other node (that node's relay).
    try:
        executor = start_ray_executor(engine_args) if engine_args.distributed_executor == "ray" else None
    except Exception as exc:
        return report_start_failure(args.event_ring, exc)
    readers = executor.step_readers if executor is not None else engine_args.world_size
    step_ring = _core.ShmRing.create(new_segment_name("step"), STEP_RING_BYTES, readers)
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
        try:
            if executor is not None:
                pids = executor.start(step_ring.name, result_ring.name)
            else:
                env = worker_env(free_port())
                for rank in range(engine_args.world_size):
                    command = worker_command(engine_args, rank, step_ring.name, result_ring.name)
                    workers.append(subprocess.Popen(command, env=env))
                pids = [w.pid for w in workers]
            engine = _core.Engine(
                engine_config(engine_args), args.request_ring, args.event_ring, step_ring.name, result_ring.name, pids
            )
        except Exception as exc:
            return report_start_failure(args.event_ring, exc)

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
        # After a Shutdown the ranks exit on the WorkerShutdown that followed it; after a failure one may be stuck
        # (--step-timeout) and the others waiting on it, so they get a short grace before the signals.
        grace_s = RANK_STOP_GRACE_S if failure else RANK_EXIT_WAIT_S
        for w, code in zip(workers, stop_children(workers, grace_s), strict=True):
            if code not in (0, -signal.SIGTERM):
                log.warning("worker pid %d exited with %d", w.pid, code)
        if executor is not None:
            executor.stop(grace_s)
        step_ring.unlink()  # the loop removed the names once the workers attached; this covers a failed start
        result_ring.unlink()
        if os.getppid() != parent_pid:  # the frontend died (we got its death signal): clean up after it
            leave_nothing_behind(engine_args)


def report_start_failure(event_ring: str | _core.ShmRing, error: Exception) -> int:
    """Tell the frontend why the engine could not start its ranks, as the EngineFailed a failing engine loop sends
    (the frontend then reports, retries and gives up on it as on any engine failure), and return the exit code 1.
    Nothing else writes the event ring before the engine loop exists."""
    message = str(error) if isinstance(error, RuntimeError) else f"{type(error).__name__}: {error}"
    log.error("the engine could not start: %s", message)
    try:
        writer = _core.RingWriter(_core.ShmRing.attach(event_ring) if isinstance(event_ring, str) else event_ring)
        failed = _core.EngineFailed(message=message, reason=_core.FailureReason.LOAD_FAILED)
        writer.write(_core.encode_record(failed), 5.0)
    except Exception as exc:  # the frontend is gone: it sees the exit code, if anyone does
        log.error("reporting it to the frontend failed: %s", exc)
    return 1


def start_ray_executor(engine_args: EngineArgs) -> RayExecutor:
    """Joins the Ray cluster and places the ranks (Ray is imported only with --distributed-executor ray)."""
    from ringserve.backend.ray_executor import RayExecutor

    return RayExecutor(engine_args)


def leave_nothing_behind(engine_args: EngineArgs) -> None:
    """Remove what a frontend that died leaves behind: its KV peer-info folder and any segment of a dead process
    (its rings, if it died before this engine attached them; a killed worker's KV region)."""
    if engine_args.kv_info_dir:
        shutil.rmtree(engine_args.kv_info_dir, ignore_errors=True)
    for name in _core.reclaim_stale_segments():
        log.info("removed %s, left by a process that died", name)


if __name__ == "__main__":
    sys.exit(main())
