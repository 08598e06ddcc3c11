"""A real `ringserve serve` process for the model benchmarks (chunked_prefill_jitter.py, prefix_cache.py): started on
a free loopback port, waited for until its health check says SERVING, stopped (SIGTERM, then SIGKILL) on exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class LiveServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"server not SERVING after {timeout_s:.0f} s:\n{self.log_tail()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(model: Path, log_dir: Path, *flags: str, same_session: bool = False) -> Iterator[LiveServer]:
    """Starts the server (float32, the given extra serve flags) without waiting for it: call wait_serving().
    `same_session`: see running_process."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model), "--dtype", "float32", "--log-level", "WARNING", *flags]  # fmt: skip
    with running_process(cmd, log_path, port, same_session=same_session) as server:
        yield server


@contextmanager
def running_process(cmd: list[str], log_path: Path, port: int, *, same_session: bool = False) -> Iterator[LiveServer]:
    """Runs `cmd` (a server listening on `port`, output to `log_path`); SIGTERM, then SIGKILL of its group, at exit.
    It gets a session of its own, unless `same_session`: then only a process group of its own, so it shares this
    process's scheduler autogroup (Linux gives each session an equal share of a busy CPU), as do the other processes
    this one started, e.g. a Ray cluster's workers."""
    with log_path.open("wb") as log:
        group = {"process_group": 0} if same_session else {"start_new_session": True}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **group)  # type: ignore[call-overload]
    try:
        yield LiveServer(proc, port, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
