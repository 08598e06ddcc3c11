"""`--distributed-executor ray` on a two-node Ray cluster on this host (ray.cluster_utils.Cluster, one CPU per node):
STRICT_SPREAD puts rank 0 and rank 1 of a tiny random llama on different nodes, so one rank reads the engine's step
ring and the other gets the records over the TCP relay. TP=2 decodes the TP=1 greedy tokens; killing the remote
rank's actor, or stopping its worker (SIGSTOP: the heartbeat's case), ends the stream UNAVAILABLE within seconds, the
model comes back, and nothing is left behind (actors, placement groups, processes, /dev/shm). Two data-parallel
replicas each place their rank on the cluster; killing one engine leaves nothing either. A placement the cluster
cannot satisfy fails the server's start with the reason, and so does one that puts more ranks on a node than its
step ring has readers; a replica whose restart cannot be placed (its third node is
gone) is retried, then FAILED with the reason. Pipeline stages across the nodes (a tiny llama TP=2 x PP=2, each
stage's two ranks packed on one node; the embedded model PP=2, one stage per node) decode the one-rank tokens.
Skipped without Ray (pip install 'ringserve[ray]')."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import real_model_path, start_server

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ringserve[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402
from ringserve.backend.step_relay import HEARTBEAT_TIMEOUT_S  # noqa: E402
from server_harness import free_port  # noqa: E402
from test_pipeline_parallel import save_three_layer_llama  # noqa: E402
from test_self_healing import NOT_SERVING, SERVING, open_streams, restarts_metric, wait_health  # noqa: E402
from test_tensor_parallel import save_tiny_hf_model, save_word_tokenizer  # noqa: E402

PROMPTS = [[5, 9, 200, 3, 17, 8], [250, 1, 2]]
FLAGS = ("--worker-threads", "1", "--num-kv-blocks", "128", "--max-num-batched-tokens", "256")
SHM = Path("/dev/shm")


def request(ids: list[int], n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))  # fmt: skip


def greedy(server, n: int = 32) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [[t for r in server.stub().Generate(request(ids, n), timeout=120) for t in r.token_ids] for ids in PROMPTS]


def local_cluster(head_cpus: int, *node_cpus: int) -> Iterator[Cluster]:
    """A Ray cluster on this host (for a module fixture): a head node and one node per `node_cpus`, with that many
    CPUs each, small object stores and no dashboard."""
    store = 80 * 1024 * 1024
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "object_store_memory": store,
                                                      "include_dashboard": False})  # fmt: skip
    for cpus in node_cpus:
        c.add_node(num_cpus=cpus, object_store_memory=store)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head node and a second node, two CPUs each (the ranks' bundles: one CPU each)."""
    yield from local_cluster(2, 2)


def save_tiny_llama(folder: Path) -> Path:
    hf = save_tiny_hf_model("llama", folder)
    save_word_tokenizer(folder, hf.config.vocab_size)
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ray") / "tiny-llama")


@pytest.fixture(scope="module")
def llama_3_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three layers: three pipeline stages, one per node."""
    return save_three_layer_llama(tmp_path_factory.mktemp("ray") / "llama-3-layers")


@pytest.fixture(scope="module")
def single(tiny_llama: Path) -> list[list[int]]:
    """The greedy tokens of one local rank (--distributed-executor mp)."""
    with start_server(tiny_llama, tiny_llama.parent, *FLAGS) as server:
        tokens = greedy(server)
        assert server.stop() == 0
    assert all(len(t) == 32 for t in tokens)
    return tokens


def segments() -> set[str]:
    return {p.name for p in SHM.glob("ringserve-*")}


def remote_worker(server) -> psutil.Process:  # type: ignore[no-untyped-def]
    """The worker of the rank on the other node: it reads a node relay's ring."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if "ringserve.workers.worker_main" in cmd and "-rstep" in cmd:
            return proc
    raise AssertionError(f"no worker reads a node relay's step ring\n{server.log()}")


