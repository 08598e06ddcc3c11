"""The step and result rings carried over TCP to the ranks of another node (`--distributed-executor ray`).

One TCP stream per remote node. Each frame is a 4-byte little-endian length and one ring record, copied byte for
byte: the step records the engine wrote (engine -> node) and, when the node holds rank 0, the result records rank 0
wrote (node -> engine). Nothing is pickled. The stream opens with a random token the engine handed the node's relay
(over Ray, as a plain string), so a stray connection cannot feed a worker.

- Engine side: `python -m ringserve.backend.step_relay`, a child of the engine, reads its own reader slot of the
  engine's step ring and writes what comes back into the engine's result ring. The engine watches its pid like a
  worker's: it exits when the stream ends, so a dead node, relay or rank becomes a dead "worker" of the engine.
- Node side: `NodeRelay` (run in a Ray actor on that node, backend/ray_executor.py) owns the node's own step ring
  (one reader per local rank) and result ring, and ends the stream when one of its ranks' processes dies or stays
  stopped (SIGSTOP) for HEARTBEAT_TIMEOUT_S.

Liveness: each side sends an empty frame (a heartbeat; a ring record is never empty) five times per
HEARTBEAT_TIMEOUT_S, and a side that receives nothing for HEARTBEAT_TIMEOUT_S (or cannot send for as long) ends the
stream, so a node or relay that stops answering without closing its TCP connection is noticed within seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringserve.formats.segments import RESULT_RING_BYTES, STEP_RING_BYTES, new_segment_name, process_alive

log = logging.getLogger("ringserve.step_relay")

_LENGTH = struct.Struct("<I")
TOKEN_BYTES = 16
TOKEN_ENV = "RINGSERVE_RELAY_TOKEN"  # the engine-side relay's token (hex), kept off its command line
_POLL_S = 0.1
# A stream (or a rank's process) silent or stopped this long is dead; heartbeats go out five times as often.
HEARTBEAT_TIMEOUT_S = 5.0
_BEATS_PER_TIMEOUT = 5
_HEARTBEAT = b""
_EXITED = (None, "Z", "X", "x")  # process states
_STOPPED = ("T", "t")


def process_state(pid: int) -> str | None:
    """The process's state letter (/proc/PID/stat: R, S, T for stopped, Z for exited, ...), None when it is gone. A
    rank's worker is the child of another actor, which reaps it only when asked, so an exited one stays a zombie
    that signal 0 still reaches."""
    if not process_alive(pid):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def send_frame(sock: socket.socket, record: bytes | memoryview) -> None:
    sock.sendall(_LENGTH.pack(len(record)) + bytes(record))


class FrameSender:
    """The sending half of a stream shared by a pump and the heartbeat: one frame at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, record: bytes | memoryview) -> None:
        with self._lock:
            send_frame(self.sock, record)


