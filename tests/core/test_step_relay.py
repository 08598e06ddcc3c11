"""The step relay of `--distributed-executor ray` without Ray: the engine's rings on one side, a node's rings on the
other, the engine-side relay as a real process and the node side in this process, over loopback TCP."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ringserve import _core
from ringserve.backend.process import stop_child, stop_children
from ringserve.backend.step_relay import (
    TOKEN_BYTES,
    TOKEN_ENV,
    FrameSender,
    NodeRelay,
    heartbeat,
    recv_frame,
    send_frame,
)
from ringserve.formats.segments import new_segment_name

SHM = Path("/dev/shm")
HEARTBEAT_S = 1.5  # the tests' heartbeat timeout (the default is HEARTBEAT_TIMEOUT_S)


def read(reader: _core.RingReader, timeout_s: float = 10.0) -> bytes:
    record = reader.read(timeout_s)
    assert record is not None, "nothing arrived within the timeout"
    return bytes(record)


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def relayed(holds_rank0: bool = True, token: str | None = None, port: int = 0) -> Iterator[dict]:
    """The engine's step ring (slot 0: a local rank, slot 1: the relay) and result ring, a node relay watching a
    stand-in rank process, and the engine-side relay process connected to it."""
    step = _core.ShmRing.create(new_segment_name("step"), 1 << 20, 2)
    result = _core.ShmRing.create(new_segment_name("res"), 1 << 16, 1)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    node_token = secrets.token_hex(TOKEN_BYTES)
    node = NodeRelay(1, holds_rank0, node_token, heartbeat_timeout_s=HEARTBEAT_S)
    node.watch([rank.pid], accept_timeout_s=30.0)
    command = [
        sys.executable,
        "-m",
        "ringserve.backend.step_relay",
        "--connect",
        f"127.0.0.1:{port or node.port}",
        "--step-ring",
        step.name,
        "--step-reader",
        "1",
        "--result-ring",
        result.name if holds_rank0 else "",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
    ]
    relay = subprocess.Popen(command, env={**os.environ, TOKEN_ENV: token or node_token})
    try:
        yield {"step": step, "result": result, "node": node, "rank": rank, "relay": relay}
    finally:
        for proc in (relay, rank):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        node.close()
        step.unlink()
        result.unlink()


def plan(step_id: int) -> bytes:
    return _core.encode_record(_core.StepPlan(step_id=step_id))


def test_records_cross_unchanged_both_ways_and_a_shutdown_ends_the_relay_cleanly() -> None:
    with relayed() as r:
        node: NodeRelay = r["node"]
        engine_writer, node_reader = _core.RingWriter(r["step"]), _core.RingReader(node.step_ring, 0)
        local_reader = _core.RingReader(r["step"], 0)
        sent = [plan(i) for i in range(50)]
        for record in sent:
            assert engine_writer.write(record, 5.0)
        assert [read(node_reader) for _ in sent] == sent
        assert [read(local_reader) for _ in sent] == sent  # the local rank's slot is untouched by the relay
        assert not (SHM / node.step_ring.name.lstrip("/")).exists(), "the node's ring names outlive the first record"

        results = [
            _core.encode_worker_ready(0, 77),
            *(_core.encode_record(_core.StepResult(step_id=i)) for i in range(5)),
        ]
        node_writer, engine_reader = _core.RingWriter(node.result_ring), _core.RingReader(r["result"], 0)
        for record in results:
            assert node_writer.write(record, 5.0)
        assert [read(engine_reader) for _ in results] == results

        assert engine_writer.write(_core.encode_record(_core.WorkerShutdown()), 5.0)
        assert isinstance(_core.decode_worker_command(read(node_reader)), _core.WorkerShutdown)
        r["rank"].terminate()  # the rank exits after its shutdown, as a worker does
        assert wait_exit(r["relay"]) == 0


def test_a_dead_rank_on_the_node_ends_the_engine_side_relay_with_a_failure() -> None:
    with relayed(holds_rank0=False) as r:
        node_reader = _core.RingReader(r["node"].step_ring, 0)
        assert _core.RingWriter(r["step"]).write(plan(1), 5.0)
        assert read(node_reader) == plan(1)
        r["rank"].kill()
        assert wait_exit(r["relay"]) == 1


def test_an_idle_stream_stays_up_on_heartbeats() -> None:
    with relayed() as r:
        time.sleep(3 * HEARTBEAT_S)  # no records either way: only heartbeats cross
        assert r["relay"].poll() is None and not r["node"].done()
        assert _core.RingWriter(r["step"]).write(plan(1), 5.0)
        assert read(_core.RingReader(r["node"].step_ring, 0)) == plan(1)


def test_a_rank_stopped_on_the_node_ends_the_engine_side_relay_within_the_heartbeat_timeout() -> None:
    with relayed(holds_rank0=False) as r:
        assert _core.RingWriter(r["step"]).write(plan(1), 5.0)
        assert read(_core.RingReader(r["node"].step_ring, 0)) == plan(1)
        r["rank"].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert wait_exit(r["relay"], 10 * HEARTBEAT_S) == 1
        print(f"\n[relay] a stopped rank ended the stream after {time.monotonic() - stopped_at:.2f} s")


def test_a_stopped_rank_is_ended_by_sigterm_when_its_replica_stops() -> None:
    """stop_child continues a stopped (SIGSTOP) child after SIGTERM, so it need not wait for SIGKILL."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    rank.send_signal(signal.SIGSTOP)
    assert stop_child(rank, timeout_s=2.0) == -signal.SIGTERM


