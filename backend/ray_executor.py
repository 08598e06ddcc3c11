"""`--distributed-executor ray`: the engine's worker ranks as Ray actors on the nodes of a running Ray cluster.

The engine joins the cluster (`--ray-address`, else $RAY_ADDRESS, else the cluster on this host), reserves a
placement group of one bundle per rank (a GPU and a CPU where the cluster has GPUs, else a CPU) and starts, in each
bundle, a `RankHost` actor that runs the rank as the same worker command the local executor starts
(`python -m ringserve.workers.worker_main`), as its child. Ranks on the engine's node read the engine's step ring
directly. Each other node gets one `NodeRelay` actor with that node's own rings and one TCP stream to an engine-side
relay process (backend/step_relay.py), which carries the ring records unchanged; so does the engine's node where its
ranks and the other nodes' relays would be more readers than the engine's ring has (`split_by_reader`). Ray's calls
carry only strings and integers. torch.distributed rendezvouses at rank 0's node address and a port free there. Details:
docs/distributed.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ringserve.backend.process import stop_child, worker_environment
from ringserve.backend.step_relay import TOKEN_BYTES, TOKEN_ENV, NodeRelay
from ringserve.formats.engine_args import MAX_LOCAL_WORKERS, EngineArgs

log = logging.getLogger("ringserve.ray_executor")

START_TIMEOUT_S = 120.0  # for each of Ray's calls that start the ranks and relays
CONNECT_TIMEOUT_S = 10.0  # for the cluster's address to accept a connection (ray.init waits for ever)
# What a rank's worker (or a remote engine) takes from the environment of the process that placed it.
_PASSED_ENV = ("RINGSERVE_", "GLIBC_TUNABLES", "GLOO_", "NCCL_", "TORCH_", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


class RankHost:
    """A Ray actor in one rank's bundle: starts that rank's worker process and reports its pid."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def address(self) -> tuple[str, int]:
        """This node's address as Ray knows it, and a TCP port free on it (for rank 0: the rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return str(ray.util.get_node_ip_address()), int(s.getsockname()[1])

    def start(self, worker_args: list[str], env: dict[str, str]) -> int:
        command = [
            sys.executable,
            "-m",
            "ringserve.workers.worker_main",
            *worker_args,
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(command, env={**os.environ, **env})
        return self.proc.pid

    def stop(self, timeout_s: float) -> int | None:
        """Wait for the worker to exit (it was sent WorkerShutdown), then escalate to signals."""
        return None if self.proc is None else stop_child(self.proc, timeout_s)


class NodeRelayActor:
    """A Ray actor on a node without the engine: that node's rings and the far end of its TCP stream."""

    def __init__(self, num_local_ranks: int, holds_rank0: bool, token_hex: str) -> None:
        self.relay = NodeRelay(num_local_ranks, holds_rank0, token_hex)

    def open(self) -> tuple[str, int, str, str]:
        import ray

        return (str(ray.util.get_node_ip_address()), self.relay.port, *self.relay.ring_names())

    def watch(self, pids: list[int]) -> None:
        self.relay.watch(pids)

    def close(self) -> None:
        self.relay.close()


@dataclass
class RemoteNode:
    node_id: str
    ranks: list[int]
    step_reader: int  # the engine-side relay's slot in the engine's step ring
    token_hex: str = field(default_factory=lambda: secrets.token_hex(TOKEN_BYTES))
    actor: Any = None
    address: str = ""  # the node relay's listening end
    port: int = 0
    relay: subprocess.Popen[bytes] | None = None


