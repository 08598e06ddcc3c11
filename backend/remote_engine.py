"""`--engine-placement ray`: a replica's engine process on a node of the Ray cluster, its ranks packed beside it.

For such a replica the frontend starts this module instead of the engine, with the same arguments
(`python -m ringserve.backend.remote_engine --request-ring R --event-ring E --engine-args JSON`): the *engine
bridge*. It joins the cluster, reserves a placement group of one bundle that holds the whole replica (a CPU per rank,
and a GPU per rank where the cluster has GPUs) and starts in it an `EngineHostActor`. On its node the actor creates
the engine's own request and event rings, starts the engine on them (`python -m ringserve.backend.engine_main` with
`--distributed-executor mp`: the ranks are the engine's child processes on that node) and listens. The bridge
connects with a random token (handed to the actor over Ray as a plain string) and then copies the frontend's request
ring into the stream and the stream into the frontend's event ring, while the actor copies the stream into the
node's request ring and the node's event ring into the stream: the same ring records, byte for byte, in the frames,
with the token, heartbeats and record-size bound of the step relay (backend/step_relay.py). Nothing is pickled.

To the frontend the bridge *is* the engine process: it exits when the stream ends, 0 after the frontend's Shutdown
went through, else 1 after writing an EngineFailed that says how the stream ended (the engine, its actor or its node
died or stopped answering), so the replica's requests end UNAVAILABLE and the frontend restarts it. On exit it kills
the actor (the engine follows on its parent-death signal, the ranks on theirs) and removes the placement group; a
bridge that is itself killed is a Ray driver that died, whose actors and group Ray removes. Details:
docs/distributed.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
from types import FrameType
from typing import Any

from ringserve import _core
from ringserve.backend.engine_main import report_start_failure
from ringserve.backend.process import die_with_parent, stop_child
from ringserve.backend.step_relay import (
    HEARTBEAT_TIMEOUT_S,
    TOKEN_BYTES,
    TOKEN_ENV,
    ListeningRelay,
    connect,
    relay_connected,
)
from ringserve.formats.engine_args import EngineArgs, started_process_engine_args
from ringserve.formats.segments import EVENT_RING_BYTES, REQUEST_RING_BYTES, new_segment_name

log = logging.getLogger("ringserve.remote_engine")

ENGINE_STOP_S = 10.0  # for a remote engine to exit after a Shutdown, before SIGTERM (then SIGKILL)
ENGINE_STOP_GRACE_S = 2.0  # the same without one (a failure, or the bridge was stopped): it may be stuck
_SHUTDOWN = _core.encode_record(_core.Shutdown())  # the frontend's last record to an engine (it has no fields)


def is_shutdown(record: bytes) -> bool:
    return record == _SHUTDOWN


class EngineHost(ListeningRelay):
    """On the engine's node: its request ring (records in from the stream) and event ring (records out), the engine
    process (`start`) and the listening end of the bridge's stream, which ends when the engine exits (after the
    frontend's Shutdown: in order), dies or stays stopped."""

    def __init__(self, token_hex: str, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        super().__init__(token_hex, heartbeat_timeout_s)
        self.request_ring = self.inbound = _core.ShmRing.create(new_segment_name("rreq"), REQUEST_RING_BYTES, 1)
        self.event_ring = self.outbound = _core.ShmRing.create(new_segment_name("revt"), EVENT_RING_BYTES, 1)
        self.engine: subprocess.Popen[bytes] | None = None

    def start(self, engine_argv: list[str], env: dict[str, str]) -> int:
        """Start `python ENGINE_ARGV --request-ring R --event-ring E` on this node's rings, with `env` over this
        process's environment, and serve the bridge's stream; returns the engine's pid."""
        command = [sys.executable, *engine_argv, "--request-ring", self.request_ring.name, "--event-ring",
                   self.event_ring.name]  # fmt: skip
        self.engine = subprocess.Popen(command, env={**os.environ, **env})
        self.watch([self.engine.pid])
        return self.engine.pid

    def on_inbound(self, record: bytes) -> bool:
        return is_shutdown(record)

    def close(self, engine_stop_s: float = ENGINE_STOP_S) -> None:
        """End the stream, stop the engine (it has exited already after a Shutdown) and remove what it left here."""
        super().close()
        if self.engine is not None:
            stop_child(self.engine, engine_stop_s)
        self.request_ring.unlink()  # the engine removed the names once it attached; this covers a failed start
        self.event_ring.unlink()
        for name in _core.reclaim_stale_segments():  # those of a killed engine or rank
            log.info("removed %s, left by a process that died", name)


class EngineHostActor:
    """A Ray actor in the replica's bundle: its `EngineHost`. Its calls take and return strings and integers."""

    def __init__(self, token_hex: str) -> None:
        self.host = EngineHost(token_hex)

    def start(self, engine_argv: list[str], env: dict[str, str]) -> tuple[str, int, int]:
        """(this node's address as Ray knows it, the listening port, the engine's pid)."""
        import ray

        pid = self.host.start(engine_argv, env)
        return str(ray.util.get_node_ip_address()), self.host.port, pid

    def close(self, engine_stop_s: float) -> None:
        self.host.close(engine_stop_s)


class RemoteEngine:
    """The bridge's view of its placement: the placement group and the actor (`place`), released by `release`."""

    def __init__(self, args: EngineArgs) -> None:
        from ringserve.backend.ray_executor import join_cluster

        self.args = args
        self.ray, self.cluster = join_cluster(args)
        self.token_hex = secrets.token_hex(TOKEN_BYTES)
        self.group: Any = None
        self.actor: Any = None
        self.node_id = ""

    def place(self) -> tuple[str, int]:
        """Reserve the replica's bundle and start the engine in it; returns the HOST:PORT its stream listens on and
        the engine's pid there."""
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from ringserve.backend.ray_executor import passed_environment, ray_get

        ray, args, world = self.ray, self.args, self.args.world_size
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"CPU": float(world), **({"GPU": float(world)} if gpus else {})}
        self.group = placement_group([bundle])
        ready, _ = ray.wait([self.group.ready()], timeout=args.ray_placement_timeout)
        if not ready:
            raise RuntimeError(
                f"--engine-placement ray: the cluster at {self.cluster} could not place the replica's bundle of "
                f"{bundle} within --ray-placement-timeout {args.ray_placement_timeout:g} s (available: "
                f"{ray.available_resources()})"
            )
        self.node_id = str(placement_group_table(self.group)["bundles_to_node_id"][0])
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0)
        self.actor = ray.remote(EngineHostActor).options(
            scheduling_strategy=strategy, num_cpus=float(world), num_gpus=float(world) if gpus else 0.0
        ).remote(self.token_hex)  # fmt: skip
        # The ranks are the remote engine's own processes on its node (packed in the bundle).
        remote = dataclasses.replace(args, distributed_executor="mp", engine_placement="local")
        argv = ["-m", "ringserve.backend.engine_main", "--engine-args", remote.to_json()]
        host, port, pid = ray_get(ray, self.actor.start.remote(argv, passed_environment(dict(os.environ))),
                                  f"--engine-placement ray: the engine's actor on node {self.node_id}")  # fmt: skip
        log.info("engine placed on Ray node %s (%s), pid %d there", self.node_id, host, pid)
        return f"{host}:{port}", pid

    def release(self, engine_stop_s: float) -> None:
        """Close the actor (its engine gets `engine_stop_s` to exit, then signals), kill it and remove the group.
        Safe to call more than once."""
        ray = self.ray
        if self.actor is not None:
            try:
                ray.get(self.actor.close.remote(engine_stop_s), timeout=3 * engine_stop_s + 5.0)
            except Exception as exc:  # a dead actor or node: its engine died with it
                log.warning("closing the engine's actor: %s", exc)
            ray.kill(self.actor)
            self.actor = None
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        ray.shutdown()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ringserve.backend.remote_engine", description=__doc__)
    p.add_argument("--request-ring", required=True, help="shm name of the request ring (created by the frontend)")
    p.add_argument("--event-ring", required=True, help="shm name of the event ring (created by the frontend)")
    p.add_argument("--engine-args", default="", help="the EngineArgs JSON; the engine is placed on the Ray cluster")
    p.add_argument("--connect", default="", help=f"HOST:PORT of an EngineHost already started, instead of placing "
                   f"one (its token in ${TOKEN_ENV}, hex)")  # fmt: skip
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                   help="seconds of silence after which the engine counts as dead (default %(default)s)")  # fmt: skip
    args = p.parse_args(argv)
    if not args.connect and not args.engine_args:
        p.error("one of --engine-args and --connect is required")
    args.engine = started_process_engine_args(p, args.engine_args) if args.engine_args else None
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the stream ends after the frontend's Shutdown went through, 1 otherwise (after an EngineFailed)."""
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    die_with_parent()
    request_ring, event_ring = _core.ShmRing.attach(args.request_ring), _core.ShmRing.attach(args.event_ring)
    request_ring.unlink()  # both ends attached: the names are not needed any more (docs/architecture.md §4)
    event_ring.unlink()
    stream: list[socket.socket] = []
    stopping: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping the engine bridge", signum)
        stopping.append(signum)
        if not stream:
            raise KeyboardInterrupt  # still placing: the finally below releases what was placed
        try:
            stream[0].shutdown(socket.SHUT_RDWR)  # the relay below sees the end of the stream
        except OSError:
            pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    remote: RemoteEngine | None = None
    shutdown_sent = False
    try:
        try:
            if args.connect:
                address, where, token = args.connect, f"at {args.connect}", bytes.fromhex(os.environ.pop(TOKEN_ENV))
            else:
                remote = RemoteEngine(args.engine)
                address, pid = remote.place()
                where, token = f"on Ray node {remote.node_id} ({address}, pid {pid})", bytes.fromhex(remote.token_hex)
            stream.append(connect(address, token, args.heartbeat_timeout))
        except KeyboardInterrupt:  # from on_signal: stopped while placing
            return 1
        except Exception as exc:
            return report_start_failure(event_ring, exc)
        with stream[0] as sock:
            reader = _core.RingReader(request_ring, 0)
            shutdown_sent, how = relay_connected(sock, reader, event_ring, args.heartbeat_timeout, is_shutdown)
        if shutdown_sent or stopping:
            return 0 if shutdown_sent else 1
        message = (f"the engine process {where} ended without a Shutdown: the stream {how} (the engine, its actor "
                   "or its node died or stopped answering)")  # fmt: skip
        log.error("%s", message)
        failed = _core.EngineFailed(message=message, reason=_core.FailureReason.ENGINE_DIED)
        _core.RingWriter(event_ring).write(_core.encode_record(failed), 5.0)
        return 1
    finally:
        if remote is not None:
            remote.release(ENGINE_STOP_S if shutdown_sent else ENGINE_STOP_GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
