"""Starting and stopping an engine process (`python -m ringserve.backend.engine_main`): the frontend resolves the
engine's `auto` settings here for the host and model, then `EngineProcess.start` creates the request and event rings
the frontend talks through and starts the process; `stop` stops it and removes the rings."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ringserve.backend.process import engine_environment, stop_child, wait_for_exit
from ringserve.formats.engine_args import DEFAULT_MAX_STEP_SLOWDOWN, EngineArgs
from ringserve.formats.segments import EVENT_RING_BYTES, REQUEST_RING_BYTES, new_segment_name

log = logging.getLogger("ringserve.engine_process")


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


def resolve_dtype(choice: str) -> str:
    """--dtype auto: bfloat16 where it is the fast exact-enough choice (a GPU, or a CPU with the native bf16
    kernels), else float32 (bf16 arithmetic without AVX512-BF16 is emulated and slower than float32)."""
    if choice != "auto":
        return choice
    return "bfloat16" if nvidia_gpu_present() or native_bf16_cpu() else "float32"


def decode_graphs_expected(args: EngineArgs) -> bool:
    """The workers will replay decode steps as CUDA graphs (workers/cuda_graphs.py and ModelRunner: an NVIDIA GPU,
    --cuda-graphs other than off, the Triton paged attention, one rank, no speculation, a KV cache of the worker's
    own)."""
    return (nvidia_gpu_present() and args.cuda_graphs != "off" and args.attention_backend in ("auto", "triton_paged")
            and importlib.util.find_spec("triton") is not None and args.world_size == 1
            and args.num_speculative_tokens == 0 and args.kv_transfer in ("none", "auto"))  # fmt: skip


def resolve_max_step_slowdown(args: EngineArgs) -> float:
    """--max-step-slowdown auto: the default guard, or none where decode steps are CUDA graphs. Measured on an H200
    (benchmarks/serve.py, 1B shape, 64 streams): with graphs and the guard at 2, steps that prefill (eager, ~15 ms
    more than a graph replay) were held to the guard's floor and the p99 first token took 8.5 s; with graphs and no
    guard, 74 ms."""
    if args.max_step_slowdown == "auto":
        return 0.0 if decode_graphs_expected(args) else DEFAULT_MAX_STEP_SLOWDOWN
    return float(args.max_step_slowdown)


def resolve_engine_args(args: EngineArgs, context_length: int) -> EngineArgs:
    """`args` with the choices left to this host and model made: the dtype, the context length (at most the
    model's), the decode-latency guard and the KV transfer backend (`auto` here: none)."""
    return dataclasses.replace(
        args, dtype=resolve_dtype(args.dtype),
        max_model_len=min(args.max_model_len or context_length, context_length),
        max_step_slowdown=str(resolve_max_step_slowdown(args)),
        kv_transfer="none" if args.kv_transfer == "auto" else args.kv_transfer,
    )  # fmt: skip


def engine_command(args: EngineArgs, request_ring: str, event_ring: str) -> list[str]:
    """The engine on this host, or with --engine-placement ray its bridge to an engine on a Ray node (which the
    frontend treats as the engine process: same arguments, same rings, its exit is the engine's)."""
    module = "remote_engine" if args.engine_placement == "ray" else "engine_main"
    return [sys.executable, "-m", f"ringserve.backend.{module}", "--request-ring", request_ring,
            "--event-ring", event_ring, "--engine-args", args.to_json()]  # fmt: skip


class EngineProcess:
    """One running engine process and the two rings the frontend shares with it (the engine attaches to them)."""

    def __init__(self, process: subprocess.Popen[bytes], request_ring: Any, event_ring: Any) -> None:
        self.process = process
        self.request_ring = request_ring  # frontend -> engine
        self.event_ring = event_ring  # engine -> frontend

    @classmethod
    async def start(cls, args: EngineArgs, *, log_level: str = "INFO") -> EngineProcess:
        """Create the rings and start the engine on them; `args` must be resolved (`resolve_engine_args`)."""
        if unresolved := args.unresolved():
            raise ValueError(f"engine arguments {', '.join(unresolved)} are not resolved (see resolve_engine_args)")
        from ringserve import _core

        rings: list[Any] = []
        try:
            rings.append(_core.ShmRing.create(new_segment_name("req"), REQUEST_RING_BYTES, 1))
            rings.append(_core.ShmRing.create(new_segment_name("evt"), EVENT_RING_BYTES, 1))
            env = {**engine_environment(dict(os.environ)), "RINGSERVE_LOG_LEVEL": log_level.upper()}
            command = engine_command(args, rings[0].name, rings[1].name)
            process = await asyncio.to_thread(subprocess.Popen, command, env=env)
        except BaseException:
            for ring in rings:
                ring.unlink()
            raise
        return cls(process, rings[0], rings[1])

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    async def wait(self) -> int:
        """Completes when the process exits, with its exit code."""
        code = await wait_for_exit(self.process)
        await asyncio.to_thread(reclaim_dead_segments)
        return code

    async def stop(self, timeout_s: float) -> int:
        """Wait for the process to exit (SIGTERM, then SIGKILL after `timeout_s` each), then remove the rings."""
        try:
            return await asyncio.to_thread(stop_child, self.process, timeout_s)
        finally:
            self.request_ring.unlink()  # the engine removed the names once it attached; this covers a failed start
            self.event_ring.unlink()
            await asyncio.to_thread(reclaim_dead_segments)


def reclaim_dead_segments() -> None:
    """After an engine exits, however it exited: remove the segments its processes can no longer remove (those of
    an engine or worker that was killed before it could unlink its names, such as a worker's KV region)."""
    from ringserve import _core

    for name in _core.reclaim_stale_segments():
        log.info("removed %s, left by a process that died", name)
