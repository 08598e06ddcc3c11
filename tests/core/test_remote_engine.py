"""The engine bridge of `--engine-placement ray` without Ray: the frontend's request and event rings on one side, an
`EngineHost` in this process with a stand-in engine (a process that echoes every request record into its event
ring, unchanged) on the other, and the bridge (`python -m ringserve.backend.remote_engine --connect`) as a real
process between them over loopback TCP."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ringserve import _core
from ringserve.backend.remote_engine import EngineHost
from ringserve.backend.step_relay import TOKEN_BYTES, TOKEN_ENV
from ringserve.formats.segments import new_segment_name
from test_step_relay import read, wait_exit

SHM = Path("/dev/shm")
HEARTBEAT_S = 1.5
# The stand-in engine: attaches the rings it is given and echoes each request record; exits 0 after a Shutdown.
ECHO = """
import sys
from ringserve import _core
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
reader = _core.RingReader(_core.ShmRing.attach(flags["--request-ring"]), 0)
writer = _core.RingWriter(_core.ShmRing.attach(flags["--event-ring"]))
shutdown = _core.encode_record(_core.Shutdown())
while True:
    record = reader.read(1.0)
    if record is not None:
        assert writer.write(bytes(record), 5.0)
        if bytes(record) == shutdown:
            break
"""


def bridge(port: int, rings: dict, token: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "ringserve.backend.remote_engine", "--connect", f"127.0.0.1:{port}",
               "--request-ring", rings["request"].name, "--event-ring", rings["event"].name,
               "--heartbeat-timeout", str(HEARTBEAT_S)]  # fmt: skip
    return subprocess.Popen(command, env={**os.environ, TOKEN_ENV: token})


@contextmanager
def frontend_rings() -> Iterator[dict]:
    rings = {"request": _core.ShmRing.create(new_segment_name("req"), 1 << 20, 1),
             "event": _core.ShmRing.create(new_segment_name("evt"), 1 << 20, 1)}  # fmt: skip
    try:
        yield rings
    finally:
        for ring in rings.values():
            ring.unlink()


@contextmanager
def bridged(token: str | None = None, port: int = 0) -> Iterator[dict]:
    """The frontend's rings, an EngineHost running the echo engine, and the bridge connected to it."""
    with frontend_rings() as rings:
        host_token = secrets.token_hex(TOKEN_BYTES)
        host = EngineHost(host_token, heartbeat_timeout_s=HEARTBEAT_S)
        host.start(["-c", ECHO], {})
        proc = bridge(port or host.port, rings, token or host_token)
        try:
            yield {**rings, "host": host, "bridge": proc}
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            host.close(engine_stop_s=0.5)
            assert not (SHM / host.request_ring.name.lstrip("/")).exists()
            assert not (SHM / host.event_ring.name.lstrip("/")).exists()


def add_request(request_id: int, prompt_len: int) -> bytes:
    return _core.encode_record(_core.AddRequest(request_id=request_id, prompt_token_ids=list(range(prompt_len))))


def engine_failed(reader: _core.RingReader) -> str:
    event = _core.decode_engine_event(read(reader))
    assert isinstance(event, _core.EngineFailed), event
    return str(event.message)


def wait_done(host: EngineHost, timeout_s: float) -> float:
    started = time.monotonic()
    while not host.done():
        assert time.monotonic() - started < timeout_s, "the engine host still serves the stream"
        time.sleep(0.05)
    return time.monotonic() - started


def test_records_cross_unchanged_both_ways_and_a_shutdown_ends_the_bridge_cleanly() -> None:
    with bridged() as b:
        writer, reader = _core.RingWriter(b["request"]), _core.RingReader(b["event"], 0)
        sent = [add_request(i, n) for i, n in enumerate((1, 7, 300, 20_000))]  # 80 kB: many TCP segments
        for record in sent:
            assert writer.write(record, 5.0)
        assert [read(reader) for _ in sent] == sent  # out and back through the echo engine, byte for byte
        shutdown = _core.encode_record(_core.Shutdown())
        assert writer.write(shutdown, 5.0)
        assert read(reader) == shutdown  # the engine's last events still come back after its Shutdown
        assert wait_exit(b["bridge"]) == 0
        assert b["host"].engine is not None and b["host"].engine.wait(5.0) == 0
        assert reader.read(0.2) is None  # no EngineFailed after an orderly end


