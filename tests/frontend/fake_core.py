"""An in-process stand-in for `ringserve._core`'s ring and record API, so EngineClient is tested without the
native extension. Records are JSON bytes; the event ring hands out opaque keys for events the test queued."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any


class RecordError(ValueError):
    pass


class FinishReason(enum.Enum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclass
class RequestOutput:
    request_id: int
    new_token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class StepEvents:
    outputs: list[RequestOutput]
    step_id: int = 0
    emit_time_ns: int = 0


@dataclass
class EngineStats:
    query_id: int
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    block_size: int = 16
    num_steps: int = 0
    num_preemptions: int = 0


@dataclass
class RequestRejected:
    request_id: int
    status_code: int
    message: str


@dataclass
class EngineReady:
    num_total_blocks: int = 10
    block_size: int = 16
    max_model_len: int = 128


@dataclass
class EngineFailed:
    message: str


class AddRequest:
    def __init__(self) -> None:
        self.request_id = 0
        self.prompt_token_ids: list[int] = []
        self.max_tokens = 0
        self.temperature = 1.0
        self.top_p = 1.0
        self.top_k = 0
        self.seed = 0
        self.has_seed = False
        self.ignore_eos = False
        self.stop_token_ids: list[int] = []
        self.min_tokens = 0
        self.min_p = 0.0
        self.repetition_penalty = 1.0
        self.frequency_penalty = 0.0
        self.presence_penalty = 0.0
        self.num_logprobs = 0
        self.cache_salt = 0
        self.priority = 0
        self.arrival_time_ns = 0
        self.trace_id = bytes(16)
        self.span_id = bytes(8)
        self.trace_flags = 0


def encode_add_request(r: AddRequest) -> bytes:
    return json.dumps({"type": "add", **{k: v for k, v in vars(r).items() if not isinstance(v, bytes)}}).encode()


def encode_abort_request(request_id: int) -> bytes:
    return json.dumps({"type": "abort", "request_id": request_id}).encode()


def encode_stats_query(query_id: int) -> bytes:
    return json.dumps({"type": "stats", "query_id": query_id}).encode()


def encode_shutdown() -> bytes:
    return json.dumps({"type": "shutdown"}).encode()


class FakeRing:
    """Request ring: records written (with a capacity in records). Event ring: events queued by the test."""

    def __init__(self, capacity: int = 1000) -> None:
        self.capacity = capacity
        self.records: list[dict[str, Any]] = []
        self.events: dict[bytes, Any] = {}
        self.pending: list[bytes] = []
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)

    def written(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    def push(self, *events: Any) -> None:
        for event in events:
            key = f"evt:{len(self.events)}".encode()
            self.events[key] = event
            self.pending.append(key)
        os.write(self._write_fd, b"x")

    def push_raw(self, raw: bytes) -> None:
        self.pending.append(raw)
        os.write(self._write_fd, b"x")


_ALL_EVENTS: dict[bytes, Any] = {}


class RingWriter:
    def __init__(self, ring: FakeRing) -> None:
        self.ring = ring

    def try_write(self, record: bytes) -> bool:
        if len(self.ring.records) >= self.ring.capacity:
            return False
        self.ring.records.append(json.loads(record))
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
        keys, self.ring.pending = self.ring.pending, []
        _ALL_EVENTS.update(self.ring.events)
        return keys

    def close(self) -> None:
        self.closed = True


def decode_engine_event(raw: bytes) -> Any:
    if raw not in _ALL_EVENTS:
        raise RecordError(f"bad record {raw!r}")
    return _ALL_EVENTS[raw]


class ShmRing:
    @staticmethod
    def attach(name: str) -> FakeRing:
        raise AssertionError("tests pass ring objects")
