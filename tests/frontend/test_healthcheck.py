"""The container health probe (`python -m ringserve.frontend.healthcheck`) against a real grpc.health.v1 server."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from ringserve.frontend import healthcheck

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serving_server_is_healthy(health_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = health_server
    servicer.set("", SERVING)
    assert healthcheck.main(["--host", "127.0.0.1", "--port", str(port)]) == healthcheck.HEALTHY


def test_not_serving_server_is_unhealthy(health_server: tuple[health.HealthServicer, int],
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    servicer, port = health_server
    servicer.set("", NOT_SERVING)  # what the frontend reports while the engine loads or the server drains
    assert healthcheck.main(["--port", str(port)]) == healthcheck.UNHEALTHY
    assert "NOT_SERVING" in capsys.readouterr().out


def test_unknown_service_is_unhealthy(health_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = health_server
    servicer.set("", SERVING)
    assert healthcheck.main(["--port", str(port), "--service", "no.such.Service"]) == healthcheck.UNHEALTHY


def test_no_server_listening_is_unhealthy_not_an_exception(capsys: pytest.CaptureFixture[str]) -> None:
    assert healthcheck.main(["--port", str(unused_port()), "--timeout", "1"]) == healthcheck.UNHEALTHY
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_port_and_wildcard_host_come_from_the_server_environment(
    health_server: tuple[health.HealthServicer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, port = health_server
    servicer.set("", SERVING)
    monkeypatch.setenv("RINGSERVE_HOST", "0.0.0.0")  # what the images listen on
    monkeypatch.setenv("RINGSERVE_PORT", str(port))
    assert healthcheck.main([]) == healthcheck.HEALTHY


def test_invalid_configuration_is_unhealthy_not_docker_reserved_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RINGSERVE_PORT", "fifty")
    assert healthcheck.main([]) == healthcheck.UNHEALTHY
    assert "RINGSERVE_PORT" in capsys.readouterr().err
    assert healthcheck.main(["--port", "not-a-number"]) == healthcheck.UNHEALTHY


@pytest.mark.parametrize(("host", "address"), [
    ("0.0.0.0", "127.0.0.1:50051"), ("::", "127.0.0.1:50051"), ("", "127.0.0.1:50051"),
    ("10.1.2.3", "10.1.2.3:50051"), ("::1", "[::1]:50051"), ("[::1]", "[::1]:50051"),
])  # fmt: skip
def test_probe_address_dials_loopback_for_wildcard_listeners(host: str, address: str) -> None:
    assert healthcheck.probe_address(host, 50051) == address


def test_module_runs_as_a_command_with_the_exit_code_docker_reads(
    health_server: tuple[health.HealthServicer, int]
) -> None:
    servicer, port = health_server
    cmd = [sys.executable, "-m", "ringserve.frontend.healthcheck", "--port", str(port)]
    servicer.set("", SERVING)
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    servicer.set("", NOT_SERVING)
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 1
