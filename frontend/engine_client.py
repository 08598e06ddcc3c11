"""The frontend's side of the engine rings: submit requests, route the engine's events to per-request streams.

The request ring is written without ever blocking (a full ring is backpressure the caller sees as
RESOURCE_EXHAUSTED). The event ring is drained by `_core.RingNotifier`'s native thread, which signals an eventfd
that the asyncio loop watches, so the loop never waits on the ring itself.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc

if TYPE_CHECKING:
    from ringserve import _core

log = logging.getLogger(__name__)

# How long an abort or other control record waits before retrying when the request ring is full.
_CONTROL_RETRY_S = 0.005


class EngineError(Exception):
    """A request failure carrying the gRPC status the servicer answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EngineBusyError(EngineError):
    """The request ring is full: the engine is not keeping up."""

    def __init__(self, message: str = "the engine's request queue is full; retry later") -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class EngineUnavailableError(EngineError):
    """The engine failed or the client was closed; every in-flight stream ends with this."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class RequestRejectedError(EngineError):
    """The engine refused one request (e.g. it can never fit in the KV cache)."""


def status_code_from_number(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN


def _default_sampling() -> _core.SamplingParams:
    from ringserve import _core  # the records' defaults (csrc/ringserve/records.h), the one set there is

    return _core.SamplingParams()


@dataclass(frozen=True)
class SamplingOptions:
    """Validated per-request options, as the engine's AddRequest record carries them: `sampling` is the record's
    own `_core.SamplingParams` (every sampling field and its default, declared once in records.h), the rest is
    what the engine does around it. Treat `sampling` as read-only once the options are built (copy to change)."""

    max_tokens: int
    sampling: _core.SamplingParams = field(default_factory=_default_sampling)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower first
    cache_salt: int = 0  # u64 mixed into the first block's prefix hash; 0 = none
    trace_id: bytes = bytes(16)  # zero = no trace context
    span_id: bytes = bytes(8)
    trace_flags: int = 0
    kv: KvTransfer | None = None  # disaggregated prefill/decode

    @property
    def seed(self) -> int | None:
        """The request's seed; None = unseeded."""
        return self.sampling.seed if self.sampling.has_seed else None


@dataclass(frozen=True)
class KvTransfer:
    """How a request uses KV computed on another server (the engine's KvRequestOptions record).

    mode "prefill": run the prompt, sample one token, keep the blocks pinned for `pin_timeout_ms` (the stream yields
    a `_core.KvPinned` before the final output). mode "pull": the prompt's KV is pulled from `remote_block_ids` on
    the source `peer` (packed KvPeerInfos); the stream starts with `first_token_id`, the token the prefill server
    sampled, and ends there when `first_finish` (an engine finish reason name) is not NONE.
    """

    mode: str
    pin_timeout_ms: int = 0
    first_token_id: int = 0
    first_logprob: float = 0.0
    first_finish: str = "NONE"
    remote_block_ids: tuple[int, ...] = ()
    peer: bytes = b""


class TimedOutput:
    """A `RequestOutput` with its step's engine emit time and the time the frontend read it off the event ring.

    Other attributes read through to the output, so consumers treat it as the output itself.
    """

    __slots__ = ("emit_time_ns", "output", "receive_time_ns")

    def __init__(self, output: Any, emit_time_ns: int, receive_time_ns: int) -> None:
        self.output = output
        self.emit_time_ns = emit_time_ns
        self.receive_time_ns = receive_time_ns

    def __getattr__(self, name: str) -> Any:
        return getattr(self.output, name)


class GenerationEngine(Protocol):
    """What the servicer needs from an engine; `EngineClient` is the real one, tests use a scripted fake.

    `generate` yields objects shaped like `_core.RequestOutput` (`new_token_ids`, `logprobs`,
    `finish_reason` with a `.name` of NONE/STOP/LENGTH/ABORT, `num_prompt_tokens`, `num_cached_tokens`).
    """

    @property
    def failure(self) -> str | None: ...

    def allocate_request_id(self) -> int: ...

    def generate(self, request_id: int, prompt_ids: Sequence[int], params: SamplingOptions) -> AsyncIterator[Any]: ...

    async def get_stats(self, timeout: float = 5.0) -> Any: ...

    async def wait_ready(self, timeout: float | None = None) -> Any: ...

    def add_failure_listener(self, callback: Callable[[str], None]) -> None: ...


