"""`--engine-placement ray` on a two-node Ray cluster on this host (ray.cluster_utils.Cluster, one CPU per node): two
data-parallel replicas of a tiny random llama, each engine placed with its one rank in a one-CPU bundle, so one
engine runs on each node and talks to the frontend through its bridge's TCP stream. Both decode the one-rank greedy
tokens; SIGKILL of the engine on the second node ends its streams UNAVAILABLE while the other replica keeps serving,
the replica comes back (restart reason `engine_died`); so does SIGKILL of its rank (`worker_died`: the remote engine's
EngineFailed crosses the bridge) and the removal of the node (placed again once a node joins); and nothing is left
behind (actors, placement groups,
processes, /dev/shm). A replica whose bundle no node can hold fails the server's start with the reason. Skipped
without Ray (pip install 'ringserve[ray]')."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import compile_torchserve_stubs, free_port, start_server

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ringserve[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402
from test_ray_executor import (  # noqa: E402
    FLAGS,
    PROMPTS,
    assert_nothing_left,
    local_cluster,
    request,
    save_tiny_llama,
    segments,
)
from test_replica_restart_while_serving import CLIENT, Stream, replicas  # noqa: E402
from test_self_healing import restarts_metric  # noqa: E402

PLACED = ("--distributed-executor", "ray", "--engine-placement", "ray", "--data-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head node and a second node, one CPU each: room for one one-rank replica on each."""
    yield from local_cluster(1, 1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ray-engines") / "tiny-llama")


def greedy_on_both_replicas(server, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt's greedy tokens, the prompts sent at once (so the least-loaded routing gives each a replica)."""
    streams = [server.stub().Generate(request(ids, n), timeout=120) for ids in PROMPTS]
    tokens: list[list[int]] = [[] for _ in PROMPTS]

    def drain(i: int) -> None:
        tokens[i] = [t for r in streams[i] for t in r.token_ids]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return tokens


def on_second_node(cluster: Cluster, module: str) -> list[psutil.Process]:
    """The live processes running `module` under the second node's raylet (that node's Ray workers and what they
    started are its descendants)."""
    [node] = cluster.worker_nodes
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return [p for p in raylet.children(recursive=True)
            if module in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]


def fail_and_recover(server, stubs: Path, model: str, fail: Callable[[], object],  # type: ignore[no-untyped-def]
                     single: list[list[int]], then: Callable[[], object] = lambda: None) -> tuple[float, float, str]:
    """`fail()` while each replica streams: only the failed replica's stream ends (UNAVAILABLE), the other goes on
    and new requests are served; after `then()`, both replicas are READY again. Returns the seconds from `fail()` to
    the end of the stream and to both READY, and the ended stream's details."""
    streams = [Stream(server), Stream(server)]  # one per replica: each to the one with fewer tokens to go
    assert sorted(r["outstandingTokens"] > 0 for r in replicas(stubs, server, model)) == [True, True]
    killed_at = time.monotonic()
    fail()
    while all(s.error is None for s in streams):
        assert time.monotonic() - killed_at < 30, "no stream failed after the kill"
        time.sleep(0.05)
    ended_s = time.monotonic() - killed_at
    [ended] = [s for s in streams if s.error is not None]
    [going] = [s for s in streams if s.error is None]
    assert ended.error is not None and ended.error.code() == grpc.StatusCode.UNAVAILABLE, ended.error
    assert greedy_on_both_replicas(server, 8) == [t[:8] for t in single]  # the other replica serves meanwhile
    then()
    deadline = time.monotonic() + 240
    while [r["status"] for r in replicas(stubs, server, model)] != ["READY", "READY"]:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.5)
    recovered_s = time.monotonic() - killed_at
    going.call.cancel()
    going.thread.join(timeout=10)
    # The other replica's stream ran on (to the model's length limit, or until cancelled here): no error of its own.
    assert going.tokens > 0 and (going.error is None or going.error.code() == grpc.StatusCode.CANCELLED)
    return ended_s, recovered_s, ended.error.details()


def test_two_replicas_with_an_engine_on_each_node_decode_like_one_rank_and_a_killed_remote_engine_comes_back(
    cluster: Cluster, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start_server(tiny_llama, tmp_path, *FLAGS) as server:
        single = greedy_on_both_replicas(server, 32)
        assert server.stop() == 0
    assert all(len(t) == 32 for t in single)

    (tmp_path / "stubs").mkdir()
    stubs = compile_torchserve_stubs(CLIENT.parent, tmp_path / "stubs")
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    metrics_port = free_port()
    with start_server(tiny_llama, tmp_path, *FLAGS, *PLACED, "--metrics-port", str(metrics_port),
                      ready_timeout_s=240) as server:  # fmt: skip
        assert [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if "ringserve.backend.engine_main" in " ".join(p.info["cmdline"] or ())
                and p.ppid() == server.proc.pid] == []  # no engine on the frontend's side: two bridges instead
        [engine] = on_second_node(cluster, "ringserve.backend.engine_main")
        assert greedy_on_both_replicas(server, 32) == single
        model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model

        ended_s, recovered_s, details = fail_and_recover(server, stubs, model, engine.kill, single)
        print(f"\n[ray engines] remote engine killed: its stream UNAVAILABLE after {ended_s:.2f} s ({details}), "
              f"both replicas serving again after {recovered_s:.1f} s")  # fmt: skip
        assert "ended without a Shutdown" in details
        assert restarts_metric(metrics_port, model, "engine_died") == 1.0

        # A rank of the remote engine: the engine's own EngineFailed (naming the worker) crosses the bridge before
        # the stream ends, so the restart is counted as a dead worker.
        [worker] = on_second_node(cluster, "ringserve.workers.worker_main")
        ended_s, recovered_s, details = fail_and_recover(server, stubs, model, worker.kill, single)
        print(f"[ray engines] remote rank killed: its stream UNAVAILABLE after {ended_s:.2f} s ({details}), both "
              f"replicas serving again after {recovered_s:.1f} s")  # fmt: skip
        assert "worker" in details and "ended without a Shutdown" not in details
        assert restarts_metric(metrics_port, model, "worker_died") == 1.0

        # The second node goes away (its raylet and Ray workers killed): the replica there ends as for a dead engine
        # and is placed again once a node with room has joined.
        [node] = cluster.worker_nodes
        ended_s, recovered_s, details = fail_and_recover(server, stubs, model, lambda: cluster.remove_node(node),
                                                         single, then=lambda: cluster.add_node(num_cpus=1))  # fmt: skip
        print(f"[ray engines] second node removed: its stream UNAVAILABLE after {ended_s:.2f} s ({details}), both "
              f"replicas serving again after {recovered_s:.1f} s (a node added)")  # fmt: skip
        assert "ended without a Shutdown" in details
        assert restarts_metric(metrics_port, model, "engine_died") == 2.0
        assert len(on_second_node(cluster, "ringserve.backend.engine_main")) == 1
        assert greedy_on_both_replicas(server, 8) == [t[:8] for t in single]
        assert server.stop() == 0
    assert_nothing_left(cluster, server.proc.pid, before)


def test_an_engine_the_cluster_cannot_place_fails_the_start_with_the_reason(
    cluster: Cluster, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks packed with their engine need a two-CPU bundle; no node has two CPUs."""
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    flags = ("--distributed-executor", "ray", "--engine-placement", "ray", "--tensor-parallel-size", "2",
             "--ray-placement-timeout", "2")  # fmt: skip
    with pytest.raises(AssertionError, match="server exited with 1 while starting") as failed:
        start_server(tiny_llama, tmp_path, *FLAGS, *flags, ready_timeout_s=120)
    assert "engine failed: --engine-placement ray: the cluster at" in str(failed.value)
    assert "could not place the replica's bundle of {'CPU': 2.0} within --ray-placement-timeout 2 s" \
        in str(failed.value)  # fmt: skip
    assert_nothing_left(cluster, 0, before)
