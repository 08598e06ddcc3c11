"""docker/entrypoint.sh, the script the images run, started outside Docker and configured the way a container is:
RINGSERVE_* environment variables, plus flags after the image name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, free_port

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "entrypoint.sh"


def container_env(**variables: str) -> dict[str, str]:
    """This environment minus any RINGSERVE_*/OTEL_* setting, plus `variables`; this interpreter's folder first on
    PATH, so the script's `ringserve` (or `python3 -m ...` fallback) is the one under test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "OTEL_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **variables}


def wait_until_serving(server: RunningServer, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise AssertionError(f"entrypoint exited with {server.proc.returncode}\n{server.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise AssertionError(f"not SERVING after {timeout_s}s\n{server.log()}")


def listening_addresses(pid: int, port: int) -> set[str]:
    sockets = psutil.Process(pid).net_connections(kind="inet")
    return {s.laddr.ip for s in sockets if s.status == psutil.CONN_LISTEN and s.laddr.port == port}


def test_entrypoint_serves_from_environment_configuration_and_drains_on_sigterm(
    model_path: Path, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    env = container_env(
        RINGSERVE_PORT=str(port),
        RINGSERVE_MODEL=str(model_path),
        RINGSERVE_SERVED_MODEL_NAME="smollm2-in-a-container",
        RINGSERVE_NUM_KV_BLOCKS="64",
        RINGSERVE_MAX_NUM_SEQS="4",
        RINGSERVE_DTYPE="float32",
        RINGSERVE_METRICS_PORT=str(metrics_port),
    )  # no RINGSERVE_HOST: the entrypoint's default, every interface, is what a published port needs
    log_path = tmp_path / "entrypoint.log"
    with log_path.open("wb") as log:  # a flag after the image name, as in `docker run IMAGE --max-model-len 1024`
        proc = subprocess.Popen([str(ENTRYPOINT), "--max-model-len", "1024"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    with RunningServer(proc, port, log_path) as server:
        wait_until_serving(server)

        # exec: the server replaced the shell, so the container's SIGTERM reaches it directly
        cmdline = " ".join(psutil.Process(proc.pid).cmdline())
        assert "serve" in cmdline and "entrypoint" not in cmdline, cmdline
        assert listening_addresses(proc.pid, port) & {"0.0.0.0", "::"}, listening_addresses(proc.pid, port)

        stub = server.stub()
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.model == "smollm2-in-a-container"  # from RINGSERVE_SERVED_MODEL_NAME
        assert info.context_length == 1024  # from the flag
        assert info.kv_capacity_tokens == 64 * info.block_size  # from RINGSERVE_NUM_KV_BLOCKS

        request = pb.GenerateRequest(text="The capital of France is")
        request.sampling.max_tokens = 4
        request.sampling.temperature = 0.0
        replies = list(stub.Generate(request, timeout=120))
        assert sum(len(r.token_ids) for r in replies) == 4
        assert "".join(r.text for r in replies).strip()
        assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH

        # the image's HEALTHCHECK command, in the container's environment
        probe = subprocess.run([sys.executable, "-m", "ringserve.frontend.healthcheck"], env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert probe.returncode == 0, probe.stdout + probe.stderr

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert response.status == 200  # RINGSERVE_METRICS_PORT, which the images set to 8002

        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, server.log()
        _, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, f"left running after SIGTERM: {alive}"


def test_entrypoint_runs_other_subcommands_and_programs_unchanged(tmp_path: Path) -> None:
    ran = subprocess.run([str(ENTRYPOINT), "echo", "debug", "shell"], env=container_env(), capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert (ran.returncode, ran.stdout) == (0, "debug shell\n")

    # `docker run IMAGE --help` is `ringserve serve --help`, which names the variable behind each flag
    helped = subprocess.run([str(ENTRYPOINT), "--help"], env=container_env(), capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "RINGSERVE_MAX_NUM_SEQS" in helped.stdout


def test_entrypoint_reports_a_bad_environment_variable_by_name() -> None:
    ran = subprocess.run([str(ENTRYPOINT)], env=container_env(RINGSERVE_MAX_NUM_SEQS="many"), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert ran.returncode != 0
    assert "RINGSERVE_MAX_NUM_SEQS" in ran.stderr