class EngineClient:
    """Talks to one engine over a request ring (we write) and an event ring (we read).

    Construct with ring names (attached here) or `_core.ShmRing` objects, then call `start()` from inside the
    running event loop (or use `async with`). Request ids are u64s from `allocate_request_id()`.
    """

    def __init__(self, request_ring: Any, event_ring: Any, *, event_reader_index: int = 0, core: Any = None) -> None:
        if core is None:
            # Imported here so the servicer and its tests work without the native extension.
            from ringserve import _core as core
        self._core = core
        self._request_ring = core.ShmRing.attach(request_ring) if isinstance(request_ring, str) else request_ring
        self._event_ring = core.ShmRing.attach(event_ring) if isinstance(event_ring, str) else event_ring
        self._event_reader_index = event_reader_index
        self._writer = core.RingWriter(self._request_ring)
        self._notifier: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._request_ids = itertools.count(1)
        self._query_ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._stats_waiters: dict[int, asyncio.Future[Any]] = {}
        self._ready: Any = None
        self._ready_waiters: list[asyncio.Future[Any]] = []
        self._failure: str | None = None
        self.failure_reason: _core.FailureReason | None = None  # set with `failure`
        self._failure_listeners: list[Callable[[str], None]] = []
        self._stats_listeners: list[Callable[[Any], None]] = []
        # Control records (aborts) must never be dropped: they wait here while the request ring is full.
        self._pending_control: collections.deque[bytes] = collections.deque()
        self._control_retry: asyncio.TimerHandle | None = None
        self.latest_stats: Any = None  # the last unsolicited EngineStats, if the engine sends any

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start consuming the event ring on the running loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._notifier = self._core.RingNotifier(self._event_ring, self._event_reader_index)
        self._loop.add_reader(self._notifier.fileno(), self._on_events_ready)
        self._on_events_ready()  # events that arrived before we watched the fd

    async def close(self, reason: str = "the server is shutting down") -> None:
        """Stop reading events; every stream still open ends with UNAVAILABLE."""
        if self._loop is not None and self._notifier is not None:
            self._loop.remove_reader(self._notifier.fileno())
            self._notifier.close()
            self._notifier = None
        if self._control_retry is not None:
            self._control_retry.cancel()
            self._control_retry = None
        if self._failure is None:
            self.fail(reason, notify=False)

    async def __aenter__(self) -> EngineClient:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def ready(self) -> Any:
        """The engine's EngineReady event, or None until it arrives."""
        return self._ready

    @property
    def failure(self) -> str | None:
        """Why the engine is unusable, or None while it is healthy."""
        return self._failure

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_failure_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs once, on the loop, when the engine fails (EngineFailed or `fail()`)."""
        self._failure_listeners.append(callback)

    def add_stats_listener(self, callback: Callable[[Any], None]) -> None:
        """`callback(stats)` runs on the loop for every EngineStats the engine sends unsolicited."""
        self._stats_listeners.append(callback)

    def fail(self, message: str, reason: _core.FailureReason | None = None, notify: bool = True) -> None:
        """Mark the engine dead (e.g. its process exited): every stream and waiter fails with UNAVAILABLE.
        `reason` (default ENGINE_FAILED) labels the replica's restart."""
        if self._failure is not None:
            return
        self._failure = message
        self.failure_reason = self._core.FailureReason.ENGINE_FAILED if reason is None else reason
        for queue in self._streams.values():
            queue.put_nowait(EngineUnavailableError(f"engine failed: {message}"))
        for future in [*self._stats_waiters.values(), *self._ready_waiters]:
            if not future.done():
                future.set_exception(EngineUnavailableError(f"engine failed: {message}"))
        self._ready_waiters.clear()
        if notify:
            for callback in self._failure_listeners:
                try:
                    callback(message)
                except Exception:
                    log.exception("engine failure listener raised")

    async def wait_ready(self, timeout: float | None = None) -> Any:
        """The engine's EngineReady; raises TimeoutError, or EngineUnavailableError if the engine failed first."""
        if self._ready is not None:
            return self._ready
        self._raise_if_failed()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._ready_waiters.append(future)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the engine did not report ready within {timeout} s") from None
        finally:
            if future in self._ready_waiters:
                self._ready_waiters.remove(future)

    async def shutdown_engine(self, timeout: float = 5.0) -> bool:
        """Ask the engine to exit (Shutdown record); False if the ring stayed full for `timeout` seconds."""
        record = self._core.encode_shutdown()
        deadline = time.monotonic() + timeout
        while not self._writer.try_write(record):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_CONTROL_RETRY_S)
        return True

    # -- requests -------------------------------------------------------------------------------------------

    def allocate_request_id(self) -> int:
        return next(self._request_ids)

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[Any]:
        """Submit the request and yield its `RequestOutput`s until one has a finish reason.

        Stopping early (break, aclose, cancellation) aborts the request in the engine, so its KV blocks are freed.
        """
        self._raise_if_failed()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id} is already in flight")
        kv = params.kv
        first = self._first_output(request_id, prompt_ids, kv) if kv is not None and kv.mode == "pull" else None
        if first is not None and kv is not None and kv.first_finish != "NONE":
            yield first  # the prefill's token ended the request: nothing for the engine to do
            return
        record = self._core.encode_add_request(self._add_request(request_id, prompt_ids, params))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = queue
        submitted = finished = pinned = False
        kv_pinned = self._core.KvPinned
        try:
            options_sent = False
            try:
                if kv is not None:
                    if not self._writer.try_write(self._kv_options(request_id, kv)):
                        raise EngineBusyError()
                    options_sent = True
                written = self._writer.try_write(record)
            except ValueError as exc:  # larger than the ring's largest record
                message = f"the prompt of {len(prompt_ids)} tokens is too large for the request ring: {exc}"
                written = False
                raise EngineError(grpc.StatusCode.INVALID_ARGUMENT, message) from exc
            finally:
                if options_sent and not written:  # the engine holds options for a request that never comes
                    self._send_control(self._core.encode_abort_request(request_id))
            if not written:
                raise EngineBusyError()
            submitted = True
            if first is not None:
                yield first  # at once: the client sees the first token while the KV is being pulled
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, kv_pinned):
                    pinned = True
                    yield item
                    continue
                finished = item.finish_reason.name != "NONE"
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if submitted and not finished and self._failure is None:
                # An abort also frees blocks pinned for this id (a prefill whose caller went away).
                self._send_control(self._core.encode_abort_request(request_id))
            elif pinned and not finished and self._failure is None:
                self._send_control(self._core.encode_release_kv(request_id))

    def release_kv(self, request_id: int) -> None:
        """Free the blocks a prefill-only request left pinned (the decode side has them or gave up)."""
        self._send_control(self._core.encode_release_kv(request_id))

    async def abort(self, request_id: int) -> None:
        """Abort a request by id (its stream then ends with an ABORT output)."""
        self._send_control(self._core.encode_abort_request(request_id))

    async def get_stats(self, timeout: float = 5.0) -> Any:
        """Ask the engine for its counters and wait for the matching EngineStats reply."""
        self._raise_if_failed()
        query_id = next(self._query_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._stats_waiters[query_id] = future
        try:
            if not self._writer.try_write(self._core.encode_stats_query(query_id)):
                raise EngineBusyError()
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine did not answer a stats query within {timeout} s") from None
        finally:
            self._stats_waiters.pop(query_id, None)

    # -- internals ------------------------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineUnavailableError(f"engine failed: {self._failure}")

    def _add_request(self, request_id: int, prompt_ids: Sequence[int], params: SamplingOptions) -> Any:
        record = self._core.AddRequest()
        record.request_id = request_id
        record.prompt_token_ids = list(prompt_ids)
        record.sampling = params.sampling  # the record's own struct, copied whole
        record.max_tokens = params.max_tokens
        record.ignore_eos = params.ignore_eos
        record.stop_token_ids = list(params.stop_token_ids)
        record.priority = params.priority
        record.cache_salt = params.cache_salt
        record.arrival_time_ns = time.time_ns()  # wall clock, comparable with trace timestamps
        record.trace_id = params.trace_id
        record.span_id = params.span_id
        record.trace_flags = params.trace_flags
        return record

    def _kv_options(self, request_id: int, kv: KvTransfer) -> bytes:
        core = self._core
        options = core.KvRequestOptions()
        options.request_id = request_id
        options.mode = core.KvMode.PREFILL_ONLY if kv.mode == "prefill" else core.KvMode.PULL_REMOTE
        options.pin_timeout_ms = kv.pin_timeout_ms
        options.first_token_id = kv.first_token_id
        options.remote_block_ids = list(kv.remote_block_ids)
        options.peer = kv.peer
        return core.encode_kv_request_options(options)

    def _first_output(self, request_id: int, prompt_ids: Sequence[int], kv: KvTransfer) -> TimedOutput:
        """The prefill server's token as this request's first output."""
        output = self._core.RequestOutput()
        output.request_id = request_id
        output.new_token_ids = [kv.first_token_id]
        output.logprobs = [kv.first_logprob]
        output.finish_reason = getattr(self._core.FinishReason, kv.first_finish)
        output.num_prompt_tokens = len(prompt_ids)
        now = time.time_ns()
        return TimedOutput(output, now, now)

    def _send_control(self, record: bytes) -> None:
        # Keep order: once anything is pending, later records queue behind it.
        if not self._pending_control and self._writer.try_write(record):
            return
        self._pending_control.append(record)
        self._schedule_control_retry()

    def _flush_control(self) -> None:
        self._control_retry = None
        while self._pending_control and self._writer.try_write(self._pending_control[0]):
            self._pending_control.popleft()
        if self._pending_control:
            self._schedule_control_retry()

    def _schedule_control_retry(self) -> None:
        if self._control_retry is None and self._loop is not None and self._notifier is not None:
            self._control_retry = self._loop.call_later(_CONTROL_RETRY_S, self._flush_control)

    def _on_events_ready(self) -> None:
        if self._notifier is None:
            return
        batch = self._notifier.drain()
        # One read of the clock per drained batch, after the drain: every event in it was in the ring by then, so no
        # receive time precedes its engine emit time (a read before the drain missed events published meanwhile).
        received_ns = time.time_ns()
        for raw in batch:
            try:
                event = self._core.decode_engine_event(raw)
            except self._core.RecordError as exc:
                # The engine's bug, not ours to crash on: report it and keep serving the other requests.
                log.error("dropping a malformed engine event (%d bytes): %s", len(raw), exc)
                continue
            self._dispatch(event, received_ns)
        if self._pending_control:
            self._flush_control()

    def _dispatch(self, event: Any, received_ns: int = 0) -> None:
        core = self._core
        if isinstance(event, core.StepEvents):
            emit_ns = event.emit_time_ns
            for output in event.outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:  # outputs of streams already closed (e.g. the final ABORT) are dropped
                    queue.put_nowait(TimedOutput(output, emit_ns, received_ns))
        elif isinstance(event, core.RequestRejected):
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(RequestRejectedError(status_code_from_number(event.status_code), event.message))
        elif isinstance(event, core.EngineStats):
            future = self._stats_waiters.get(event.query_id)
            if future is not None and not future.done():
                future.set_result(event)
            elif event.query_id == 0:
                self.latest_stats = event
                for callback in self._stats_listeners:
                    callback(event)
        elif isinstance(event, core.EngineReady):
            self._ready = event
            for future in self._ready_waiters:
                if not future.done():
                    future.set_result(event)
            self._ready_waiters.clear()
        elif isinstance(event, core.KvPinned):
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
            else:  # nobody is left to hand the blocks to a decode server
                self.release_kv(event.request_id)
        elif isinstance(event, core.EngineFailed):
            log.error("engine failed (%s): %s", event.reason.name.lower(), event.message)
            self.fail(event.message, event.reason)
        else:
            log.error("ignoring an unknown engine event %r", type(event).__name__)
