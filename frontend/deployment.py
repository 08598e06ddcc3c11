"""Served models and their engine replicas: what RegisterModel, ScaleWorker and UnregisterModel act on.

A `ModelDeployment` is one served model (its tokenizer, its ModelInfo) with one or more `EngineReplica`s, each an
engine process with its own workers, rings and KV cache (data parallelism). The deployment is the servicer's
`GenerationEngine`: each request goes to the ready replica with the fewest outstanding tokens (prompt tokens not
yet prefilled plus tokens still to generate). The launcher starts every served model as a deployment; the
`ModelCatalog` (frontend/catalog.py) maps names to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
from ringserve import _core
from ringserve.backend.engine_process import EngineProcess
from ringserve.backend.process import child_pids, wait_gone
from ringserve.formats.engine_args import EngineArgs
from ringserve.frontend.catalog import ModelError
from ringserve.frontend.engine_client import EngineClient, EngineError, EngineUnavailableError, SamplingOptions
from ringserve.frontend.restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S, RestartPolicy
from ringserve.frontend.text.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

class EngineReplica:
    """One engine process serving one model: its rings, its process and the client that talks to it. A replica that
    dies is started again on the same EngineArgs by its deployment (`ModelDeployment._restart`)."""

    def __init__(self, index: int, engine_args: EngineArgs, policy: RestartPolicy | None = None, *,
                 log_level: str = "INFO") -> None:  # fmt: skip
        self.index = index
        self._engine_args = engine_args
        self._log_level = log_level
        self.policy = policy or RestartPolicy(DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_WINDOW_S)
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self._watch: asyncio.Task[None] | None = None
        self.outstanding_tokens = 0
        self.state = "STARTING"  # STARTING, READY, RESTARTING, DRAINING, STOPPED, FAILED
        self.ready: Any = None
        self.ready_at: float | None = None  # time.monotonic() of the last EngineReady
        self.restarts = 0
        self.last_failure: str | None = None  # why it last died or failed to start
        self.restart_task: asyncio.Task[None] | None = None  # while it is being started again
        self._worker_pids: list[tuple[int, int]] = []

    @property
    def failure(self) -> str | None:
        return None if self.client is None else self.client.failure

    @property
    def serving(self) -> bool:
        return self.state == "READY" and self.failure is None

    async def start(self, timeout_s: float) -> Any:
        """Start the engine and wait for its EngineReady; on any failure everything started is stopped again."""
        try:
            self.engine = await EngineProcess.start(self._engine_args, log_level=self._log_level)
            self.client = EngineClient(self.engine.request_ring, self.engine.event_ring)
            self.client.start()
            self._watch = asyncio.create_task(self._watch_process(self.engine))
            ready = asyncio.create_task(self.client.wait_ready(timeout_s))
            await asyncio.wait({ready, self._watch}, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"the engine {exit_description(self.engine.poll())} while loading the model (see "
                                 "the server log)")  # fmt: skip
            self.ready = ready.result()
        except BaseException:
            if self.state != "RESTARTING":  # a restart that fails stays RESTARTING: its deployment decides
                self.state = "FAILED"
            await self.stop(0.0)
            raise
        self.state = "READY"
        self.ready_at = time.monotonic()
        self._worker_pids = child_pids(self.engine.pid)
        return self.ready

    async def _watch_process(self, engine: EngineProcess) -> None:
        """Fails the client when the engine process exits (its in-flight streams end UNAVAILABLE)."""
        code = await engine.wait()
        if self.state not in ("STOPPED", "DRAINING") and self.client is not None:
            self.client.fail(f"the engine process of replica {self.index} {exit_description(code)}",
                             _core.FailureReason.ENGINE_DIED)  # fmt: skip
            log.error("engine replica %d %s", self.index, exit_description(code))

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests and wait (up to timeout_s) for the in-flight ones to finish."""
        if self.state == "READY":
            self.state = "DRAINING"
        deadline = time.monotonic() + timeout_s
        # The client keeps no "idle" event; a drain is rare and bounded, so it polls.
        while self.client is not None and self.client.num_in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def stop(self, drain_s: float) -> int | None:
        """Drain, ask the engine to exit, stop the process and remove the rings; wait for the workers of an engine
        that was killed (they follow it through their parent-death signal). Returns the engine's exit code."""
        await self.drain(drain_s)
        self.state = "STOPPED" if self.state not in ("FAILED", "RESTARTING") else self.state
        code: int | None = None
        if self.client is not None:
            if self.client.failure is None and self.engine is not None and self.engine.poll() is None:
                await self.client.shutdown_engine(timeout=5.0)
            await self.client.close(f"model replica {self.index} was stopped")
        if self.engine is not None:
            code = await self.engine.stop(15.0)
            self.engine = None
        if self._worker_pids:
            await asyncio.to_thread(wait_gone, self._worker_pids, 15.0)
            self._worker_pids = []
        if self._watch is not None:
            self._watch.cancel()
        return code