def test_the_ranks_of_a_failed_engine_are_stopped_together() -> None:
    """stop_children: one that exits by itself, one stopped, one that ignores SIGTERM; each ends the right way."""
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
    ranks = [subprocess.Popen(["true"]), subprocess.Popen(["sleep", "600"]),
             subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE)]  # fmt: skip
    assert ranks[2].stdout is not None and ranks[2].stdout.readline()  # its handler is set
    ranks[1].send_signal(signal.SIGSTOP)
    assert stop_children(ranks, timeout_s=0.5) == [0, -signal.SIGTERM, -signal.SIGKILL]
    ranks[2].stdout.close()


def test_a_silent_node_ends_the_engine_side_relay_within_the_heartbeat_timeout() -> None:
    """A node whose relay accepts the stream, then sends nothing and never closes it (a frozen or cut-off node)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted: list[socket.socket] = []
        threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
        with relayed(holds_rank0=True, port=listener.getsockname()[1]) as r:
            assert wait_exit(r["relay"], 10 * HEARTBEAT_S) == 1
        for sock in accepted:
            sock.close()


def test_a_silent_engine_side_ends_the_node_relay() -> None:
    with relayed() as r:
        assert _core.RingWriter(r["step"]).write(plan(1), 5.0)
        assert read(_core.RingReader(r["node"].step_ring, 0)) == plan(1)
        r["relay"].send_signal(signal.SIGSTOP)  # frozen: the connection stays open, nothing more is sent
        deadline = time.monotonic() + 10 * HEARTBEAT_S
        while not r["node"].done():
            assert time.monotonic() < deadline, "the node relay still serves a silent stream"
            time.sleep(0.05)


def test_a_connection_without_the_token_is_refused() -> None:
    with relayed(token=secrets.token_hex(TOKEN_BYTES)) as r:
        assert _core.RingWriter(r["step"]).write(plan(1), 5.0)
        assert wait_exit(r["relay"]) == 1
        assert _core.RingReader(r["node"].step_ring, 0).read(0.2) is None


def test_frames_round_trip_and_an_oversized_one_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"abc")
        assert recv_frame(b, 64) == b"abc"
        send_frame(a, b"x" * 100)
        with pytest.raises(ConnectionError, match="exceeds the ring's record limit 64"):
            recv_frame(b, 64)
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"abc")
        a.shutdown(socket.SHUT_WR)
        assert recv_frame(b, 64) == b"abc"
        assert recv_frame(b, 64) is None  # the end of the stream


def test_heartbeats_are_skipped_between_frames_and_their_absence_times_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        stopped = threading.Event()
        sender = FrameSender(a)
        beat = threading.Thread(target=heartbeat, args=(sender, stopped, 0.05))
        beat.start()
        time.sleep(0.1)
        sender.send(b"record")
        stopped.set()
        beat.join()
        b.settimeout(0.3)
        assert recv_frame(b, 64) == b"record"  # the empty frames before it were skipped
        with pytest.raises(TimeoutError):
            recv_frame(b, 64)
