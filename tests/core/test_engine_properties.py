"""Property tests of the whole C++ engine loop through the binding: real shared-memory rings, Engine.run() in a
thread and the fake worker of test_engine.py (it samples last token + 1, so every output is known in advance).

Random arrivals, prompt lengths with shared prefixes, priorities (with and without aging), aborts and pool sizes;
every accepted request must finish exactly once with exactly its expected tokens, no step may exceed its budgets, and
once the workload drained every block is free again (cached blocks count as free) while the engine reports nothing
running or waiting.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ringserve import _core
from test_engine import BLOCK_SIZE, Frontend, make_config

pytestmark = pytest.mark.timeout(120)

SHARED = [1000 + i for i in range(64)]

request_strategy = st.fixed_dictionaries({
    "prefix_len": st.integers(0, 64),
    "tail_len": st.integers(1, 40),
    "max_tokens": st.integers(1, 30),
    "priority": st.integers(0, 2),
    "delay_ms": st.sampled_from([0, 0, 1, 3]),
    "abort": st.booleans(),
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(8, 48),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(16, 96),
    caching=st.booleans(),
    aging_ms=st.sampled_from([0, 1]),
    requests=st.lists(request_strategy, min_size=1, max_size=10),
)
def test_engine_finishes_every_request_exactly_once_with_its_tokens(num_blocks: int, max_num_seqs: int, budget: int,
                                                                    caching: bool, aging_ms: int,
                                                                    requests: list[dict]) -> None:
    config = make_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_caching=caching,
                         stats_interval_ms=5, priority_aging_ms=aging_ms)
    f = Frontend(config, num_blocks, [], 0.0)
    try:
        f.start()
        expected: dict[int, list[int]] = {}
        for rid, spec in enumerate(requests, start=1):
            tail_start = 5000 + 100 * rid
            prompt = SHARED[: spec["prefix_len"]] + list(range(tail_start, tail_start + spec["tail_len"]))
            f.add(rid, prompt, spec["max_tokens"], priority=spec["priority"])
            if len(prompt) + spec["max_tokens"] <= num_blocks * BLOCK_SIZE:
                expected[rid] = [prompt[-1] + 1 + i for i in range(spec["max_tokens"])]
            if spec["abort"]:
                f.send(_core.encode_abort_request(rid))
            time.sleep(spec["delay_ms"] / 1000)
        f.wait_finished(list(expected))
        stats = f.stats(query_id=77)
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == num_blocks, "blocks leaked: after the drain every block is free or cached"
        assert 0.0 <= stats.kv_usage <= 1e-6
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        rejected = {e.request_id for e in f.other_events if isinstance(e, _core.RequestRejected)}
        assert rejected == set(range(1, len(requests) + 1)) - set(expected), "exactly the oversized were rejected"
        for rid, want in expected.items():
            log = f.log[rid]
            if log.finish == _core.FinishReason.ABORT:
                assert log.tokens == want[: len(log.tokens)]
            else:
                assert (log.tokens, log.finish) == (want, _core.FinishReason.LENGTH)
        assert not f.worker.errors, f.worker.errors
        for plan in f.worker.plans:
            assert int(plan.sched_len.sum()) <= budget and len(plan.sched_slots) <= max_num_seqs
        assert any(isinstance(e, _core.EngineStats) and e.query_id == 0 for e in f.other_events) or not f.worker.plans
    finally:
        f.close()
