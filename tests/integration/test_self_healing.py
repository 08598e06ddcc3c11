"""Self-healing replicas: when a worker, the engine or one tensor-parallel rank is killed, the in-flight streams end
UNAVAILABLE, health turns NOT_SERVING, new requests hear the model is restarting, and the replica comes back with
the same settings (SERVING, and a fresh request succeeds); a restart that cannot load the model any more ends in
FAILED with the reason in DescribeModel once --max-restarts is spent. The time to SERVING again is printed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, compile_torchserve_stubs, free_port, start_server
from test_leak_free_death import segments_of

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CLIENT = Path(__file__).parent / "torchserve_client" / "ts_manage.py"
FLAGS = ("--worker-threads", "1", "--num-kv-blocks", "256", "--max-num-batched-tokens", "256")


def long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Once upon a time",
                              sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))


def fresh_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="The capital of France is",
                              sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def health(server: RunningServer, service: str = "") -> int:
    with server.channel() as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=5).status  # fmt: skip


def wait_health(server: RunningServer, status: int, timeout_s: float, service: str = "") -> float:
    """Seconds until health reports `status` (fails after `timeout_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}\n{server.log()}"
        if health(server, service) == status:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"health of {service!r} not {status} within {timeout_s} s\n{server.log()}")


def open_streams(server: RunningServer, count: int) -> list[tuple[threading.Thread, list[grpc.RpcError]]]:
    """`count` long streams, each past its first token, read to the end in a thread that records its error."""
    streams = []
    for _ in range(count):
        stream = server.stub().Generate(long_request(), timeout=300)
        next(stream)
        errors: list[grpc.RpcError] = []

        def drain(stream=stream, errors=errors) -> None:  # type: ignore[no-untyped-def]
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as error:
                errors.append(error)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        streams.append((thread, errors))
    return streams


def assert_streams_end_unavailable(streams: list[tuple[threading.Thread, list[grpc.RpcError]]], timeout: float,
                                   details: str | None = None) -> None:  # fmt: skip
    """Each of open_streams' streams ends within `timeout` s with UNAVAILABLE (its details holding `details`)."""
    for thread, errors in streams:
        thread.join(timeout=timeout)
        assert not thread.is_alive() and errors, f"a stream did not end within {timeout} s"
        assert errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors[0]
        assert details is None or details in (errors[0].details() or ""), errors[0].details()


def victim(server: RunningServer, marker: str) -> psutil.Process:
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    return next(p for p in tree if marker in " ".join(p.cmdline()))


def kill_and_watch_recovery(server: RunningServer, marker: str, model: str) -> float:
    """Kill the process whose command line has `marker` while 3 streams run; check every step of the recovery.
    Returns the seconds from the kill to SERVING again."""
    streams = open_streams(server, 3)
    target = victim(server, marker)
    engine_before = victim(server, "ringserve.backend.engine_main")
    target.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert_streams_end_unavailable(streams, 30)
    wait_health(server, NOT_SERVING, 10)
    assert health(server, model) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as refused:  # the backoff is 1 s, so the model is still restarting
        list(server.stub().Generate(fresh_request(), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "restarting" in (refused.value.details() or ""), refused.value.details()
    wait_health(server, SERVING, 240)
    recovered_s = time.monotonic() - killed_at
    assert health(server, model) == SERVING
    assert [t for r in server.stub().Generate(fresh_request(), timeout=120) for t in r.token_ids]
    # The old engine (and with it its workers) is gone: reaped, no zombie left under the frontend.
    assert not psutil.pid_exists(engine_before.pid) or engine_before.status() != psutil.STATUS_ZOMBIE
    assert not engine_before.is_running()
    engines = [p for p in psutil.Process(server.proc.pid).children() if "engine_main" in " ".join(p.cmdline())]
    assert len(engines) == 1 and engines[0].pid != engine_before.pid
    print(f"\n[self-healing] kill -9 of {marker}: SERVING again after {recovered_s:.2f} s")
    return recovered_s


def restarts_metric(metrics_port: int, model: str, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    label = f'ringserve_engine_restarts_total{{model_name="{model}",reason="{reason}"}}'
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(label)]
    return values[0] if values else 0.0


@pytest.mark.parametrize(("marker", "reason"), [("ringserve.workers.worker_main", "worker_died"),
                                                ("ringserve.backend.engine_main", "engine_died")])
def test_a_killed_worker_or_engine_is_restarted(model_path: Path, tmp_path: Path, marker: str, reason: str) -> None:
    metrics_port = free_port()
    with start_server(model_path, tmp_path, *FLAGS, "--metrics-port", str(metrics_port)) as server:
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        kill_and_watch_recovery(server, marker, model)
        assert restarts_metric(metrics_port, model, reason) == 1.0
        # And again: the restarted replica is watched like the first one.
        kill_and_watch_recovery(server, "ringserve.workers.worker_main", model)
        assert server.stop() == 0


def test_a_killed_rank_of_three_is_restarted(model_path: Path, tmp_path: Path) -> None:
    with start_server(model_path, tmp_path, *FLAGS, "--tensor-parallel-size", "3") as server:
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        kill_and_watch_recovery(server, "--rank 1 ", model)
        ranks = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                 if "worker_main" in " ".join(p.cmdline())]  # fmt: skip
        assert len(ranks) == 3
        assert server.stop() == 0


def test_a_stopped_worker_fails_its_steps_after_the_step_timeout_and_is_restarted(model_path: Path,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    """SIGSTOP keeps a worker alive, so no liveness check sees it, but its steps never finish: after --step-timeout
    the streams end UNAVAILABLE naming the timeout, the replica restarts (reason step_timeout), and none of the old
    replica's processes or segments is left."""
    metrics_port = free_port()
    flags = ("--step-timeout", "4", "--metrics-port", str(metrics_port))
    with start_server(model_path, tmp_path, *FLAGS, *flags) as server:
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        streams = open_streams(server, 2)
        old_replica = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
        worker = victim(server, "ringserve.workers.worker_main")
        worker.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        stuck = "no step result within --step-timeout 4 s: a rank is alive but stuck"
        assert_streams_end_unavailable(streams, 60, stuck)
        ended_s = time.monotonic() - stopped_at
        wait_health(server, SERVING, 240)
        print(f"\n[self-healing] SIGSTOP of the worker: streams UNAVAILABLE after {ended_s:.2f} s (--step-timeout 4), "
              f"SERVING again after {time.monotonic() - stopped_at:.2f} s")  # fmt: skip
        assert restarts_metric(metrics_port, model, "step_timeout") == 1.0
        assert [t for r in server.stub().Generate(fresh_request(), timeout=120) for t in r.token_ids]
        left = [p for p in old_replica if running(p)]
        assert not left, f"processes of the replica that failed are still running: {left}"
        assert not segments_of(old_replica)
        assert server.stop() == 0


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(stubs: Path, server: RunningServer, model: str) -> dict[str, object]:
    run = subprocess.run([sys.executable, str(CLIENT), str(stubs), server.address, "describe", model],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["ok"][0]


def test_a_restart_that_cannot_load_the_weights_fails_the_model_with_the_reason(model_path: Path,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    (tmp_path / "stubs").mkdir()
    stubs = compile_torchserve_stubs(CLIENT.parent, tmp_path / "stubs")
    weights = tmp_path / "model.gguf"
    shutil.copyfile(model_path, weights)
    with start_server(weights, tmp_path, *FLAGS, "--max-restarts", "2", "--restart-window", "600") as server:
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        # The weights on disk go bad (a truncated copy replaces the file), then a worker dies.
        truncated = tmp_path / "truncated.gguf"
        with weights.open("rb") as source, truncated.open("wb") as out:
            out.write(source.read(weights.stat().st_size // 3))
        truncated.replace(weights)
        streams = open_streams(server, 1)
        victim(server, "ringserve.workers.worker_main").send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        streams[0][0].join(timeout=30)
        assert streams[0][1] and streams[0][1][0].code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 240
        while (state := server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).state) != pb.MODEL_STATE_FAILED:
            assert time.monotonic() < deadline, f"not FAILED: {pb.ModelState.Name(state)}\n{server.log()}"
            time.sleep(0.2)
        print(f"\n[self-healing] bad weights: FAILED after {time.monotonic() - killed_at:.2f} s (2 restarts)")
        description = describe(stubs, server, model)
        ringserve = description["ringserve"]
        assert isinstance(ringserve, dict) and ringserve["state"] == "FAILED"
        assert str(ringserve["error"]).startswith("load failed: "), ringserve
        assert "--max-restarts 2" in str(ringserve["error"])
        workers = description["workers"]
        assert isinstance(workers, list) and workers[0]["restarts"] == 2
        assert health(server) == NOT_SERVING and health(server, model) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub().Generate(fresh_request(), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "load failed" in refused.value.details()
        # The frontend stays up; no engine or worker is left running.
        assert server.proc.poll() is None
        assert not psutil.Process(server.proc.pid).children(recursive=True)
        assert server.stop() == 0