def heartbeat(sender: FrameSender, stopped: threading.Event, timeout_s: float) -> None:
    """An empty frame, several per `timeout_s` (the peer's heartbeat timeout), until `stopped` or the stream
    fails."""
    try:
        while not stopped.wait(timeout_s / _BEATS_PER_TIMEOUT):
            sender.send(_HEARTBEAT)
    except OSError:
        pass  # the stream ended: the receiving side or the watch loop notices


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None when the peer closed the stream first."""
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, max_bytes: int) -> bytes | None:
    """One record, or None at the end of the stream, skipping heartbeats; a length over `max_bytes` (the ring's
    largest record) is a broken or hostile stream and raises. A socket timeout (the heartbeat's) raises
    TimeoutError."""
    while True:
        header = recv_exact(sock, _LENGTH.size)
        if header is None:
            return None
        (length,) = _LENGTH.unpack(header)
        if length > max_bytes:
            raise ConnectionError(f"step relay: a frame of {length} bytes exceeds the ring's record limit {max_bytes}")
        if length > 0:
            return recv_exact(sock, length)


def ring_to_socket(reader: Any, sender: FrameSender, stopped: threading.Event,
                   after: Callable[[bytes], None] = lambda _r: None) -> None:  # fmt: skip
    """Copies every record of `reader` into the stream until `stopped`; `after` sees each record once sent."""
    while not stopped.is_set():
        record = reader.read(_POLL_S)
        if record is not None:
            sender.send(record)
            after(bytes(record))


def socket_to_ring(sock: socket.socket, writer: Any, max_bytes: int, stopped: threading.Event,
                   after: Callable[[bytes], None] = lambda _r: None) -> None:  # fmt: skip
    """Copies every frame of the stream into `writer`'s ring (waiting for room: the ring is backpressure) until
    the stream ends."""
    while (record := recv_frame(sock, max_bytes)) is not None:
        while not writer.write(record, _POLL_S):
            if stopped.is_set():
                return
        after(record)


# -- node side ---------------------------------------------------------------------------------------------------


class NodeRelay:
    """The rings of one remote node and the listening end of its stream. `open` creates them and listens;
    `watch(pids)` then serves one connection (in a thread) until the stream ends or falls silent, the engine's
    WorkerShutdown has passed and the ranks exited, or a rank's process died or stayed stopped."""

    def __init__(self, num_local_ranks: int, holds_rank0: bool, token_hex: str,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:  # fmt: skip
        from ringserve import _core

        self._core = _core
        self._token = bytes.fromhex(token_hex)
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.step_ring = _core.ShmRing.create(new_segment_name("rstep"), STEP_RING_BYTES, num_local_ranks)
        self.result_ring = _core.ShmRing.create(new_segment_name("rres"), RESULT_RING_BYTES, 1) if holds_rank0 else None
        self._listener = socket.create_server(("", 0))
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def ring_names(self) -> tuple[str, str]:
        return self.step_ring.name, self.result_ring.name if self.result_ring is not None else ""

    def watch(self, pids: Sequence[int], accept_timeout_s: float = 120.0) -> None:
        self._thread = threading.Thread(target=self._serve, args=(list(pids), accept_timeout_s), daemon=True,
                                        name="node-relay")  # fmt: skip
        self._thread.start()

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def close(self) -> None:
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes an accept() still waiting
        except OSError:
            pass  # accepted and closed already
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._listener.close()
        self.unlink()

    def unlink(self) -> None:
        self.step_ring.unlink()
        if self.result_ring is not None:
            self.result_ring.unlink()

    def _serve(self, pids: list[int], accept_timeout_s: float) -> None:
        self._listener.settimeout(accept_timeout_s)
        try:
            sock, _ = self._listener.accept()
        except OSError:
            log.error("node relay: the engine did not connect within %.0f s", accept_timeout_s)
            return
        finally:
            self._listener.close()
        with sock:
            sock.settimeout(self._heartbeat_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if recv_exact(sock, TOKEN_BYTES) != self._token:
                log.error("node relay: a connection without the engine's token was refused")
                return
            self._relay(sock, pids)

    def _relay(self, sock: socket.socket, pids: list[int]) -> None:
        core, stopped = self._core, self._stopped
        shutdown_seen = threading.Event()

        def on_step(record: bytes) -> None:
            self.unlink()  # every local rank attached before the first record can arrive (see docs/distributed.md)
            if isinstance(core.decode_worker_command(record), core.WorkerShutdown):
                shutdown_seen.set()

        sender = FrameSender(sock)
        step_writer = core.RingWriter(self.step_ring)
        limit = self.step_ring.max_record_size
        pumps = [threading.Thread(target=self._pump, args=(socket_to_ring, sock, step_writer, limit, stopped, on_step))]
        if self.result_ring is not None:
            pumps.append(threading.Thread(target=self._pump, args=(ring_to_socket, core.RingReader(self.result_ring),
                                                                   sender, stopped)))  # fmt: skip
        beat = threading.Thread(target=heartbeat, args=(sender, stopped, self._heartbeat_timeout_s))
        for thread in [*pumps, beat]:
            thread.daemon = True
            thread.start()
        stopped_since: dict[int, float] = {}  # ranks seen stopped (SIGSTOP), since when
        while not stopped.is_set() and all(p.is_alive() for p in pumps):
            states = {pid: process_state(pid) for pid in pids}
            dead = [pid for pid, state in states.items() if state in _EXITED]
            now = time.monotonic()
            stopped_since = {pid: stopped_since.get(pid, now) for pid, state in states.items() if state in _STOPPED}
            hung = [pid for pid, since in stopped_since.items() if now - since >= self._heartbeat_timeout_s]
            if (dead or hung) and not shutdown_seen.is_set():
                log.error("node relay: rank process(es) %s died, %s stopped for %.1f s; ending the stream", dead,
                          hung, self._heartbeat_timeout_s)  # fmt: skip
                break
            if dead and len(dead) == len(pids):
                break  # shut down in order: every rank has exited
            time.sleep(_POLL_S)
        else:
            if not stopped.is_set():
                log.error("node relay: the stream from the engine ended or was silent for %.1f s",
                          self._heartbeat_timeout_s)  # fmt: skip
        stopped.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the engine's relay sees the end of the stream and exits
        except OSError:
            pass  # already reset by the other side

    @staticmethod
    def _pump(function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except OSError:
            pass  # the stream ended: the watch loop notices the pump is gone


# -- engine side -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ringserve.backend.step_relay", description=__doc__)
    p.add_argument("--connect", required=True, help="HOST:PORT of the node's relay")
    p.add_argument("--step-ring", required=True, help="the engine's step ring")
    p.add_argument("--step-reader", type=int, required=True, help="this relay's reader slot of the step ring")
    p.add_argument("--result-ring", default="", help="the engine's result ring, when the node holds rank 0")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                   help="seconds of silence after which the node counts as dead (default %(default)s)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the stream ends after a WorkerShutdown went through, 1 when it ends otherwise."""
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    from ringserve import _core
    from ringserve.backend.process import die_with_parent

    die_with_parent()
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV))
    host, _, port = args.connect.rpartition(":")
    step_ring = _core.ShmRing.attach(args.step_ring)
    reader = _core.RingReader(step_ring, args.step_reader)
    stopped, shutdown_sent = threading.Event(), threading.Event()

    def on_step(record: bytes) -> None:
        if isinstance(_core.decode_worker_command(record), _core.WorkerShutdown):
            shutdown_sent.set()

    with socket.create_connection((host, int(port)), timeout=30.0) as sock:
        sock.settimeout(args.heartbeat_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token)
        frames = FrameSender(sock)
        threads = [threading.Thread(target=NodeRelay._pump, args=(ring_to_socket, reader, frames, stopped, on_step)),
                   threading.Thread(target=heartbeat, args=(frames, stopped, args.heartbeat_timeout))]  # fmt: skip
        for thread in threads:
            thread.daemon = True
            thread.start()
        how = "ended (the node, its relay or one of its ranks died)"
        try:
            if args.result_ring:
                result_ring = _core.ShmRing.attach(args.result_ring)
                socket_to_ring(sock, _core.RingWriter(result_ring), result_ring.max_record_size, stopped)
            else:
                recv_frame(sock, 0)  # only heartbeats come back from a node without rank 0
        except TimeoutError:
            how = f"was silent for {args.heartbeat_timeout:g} s (the node or its relay stopped answering)"
        except OSError:
            pass
        stopped.set()
        for thread in threads:  # they poll `stopped`; one left inside the ring's read would abort the exit
            thread.join()
    if not shutdown_sent.is_set():
        log.error("step relay to %s: the stream %s", args.connect, how)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
