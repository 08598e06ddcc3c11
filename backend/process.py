"""Helpers for the processes RingServe starts: parent-death signals and orderly child shutdown."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits, so no process outlives the server."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def stop_child(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait for a child that was asked to stop; escalate to SIGTERM, then SIGKILL. Returns its exit code."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


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
