"""Helpers for the processes RingServe starts: their environment, parent-death signals and orderly shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1

# glibc (2.35 and later; older ones ignore it) then backs malloc's heap with transparent huge pages where the kernel
# allows them ("always" or "madvise").
HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb=1"
# Set in the engine's environment: the GLIBC_TUNABLES the workers get back ("" = none).
_WORKER_TUNABLES = "RINGSERVE_WORKER_GLIBC_TUNABLES"
# PyTorch's CPU wheel runs its intra-op threads (and MKL's) on GNU OpenMP, which by default spins 300,000 polls
# (milliseconds) at every barrier and after every parallel region before it sleeps. A worker with two threads then
# keeps its OpenMP helper spinning on the core that the native kernels' pool helper, the frontend and the engine
# need, and the main thread spinning at barriers for a helper another process pushed off its core: on 2 cores that
# cost four times the CPU of one thread per generated token (benchmarks/cpu_split.py). Workers sleep at once instead
# (libgomp reads these when torch loads it), unless the operator set either variable.
OPENMP_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
_OPENMP_WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_environment(base: dict[str, str]) -> dict[str, str]:
    """`base` plus huge-page malloc for the engine core process. Its scheduler touches every running request's token
    array in every step, each array on a 4 KiB page of its own otherwise, so at a thousand running requests the TLB
    misses add up (on the development VM: a fifth of a step in its slow minutes, nothing measurable in its fast
    ones). An operator's own glibc.malloc.hugetlb setting is kept, and
    RINGSERVE_ENGINE_HUGE_PAGES=0 turns this off. The workers the engine starts get the original setting back (see
    worker_environment)."""
    env = dict(base)
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get("RINGSERVE_ENGINE_HUGE_PAGES", "1") == "0" or "glibc.malloc.hugetlb" in tunables:
        return env
    env[_WORKER_TUNABLES] = tunables
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_MALLOC}" if tunables else HUGE_PAGE_MALLOC
    return env


def worker_environment(base: dict[str, str]) -> dict[str, str]:
    """`base` (the engine's environment) with the GLIBC_TUNABLES the engine was given before engine_environment, and
    OpenMP told to sleep rather than spin (OPENMP_WAIT_ENV) unless `base` sets its wait policy or spin count."""
    env = dict(base)
    if not any(key in env for key in _OPENMP_WAIT_KEYS):
        env.update(OPENMP_WAIT_ENV)
    if _WORKER_TUNABLES in env:
        original = env.pop(_WORKER_TUNABLES)
        if original:
            env["GLIBC_TUNABLES"] = original
        else:
            env.pop("GLIBC_TUNABLES", None)
    return env


def malloc_huge_pages_requested() -> bool:
    """Whether this process was started with huge-page malloc (glibc reads the tunable once, at start)."""
    return HUGE_PAGE_MALLOC in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_as_engine_process(huge_pages: bool = True) -> None:
    """Replaces this process by itself under engine_environment(), unless it already runs so: for benchmarks that time
    the engine core in process, with the settings the engine process gets (`huge_pages=False`: as with
    RINGSERVE_ENGINE_HUGE_PAGES=0)."""
    if not huge_pages:
        os.environ["RINGSERVE_ENGINE_HUGE_PAGES"] = "0"
    env = engine_environment(dict(os.environ))
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def reexec_as_worker_process() -> None:
    """Replaces this process by itself under worker_environment()'s OpenMP settings, unless it already runs so: for
    benchmarks that time a worker's model runner in process (libgomp reads them only when it is loaded)."""
    env = worker_environment(dict(os.environ))
    if any(env.get(key) != os.environ.get(key) for key in _OPENMP_WAIT_KEYS):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def anon_huge_pages_kb() -> int:
    """This process's anonymous memory on transparent huge pages (kB), 0 where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits, so no process outlives the server."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def stop_child(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait for a child that was asked to stop; escalate to SIGTERM, then SIGKILL. Returns its exit code."""
    return stop_children([proc], timeout_s)[0]


def stop_children(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """stop_child for several children at once: each step waits for all of them together, so a child that is stuck
    costs `timeout_s` per step once, not once per child. Returns their exit codes."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if sig is not None and proc.poll() is None:
                proc.send_signal(sig)
                if sig == signal.SIGTERM:
                    proc.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) acts on SIGTERM only once continued
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            break
        except subprocess.TimeoutExpired:
            continue
    return [proc.wait() for proc in procs]


async def wait_for_exit(proc: subprocess.Popen[bytes]) -> int:
    """Completes when the child exits, with its exit code: a pidfd turns readable then, so nothing polls."""
    exited = asyncio.Event()
    pidfd = os.pidfd_open(proc.pid)
    loop = asyncio.get_running_loop()
    loop.add_reader(pidfd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()


def child_pids(pid: int) -> list[tuple[int, int]]:
    """The children of `pid` now (for the frontend: an engine's workers) as (pid, start time) pairs, so a pid the
    kernel hands to another process later is not mistaken for them; [] where procfs does not say."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(part) for part in f.read().split()]
    except (OSError, ValueError):
        return []
    return [(child, started) for child in children if (started := _stat(child)[1]) >= 0]


def _stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks) of `pid` from /proc/PID/stat; ("", -1) when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5), counted after the command name
    except (OSError, IndexError, ValueError):
        return "", -1


def _running(process: tuple[int, int]) -> bool:
    state, started = _stat(process[0])
    return started == process[1] and state not in ("Z", "X", "x")


def wait_gone(processes: list[tuple[int, int]], timeout_s: float) -> None:
    """Wait until none of `processes` (child_pids() of a process this one did not start, e.g. a killed engine's
    workers, which exit on their parent-death signal) runs; SIGKILL those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, _started in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
