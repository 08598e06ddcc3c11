"""Prometheus metrics: request latencies from RequestTimelines, engine gauges and counters from EngineStats.

Every name starts with `ringserve_` and carries a `model_name` label; the request counters also carry `api`, the
front door the request came through (`ringserve`, `openai`, ...). With several frontend processes, set
PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode) and every process's samples are summed on scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from ringserve import _core
from ringserve.frontend.observability.timeline import RequestTimeline

log = logging.getLogger(__name__)

# Buckets in seconds, close to vLLM's so dashboards carry over.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)  # fmt: skip
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0)  # fmt: skip
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_NS = 1e-9


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class _MetricFamilies:
    """The metric families of one registry; every served model binds its own `model_name` children."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        r = registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        self.ttft = histogram("ringserve_time_to_first_token_seconds",
                              "From the RPC's arrival to the engine emitting its first token.", _TTFT_BUCKETS)
        self.itl = histogram("ringserve_inter_token_latency_seconds",
                             "Engine time between consecutive outputs of one request.", _ITL_BUCKETS)
        self.e2e = histogram("ringserve_e2e_request_latency_seconds",
                             "From the RPC's arrival to its last response.", _REQUEST_BUCKETS)
        self.queue = histogram("ringserve_request_queue_time_seconds",
                               "Engine arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram("ringserve_request_prefill_time_seconds",
                                 "First scheduled to first token.", _REQUEST_BUCKETS)
        self.decode = histogram("ringserve_request_decode_time_seconds",
                                "First token to last token.", _REQUEST_BUCKETS)
        self.step_time = histogram("ringserve_scheduler_step_time_seconds",
                                   "Engine step time (schedule, plan, forward, update), sampled from engine stats.",
                                   _STEP_BUCKETS)  # fmt: skip
        self.running = gauge("ringserve_num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("ringserve_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("ringserve_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.prompt_tokens = counter("ringserve_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("ringserve_generation_tokens", "Generated tokens of finished requests.")
        self.prefix_queries = counter("ringserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("ringserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("ringserve_num_preemptions", "Requests preempted by the engine (recompute).")
        self.spec_drafts = counter("ringserve_spec_decode_num_drafts",
                                   "Request-steps that verified speculative draft tokens.")
        self.spec_draft_tokens = counter("ringserve_spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("ringserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_acceptance = gauge("ringserve_spec_decode_acceptance_rate",
                                     "Accepted / verified draft tokens since the engine started (0 before any).")
        self.success = Counter("ringserve_request_success", "Finished requests by finish reason and API.",
                               ["model_name", "finished_reason", "api"], registry=r)
        self.errors = Counter("ringserve_request_errors", "Failed requests by gRPC status code and API.",
                              ["model_name", "code", "api"], registry=r)
        reasons = ", ".join(name.lower() for name in _core.FailureReason.__members__)
        self.engine_restarts = Counter("ringserve_engine_restarts",
                                       "Engine replicas started again after their engine or a worker failed, or after "
                                       f"a restart failed to load (reason: {reasons}).", ["model_name", "reason"],
                                       registry=r)  # fmt: skip


class ServingMetrics:
    """The frontend's metrics for one served model; `for_model` gives another model's, in the same registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 families: _MetricFamilies | None = None) -> None:  # fmt: skip
        self.model_name = model_name
        if families is None:
            self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
            families = _MetricFamilies(self.registry)
        else:
            self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._families = families
        f = families
        self.ttft = f.ttft.labels(model_name)
        self.itl = f.itl.labels(model_name)
        self.e2e = f.e2e.labels(model_name)
        self.queue = f.queue.labels(model_name)
        self.prefill = f.prefill.labels(model_name)
        self.decode = f.decode.labels(model_name)
        self.step_time = f.step_time.labels(model_name)
        self.running = f.running.labels(model_name)
        self.waiting = f.waiting.labels(model_name)
        self.kv_usage = f.kv_usage.labels(model_name)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.prefix_queries = f.prefix_queries.labels(model_name)
        self.prefix_hits = f.prefix_hits.labels(model_name)
        self.preemptions = f.preemptions.labels(model_name)
        self.spec_drafts = f.spec_drafts.labels(model_name)
        self.spec_draft_tokens = f.spec_draft_tokens.labels(model_name)
        self.spec_accepted_tokens = f.spec_accepted_tokens.labels(model_name)
        self.spec_acceptance = f.spec_acceptance.labels(model_name)
        self._last_spec: tuple[int, int, int] | None = None
        self._success = f.success
        self._errors = f.errors
        self._success_by_reason: dict[tuple[str, str], Any] = {}
        self._error_codes: set[tuple[str, str]] = set()
        self._engine_restarts = f.engine_restarts
        self._restart_reasons: set[str] = set()
        self._last_preemptions: int | None = None
        self._last_num_steps: int | None = None

    def for_model(self, model_name: str) -> ServingMetrics:
        """Metrics of another served model, exported by the same registry (and /metrics endpoint)."""
        return ServingMetrics(model_name, self.registry, self._families)

    def remove(self) -> None:
        """Drop this model's series (it was unregistered), so /metrics stops reporting stale values."""
        f = self._families
        for family in (f.ttft, f.itl, f.e2e, f.queue, f.prefill, f.decode, f.step_time, f.running, f.waiting,
                       f.kv_usage, f.prompt_tokens, f.generation_tokens, f.prefix_queries, f.prefix_hits,
                       f.preemptions, f.spec_drafts, f.spec_draft_tokens, f.spec_accepted_tokens,
                       f.spec_acceptance):  # fmt: skip
            with contextlib.suppress(KeyError):
                family.remove(self.model_name)
        for reason, api in self._success_by_reason:
            with contextlib.suppress(KeyError):
                f.success.remove(self.model_name, reason, api)
        for code, api in self._error_codes:
            with contextlib.suppress(KeyError):
                f.errors.remove(self.model_name, code, api)
        for reason in self._restart_reasons:
            with contextlib.suppress(KeyError):
                f.engine_restarts.remove(self.model_name, reason)

    def observe_engine_restart(self, reason: str) -> None:
        """An engine replica of this model is being restarted (`reason`: deployment.restart_label's label)."""
        self._restart_reasons.add(reason)
        self._engine_restarts.labels(self.model_name, reason).inc()

    # -- per request ----------------------------------------------------------------------------------------

    def observe_request(self, t: RequestTimeline) -> None:
        """Samples of one finished RPC (call after `t.finish()`)."""
        if t.error_code is not None:
            self._error_codes.add((t.error_code.name, t.api))
            self._errors.labels(self.model_name, t.error_code.name, t.api).inc()
        elif t.finish_reason:
            key = (t.finish_reason, t.api)
            counter = self._success_by_reason.get(key)
            if counter is None:
                counter = self._success_by_reason[key] = self._success.labels(self.model_name, *key)
            counter.inc()
        if t.prompt_tokens and t.params is not None:  # reached the engine
            self.prompt_tokens.inc(t.prompt_tokens)
        if t.completion_tokens:
            self.generation_tokens.inc(t.completion_tokens)
        if t.first_scheduled_ns:  # the engine looked the prompt up in its prefix cache
            self.prefix_queries.inc(t.prompt_tokens)
            self.prefix_hits.inc(t.num_cached_tokens)
        if t.first_token_ns:
            self.ttft.observe(max(t.first_token_ns - t.rpc_start_ns, 0) * _NS)
            self.decode.observe(max(t.last_emit_ns - t.first_token_ns, 0) * _NS)
        if t.engine_arrival_ns and t.first_scheduled_ns:
            self.queue.observe(max(t.first_scheduled_ns - t.engine_arrival_ns, 0) * _NS)
        if t.first_scheduled_ns and t.first_token_ns:
            self.prefill.observe(max(t.first_token_ns - t.first_scheduled_ns, 0) * _NS)
        emits = t.emit_ns
        for previous, current in itertools.pairwise(emits):
            self.itl.observe(max(current - previous, 0) * _NS)
        if t.end_ns and t.error_code is None:  # latency of served requests, as vLLM counts it
            self.e2e.observe(max(t.end_ns - t.rpc_start_ns, 0) * _NS)

    # -- engine ---------------------------------------------------------------------------------------------

    def observe_engine_stats(self, stats: Any) -> None:
        """Gauges from one EngineStats; counters and the step-time sample only from what changed since the last."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        if self._last_preemptions is not None and stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        spec = (stats.spec_verify_rows, stats.spec_proposed_tokens, stats.spec_accepted_tokens)
        if self._last_spec is not None:
            for metric, now, before in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens),
                                           spec, self._last_spec, strict=True):  # fmt: skip
                if now > before:
                    metric.inc(now - before)
        self._last_spec = spec
        if spec[1]:
            self.spec_acceptance.set(spec[2] / spec[1])
        step_time_ns = stats.step_time_ns
        if step_time_ns and stats.num_steps != self._last_num_steps:
            self.step_time.observe(step_time_ns * _NS)
        self._last_num_steps = stats.num_steps


class EngineStatsFeed:
    """Keeps the engine gauges current: uses the stats the engine pushes, and asks for them when none came lately."""

    def __init__(self, engine: Any, metrics: ServingMetrics, interval_s: float = 1.0) -> None:
        self._engine = engine
        self._metrics = metrics
        self._interval_s = interval_s
        self._pushed = False
        self._task: asyncio.Task[None] | None = None
        engine.add_stats_listener(self._on_pushed)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_pushed(self, stats: Any) -> None:
        self._pushed = True
        self._metrics.observe_engine_stats(stats)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if self._pushed:  # the engine reported on its own within the last interval
                self._pushed = False
                continue
            if self._engine.failure is not None:  # dead or restarting: ask again once it serves
                continue
            try:
                self._metrics.observe_engine_stats(await self._engine.get_stats(timeout=self._interval_s * 5))
            except Exception as exc:  # a slow or busy engine: try again next interval
                log.debug("engine stats query failed: %s", exc)


def serve_metrics(metrics: ServingMetrics, host: str, port: int) -> Any:
    """Serve /metrics over HTTP on a daemon thread; returns the http server (call `.shutdown()` to stop)."""
    registry = metrics.registry
    if _multiprocess():
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server

