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

The listening end (`ListeningRelay`) and the connecting end (`connect`, `relay_connected`) are generic over the two
rings they join: `--engine-placement ray` carries an engine's request and event records the same way
(backend/remote_engine.py).

Liveness: each side sends an empty frame (a heartbeat; a ring record is never empty) five times per
HEARTBEAT_TIMEOUT_S, and a side that receives nothing for HEARTBEAT_TIMEOUT_S (or cannot send for as long) ends the
stream, so a node or relay that stops answering without closing its TCP connection is noticed within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
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


# -- the listening end ------------------------------------------------------------------------------------------


class ListeningRelay:
    """The listening end of one stream, on the side that owns the processes: `watch(pids)` accepts one connection
    (in a thread) that opens with the token, then copies the stream's frames into the `inbound` ring and the
    `outbound` ring's records (if any) into the stream, until the stream ends or falls silent, the last record
    (`on_inbound` says which) has come in and every watched process exited, or a watched process died or stayed
    stopped (SIGSTOP) for the heartbeat timeout. What the outbound ring still holds then goes out before the stream
    is closed (an engine's EngineFailed). Subclasses create the rings: `NodeRelay` a node's step and result rings,
    `remote_engine.EngineHost` an engine's request and event rings."""

    inbound: Any  # the ShmRing the stream's frames are written into
    outbound: Any = None  # the ShmRing whose records go out, or None

    def __init__(self, token_hex: str, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        from ringserve import _core

        self._core = _core
        self._token = bytes.fromhex(token_hex)
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._listener = socket.create_server(("", 0))
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def on_inbound(self, record: bytes) -> bool:
        """Called once per record that came in; True for the last one (the watched processes exit after it)."""
        return False

    def watch(self, pids: Sequence[int], accept_timeout_s: float = 120.0) -> None:
        self._thread = threading.Thread(target=self._serve, args=(list(pids), accept_timeout_s), daemon=True,
                                        name=type(self).__name__)  # fmt: skip
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

    def _serve(self, pids: list[int], accept_timeout_s: float) -> None:
        name = type(self).__name__
        self._listener.settimeout(accept_timeout_s)
        try:
            sock, _ = self._listener.accept()
        except OSError:
            log.error("%s: the other end did not connect within %.0f s", name, accept_timeout_s)
            return
        finally:
            self._listener.close()
        with sock:
            sock.settimeout(self._heartbeat_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if recv_exact(sock, TOKEN_BYTES) != self._token:
                log.error("%s: a connection without the token was refused", name)
                return
            self._relay(sock, pids)

    def _relay(self, sock: socket.socket, pids: list[int]) -> None:
        core, stopped, name = self._core, self._stopped, type(self).__name__
        last_seen = threading.Event()

        def after(record: bytes) -> None:
            if self.on_inbound(record):
                last_seen.set()

        sender = FrameSender(sock)
        limit = self.inbound.max_record_size
        pumps = [threading.Thread(target=_pump, args=(socket_to_ring, sock, core.RingWriter(self.inbound), limit,
                                                      stopped, after))]  # fmt: skip
        reader = core.RingReader(self.outbound) if self.outbound is not None else None
        if reader is not None:
            pumps.append(threading.Thread(target=_pump, args=(ring_to_socket, reader, sender, stopped)))
        beat = threading.Thread(target=heartbeat, args=(sender, stopped, self._heartbeat_timeout_s))
        for thread in [*pumps, beat]:
            thread.daemon = True
            thread.start()
        stopped_since: dict[int, float] = {}  # processes seen stopped (SIGSTOP), since when
        while not stopped.is_set() and all(p.is_alive() for p in pumps):
            states = {pid: process_state(pid) for pid in pids}
            dead = [pid for pid, state in states.items() if state in _EXITED]
            now = time.monotonic()
            stopped_since = {pid: stopped_since.get(pid, now) for pid, state in states.items() if state in _STOPPED}
            hung = [pid for pid, since in stopped_since.items() if now - since >= self._heartbeat_timeout_s]
            if (dead or hung) and not last_seen.is_set():
                log.error("%s: process(es) %s died, %s stopped for %.1f s; ending the stream", name, dead, hung,
                          self._heartbeat_timeout_s)  # fmt: skip
                break
            if dead and len(dead) == len(pids):
                break  # shut down in order: every watched process has exited
            time.sleep(_POLL_S)
        else:
            if not stopped.is_set():
                log.error("%s: the stream ended or was silent for %.1f s", name, self._heartbeat_timeout_s)
        stopped.set()
        if reader is not None:
            pumps[-1].join(timeout=1.0)  # it polls `stopped`; then this thread alone reads the ring
            with contextlib.suppress(OSError):
                while (record := reader.try_read()) is not None:
                    sender.send(record)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the other end sees the end of the stream
        except OSError:
            pass  # already reset by the other side


def _pump(function: Callable[..., None], *args: Any) -> None:
    try:
        function(*args)
    except OSError:
        pass  # the stream ended: the watch loop notices the pump is gone


class NodeRelay(ListeningRelay):
    """The rings of one remote node and the listening end of its stream: step records in, result records out when
    the node holds rank 0; the watched processes are the node's ranks, which exit after a WorkerShutdown."""

    def __init__(self, num_local_ranks: int, holds_rank0: bool, token_hex: str,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:  # fmt: skip
        super().__init__(token_hex, heartbeat_timeout_s)
        core = self._core
        self.step_ring = self.inbound = core.ShmRing.create(new_segment_name("rstep"), STEP_RING_BYTES,
                                                            num_local_ranks)  # fmt: skip
        self.result_ring = self.outbound = (core.ShmRing.create(new_segment_name("rres"), RESULT_RING_BYTES, 1)
                                            if holds_rank0 else None)  # fmt: skip

    def ring_names(self) -> tuple[str, str]:
        return self.step_ring.name, self.result_ring.name if self.result_ring is not None else ""

    def on_inbound(self, record: bytes) -> bool:
        self.unlink()  # every local rank attached before the first record can arrive (see docs/distributed.md)
        return isinstance(self._core.decode_worker_command(record), self._core.WorkerShutdown)

    def close(self) -> None:
        super().close()
        self.unlink()

    def unlink(self) -> None:
        self.step_ring.unlink()
        if self.result_ring is not None:
            self.result_ring.unlink()


# -- the connecting end -----------------------------------------------------------------------------------------


def connect(address: str, token: bytes, heartbeat_timeout_s: float) -> socket.socket:
    """A stream to the listening relay at HOST:PORT, opened with its token."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30.0)
    sock.settimeout(heartbeat_timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(token)
    return sock


def relay_connected(sock: socket.socket, reader: Any, inbound: Any, heartbeat_timeout_s: float,
                    is_last: Callable[[bytes], bool]) -> tuple[bool, str]:  # fmt: skip
    """Copies `reader`'s records into the stream and the stream's frames into the `inbound` ring (None: only
    heartbeats come back) until the stream ends or falls silent. Returns whether a last record (`is_last`) went out
    before, and how the stream ended."""
    from ringserve import _core

    stopped, last_sent = threading.Event(), threading.Event()

    def after(record: bytes) -> None:
        if is_last(record):
            last_sent.set()

    frames = FrameSender(sock)
    threads = [threading.Thread(target=_pump, args=(ring_to_socket, reader, frames, stopped, after)),
               threading.Thread(target=heartbeat, args=(frames, stopped, heartbeat_timeout_s))]  # fmt: skip
    for thread in threads:
        thread.daemon = True
        thread.start()
    how = "ended"
    try:
        if inbound is not None:
            socket_to_ring(sock, _core.RingWriter(inbound), inbound.max_record_size, stopped)
        else:
            recv_frame(sock, 0)
    except TimeoutError:
        how = f"was silent for {heartbeat_timeout_s:g} s"
    except OSError as exc:  # reset, or a frame over the ring's record limit
        how = f"failed ({exc})"
    stopped.set()
    for thread in threads:  # they poll `stopped`; one left inside the ring's read would abort the exit
        thread.join()
    return last_sent.is_set(), how


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
    """The engine-side relay: exit 0 when the stream ends after a WorkerShutdown went through, 1 when it ends
    otherwise."""
    logging.basicConfig(level=os.environ.get("RINGSERVE_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    from ringserve import _core
    from ringserve.backend.process import die_with_parent

    die_with_parent()
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV))
    reader = _core.RingReader(_core.ShmRing.attach(args.step_ring), args.step_reader)
    result_ring = _core.ShmRing.attach(args.result_ring) if args.result_ring else None

    def is_shutdown(record: bytes) -> bool:
        return isinstance(_core.decode_worker_command(record), _core.WorkerShutdown)

    with connect(args.connect, token, args.heartbeat_timeout) as sock:
        shutdown_sent, how = relay_connected(sock, reader, result_ring, args.heartbeat_timeout, is_shutdown)
    if not shutdown_sent:
        log.error("step relay to %s: the stream %s (the node, its relay or one of its ranks died or stopped "
                  "answering)", args.connect, how)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
