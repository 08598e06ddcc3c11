"""Runs docker and compose for the Docker tests: commands with their output in failures, a compose project on free
host ports that is always taken down, and the waits (healthy, exited) that every test needs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_tracing import OtlpReceiver, trace_service_pb2_grpc  # noqa: E402  (tests/integration's receiver)

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
ENV_SCRIPT = REPO / "scripts" / "docker-env.sh"  # the engine and the images for these tests
BUILD_TIMEOUT_S = 3600  # a cold build (base image, compiler, torch) on two cores; test modules add their own time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def docker(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    ran = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and ran.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited with {ran.returncode}\n{ran.stdout}\n{ran.stderr}")
    return ran


def inspect(container: str, template: str) -> str:
    return docker("inspect", "-f", template, container).stdout.strip()


def logs(container: str, tail: int = 60) -> str:
    ran = docker("logs", "--tail", str(tail), container, check=False)
    return ran.stdout + ran.stderr


def wait_healthy(container: str, timeout_s: float = 600.0) -> None:
    """Until the image's HEALTHCHECK says healthy (the model is loaded and the server answers SERVING)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", container).stdout)
        if state.get("Health", {}).get("Status") == "healthy":
            return
        if not state["Running"]:
            raise AssertionError(f"{container} exited with {state['ExitCode']} while starting\n{logs(container)}")
        time.sleep(2)
    raise AssertionError(f"{container} not healthy after {timeout_s}s\n{logs(container)}")


def compose_command() -> list[str]:
    """`docker compose` (the CLI plugin) where it exists, else the standalone docker-compose (Debian's 1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("no compose client: neither `docker compose` nor docker-compose")


class ComposeProject:
    """One profile of docker/compose.yaml (with `extra_files` merged in, and `variables` for its ${...}) as its own
    project, its published ports on free host ports; `with` takes it down (containers, network) whatever the test
    did."""

    def __init__(self, profile: str, *extra_files: Path, services: tuple[str, ...] = (), **variables: str) -> None:
        self.profile = profile
        self.services = services  # only these (and not what they depend on); all of the profile's when empty
        self.name = f"ringserve-test-{profile}-{os.getpid()}"
        self.ports = {name: free_port() for name in ("GRPC", "HTTP", "METRICS", "JAEGER_UI", "OTLP", "PROMETHEUS")}
        self.env = {**os.environ, **{f"HOST_{name}_PORT": str(port) for name, port in self.ports.items()}, **variables}
        files = [arg for path in (COMPOSE_FILE, *extra_files) for arg in ("-f", str(path))]
        self.base = [*compose_command(), *files, "-p", self.name, "--profile", profile]

    def run(self, *args: str, timeout: float = 300.0) -> str:
        ran = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if ran.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} exited with {ran.returncode}\n{ran.stdout}\n{ran.stderr}")
        return ran.stdout

    def container(self, service: str) -> str:
        cid = self.run("ps", "-q", service).strip()
        assert cid, f"no container for {service}"
        return cid

    def __enter__(self) -> ComposeProject:
        self.run("up", "-d", "--no-build", *(("--no-deps", *self.services) if self.services else ()), timeout=900)
        return self

    def __exit__(self, *exc_info: object) -> None:
        subprocess.run([*self.base, "down", "-v", "-t", "5"], env=self.env, capture_output=True, timeout=300)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    """tests/integration's OTLP/gRPC trace receiver, listening on every interface of this machine so that containers
    reach it as host.docker.internal (compose's extra_hosts: host-gateway). Yields it and its port."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("0.0.0.0:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(0)
