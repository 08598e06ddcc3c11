"""Data parallel: when one replica's engine is killed, only its streams end (UNAVAILABLE); the model stays SERVING,
the other replica's stream goes on and new requests are served by it while the killed one restarts, which
DescribeModel shows (one replica RESTARTING, one READY) until both are READY again with a new engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, compile_torchserve_stubs, start_server

CLIENT = Path(__file__).parent / "torchserve_client" / "ts_manage.py"
FLAGS = ("--worker-threads", "1", "--num-kv-blocks", "256", "--max-num-batched-tokens", "256",
         "--data-parallel-size", "2")


def engines(server: RunningServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children() if "engine_main" in " ".join(p.cmdline())]


def replicas(stubs: Path, server: RunningServer, model: str) -> list[dict[str, Any]]:
    run = subprocess.run([sys.executable, str(CLIENT), str(stubs), server.address, "describe", model],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["ok"][0]["workers"]


class Stream:
    """A long greedy stream, past its first token, read to its end in a thread."""

    def __init__(self, server: RunningServer) -> None:
        request = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(
            max_tokens=2000, temperature=0.0, ignore_eos=True))
        self.call = server.stub().Generate(request, timeout=600)
        next(self.call)
        self.tokens = 0
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.tokens += len(response.token_ids)
        except grpc.RpcError as error:
            self.error = error


def model_health(server: RunningServer, model: str) -> int:
    with server.channel() as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=model),
                                                          timeout=5).status  # fmt: skip


def test_one_replica_restarts_while_the_other_serves(model_path: Path, tmp_path: Path) -> None:
    (tmp_path / "stubs").mkdir()
    stubs = compile_torchserve_stubs(CLIENT.parent, tmp_path / "stubs")
    with start_server(model_path, tmp_path, *FLAGS) as server:
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        before = engines(server)
        assert len(before) == 2
        # Requests go to the replica with the fewest outstanding tokens: one long stream on each.
        streams = [Stream(server), Stream(server)]
        assert sorted(r["outstandingTokens"] > 0 for r in replicas(stubs, server, model)) == [True, True]
        killed = before[0]
        killed.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while all(s.thread.is_alive() for s in streams):
            assert time.monotonic() < deadline, "no stream ended after the kill"
            time.sleep(0.05)
        ended = [s for s in streams if not s.thread.is_alive()]
        going = [s for s in streams if s.thread.is_alive()]
        assert len(ended) == 1 and len(going) == 1
        assert ended[0].error is not None and ended[0].error.code() == grpc.StatusCode.UNAVAILABLE

        # While the killed replica restarts, the model serves: health, new requests, the other stream.
        states = sorted(r["status"] for r in replicas(stubs, server, model))
        assert states == ["READY", "RESTARTING"], states
        assert model_health(server, model) == health_pb2.HealthCheckResponse.SERVING
        for _ in range(3):
            request = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True))
            assert len([t for r in server.stub().Generate(request, timeout=120) for t in r.token_ids]) == 4
        tokens = going[0].tokens
        deadline = time.monotonic() + 60  # a step can take seconds on a loaded machine, while the other replica loads
        while going[0].tokens == tokens:
            assert going[0].thread.is_alive() and time.monotonic() < deadline, "the other stream stopped"
            time.sleep(0.1)

        # It comes back with a new engine; the other replica's engine is the one it had.
        deadline = time.monotonic() + 240
        while sorted(r["status"] for r in replicas(stubs, server, model)) != ["READY", "READY"]:
            assert time.monotonic() < deadline, f"the replica did not come back\n{server.log()}"
            time.sleep(0.5)
        after = engines(server)
        assert len(after) == 2 and before[1].pid in {p.pid for p in after} and killed.pid not in {p.pid for p in after}
        assert [r["restarts"] for r in replicas(stubs, server, model)].count(1) == 1
        going[0].call.cancel()
        going[0].thread.join(timeout=30)
        assert server.stop() == 0
