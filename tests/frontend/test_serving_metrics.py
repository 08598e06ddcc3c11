"""Prometheus metrics from served requests (scripted engine with engine times) and from engine stats."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from frontend_testkit import CONTEXT_LENGTH, MODEL, Harness, completion_chunks
from observed_engine import TimedEngine
from prometheus_client import generate_latest
from ringserve import _core
from ringserve.frontend.api.server import build_server
from ringserve.frontend.observability.metrics import EngineStatsFeed, ServingMetrics
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb


def value(metrics: ServingMetrics, name: str, **labels: str) -> float:
    sample = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if sample is None else sample


@pytest.fixture
async def served(tiny_tokenizer: ModelTokenizer):
    metrics = ServingMetrics(MODEL)
    engine = TimedEngine(completion_chunks(tiny_tokenizer), cached=2)
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tiny_tokenizer.eos_token_ids, vocab_size=tiny_tokenizer.vocab_size)
    server = build_server(engine, tiny_tokenizer, info, port=0, metrics=metrics)
    await server.start()
    harness = Harness(server, engine, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
    yield harness, metrics
    await harness.channel.close()
    await server.stop(grace=None)


async def test_finished_requests_are_counted_with_their_tokens_and_latencies(served) -> None:
    harness, metrics = served
    generated = 0
    for _ in range(3):
        responses = [r async for r in harness.stub.Generate(pb.GenerateRequest(text="hello world"), timeout=10)]
        generated += sum(len(r.token_ids) for r in responses)
    await asyncio.sleep(0.02)  # samples are taken on the loop just after each RPC
    prompt_len = len(harness.engine.submitted[0][1])
    outputs_per_request = len(harness.engine.chunks)
    assert value(metrics, "ringserve_request_success_total", finished_reason="length", api="ringserve") == 3
    assert value(metrics, "ringserve_prompt_tokens_total") == 3 * prompt_len
    assert value(metrics, "ringserve_generation_tokens_total") == generated
    assert value(metrics, "ringserve_prefix_cache_queries_total") == 3 * prompt_len
    assert value(metrics, "ringserve_prefix_cache_hits_total") == 3 * 2
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time"):  # fmt: skip
        assert value(metrics, f"ringserve_{histogram}_seconds_count") == 3, histogram
    assert value(metrics, "ringserve_inter_token_latency_seconds_count") == 3 * (outputs_per_request - 1)
    # The scripted engine steps every 1 ms: each inter-token gap is in the (0.001, 0.0025] bucket or near it.
    assert value(metrics, "ringserve_inter_token_latency_seconds_sum") > 0
    assert b'ringserve_time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 3.0' in generate_latest(
        metrics.registry)


async def test_rejected_requests_are_counted_by_status_code(served) -> None:
    harness, metrics = served
    with pytest.raises(grpc.aio.AioRpcError):
        bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1.0))
        await harness.stub.Generate(bad, timeout=10).read()
    # A request for a model that is not served is refused before any model's metrics (no label per unknown name).
    with pytest.raises(grpc.aio.AioRpcError):
        await harness.stub.Generate(pb.GenerateRequest(text="hi", model="other"), timeout=10).read()
    await asyncio.sleep(0.02)
    assert value(metrics, "ringserve_request_errors_total", code="INVALID_ARGUMENT", api="ringserve") == 1
    assert value(metrics, "ringserve_request_errors_total", code="NOT_FOUND", api="ringserve") == 0
    assert value(metrics, "ringserve_request_success_total", finished_reason="length", api="ringserve") == 0
    assert value(metrics, "ringserve_prompt_tokens_total") == 0


def stats(**fields: object) -> _core.EngineStats:
    """An EngineStats with these tests' baseline counters, `fields` set over them."""
    baseline = {"num_running": 3, "num_waiting": 2, "num_total_blocks": 100, "num_free_blocks": 75, "num_steps": 10,
                "num_preemptions": 1, "step_time_ns": 0, "kv_usage": 0.25}
    return _core.EngineStats(**{**baseline, **fields})


def test_engine_stats_set_gauges_and_count_only_new_preemptions() -> None:
    metrics = ServingMetrics(MODEL)
    metrics.observe_engine_stats(stats())
    assert value(metrics, "ringserve_num_requests_running") == 3
    assert value(metrics, "ringserve_num_requests_waiting") == 2
    assert value(metrics, "ringserve_kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(metrics, "ringserve_num_preemptions_total") == 0  # what happened before we looked is not ours
    metrics.observe_engine_stats(stats(num_preemptions=4, num_steps=11, step_time_ns=2_000_000))
    metrics.observe_engine_stats(stats(num_preemptions=4, num_steps=11, step_time_ns=2_000_000))
    assert value(metrics, "ringserve_num_preemptions_total") == 3
    assert value(metrics, "ringserve_scheduler_step_time_seconds_count") == 1  # the same step seen twice
    assert value(metrics, "ringserve_scheduler_step_time_seconds_sum") == pytest.approx(0.002)


class PolledEngine:
    failure = None

    def __init__(self) -> None:
        self.queries = 0
        self.listeners = []

    def add_stats_listener(self, callback) -> None:
        self.listeners.append(callback)

    async def get_stats(self, timeout: float = 5.0) -> _core.EngineStats:
        self.queries += 1
        return stats(num_running=self.queries)


async def test_the_feed_polls_only_while_the_engine_pushes_no_stats() -> None:
    metrics = ServingMetrics(MODEL)
    engine = PolledEngine()
    feed = EngineStatsFeed(engine, metrics, interval_s=0.02)
    feed.start()
    try:
        await asyncio.sleep(0.07)
        polled = engine.queries
        assert polled >= 2
        assert value(metrics, "ringserve_num_requests_running") == polled
        for _ in range(6):  # the engine pushes faster than the interval: no queries
            engine.listeners[0](stats(num_running=42))
            await asyncio.sleep(0.01)
        assert engine.queries <= polled + 1
        assert value(metrics, "ringserve_num_requests_running") == 42
    finally:
        await feed.stop()


def test_speculative_decoding_counters_follow_engine_stats() -> None:
    metrics = ServingMetrics(MODEL)
    metrics.observe_engine_stats(stats(spec_verify_rows=5, spec_proposed_tokens=20, spec_accepted_tokens=8))
    assert value(metrics, "ringserve_spec_decode_num_draft_tokens_total") == 0  # before we looked
    metrics.observe_engine_stats(stats(spec_verify_rows=7, spec_proposed_tokens=28, spec_accepted_tokens=14))
    assert value(metrics, "ringserve_spec_decode_num_drafts_total") == 2
    assert value(metrics, "ringserve_spec_decode_num_draft_tokens_total") == 8
    assert value(metrics, "ringserve_spec_decode_num_accepted_tokens_total") == 6
    assert value(metrics, "ringserve_spec_decode_acceptance_rate") == pytest.approx(0.5)