def remote_rank(server) -> psutil.Process:  # type: ignore[no-untyped-def]
    """The actor process of the rank on the other node: the parent of its worker."""
    return remote_worker(server).parent()


def end_a_stream(server, act) -> float:  # type: ignore[no-untyped-def]
    """Seconds from `act()` until a long stream ends UNAVAILABLE; then the model is SERVING again."""
    ended_s = end_a_stream_on_failure(server, act)
    wait_health(server, NOT_SERVING, 10)
    wait_health(server, SERVING, 240)
    return ended_s


def test_tp2_across_two_nodes_decodes_like_one_rank_and_heals_after_a_remote_rank_dies(
    cluster: Cluster, tiny_llama: Path, single: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ray_flags = ("--distributed-executor", "ray", "--placement-strategy", "STRICT_SPREAD",
                 "--tensor-parallel-size", "2")  # fmt: skip
    with start_server(tiny_llama, tmp_path, *FLAGS, *ray_flags, ready_timeout_s=240) as server:
        assert greedy(server) == single

        started = time.monotonic()
        ended_s = end_a_stream(server, lambda: os.kill(remote_rank(server).pid, signal.SIGKILL))
        print(f"\n[ray] remote rank's actor killed: stream UNAVAILABLE after {ended_s:.2f} s, SERVING again after "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
        assert greedy(server, 8) == [t[:8] for t in single]

        # A remote rank that stops answering without dying: only the relay's liveness check notices.
        stopped = remote_worker(server)
        started = time.monotonic()
        ended_s = end_a_stream(server, lambda: stopped.send_signal(signal.SIGSTOP))
        print(f"[ray] remote worker stopped (SIGSTOP): stream UNAVAILABLE after {ended_s:.2f} s (heartbeat timeout "
              f"{HEARTBEAT_TIMEOUT_S:g} s), SERVING again after {time.monotonic() - started:.1f} s")  # fmt: skip
        assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE  # the restart killed it
        assert greedy(server, 8) == [t[:8] for t in single]
        assert server.stop() == 0

    assert_nothing_left(cluster, server.proc.pid, before)


def test_data_parallel_replicas_on_the_cluster_and_a_killed_engine_leaves_nothing(
    cluster: Cluster, tiny_llama: Path, single: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas, each an engine with its own placement group on the cluster; an engine killed with SIGKILL
    takes its actors and placement group with it (Ray ends the job of a dead driver) and its replica comes back."""
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    flags = ("--distributed-executor", "ray", "--placement-strategy", "SPREAD", "--data-parallel-size", "2")
    with start_server(tiny_llama, tmp_path, *FLAGS, *flags, ready_timeout_s=240) as server:
        assert greedy(server) == single
        engines = [psutil.Process(pid) for pid in engine_pids(server.proc.pid)]
        assert len(engines) == 2
        engines[0].kill()
        deadline = time.monotonic() + 240
        while engines[0].pid in (pids := engine_pids(server.proc.pid)) or len(pids) < 2:  # restarted
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.5)
        wait_health(server, SERVING, 240)
        assert greedy(server, 8) == [t[:8] for t in single]
        assert server.stop() == 0
    assert_nothing_left(cluster, server.proc.pid, before)


def test_pipeline_stages_across_nodes_decode_like_one_rank(
    cluster: Cluster, tiny_llama: Path, single: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    # Four one-CPU bundles on two two-CPU nodes: PACK fills one node with stage 0's ranks, the other with stage 1's.
    flags = ("--distributed-executor", "ray", "--placement-strategy", "PACK", "--tensor-parallel-size", "2",
             "--pipeline-parallel-size", "2")  # fmt: skip
    with start_server(tiny_llama, tmp_path, *FLAGS, *flags, ready_timeout_s=240) as server:
        assert greedy(server) == single
        assert server.stop() == 0

    model = real_model_path()
    if model is None:
        pytest.skip("set RINGSERVE_TEST_GGUF to the embedded model for its two-stage run")
    text = pb.GenerateRequest(text="The capital of France is",
                              sampling=pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))  # fmt: skip
    tokens = {}
    for name, extra in (("one rank", ()), ("two stages on two nodes", ("--distributed-executor", "ray",
                        "--placement-strategy", "STRICT_SPREAD", "--pipeline-parallel-size", "2"))):  # fmt: skip
        with start_server(model, tmp_path, *FLAGS, *extra, ready_timeout_s=300) as server:
            tokens[name] = [t for r in server.stub().Generate(text, timeout=300) for t in r.token_ids]
            assert server.stop() == 0
    assert len(tokens["one rank"]) == 32
    assert tokens["two stages on two nodes"] == tokens["one rank"]


def test_a_placement_the_cluster_cannot_satisfy_fails_the_start_with_the_reason(
    cluster: Cluster, llama_3_layers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ranks, one per node, on a two-node cluster (or a bad --ray-address): the engine reports the placement
    it could not get (or the address it could not reach) and the server exits instead of waiting for ever."""
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    flags = ("--distributed-executor", "ray", "--placement-strategy", "STRICT_SPREAD", "--pipeline-parallel-size",
             "3", "--ray-placement-timeout", "2")  # fmt: skip
    with pytest.raises(AssertionError, match="server exited with 1 while starting") as failed:
        start_server(llama_3_layers, tmp_path, *FLAGS, *flags, ready_timeout_s=120)
    assert "could not be loaded: engine failed: --distributed-executor ray: the cluster at" in str(failed.value)
    assert "could not place 3 bundle(s) of {'CPU': 1.0} with --placement-strategy STRICT_SPREAD within " \
           "--ray-placement-timeout 2 s" in str(failed.value)
    assert_nothing_left(cluster, 0, before)

    # An address where no cluster listens: ray.init would retry it for ever.
    closed = free_port()
    with pytest.raises(AssertionError, match="server exited with 1 while starting") as failed:
        start_server(llama_3_layers, tmp_path, *FLAGS, "--distributed-executor", "ray", "--ray-address",
                     f"127.0.0.1:{closed}", ready_timeout_s=120)  # fmt: skip
    assert f"engine failed: --distributed-executor ray: no Ray cluster at 127.0.0.1:{closed}: cannot connect" \
        in str(failed.value)


def test_more_ranks_on_a_node_than_its_step_ring_has_readers_fail_the_start_naming_the_limit(
    cluster: Cluster, llama_3_layers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine ranks packed on one node (STRICT_PACK, a nine-CPU node): its ring would need nine readers. The engine
    fails its start with the count and the limit, before any rank starts."""
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    big = cluster.add_node(num_cpus=9, object_store_memory=80 * 1024 * 1024)
    cluster.wait_for_nodes()
    flags = ("--distributed-executor", "ray", "--placement-strategy", "STRICT_PACK", "--tensor-parallel-size", "9",
             "--ray-placement-timeout", "30")  # fmt: skip
    try:
        with pytest.raises(AssertionError, match="server exited with 1 while starting") as failed:
            start_server(llama_3_layers, tmp_path, *FLAGS, *flags, ready_timeout_s=120)
        assert "engine failed: --distributed-executor ray: the cluster at" in str(failed.value)
        assert "placed the 9 ranks so that node " in str(failed.value)
        assert "holds 9 ranks; a node's step ring has a reader per rank and at most 8" in str(failed.value)
    finally:
        cluster.remove_node(big)
    assert_nothing_left(cluster, 0, before)


def test_a_replica_whose_restart_cannot_be_placed_is_retried_then_failed_with_the_reason(
    cluster: Cluster, llama_3_layers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three pipeline stages on three nodes; the third node goes away, so the replica's restarts cannot be placed:
    each fails after --ray-placement-timeout, the restarts are counted (load_failed), and after --max-restarts the
    model is FAILED and requests are refused with the reason."""
    before = segments()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    third = cluster.add_node(num_cpus=2, object_store_memory=80 * 1024 * 1024)
    cluster.wait_for_nodes()
    metrics_port = free_port()
    flags = ("--distributed-executor", "ray", "--placement-strategy", "STRICT_SPREAD", "--pipeline-parallel-size",
             "3", "--ray-placement-timeout", "3", "--max-restarts", "2", "--restart-window", "600",
             "--metrics-port", str(metrics_port))  # fmt: skip
    try:
        with start_server(llama_3_layers, tmp_path, *FLAGS, *flags, ready_timeout_s=240) as server:
            assert all(len(t) == 8 for t in greedy(server, 8))
            model = server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
            ended_s = end_a_stream_on_failure(server, lambda: cluster.remove_node(third))
            deadline = time.monotonic() + 240
            while (state := server.stub().GetModelInfo(pb.ModelInfoRequest(), timeout=10).state) \
                    != pb.MODEL_STATE_FAILED:  # fmt: skip
                assert time.monotonic() < deadline, f"not FAILED: {pb.ModelState.Name(state)}\n{server.log()}"
                time.sleep(0.5)
            print(f"\n[ray] third node removed: stream UNAVAILABLE after {ended_s:.2f} s, FAILED after 2 restarts")
            assert wait_health(server, NOT_SERVING, 5) >= 0
            with pytest.raises(grpc.RpcError) as refused:
                list(server.stub().Generate(request(PROMPTS[0], 4), timeout=30))
            details = refused.value.details()
            print(f"[ray] refused: {details}")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, details
            assert "load failed: engine failed: --distributed-executor ray:" in details, details
            assert "could not place 3 bundle(s)" in details and "--max-restarts 2" in details, details
            assert restarts_metric(metrics_port, model, "load_failed") == 1.0
            assert server.proc.poll() is None  # the frontend stays up
            assert server.stop() == 0
    finally:
        if third in cluster.worker_nodes:
            cluster.remove_node(third)
    assert_nothing_left(cluster, server.proc.pid, before)


def end_a_stream_on_failure(server, act) -> float:  # type: ignore[no-untyped-def]
    """Seconds from `act()`'s start until a long stream ends UNAVAILABLE."""
    [(reader, errors)] = open_streams(server, 1)  # a long stream, past its first token
    acted_at = time.monotonic()
    act()
    reader.join(timeout=30 + HEARTBEAT_TIMEOUT_S)
    assert not reader.is_alive() and errors, "the stream did not end"
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
    return time.monotonic() - acted_at


def engine_pids(server_pid: int) -> set[int]:
    pids = set()
    for p in psutil.Process(server_pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "engine_main" in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def assert_nothing_left(cluster: Cluster, server_pid: int, before: set[str]) -> None:
    """No placement group, actor, relay or node ring of the stopped server remains (within 30 s: Ray reclaims a
    dead driver's actors and groups asynchronously)."""
    ours = ("-rstep", "-rres", "ringserve.backend.step_relay", "ray::RankHost", "ray::NodeRelayActor", "-rreq", "-revt",
            "ringserve.backend.remote_engine", "ray::EngineHostActor")  # fmt: skip
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
            left = [c for p in psutil.process_iter(["cmdline"]) if any(k in (c := " ".join(p.info["cmdline"] or ()))
                                                                      for k in ours)]  # fmt: skip
            if not groups and not left:
                break
            time.sleep(0.5)
        assert not groups, groups
        assert not left, left
    finally:
        ray.shutdown()
    # Other servers may run on this host: only the segments this server's processes would name are checked.
    assert not [n for n in segments() - before if any(k in n for k in ours) or f"-{server_pid}-" in n]
