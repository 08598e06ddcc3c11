"""Peer death: when the engine or a worker dies, streams end UNAVAILABLE, health turns NOT_SERVING, nothing hangs
(with --max-restarts 0 the model stays FAILED; test_self_healing.py has the restarts). What each death leaves
behind, nothing, is test_leak_free_death.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server


def long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Once upon a time",
                              sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("victim", ["engine_main", "worker_main"])
def test_killed_peer_ends_streams_with_unavailable_and_health_not_serving(
    model_path: Path, tmp_path: Path, victim: str
) -> None:
    with start_server(model_path, tmp_path, "--num-kv-blocks", "256", "--max-restarts", "0") as server:
        stub = server.stub()
        stream = stub.Generate(long_request(), timeout=120)
        next(stream)  # the request is running
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        target = next(p for p in tree if any(victim in part for part in p.cmdline()))
        target.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert time.monotonic() - killed_at < 2.0 + 1.0  # 2 s promised; 1 s slack for a loaded test machine
        with server.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 5
            status = None
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as again:
            list(stub.Generate(long_request(), timeout=10))
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--max-restarts 0" in (again.value.details() or ""), again.value.details()
        assert server.proc.poll() is None  # the frontend stays up with the model FAILED, and stops on SIGTERM
        assert server.stop() == 0
        _gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive
