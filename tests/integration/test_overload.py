"""Overload: at four times the concurrency the server can hold (running + waiting), it admits what fits its waiting
queue (--max-waiting-requests), refuses the rest with RESOURCE_EXHAUSTED before any admitted stream has finished,
admits new requests again once the admitted ones run, stays up, and its health check keeps answering SERVING within
a second (the one time bound here: it is the property asked for). Afterwards nothing is held: every KV block is
free and a new request is served."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc
from server_harness import RunningServer, start_server

MAX_NUM_SEQS, MAX_WAITING = 2, 2
CLIENTS = 4 * (MAX_NUM_SEQS + MAX_WAITING)


@pytest.fixture(scope="module")
def small_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("overload"), "--worker-threads", "1",
                       "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                       "--num-kv-blocks", "256", "--max-num-batched-tokens", "256")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


@dataclass
class Outcome:
    tokens: int = 0
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    ended: float = 0.0


@dataclass
class HealthLog:
    latencies: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)


def stream(server: RunningServer, start: threading.Event, outcome: Outcome) -> None:
    request = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(
        max_tokens=48, temperature=0.0, ignore_eos=True))
    with server.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start.wait()
        try:
            for response in stub.Generate(request, timeout=300):
                outcome.tokens += len(response.token_ids)
        except grpc.RpcError as error:
            outcome.code, outcome.details = error.code(), error.details() or ""
        outcome.ended = time.monotonic()


def watch_health(server: RunningServer, stop: threading.Event, log: HealthLog) -> None:
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            begun = time.monotonic()
            log.statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)
            log.latencies.append(time.monotonic() - begun)
            time.sleep(0.1)


def test_four_times_the_capacity_is_admitted_up_to_the_queue_bound_and_the_rest_refused_at_once(
        small_server: RunningServer) -> None:
    frontend = psutil.Process(small_server.proc.pid)
    outcomes = [Outcome() for _ in range(CLIENTS)]
    start, stop, health = threading.Event(), threading.Event(), HealthLog()
    threads = [threading.Thread(target=stream, args=(small_server, start, o), daemon=True) for o in outcomes]
    watcher = threading.Thread(target=watch_health, args=(small_server, stop, health), daemon=True)
    for thread in threads:
        thread.start()
    watcher.start()
    time.sleep(0.5)  # every client connected
    start.set()
    # Once the burst is answered and the admitted requests run (their places in the queue free again), the server
    # keeps accepting: late requests wait their turn and are served.
    deadline = time.monotonic() + 240
    while not (sum(o.tokens > 0 for o in outcomes) >= MAX_WAITING
               and sum(o.code == grpc.StatusCode.RESOURCE_EXHAUSTED for o in outcomes) >= CLIENTS - MAX_WAITING):
        assert time.monotonic() < deadline, [(o.tokens, o.code) for o in outcomes]
        time.sleep(0.05)
    late = [Outcome() for _ in range(MAX_WAITING)]
    go = threading.Event()
    go.set()
    threads += [threading.Thread(target=stream, args=(small_server, go, o), daemon=True) for o in late]
    for thread in threads[CLIENTS:]:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    stop.set()
    watcher.join(timeout=30)
    assert not any(t.is_alive() for t in threads)

    served = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    print(f"\n[overload] {CLIENTS} clients: {len(served)} served, {len(refused)} refused; health answered "
          f"{len(health.latencies)} checks, slowest {max(health.latencies) * 1e3:.0f} ms")
    assert len(served) + len(refused) == CLIENTS, [(o.code, o.details) for o in outcomes]
    assert len(served) >= MAX_WAITING and refused, (len(served), len(refused))
    assert all(o.tokens == 48 for o in served)
    assert all(o.code == grpc.StatusCode.OK and o.tokens == 48 for o in late), [(o.code, o.details) for o in late]
    for o in refused:
        assert o.tokens == 0 and "--max-waiting-requests" in o.details, o.details
    # At once: every refusal came before the first admitted stream finished (an ordering, not a duration).
    assert max(o.ended for o in refused) < min(o.ended for o in served)
    assert len(health.statuses) >= 3 and set(health.statuses) == {health_pb2.HealthCheckResponse.SERVING}
    assert max(health.latencies) < 1.0, health.latencies

    # Still up, nothing held: the server serves a new request and every KV block is free once idle.
    assert frontend.is_running() and small_server.proc.poll() is None
    with small_server.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingParams(max_tokens=4))
        assert [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]
        deadline = time.monotonic() + 30
        while True:
            stats = stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)
            idle = stats.num_running == 0 and stats.free_kv_blocks == stats.total_kv_blocks
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert stats.free_kv_blocks == stats.total_kv_blocks, stats