def exit_description(code: int | None) -> str:
    """How a process ended, for messages: 'died (signal 9)' or 'exited with code 1'."""
    if code is None:
        return "is still running"
    return f"died (signal {-code})" if code < 0 else f"exited with code {code}"


def restart_label(reason: _core.FailureReason) -> str:
    """The `reason` label of ringserve_engine_restarts_total: the FailureReason's name in lower case."""
    return reason.name.lower()


@dataclass
class ModelDeployment:
    """One served model: its tokenizer, ModelInfo and engine replicas; the servicer's GenerationEngine.

    A replica whose engine or a worker dies is restarted (its in-flight requests have ended UNAVAILABLE): the old
    one's processes and rings are released, then after its RestartPolicy's backoff it starts again on the same
    EngineArgs. While no replica serves and one is restarting, the model is restarting; once a replica has spent
    its restart budget it is FAILED with the reason.
    """

    name: str
    url: str
    tokenizer: ModelTokenizer
    engine_args: EngineArgs  # resolved for this model (backend.engine_process.resolve_engine_args)
    start_timeout_s: float = 600.0
    log_level: str = "INFO"
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    info: Any = None  # pb.ModelInfo, filled once the first replica is ready
    replicas: list[EngineReplica] = field(default_factory=list)
    _request_ids: Any = field(default_factory=lambda: itertools.count(1))
    _replica_ids: Any = field(default_factory=lambda: itertools.count(0))
    _failure_listeners: list[Callable[[str], None]] = field(default_factory=list)
    _stats_listeners: list[Callable[[Any], None]] = field(default_factory=list)
    _state_listeners: list[Callable[[], None]] = field(default_factory=list)
    _restart_listeners: list[Callable[[str], None]] = field(default_factory=list)
    _restarts: set[asyncio.Task[None]] = field(default_factory=set)
    _stopping: bool = False
    _failed: str | None = None
    _scale_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # -- replicas -------------------------------------------------------------------------------------------

    async def add_replica(self) -> EngineReplica:
        policy = RestartPolicy(self.max_restarts, self.restart_window_s)
        replica = EngineReplica(next(self._replica_ids), self.engine_args, policy, log_level=self.log_level)
        await replica.start(self.start_timeout_s)
        self._wire(replica)
        self.replicas.append(replica)
        self._failed = None
        return replica

    def _wire(self, replica: EngineReplica) -> None:
        """Listen to a freshly started replica's client."""
        client = replica.client
        assert client is not None
        client.add_failure_listener(lambda message: self._on_replica_failure(replica, message, client.failure_reason))
        for listener in self._stats_listeners:
            replica.client.add_stats_listener(listener)

    async def scale(self, count: int, drain_s: float) -> None:
        """Start or stop replicas until `count` are serving or restarting. Scaling down stops replicas being
        restarted first (their restart is cancelled), then the newest serving ones, after draining."""
        if count < 1:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"a model needs at least one worker (got {count}); use "
                                                         "UnregisterModel to remove it")  # fmt: skip
        async with self._scale_lock:
            self.replicas = [r for r in self.replicas if r.state not in ("FAILED", "STOPPED")] or self.replicas
            while len(self.serving_replicas) + len(self._restarting_replicas) < count:
                await self.add_replica()
            # Fewer wanted: replicas being restarted go first (they serve nothing), then the newest serving ones.
            excess = len(self.serving_replicas) + len(self._restarting_replicas) - count
            dropped = self._restarting_replicas[::-1][:max(excess, 0)]
            for replica in dropped:
                if replica.restart_task is not None:
                    replica.restart_task.cancel()
            await asyncio.gather(*(r.restart_task for r in dropped if r.restart_task is not None),
                                 return_exceptions=True)
            for replica in dropped:
                replica.state = "STOPPED"
            surplus = self.serving_replicas[max(count - len(self._restarting_replicas), 0):]
            for replica in surplus:
                replica.state = "DRAINING"  # no new requests from now on
            await asyncio.gather(*(replica.stop(drain_s) for replica in [*dropped, *surplus]))
            self.replicas = [r for r in self.replicas if r not in surplus and r not in dropped]

    async def stop(self, drain_s: float) -> None:
        self._stopping = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        async with self._scale_lock:
            for replica in self.replicas:
                if replica.state == "READY":
                    replica.state = "DRAINING"
                elif replica.state == "RESTARTING":  # its restart was cancelled above
                    replica.state = "STOPPED"
            await asyncio.gather(*(replica.stop(drain_s) for replica in self.replicas))

    @property
    def serving_replicas(self) -> list[EngineReplica]:
        return [r for r in self.replicas if r.serving]

    @property
    def _restarting_replicas(self) -> list[EngineReplica]:
        return [r for r in self.replicas if r.state == "RESTARTING"]

    @property
    def restarting(self) -> bool:
        """No replica serves and at least one is being restarted."""
        return not self.serving_replicas and bool(self._restarting_replicas)

    def add_state_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs when a replica dies, is restarted, serves again or is given up on."""
        self._state_listeners.append(callback)

    def add_restart_listener(self, callback: Callable[[str], None]) -> None:
        """`callback(label)` runs for each restart, `label` the restart_label() of its FailureReason."""
        self._restart_listeners.append(callback)

    def _notify(self, listeners: Sequence[Callable[..., None]], *args: Any) -> None:
        for callback in listeners:
            try:
                callback(*args)
            except Exception:
                log.exception("model %s: listener raised", self.name)

    def _on_replica_failure(self, replica: EngineReplica, message: str, reason: _core.FailureReason) -> None:
        if self._stopping or replica.state != "READY":
            return  # being stopped, drained or restarted already
        log.error("model %s: replica %d failed (%s); %d replica(s) still serving", self.name, replica.index,
                  message, len(self.serving_replicas))  # fmt: skip
        replica.state, replica.last_failure = "RESTARTING", message
        task = asyncio.get_running_loop().create_task(self._restart(replica, message, reason))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        replica.restart_task = task
        self._notify(self._state_listeners)

    async def _restart(self, replica: EngineReplica, message: str, reason: _core.FailureReason) -> None:
        """Release the dead replica, then start it again after the policy's delay until it serves or the policy
        gives up (then it is FAILED with the message)."""
        while True:
            served_s = time.monotonic() - replica.ready_at if replica.ready_at is not None else 0.0
            replica.ready_at = None
            delay = replica.policy.failed(time.monotonic(), served_s)
            if delay is None:
                self._give_up(replica, message)
                await replica.stop(0.0)
                return
            await replica.stop(0.0)  # client closed, engine reaped, rings removed, workers gone
            replica.state, replica.last_failure = "RESTARTING", message
            log.warning("model %s: restarting replica %d in %.0f s (%s; restart %d of at most %d within %.0f s)",
                        self.name, replica.index, delay, message, replica.policy.restarts_in_window,
                        self.max_restarts, self.restart_window_s)  # fmt: skip
            self._notify(self._restart_listeners, restart_label(reason))
            self._notify(self._state_listeners)
            await asyncio.sleep(delay)
            replica.restarts += 1
            reason = _core.FailureReason.LOAD_FAILED  # what the next restart counts as, if this start fails
            try:
                await replica.start(self.start_timeout_s)
            except (ModelError, EngineError) as error:
                message = f"load failed: {error.message}"
            except (OSError, TimeoutError, ValueError) as error:
                message = f"load failed: {error}"
            else:
                replica.last_failure = None
                self._wire(replica)
                log.info("model %s: replica %d is serving again (restart %d)", self.name, replica.index,
                         replica.restarts)  # fmt: skip
                self._notify(self._state_listeners)
                return
            log.error("model %s: replica %d did not start again: %s", self.name, replica.index, message)

    def _give_up(self, replica: EngineReplica, message: str) -> None:
        replica.state = "FAILED"
        replica.last_failure = (f"{message} (gave up after {replica.policy.restarts_in_window} restart(s) within "
                                f"{self.restart_window_s:g} s; --max-restarts {self.max_restarts})")  # fmt: skip
        log.error("model %s: replica %d is FAILED: %s", self.name, replica.index, replica.last_failure)
        if not self.serving_replicas and not self._restarting_replicas:
            self._failed = replica.last_failure
            self._notify(self._failure_listeners, replica.last_failure)
        self._notify(self._state_listeners)

    def describe_replicas(self) -> list[dict[str, Any]]:
        return [{"id": f"engine-{r.index}", "status": r.state if r.failure is None or r.state != "READY" else "FAILED",
                 "pid": r.engine.pid if r.engine is not None else None, "restarts": r.restarts,
                 "lastFailure": r.last_failure or "",
                 "outstandingTokens": r.outstanding_tokens} for r in self.replicas]  # fmt: skip

    # -- GenerationEngine -----------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        if self.serving_replicas:
            return None
        if restarting := self._restarting_replicas:
            return f"it is restarting after its engine failed ({restarting[0].last_failure}); retry shortly"
        return self._failed or "no engine replica of this model is serving"

    @property
    def failure_reason(self) -> str | None:
        """Why the model is FAILED (its replicas spent their restart budget), else None."""
        return None if self.serving_replicas or self._restarting_replicas else self._failed

    def allocate_request_id(self) -> int:
        return next(self._request_ids)

    def add_failure_listener(self, callback: Callable[[str], None]) -> None:
        self._failure_listeners.append(callback)

    def add_stats_listener(self, callback: Callable[[Any], None]) -> None:
        self._stats_listeners.append(callback)
        for replica in self.replicas:
            if replica.client is not None:
                replica.client.add_stats_listener(callback)

    async def wait_ready(self, timeout: float | None = None) -> Any:
        replicas = self.serving_replicas
        if not replicas:
            raise EngineUnavailableError(self.failure or "not ready")
        return replicas[0].ready

    def _pick(self) -> EngineReplica:
        replicas = self.serving_replicas
        if not replicas:
            raise EngineUnavailableError(f"model {self.name!r}: {self.failure}")
        return min(replicas, key=lambda r: r.outstanding_tokens)

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[Any]:  # fmt: skip
        replica = self._pick()
        assert replica.client is not None
        # Outstanding work: the prompt still to prefill plus the tokens still to generate.
        outstanding = len(prompt_ids) + params.max_tokens
        replica.outstanding_tokens += outstanding
        try:
            # aclosing: when our caller stops early, the replica's stream is closed now, which aborts the request in
            # its engine (an unclosed async generator would only be finalized later by the garbage collector).
            async with contextlib.aclosing(replica.client.generate(request_id, prompt_ids, params)) as stream:
                async for output in stream:
                    if outstanding > params.max_tokens and output.num_scheduled_tokens:  # prefill progress
                        done = min(outstanding - params.max_tokens, output.num_scheduled_tokens)
                        outstanding -= done
                        replica.outstanding_tokens -= done
                    generated = len(output.new_token_ids)
                    if generated:
                        step = min(generated, outstanding)
                        outstanding -= step
                        replica.outstanding_tokens -= step
                    yield output
        finally:
            replica.outstanding_tokens -= outstanding

    async def get_stats(self, timeout: float = 5.0) -> Any:
        """Every serving replica's EngineStats, summed (KV usage averaged)."""
        replicas = self.serving_replicas
        if not replicas:
            raise EngineUnavailableError(f"model {self.name!r}: {self.failure}")
        stats = await asyncio.gather(*(r.client.get_stats(timeout) for r in replicas if r.client is not None))
        return combine_stats(stats)


_SUMMED_STATS = ("num_running", "num_waiting", "num_total_blocks", "num_free_blocks", "num_steps",
                 "num_preemptions", "num_scheduled_tokens", "prefix_cache_queries", "prefix_cache_hits",
                 "total_prompt_tokens", "total_generation_tokens", "spec_proposed_tokens", "spec_accepted_tokens",
                 "spec_verify_rows")  # fmt: skip


def combine_stats(stats: Sequence[Any]) -> Any:
    if len(stats) == 1:
        return stats[0]
    combined = SimpleNamespace(**{name: sum(getattr(s, name) for s in stats) for name in _SUMMED_STATS})
    combined.query_id = 0
    combined.block_size = stats[0].block_size
    combined.step_time_ns = max(s.step_time_ns for s in stats)
    combined.kv_usage = sum(s.kv_usage for s in stats) / len(stats)
    return combined
