"""Shared-memory rings through the binding: across processes, into asyncio, GIL release, zero-copy record views and
stale-segment cleanup."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
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


def plan_record() -> bytes:
    new = _core.NewRequestData()
    new.slot, new.token_ids, new.block_ids, new.num_prompt_tokens = 4, np.arange(100, 164, dtype=np.int32), [7, 8], 64
    append = _core.BlockAppend()
    append.slot, append.block_ids = 1, [9, 10, 11]
    plan = _core.StepPlan()
    plan.step_id, plan.new_requests, plan.block_appends = 3, [new], [append]
    plan.sched_slots, plan.sched_start, plan.sched_len, plan.sched_sample = [1, 4], [20, 0], [1, 64], [True, True]
    plan.finished_slots = [2]
    return bytes(_core.encode_record(plan))


def test_a_step_plan_off_the_ring_is_decoded_as_read_only_views_of_the_record(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=4096)
    assert _core.RingWriter(ring).try_write(plan_record())
    record = _core.RingReader(ring).try_read()
    assert isinstance(record, bytes)
    plan = _core.decode_worker_command(record)
    (new,), (append,) = plan.new_requests, plan.block_appends
    record_memory = np.frombuffer(record, np.uint8)
    arrays = [new.token_ids, new.block_ids, new.suppress_token_ids, append.block_ids, plan.sched_slots,
              plan.sched_start, plan.sched_len, plan.sched_sample, plan.finished_slots]  # fmt: skip
    for array in arrays:
        assert array.base is record  # no copy: the array's memory is the record's, and it keeps the record alive
        assert not array.flags.writeable
    for array in arrays[:2] + arrays[3:]:  # (an empty array occupies no memory to share)
        assert np.shares_memory(array, record_memory)
    assert new.token_ids.tolist() == list(range(100, 164)) and append.block_ids.tolist() == [9, 10, 11]
    assert plan.sched_sample.dtype == np.bool_ and plan.sched_sample.tolist() == [True, True]
    with pytest.raises(ValueError, match="read-only"):
        new.token_ids[0] = 1


def test_views_of_a_mutable_buffer_pin_it_until_the_plan_is_gone() -> None:
    buffer = bytearray(plan_record())
    plan = _core.decode_worker_command(buffer)
    assert np.shares_memory(plan.sched_len, np.frombuffer(buffer, np.uint8))
    with pytest.raises(BufferError):
        buffer.extend(b"12345678")  # a resize would move the bytes out from under the views
    del plan
    buffer.extend(b"12345678")


def test_a_plan_built_in_python_owns_writable_arrays() -> None:
    plan = _core.StepPlan()
    plan.sched_slots, plan.sched_start, plan.sched_len, plan.sched_sample = [5, 6], [0, 0], [1, 1], [False, True]
    assert plan.sched_slots.dtype == np.int32 and plan.sched_slots.flags.writeable
    assert _core.decode_worker_command(_core.encode_record(plan)).sched_slots.tolist() == [5, 6]


def test_a_blocked_read_lets_other_python_threads_run(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=1024)
    reader, writer = _core.RingReader(ring), _core.RingWriter(ring)
    got: list[bytes | None] = []
    waiting = threading.Thread(target=lambda: got.append(reader.read(30.0)))
    waiting.start()
    time.sleep(0.1)  # the thread is now asleep inside read(); with the GIL held this line would not run until then
    assert writer.try_write(b"wake up")
    waiting.join(timeout=30)
    assert got == [b"wake up"]


def test_a_blocked_write_lets_other_python_threads_run(make_ring: MakeRing) -> None:
    ring = make_ring(capacity=1024)
    reader, writer = _core.RingReader(ring), _core.RingWriter(ring)
    while writer.try_write(bytes(100)):
        pass
    accepted: list[bool] = []
    waiting = threading.Thread(target=lambda: accepted.append(writer.write(b"last", 30.0)))
    waiting.start()
    time.sleep(0.1)  # the thread is now waiting inside write(); with the GIL held this line would not run until then
    assert reader.try_read() == bytes(100)  # frees room while the writer thread waits without the GIL
    waiting.join(timeout=30)
    assert accepted == [True]