def test_a_killed_engine_ends_the_bridge_with_an_engine_failed_within_seconds() -> None:
    with bridged() as b:
        writer, reader = _core.RingWriter(b["request"]), _core.RingReader(b["event"], 0)
        assert writer.write(add_request(1, 3), 5.0)
        assert read(reader) == add_request(1, 3)
        assert b["host"].engine is not None
        killed_at = time.monotonic()
        b["host"].engine.kill()
        assert wait_exit(b["bridge"]) == 1
        message = engine_failed(reader)
        print(f"\n[bridge] a killed engine ended the bridge after {time.monotonic() - killed_at:.2f} s: {message}")
        assert "the engine process at 127.0.0.1:" in message and "ended without a Shutdown" in message


def test_a_connection_without_the_token_is_refused() -> None:
    with bridged(token=secrets.token_hex(TOKEN_BYTES)) as b:
        assert _core.RingWriter(b["request"]).write(add_request(1, 3), 5.0)
        assert wait_exit(b["bridge"]) == 1
        assert "ended without a Shutdown" in engine_failed(_core.RingReader(b["event"], 0))
        assert _core.RingReader(b["host"].request_ring, 0).read(0.2) is None  # nothing reached the engine's ring


def test_an_oversized_frame_is_refused_by_both_ends() -> None:
    with frontend_rings() as rings:
        token = secrets.token_hex(TOKEN_BYTES)
        host = EngineHost(token, heartbeat_timeout_s=HEARTBEAT_S)
        host.start(["-c", ECHO], {})
        try:  # towards the engine: a frame longer than its request ring's largest record ends the stream
            with socket.create_connection(("127.0.0.1", host.port)) as sock:
                sock.sendall(bytes.fromhex(token) + struct.pack("<I", host.request_ring.max_record_size + 1))
                wait_done(host, 10.0)
            assert _core.RingReader(host.request_ring, 0).read(0.2) is None
        finally:
            host.close(engine_stop_s=0.5)

        with socket.create_server(("127.0.0.1", 0)) as listener:  # towards the frontend: the same for its event ring
            proc = bridge(listener.getsockname()[1], rings, token)
            conn, _ = listener.accept()
            with conn:
                assert conn.recv(TOKEN_BYTES) == bytes.fromhex(token)
                conn.sendall(struct.pack("<I", rings["event"].max_record_size + 1))
                assert wait_exit(proc) == 1
        assert "exceeds the ring's record limit" in engine_failed(_core.RingReader(rings["event"], 0))


def test_a_silent_peer_ends_the_stream_on_either_side() -> None:
    with frontend_rings() as rings, socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
        proc = bridge(listener.getsockname()[1], rings, secrets.token_hex(TOKEN_BYTES))
        started = time.monotonic()
        assert wait_exit(proc, 10 * HEARTBEAT_S) == 1  # a host that accepts, then never answers
        print(f"\n[bridge] a silent engine host ended the bridge after {time.monotonic() - started:.2f} s")
        assert f"was silent for {HEARTBEAT_S:g} s" in engine_failed(_core.RingReader(rings["event"], 0))
        for sock in accepted:
            sock.close()

    with bridged() as b:
        assert _core.RingWriter(b["request"]).write(add_request(1, 3), 5.0)
        assert read(_core.RingReader(b["event"], 0)) == add_request(1, 3)
        b["bridge"].send_signal(signal.SIGSTOP)  # a frozen frontend side: the connection stays open, silent
        ended_s = wait_done(b["host"], 10 * HEARTBEAT_S)
        print(f"[bridge] a silent bridge ended the engine host's stream after {ended_s:.2f} s")