class RayExecutor:
    """The placement of one engine's ranks; `start` starts them, `stop` releases everything it reserved."""

    def __init__(self, args: EngineArgs) -> None:
        ray, address = join_cluster(args)
        from ray.util.placement_group import placement_group, placement_group_table

        self.ray, self.args = ray, args
        self.world = args.world_size
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.bundle = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
        self.pg = placement_group([dict(self.bundle) for _ in range(self.world)], strategy=args.placement_strategy)
        self.hosts: list[Any] = []
        self.remote: list[RemoteNode] = []
        ready, _ = ray.wait([self.pg.ready()], timeout=args.ray_placement_timeout)
        if not ready:
            available = ray.available_resources()
            self.stop()
            raise RuntimeError(
                f"--distributed-executor ray: the cluster at {address} could not place {self.world} bundle(s) of "
                f"{self.bundle} with --placement-strategy {args.placement_strategy} within --ray-placement-timeout "
                f"{args.ray_placement_timeout:g} s (available: {available})"
            )
        bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        self.rank_nodes = [str(bundle_nodes[r]) for r in range(self.world)]
        self.engine_node = ray.get_runtime_context().get_node_id()
        if (problem := step_ring_problem(self.rank_nodes)) is not None:
            self.stop()
            raise RuntimeError(f"--distributed-executor ray: the cluster at {address} placed the {self.world} ranks "
                               f"so that {problem}")  # fmt: skip
        self.local_ranks, relayed = split_by_reader(self.rank_nodes, self.engine_node)
        for node, ranks in relayed.items():
            self.remote.append(RemoteNode(node, ranks, len(self.local_ranks) + len(self.remote)))

    @property
    def step_readers(self) -> int:
        """Readers of the engine's step ring: one per local rank, one per remote node's relay."""
        return len(self.local_ranks) + len(self.remote)

    def _in_bundle(self, actor_class: type, rank: int, **resources: float) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
        return self.ray.remote(actor_class).options(scheduling_strategy=strategy, **resources)

    def start(self, step_ring: str, result_ring: str) -> list[int]:
        """Start every rank; returns, per rank, the pid the engine watches on this host: the worker's for a local
        rank, the engine-side relay's for a rank on another node."""
        gpu = {"num_gpus": 1.0} if "GPU" in self.bundle else {}
        self.hosts = [self._in_bundle(RankHost, r, num_cpus=1.0, **gpu).remote() for r in range(self.world)]
        master_addr, master_port = self._get(self.hosts[0].address.remote(), "rank 0's actor")
        rings = {r: (step_ring, self.local_ranks.index(r), result_ring) for r in self.local_ranks}
        for node in self.remote:
            node.actor = self._in_bundle(NodeRelayActor, node.ranks[0], num_cpus=0.0).remote(
                len(node.ranks), self.args.result_rank in node.ranks, node.token_hex
            )
            node.address, node.port, node_step, node_result = self._get(node.actor.open.remote(),
                                                                        f"the relay actor of node {node.node_id}")
            rings.update({r: (node_step, i, node_result) for i, r in enumerate(node.ranks)})
        env = passed_environment(worker_environment(dict(os.environ)))
        env |= {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        starts = []
        ranks_on_node = Counter(self.rank_nodes)  # they share the node's CPUs (--worker-threads 0)
        for rank, host in enumerate(self.hosts):
            step, reader, result = rings[rank]
            worker_args = ["--rank", str(rank), "--step-ring", step, "--step-reader", str(reader),
                           "--result-ring", result, "--ranks-on-host", str(ranks_on_node[self.rank_nodes[rank]]),
                           "--engine-args", self.args.to_json()]  # fmt: skip
            starts.append(host.start.remote(worker_args, env))
        worker_pids = self._get(starts, "starting the ranks' workers")
        pids = list(worker_pids)
        for node in self.remote:
            self._get(node.actor.watch.remote([worker_pids[r] for r in node.ranks]),
                      f"the relay actor of node {node.node_id}")
            node.relay = self._start_relay(node, step_ring, result_ring)
            for r in node.ranks:
                pids[r] = node.relay.pid
        return pids

    def _get(self, refs: Any, what: str) -> Any:
        return ray_get(self.ray, refs, f"--distributed-executor ray: {what}")

    def _start_relay(self, node: RemoteNode, step_ring: str, result_ring: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "ringserve.backend.step_relay", "--connect", f"{node.address}:{node.port}",
                   "--step-ring", step_ring, "--step-reader", str(node.step_reader),
                   "--result-ring", result_ring if self.args.result_rank in node.ranks else ""]  # fmt: skip
        return subprocess.Popen(command, env={**worker_environment(dict(os.environ)), TOKEN_ENV: node.token_hex})

    def stop(self, timeout_s: float = 10.0) -> None:
        """After WorkerShutdown (or a failure): wait for the ranks, end the relays, kill the actors and remove the
        placement group. Safe to call more than once."""
        ray = self.ray
        if not ray.is_initialized():
            return
        try:
            if self.hosts:
                ray.get([h.stop.remote(timeout_s) for h in self.hosts], timeout=3 * timeout_s)
        except Exception as exc:  # a dead actor or node: its worker died with it
            log.warning("stopping the Ray ranks: %s", exc)
        for node in self.remote:
            if node.relay is not None:
                stop_child(node.relay, timeout_s)
            if node.actor is not None:
                try:
                    ray.get(node.actor.close.remote(), timeout=timeout_s)
                except Exception as exc:
                    log.warning("closing the relay of node %s: %s", node.node_id, exc)
        for actor in [*self.hosts, *(n.actor for n in self.remote if n.actor is not None)]:
            ray.kill(actor)
        self.hosts, self.remote = [], []
        ray.util.remove_placement_group(self.pg)
        ray.shutdown()


def join_cluster(args: EngineArgs) -> tuple[Any, str]:
    """Ray, joined to the cluster at --ray-address, else $RAY_ADDRESS, else the one on this host, and that address; a
    RuntimeError where Ray is missing or no cluster answers there."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--distributed-executor ray needs Ray: pip install 'ringserve[ray]'") from None
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(address)
    try:
        ray.init(address=address, configure_logging=False)  # the actors' output reaches this process's log
    except Exception as exc:  # ConnectionError, or a ValueError/RuntimeError for an address Ray cannot parse
        raise RuntimeError(f"--distributed-executor ray: no Ray cluster at {address}: {first_lines(exc)}") from None
    return ray, address


def ray_get(ray: Any, refs: Any, what: str) -> Any:
    """ray.get of a starting call; a dead actor or node, or no answer within START_TIMEOUT_S, raises a RuntimeError
    naming `what` (the engine, or the engine's bridge, reports it to the frontend as its failure)."""
    try:
        return ray.get(refs, timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        problem = f"did not answer within {START_TIMEOUT_S:.0f} s"
    except ray.exceptions.RayError as exc:
        problem = f"failed: {first_lines(exc)}"
    raise RuntimeError(f"{what} {problem}")


def passed_environment(env: dict[str, str]) -> dict[str, str]:
    """What a process started by an actor takes from ours (the rest is the Ray worker's own, e.g. the
    CUDA_VISIBLE_DEVICES Ray set for its bundle)."""
    return {k: v for k, v in env.items() if k.startswith(_PASSED_ENV)}


def split_by_reader(rank_nodes: list[str], engine_node: str) -> tuple[list[int], dict[str, list[int]]]:
    """Who reads the engine's step ring: the ranks on the engine's node each directly, and one relay per other node,
    which feeds that node's ranks (rank r is on node rank_nodes[r]). Where that would be more readers than a ring
    has (MAX_LOCAL_WORKERS), the engine's node gets a relay too (over loopback TCP), so the engine's ring has one
    reader per node. Returns the direct readers' ranks and, per relayed node, its ranks."""
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        nodes.setdefault(node, []).append(rank)
    local = nodes.pop(engine_node, [])
    if len(local) + len(nodes) <= MAX_LOCAL_WORKERS:
        return local, nodes
    return [], ({engine_node: local} if local else {}) | nodes


def step_ring_problem(rank_nodes: list[str]) -> str | None:
    """Why a placement (each rank's node) needs more readers of a step ring than one has (MAX_LOCAL_WORKERS), or
    None. With a relay per node (split_by_reader) the engine's ring has a reader per node that holds ranks, and each
    node's ring one per rank there."""
    per_node = Counter(rank_nodes)
    if len(per_node) > MAX_LOCAL_WORKERS:
        return (f"{len(per_node)} nodes hold ranks; the engine's step ring has a reader per node and at most "
                f"{MAX_LOCAL_WORKERS} (docs/distributed.md)")  # fmt: skip
    count, node = max((count, node) for node, count in per_node.items())
    if count > MAX_LOCAL_WORKERS:
        return (f"node {node} holds {count} ranks; a node's step ring has a reader per rank and at most "
                f"{MAX_LOCAL_WORKERS} (docs/distributed.md)")  # fmt: skip
    return None


def check_reachable(address: str) -> None:
    """A HOST:PORT cluster address must accept a TCP connection within CONNECT_TIMEOUT_S: ray.init retries one that
    does not for ever. `auto` and `ray://` addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"--distributed-executor ray: no Ray cluster at {address}: cannot connect ({exc}); "
                           "expected HOST:PORT of the head's GCS (--ray-address or $RAY_ADDRESS)") from None


def first_lines(error: BaseException, lines: int = 2) -> str:
    """The head of an exception's text: Ray's carry their actor's details and traceback below."""
    return " ".join(line.strip() for line in str(error).splitlines()[:lines]) or type(error).__name__
