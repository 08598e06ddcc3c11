"""In-process stand-ins for `ringserve._core`'s rings (no shared memory), carrying the real records' bytes.

`core_with_fake_rings()` is the real `_core` module with its ring classes swapped for these, so EngineClient is tested
against the real records, encoders and decoders.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from ringserve import _core


class FakeRing:
    """Request ring: records written (with a capacity in records). Event ring: records queued by the test."""

    def __init__(self, capacity: int = 1000) -> None:
        self.capacity = capacity
        self.records: list[bytes] = []
        self.pending: list[bytes] = []
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)

    def written(self, kind: type) -> list[Any]:
        """The records of class `kind` (e.g. `_core.AbortRequest`) written so far, decoded."""
        decoded = (_core.decode_request_record(r) for r in self.records)
        return [r for r in decoded if isinstance(r, kind)]

    def push(self, *events: Any) -> None:
        self.pending.extend(bytes(_core.encode_record(e)) for e in events)
        os.write(self._write_fd, b"x")

    def push_raw(self, raw: bytes) -> None:
        self.pending.append(raw)
        os.write(self._write_fd, b"x")


class RingWriter:
    def __init__(self, ring: FakeRing) -> None:
        self.ring = ring

    def try_write(self, record: bytes) -> bool:
        if len(self.ring.records) >= self.ring.capacity:
            return False
        self.ring.records.append(bytes(record))
        return True


class RingNotifier:
    def __init__(self, ring: FakeRing, reader_index: int = 0) -> None:
        self.ring = ring
        self.closed = False

    def fileno(self) -> int:
        return self.ring._read_fd

    def drain(self) -> list[bytes]:
        try:
            os.read(self.ring._read_fd, 4096)
        except BlockingIOError:
            pass
        records, self.ring.pending = self.ring.pending, []
        return records

    def close(self) -> None:
        self.closed = True


class ShmRing:
    @staticmethod
    def attach(name: str) -> FakeRing:
        raise AssertionError("tests pass ring objects")


def core_with_fake_rings() -> Any:
    names = {name: getattr(_core, name) for name in dir(_core) if not name.startswith("__")}
    return SimpleNamespace(**{**names, "RingWriter": RingWriter, "RingNotifier": RingNotifier, "ShmRing": ShmRing})


def record(cls: type, **fields: Any) -> Any:
    """A `_core` record of class `cls` with the given fields set."""
    r = cls()
    for name, value in fields.items():
        setattr(r, name, value)
    return r
