"""Starts and stops the real server (frontend, engine and worker processes) on a loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2_grpc


def real_model_path() -> Path:
    path = os.environ.get("RINGSERVE_TEST_GGUF")
    if not path:
        pytest.skip("RINGSERVE_TEST_GGUF is not set (scripts/test.sh sets it to the embedded model)")
    return Path(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Whatever a test did, leave no process of this server running."""
        if self.proc.poll() is None:
            try:
                tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in tree:
                p.kill()
            psutil.wait_procs(tree, timeout=10)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop within {timeout_s}s on SIGTERM\n{self.log()}") from None


def start_server(model: Path, log_dir: Path, *extra: str, ready_timeout_s: float = 180.0) -> RunningServer:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "ringserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--dtype", "float32", *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode} while starting\n{server.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return server
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    server.stop()
    raise AssertionError(f"server not SERVING after {ready_timeout_s}s\n{server.log()}")


def compile_torchserve_stubs(proto_dir: Path, out: Path) -> Path:
    """Python stubs of TorchServe's protos (kept under tests/) in `out`, compiled by a separate protoc process.

    Not in this process: grpc_tools' compiler carries its own copies of abseil and protobuf, and NIXL's libraries
    (loaded by the KV connector tests in this same pytest process) abort the process when both are loaded.
    """
    import google.rpc

    googleapis = Path(next(iter(google.rpc.__path__))).parent.parent
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}", f"-I{googleapis}",
                    f"--python_out={out}", f"--grpc_python_out={out}", "inference.proto", "management.proto"],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    return out
