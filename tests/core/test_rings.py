"""Shared-memory rings through the binding: across processes, into asyncio, and stale-segment cleanup."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from core_testkit import segment_name
from ringserve import _core

pytestmark = pytest.mark.timeout(60)

MakeRing = Callable[..., _core.ShmRing]


def test_writer_and_reader_in_one_process(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=4096)
    writer, reader = _core.RingWriter(ring), _core.RingReader(ring)
    assert reader.try_read() is None
    assert writer.try_write(b"hello") and writer.write(bytearray(b"world"), 1.0)
    assert reader.try_read() == b"hello"
    assert reader.read(1.0) == b"world"
    assert reader.read(0.01) is None


def test_record_larger_than_max_record_size_raises_value_error(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=4096)
    assert ring.max_record_size == 4096 // 2 - 8
    with pytest.raises(ValueError, match="max record size"):
        _core.RingWriter(ring).try_write(bytes(ring.max_record_size + 1))


def test_full_ring_refuses_instead_of_overwriting(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=1024)
    writer = _core.RingWriter(ring)
    written = 0
    while writer.try_write(bytes([written]) * 100):
        written += 1
    assert written == 1024 // 112
    assert not writer.write(bytes(100), 0.01)  # 16 bytes left: a 112-byte frame does not fit
    reader = _core.RingReader(ring)
    assert [reader.try_read() for _ in range(written)] == [bytes([i]) * 100 for i in range(written)]


def test_attach_sees_the_creators_ring_and_missing_names_raise(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=2048, num_readers=2)
    other = _core.ShmRing.attach(ring.name)
    assert (other.name, other.capacity, other.num_readers) == (ring.name, 2048, 2)
    with pytest.raises(FileExistsError):
        _core.ShmRing.create(ring.name, 2048)
    with pytest.raises(FileNotFoundError):
        _core.ShmRing.attach(segment_name("missing"))


def test_a_ring_written_by_another_process(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=4096)
    reader = _core.RingReader(ring)
    count = 2000
    script = (
        "import sys; from ringserve import _core\n"
        "w = _core.RingWriter(_core.ShmRing.attach(sys.argv[1]))\n"
        f"for i in range({count}):\n"
        "    assert w.write(i.to_bytes(4, 'little') * (1 + i % 50), 10.0)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, ring.name])
    received = [reader.read(10.0) for _ in range(count)]
    assert child.wait(timeout=30) == 0
    assert received == [i.to_bytes(4, "little") * (1 + i % 50) for i in range(count)]


def test_notifier_delivers_records_to_asyncio(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=4096)
    count = 500

    def produce() -> None:
        writer = _core.RingWriter(_core.ShmRing.attach(ring.name))
        for i in range(count):
            assert writer.write(i.to_bytes(4, "little"), 10.0)
            if i % 100 == 0:
                time.sleep(0.01)  # let the notifier thread go to sleep on the futex

    async def consume() -> list[bytes]:
        loop = asyncio.get_running_loop()
        notifier = _core.RingNotifier(ring)
        got: list[bytes] = []
        done = loop.create_future()

        def on_readable() -> None:
            got.extend(notifier.drain())
            if len(got) >= count and not done.done():
                done.set_result(None)

        loop.add_reader(notifier.fileno(), on_readable)
        producer = threading.Thread(target=produce)
        producer.start()
        try:
            await asyncio.wait_for(done, 30)
        finally:
            loop.remove_reader(notifier.fileno())
            notifier.close()
            producer.join()
        assert notifier.fileno() == -1
        return got

    got = asyncio.run(consume())
    assert got == [i.to_bytes(4, "little") for i in range(count)]


def test_drain_is_empty_when_nothing_arrived(make_ring: MakeRing) -> None:
    notifier = _core.RingNotifier(make_ring(capacity=1024))
    assert notifier.drain() == []
    notifier.close()
    notifier.close()  # idempotent


def test_stale_segments_of_dead_processes_are_reclaimed(make_ring: MakeRing) -> None:
    live = make_ring(role="req", capacity=1024)
    script = (
        "import os, secrets; from ringserve import _core\n"
        "r = _core.ShmRing.create(f'/ringserve-{os.getpid()}-{secrets.token_hex(8)}-evt', 1024)\n"
        "print(r.name)\n"
    )
    stale = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.exists("/dev/shm" + stale)
    reclaimed = _core.reclaim_stale_segments()
    assert stale in reclaimed
    assert live.name not in reclaimed
    assert not os.path.exists("/dev/shm" + stale)
    assert os.path.exists("/dev/shm" + live.name)
