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
from ringserve.backend.engine_process import EngineProcess
from ringserve.formats.engine_args import EngineArgs
from ringserve.frontend.catalog import ModelError
from ringserve.frontend.engine_client import EngineClient, EngineUnavailableError, SamplingOptions
from ringserve.frontend.text.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

class EngineReplica:
    """One engine process serving one model: its rings, its process and the client that talks to it."""

    def __init__(self, index: int, engine_args: EngineArgs, *, log_level: str = "INFO") -> None:
        self.index = index
        self._engine_args = engine_args
        self._log_level = log_level
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self._watch: asyncio.Task[None] | None = None
        self.outstanding_tokens = 0
        self.state = "STARTING"  # STARTING, READY, DRAINING, STOPPED, FAILED
        self.ready: Any = None

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
                                 f"the engine exited with code {self.engine.poll()} while loading the model (see the "
                                 "server log)")  # fmt: skip
            self.ready = ready.result()
        except BaseException:
            self.state = "FAILED"
            await self.stop(0.0)
            raise
        self.state = "READY"
        return self.ready

    async def _watch_process(self, engine: EngineProcess) -> None:
        """Fails the client when the engine process exits."""
        code = await engine.wait()
        if self.state not in ("STOPPED", "DRAINING") and self.client is not None:
            self.state = "FAILED"
            self.client.fail(f"the engine process of replica {self.index} exited with code {code}")
            log.error("engine replica %d exited with code %s", self.index, code)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests and wait (up to timeout_s) for the in-flight ones to finish."""
        if self.state == "READY":
            self.state = "DRAINING"
        deadline = time.monotonic() + timeout_s
        # The client keeps no "idle" event; a drain is rare and bounded, so it polls.
        while self.client is not None and self.client.num_in_flight and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def stop(self, drain_s: float) -> int | None:
        """Drain, ask the engine to exit, stop the process and remove the rings. Returns the exit code."""
        await self.drain(drain_s)
        self.state = "STOPPED" if self.state != "FAILED" else "FAILED"
        code: int | None = None
        if self.client is not None:
            if self.client.failure is None and self.engine is not None and self.engine.poll() is None:
                await self.client.shutdown_engine(timeout=5.0)
            await self.client.close(f"model replica {self.index} was stopped")
        if self.engine is not None:
            code = await self.engine.stop(15.0)
            self.engine = None
        if self._watch is not None:
            self._watch.cancel()
        return code


@dataclass
class ModelDeployment:
    """One served model: its tokenizer, ModelInfo and engine replicas; the servicer's GenerationEngine."""

    name: str
    url: str
    tokenizer: ModelTokenizer
    engine_args: EngineArgs  # resolved for this model (backend.engine_process.resolve_engine_args)
    start_timeout_s: float = 600.0
    log_level: str = "INFO"
    info: Any = None  # pb.ModelInfo, filled once the first replica is ready
    replicas: list[EngineReplica] = field(default_factory=list)
    _request_ids: Any = field(default_factory=lambda: itertools.count(1))
    _replica_ids: Any = field(default_factory=lambda: itertools.count(0))
    _failure_listeners: list[Callable[[str], None]] = field(default_factory=list)
    _stats_listeners: list[Callable[[Any], None]] = field(default_factory=list)
    _failed: str | None = None
    _scale_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # -- replicas -------------------------------------------------------------------------------------------

    async def add_replica(self) -> EngineReplica:
        replica = EngineReplica(next(self._replica_ids), self.engine_args, log_level=self.log_level)
        await replica.start(self.start_timeout_s)
        assert replica.client is not None
        replica.client.add_failure_listener(lambda message: self._on_replica_failure(replica, message))
        for listener in self._stats_listeners:
            replica.client.add_stats_listener(listener)
        self.replicas.append(replica)
        self._failed = None
        return replica

    async def scale(self, count: int, drain_s: float) -> None:
        """Start or stop replicas until `count` are serving; the newest are stopped first, after draining."""
        if count < 1:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"a model needs at least one worker (got {count}); use "
                                                         "UnregisterModel to remove it")  # fmt: skip
        async with self._scale_lock:
            self.replicas = [r for r in self.replicas if r.state not in ("FAILED", "STOPPED")] or self.replicas
            while len(self.serving_replicas) < count:
                await self.add_replica()
            surplus = self.serving_replicas[count:]
            for replica in surplus:
                replica.state = "DRAINING"  # no new requests from now on
            await asyncio.gather(*(replica.stop(drain_s) for replica in surplus))
            self.replicas = [r for r in self.replicas if r not in surplus]

    async def stop(self, drain_s: float) -> None:
        async with self._scale_lock:
            for replica in self.replicas:
                if replica.state == "READY":
                    replica.state = "DRAINING"
            await asyncio.gather(*(replica.stop(drain_s) for replica in self.replicas))

    @property
    def serving_replicas(self) -> list[EngineReplica]:
        return [r for r in self.replicas if r.serving]

    def _on_replica_failure(self, replica: EngineReplica, message: str) -> None:
        if self.serving_replicas or self._failed is not None:
            log.error("model %s: replica %d failed (%s); %d replica(s) still serving", self.name, replica.index,
                      message, len(self.serving_replicas))  # fmt: skip
            return
        self._failed = message
        for callback in self._failure_listeners:
            try:
                callback(message)
            except Exception:
                log.exception("model failure listener raised")

    def describe_replicas(self) -> list[dict[str, Any]]:
        return [{"id": f"engine-{r.index}", "status": r.state if r.failure is None else "FAILED",
                 "pid": r.engine.pid if r.engine is not None else None,
                 "outstandingTokens": r.outstanding_tokens} for r in self.replicas]  # fmt: skip

    # -- GenerationEngine -----------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        if self.serving_replicas:
            return None
        return self._failed or "no engine replica of this model is serving"

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
