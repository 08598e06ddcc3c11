"""An engine that cannot start its ranks reports why, as the EngineFailed a failing engine loop sends, so the frontend
retries and reports it like any engine failure (docs/distributed.md). No Ray needed: the report and the check of a
cluster address that ray.init would wait on for ever."""

from __future__ import annotations

import socket

import pytest
from ringserve import _core
from ringserve.backend.engine_main import report_start_failure
from ringserve.backend.ray_executor import check_reachable
from ringserve.formats.segments import EVENT_RING_BYTES, new_segment_name


def test_a_start_failure_reaches_the_frontend_as_engine_failed_with_the_reason() -> None:
    ring = _core.ShmRing.create(new_segment_name("evt"), EVENT_RING_BYTES, 1)
    try:
        reason = "--distributed-executor ray: the cluster could not place 3 bundle(s)"
        assert report_start_failure(ring.name, RuntimeError(reason)) == 1
        assert report_start_failure(ring.name, KeyError("rank")) == 1
        reader = _core.RingReader(ring, 0)
        events = [_core.decode_engine_event(bytes(reader.read(5.0))) for _ in range(2)]
        assert all(isinstance(e, _core.EngineFailed) for e in events)
        assert [e.message for e in events] == [reason, "KeyError: 'rank'"]
        assert all(e.reason == _core.FailureReason.LOAD_FAILED for e in events)
    finally:
        ring.unlink()


def test_an_unreachable_cluster_address_is_refused_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(RuntimeError, match=rf"no Ray cluster at 127.0.0.1:{closed}: cannot connect"):
            check_reachable(f"127.0.0.1:{closed}")
    with pytest.raises(RuntimeError, match="expected HOST:PORT"):
        check_reachable("head-node")
    with socket.create_server(("127.0.0.1", 0)) as listening:
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")
    check_reachable("auto")  # left to Ray, as ray:// addresses are
