"""Fixtures for the ringserve._core binding tests: uniquely named rings that are always unlinked."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from core_testkit import segment_name
from ringserve import _core


@pytest.fixture
def make_ring() -> Iterator[Callable[..., _core.ShmRing]]:
    created: list[_core.ShmRing] = []

    def make(role: str = "test", capacity: int = 1 << 16, num_readers: int = 1) -> _core.ShmRing:
        ring = _core.ShmRing.create(segment_name(role), capacity, num_readers)
        created.append(ring)
        return ring

    yield make
    for ring in created:
        ring.unlink()
