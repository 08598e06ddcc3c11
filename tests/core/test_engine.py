"""The C++ engine driven end to end from Python with a fake worker.

The fake worker keeps a persistent batch from the StepPlan deltas exactly like a real worker, checks every plan
against it, and "samples" next = last token + 1, so every request's output is predictable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from core_testkit import segment_name
from ringserve import _core
from ringserve.backend import engine_main, engine_process
from ringserve.formats.engine_args import DEFAULT_MAX_STEP_SLOWDOWN, DEFAULT_STEP_TIMEOUT_S
from ringserve.frontend import launcher
from ringserve.frontend.model_source import ModelSource

pytestmark = pytest.mark.timeout(60)

EOS = 2
BLOCK_SIZE = 16
RING_BYTES = 1 << 16


@dataclass
class SlotState:
    tokens: list[int]
    blocks: list[int]
    computed: int


class FakeWorker(threading.Thread):
    """Rank 0 of a fake TP=1 world: reads plans from the step ring and answers StepResults."""

    def __init__(self, step_ring: str, result_ring: str, num_kv_blocks: int, step_delay_s: float = 0.0,
                 prefill_token_delay_s: float = 0.0) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.reader = _core.RingReader(_core.ShmRing.attach(step_ring))
        self.writer = _core.RingWriter(_core.ShmRing.attach(result_ring))
        self.num_kv_blocks = num_kv_blocks
        self.step_delay_s = step_delay_s
        self.prefill_token_delay_s = prefill_token_delay_s  # a step's time also grows with its prompt tokens
        self.plans: list[_core.StepPlan] = []
        self.sampled: dict[int, list[int]] = {}  # step id -> the tokens its result carried
        self.slots: dict[int, SlotState] = {}
        self.errors: list[str] = []
        self.saw_shutdown = threading.Event()
        self.quit = threading.Event()
        self.ready_delay_s = 0.0  # how long it "loads" before WorkerReady

    def run(self) -> None:
        time.sleep(self.ready_delay_s)
        assert self.writer.write(_core.encode_worker_ready(0, self.num_kv_blocks), 10.0)
        while not self.quit.is_set():
            record = self.reader.read(0.05)
            if record is None:
                continue
            command = _core.decode_worker_command(record)
            if isinstance(command, _core.WorkerShutdown):
                self.saw_shutdown.set()
                return
            try:
                slots, tokens = self.execute(command)
            except AssertionError as e:  # reported by the test, not swallowed by the thread
                self.errors.append(f"step {command.step_id}: {e!r}")
                return
            if self.step_delay_s or self.prefill_token_delay_s:
                prefill_tokens = sum(n for n in command.sched_len.tolist() if n > 1)
                time.sleep(self.step_delay_s + self.prefill_token_delay_s * prefill_tokens)
            self.sampled[command.step_id] = tokens
            result = _core.encode_step_result(
                command.step_id,
                np.array(slots, np.int32),
                np.array(tokens, np.int32),
                np.full(len(slots), -0.5, np.float32),
            )
            assert self.writer.write(result, 10.0)

    def execute(self, plan: _core.StepPlan) -> tuple[list[int], list[int]]:
        self.plans.append(plan)
        for slot in plan.finished_slots.tolist():
            self.slots.pop(slot, None)
        for new in plan.new_requests:
            assert new.slot not in self.slots, f"slot {new.slot} reused before it was finished"
            self.slots[new.slot] = SlotState(new.token_ids.tolist(), new.block_ids.tolist(), new.num_computed_tokens)
        for append in plan.block_appends:
            self.slots[append.slot].blocks.extend(append.block_ids.tolist())
        # A block may back two live slots only as a shared prefix-cache block, fully computed in each (read-only).
        holders: dict[int, int] = {}
        for state in self.slots.values():
            for b in state.blocks:
                holders[b] = holders.get(b, 0) + 1
        for state in self.slots.values():
            for j, b in enumerate(state.blocks):
                assert holders[b] == 1 or (j + 1) * BLOCK_SIZE <= state.computed, "a written KV block is shared"
        sampled_slots, sampled_tokens = [], []
        for slot, start, length, sample in zip(
            plan.sched_slots.tolist(),
            plan.sched_start.tolist(),
            plan.sched_len.tolist(),
            plan.sched_sample.tolist(),
            strict=True,
        ):
            state = self.slots[slot]
            assert start == state.computed, "plan start is not the slot's computed count"
            state.computed += length
            assert state.computed <= len(state.tokens)
            assert len(state.blocks) * BLOCK_SIZE >= state.computed, "too few blocks for the computed tokens"
            assert sample == (state.computed == len(state.tokens))
            if sample:
                token = state.tokens[-1] + 1
                state.tokens.append(token)
                sampled_slots.append(slot)
                sampled_tokens.append(token)
        return sampled_slots, sampled_tokens


@dataclass
class RequestLog:
    tokens: list[int] = field(default_factory=list)
    outputs: list[_core.RequestOutput] = field(default_factory=list)
    finish: _core.FinishReason | None = None


class Frontend:
    """The frontend side of the request and event rings, plus the engine thread."""

    def __init__(self, config: _core.EngineConfig, num_kv_blocks: int, worker_pids: list[int], delay: float,
                 token_delay: float = 0.0) -> None:  # fmt: skip
        self.rings = {
            role: _core.ShmRing.create(segment_name(role), RING_BYTES) for role in ("req", "evt", "step", "res")
        }
        self.requests = _core.RingWriter(self.rings["req"])
        self.events = _core.RingReader(self.rings["evt"])
        self.worker = FakeWorker(self.rings["step"].name, self.rings["res"].name, num_kv_blocks, delay, token_delay)
        self.engine = _core.Engine(config, *(self.rings[r].name for r in ("req", "evt", "step", "res")), worker_pids)
        self.run_error: BaseException | None = None
        self.engine_thread = threading.Thread(target=self._run_engine, daemon=True)
        self.log: dict[int, RequestLog] = {}
        self.other_events: list[object] = []
        self.step_tokens: list[tuple[int, list[int]]] = []  # (StepEvents.step_id, its outputs' new tokens)

    def _run_engine(self) -> None:
        try:
            self.engine.run()
        except BaseException as e:  # surfaced to the test through run_error
            self.run_error = e

    def start(self) -> _core.EngineReady:
        self.worker.start()
        self.engine_thread.start()
        ready = self.next_event()
        assert isinstance(ready, _core.EngineReady)
        return ready

    def add(self, request_id: int, prompt: list[int], max_tokens: int, **params: object) -> None:
        r = _core.AddRequest()
        r.request_id = request_id
        r.prompt_token_ids = prompt
        r.max_tokens = max_tokens
        for name, value in params.items():
            setattr(r, name, value)
        assert self.requests.write(_core.encode_add_request(r), 5.0)

    def send(self, record: bytes) -> None:
        assert self.requests.write(record, 5.0)

    def next_event(self, timeout_s: float = 10.0) -> object:
        record = self.events.read(timeout_s)
        assert record is not None, "no event from the engine"
        event = _core.decode_engine_event(record)
        if isinstance(event, _core.StepEvents):
            self.step_tokens.append((event.step_id, [t for out in event.outputs for t in out.new_token_ids]))
            for out in event.outputs:
                log = self.log.setdefault(out.request_id, RequestLog())
                assert log.finish is None, "output after the final output"
                log.tokens.extend(out.new_token_ids)
                log.outputs.append(out)
                if out.finish_reason != _core.FinishReason.NONE:
                    log.finish = out.finish_reason
        else:
            self.other_events.append(event)
        return event

    def wait_finished(self, request_ids: list[int]) -> None:
        while not all(rid in self.log and self.log[rid].finish is not None for rid in request_ids):
            self.next_event()

    def stats(self, query_id: int) -> _core.EngineStats:
        self.send(_core.encode_stats_query(query_id))
        while True:
            event = self.next_event()
            if isinstance(event, _core.EngineStats) and event.query_id == query_id:
                return event

    def shutdown(self) -> None:
        self.send(_core.encode_shutdown())
        self.engine_thread.join(10)
        assert not self.engine_thread.is_alive(), "run() did not return after Shutdown"

    def close(self) -> None:
        self.engine.stop()
        self.engine_thread.join(10)
        self.worker.quit.set()
        self.worker.join(10)
        for ring in self.rings.values():
            ring.unlink()


def make_config(**overrides: object) -> _core.EngineConfig:
    config = _core.EngineConfig()
    config.block_size = BLOCK_SIZE
    config.max_num_seqs = 4
    config.max_num_batched_tokens = 64
    config.eos_token_ids = [EOS]
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


@pytest.fixture
def frontend_factory() -> Iterator[Callable[..., Frontend]]:
    made: list[Frontend] = []

    def make(
        num_kv_blocks: int = 64, worker_pids: list[int] | None = None, delay: float = 0.0, token_delay: float = 0.0,
        **config: object,
    ) -> Frontend:
        f = Frontend(make_config(**config), num_kv_blocks, worker_pids or [], delay, token_delay)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
        assert not f.worker.errors, f.worker.errors


def prompt_ending_at(last: int, length: int) -> list[int]:
    return [1000 + i for i in range(length - 1)] + [last]


FrontendFactory = Callable[..., Frontend]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_continuous_batching_with_stop_rules_and_chunked_prefill(frontend_factory: FrontendFactory,
                                                                  async_scheduling: bool) -> None:  # fmt: skip
    f = frontend_factory(async_scheduling=async_scheduling)
    f.add(1, prompt_ending_at(100, 40), max_tokens=5)  # LENGTH: 101..105
    f.add(2, prompt_ending_at(0, 8), max_tokens=10)  # EOS: 1, 2
    f.add(3, prompt_ending_at(10, 8), max_tokens=10, stop_token_ids=[13])  # stop token: 11, 12, 13
    f.add(4, prompt_ending_at(500, 150), max_tokens=2)  # longer than the budget: chunked
    f.add(5, prompt_ending_at(0, 8), max_tokens=3, ignore_eos=True)  # EOS ignored: 1, 2, 3
    ready = f.start()
    assert (ready.num_total_blocks, ready.block_size, ready.max_model_len) == (64, BLOCK_SIZE, 64 * BLOCK_SIZE)
    f.wait_finished([1, 2, 3, 4, 5])

    assert f.log[1].tokens == [101, 102, 103, 104, 105] and f.log[1].finish == _core.FinishReason.LENGTH
    assert f.log[2].tokens == [1, 2] and f.log[2].finish == _core.FinishReason.STOP
    assert f.log[3].tokens == [11, 12, 13] and f.log[3].finish == _core.FinishReason.STOP
    assert f.log[4].tokens == [501, 502] and f.log[4].finish == _core.FinishReason.LENGTH
    assert f.log[5].tokens == [1, 2, 3] and f.log[5].finish == _core.FinishReason.LENGTH

    plans = f.worker.plans
    assert all(int(p.sched_len.sum()) <= 64 for p in plans), "a step exceeded max_num_batched_tokens"
    assert all(len(p.sched_slots) <= 4 for p in plans), "more than max_num_seqs scheduled"
    assert any(len(p.sched_slots) >= 3 for p in plans), "requests were not batched together"
    # Request 4's 150-token prompt went out once, then in chunks whose lengths add up to what was not cached: it
    # shares request 1's first 39 tokens, computed by request 1 in the step it waited for.
    ((sent4, new4),) = [(p.step_id, n) for p in plans for n in p.new_requests if len(n.token_ids) == 150]
    assert new4.num_computed_tokens == 39 // BLOCK_SIZE * BLOCK_SIZE > 0
    chunks = [
        (p.sched_len[i], p.sched_sample[i])
        for p in plans
        if p.step_id >= sent4
        for i in range(len(p.sched_slots))
        if p.sched_slots[i] == new4.slot and p.sched_start[i] < 150
    ]
    assert len(chunks) > 1 and sum(n for n, _ in chunks) == 150 - new4.num_computed_tokens
    assert [s for _, s in chunks] == [False] * (len(chunks) - 1) + [True]
    # Decodes of running requests are planned before new prompts in the same step.
    for p in plans:
        new_slots = {n.slot for n in p.new_requests}
        positions = [i for i, s in enumerate(p.sched_slots.tolist()) if s in new_slots]
        assert positions == list(range(len(p.sched_slots) - len(positions), len(p.sched_slots)))

    # Each StepEvents names the step whose result carried its tokens, also when the next step was already sent (a
    # result may carry more: the rows of requests that finished in the step before are dropped).
    for step_id, tokens in f.step_tokens:
        assert not Counter(tokens) - Counter(f.worker.sampled[step_id]), f"StepEvents of step {step_id}: {tokens}"

    first = f.log[1].outputs[0]
    assert first.num_prompt_tokens == 40 and first.num_cached_tokens == 0
    assert 0 < first.arrival_time_ns <= first.first_scheduled_time_ns <= first.first_token_time_ns

    stats = f.stats(7)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks == 64
    assert stats.num_steps == len(plans)
    f.shutdown()
    assert f.worker.saw_shutdown.wait(5), "WorkerShutdown was not sent"
    assert f.run_error is None


@pytest.mark.parametrize("slowdown", [0.0, 2.0])
def test_the_engine_times_its_steps_and_the_guard_cuts_prompt_chunks_while_requests_decode(
        frontend_factory: FrontendFactory, slowdown: float) -> None:  # fmt: skip
    # A worker whose steps take 20 ms plus 1 ms per prompt token: at 2x, a step may add about 20 prompt tokens.
    f = frontend_factory(num_kv_blocks=128, delay=0.02, token_delay=0.001, max_num_batched_tokens=256,
                         max_step_slowdown=slowdown)  # fmt: skip
    f.start()
    f.add(1, prompt_ending_at(100, 24), max_tokens=300, ignore_eos=True)
    f.add(2, prompt_ending_at(200, 24), max_tokens=300, ignore_eos=True)
    while sum(len(log.tokens) for log in f.log.values()) < 12:  # both decode: the engine has timed both kinds
        f.next_event()
    f.add(3, prompt_ending_at(500, 400), max_tokens=1)
    f.wait_finished([3])
    chunks = [o.num_scheduled_tokens for o in f.log[3].outputs]
    decoding = [o for rid in (1, 2) for o in f.log[rid].outputs if o.new_token_ids]
    cached = f.log[3].outputs[0].num_cached_tokens  # its first block is the other prompts' first block
    assert cached == BLOCK_SIZE and sum(chunks) + cached == 400 and f.log[3].tokens == [501]
    assert len(decoding) > 12  # the streams kept decoding
    if slowdown == 0:
        assert chunks[0] == 254  # the budget less the two decodes
    else:
        # Some 20 tokens a step (at least a block), leaving room for a busy machine's timing.
        assert max(chunks) <= 128 and sum(chunks) / len(chunks) <= 64, chunks
        assert len(chunks) >= 4
    f.engine.stop()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_all_blocks_and_emits_a_final_abort(frontend_factory: FrontendFactory,
                                                        async_scheduling: bool) -> None:  # fmt: skip
    f = frontend_factory(delay=0.002, async_scheduling=async_scheduling)
    f.start()
    f.add(1, prompt_ending_at(100, 30), max_tokens=500)
    f.add(2, prompt_ending_at(300, 30), max_tokens=500)
    while not (f.log.get(1) and f.log.get(2)):
        f.next_event()
    f.send(_core.encode_abort_request(1))
    f.wait_finished([1])
    assert f.log[1].finish == _core.FinishReason.ABORT and f.log[1].outputs[-1].new_token_ids == []
    f.send(_core.encode_abort_request(2))
    f.wait_finished([2])
    assert f.log[2].finish == _core.FinishReason.ABORT
    stats = f.stats(1)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    # Later plans tell the worker to drop both aborted slots.
    aborted_slots = {n.slot for p in f.worker.plans for n in p.new_requests}
    f.add(3, prompt_ending_at(7, 4), max_tokens=1)
    f.wait_finished([3])
    assert f.log[3].tokens == [8]
    dropped = {s for p in f.worker.plans for s in p.finished_slots.tolist()}
    assert dropped == aborted_slots
    f.shutdown()


def test_requests_that_can_never_run_are_rejected(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory(num_kv_blocks=8, max_model_len=100)
    f.start()
    f.add(1, list(range(3, 93)), max_tokens=20)
    f.add(2, [], max_tokens=5)
    f.add(3, [5, 6], max_tokens=2)
    f.wait_finished([3])
    while len([e for e in f.other_events if isinstance(e, _core.RequestRejected)]) < 2:
        f.next_event()
    rejected = {e.request_id: e for e in f.other_events if isinstance(e, _core.RequestRejected)}
    assert rejected[1].status_code == 8 and "110 tokens" in rejected[1].message
    assert rejected[2].status_code == 3
    assert f.log[3].tokens == [7, 8]
    f.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_by_recompute_keeps_outputs_exact(frontend_factory: FrontendFactory, async_scheduling: bool) -> None:
    # 6 blocks of 16 tokens; each request needs 5 blocks by the end, so one must be preempted and recomputed.
    f = frontend_factory(num_kv_blocks=6, async_scheduling=async_scheduling)
    f.add(1, prompt_ending_at(100, 20), max_tokens=60)
    f.add(2, prompt_ending_at(1000, 20), max_tokens=60)
    f.start()
    f.wait_finished([1, 2])
    assert f.log[1].tokens == list(range(101, 161))
    assert f.log[2].tokens == list(range(1001, 1061))
    stats = f.stats(3)
    assert stats.num_preemptions >= 1 and stats.num_free_blocks == 6
    resent = [n for p in f.worker.plans for n in p.new_requests if len(n.token_ids) > 20]
    assert resent, "a preempted request was not re-sent with its generated tokens"
    f.shutdown()


def test_engine_reports_stats_unsolicited_while_busy_and_once_when_idle(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory(delay=0.002, stats_interval_ms=1)
    f.start()
    f.add(1, prompt_ending_at(100, 20), max_tokens=30)
    f.wait_finished([1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the report sent when the engine turned idle
        unsolicited = [e for e in f.other_events if isinstance(e, _core.EngineStats) and e.query_id == 0]
        if unsolicited and unsolicited[-1].num_running == 0:
            break
        f.next_event()
    busy = [e for e in unsolicited if e.num_running == 1]
    assert busy, "no unsolicited EngineStats while a request ran"
    assert all(e.step_time_ns > 0 and e.num_scheduled_tokens >= 1 for e in busy)
    assert all(0 < e.kv_usage <= 1 for e in busy)
    idle = unsolicited[-1]
    assert (idle.num_running, idle.num_waiting) == (0, 0)
    assert (idle.total_prompt_tokens, idle.total_generation_tokens) == (20, 30)
    f.shutdown()


def test_a_repeated_prompt_reports_its_cached_tokens(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory()
    f.start()
    f.add(1, prompt_ending_at(100, 40), max_tokens=3)
    f.wait_finished([1])
    f.add(2, prompt_ending_at(100, 40), max_tokens=3)
    f.wait_finished([2])
    assert f.log[1].outputs[-1].num_cached_tokens == 0
    # 40 tokens = 2 full blocks of 16 + 8; both full blocks are reused, only the last 8 tokens are computed.
    assert f.log[2].outputs[-1].num_cached_tokens == 32 and f.log[2].tokens == f.log[1].tokens == [101, 102, 103]
    (resent,) = [n for p in f.worker.plans for n in p.new_requests][1:]
    assert resent.num_computed_tokens == 32 and resent.num_prompt_tokens == 40
    stats = f.stats(5)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    f.shutdown()


def test_stop_returns_from_run_and_shuts_the_worker_down(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory()
    f.start()
    f.engine.stop()
    f.engine_thread.join(10)
    assert not f.engine_thread.is_alive() and f.run_error is None
    assert f.worker.saw_shutdown.wait(5)


def test_a_dead_worker_fails_the_engine(frontend_factory: FrontendFactory) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    f = frontend_factory(worker_pids=[sleeper.pid])
    f.start()
    f.add(1, [5, 6, 7], max_tokens=3)
    f.wait_finished([1])
    sleeper.kill()
    sleeper.wait()
    assert engine_failure(f).reason == _core.FailureReason.WORKER_DIED
    f.engine_thread.join(10)
    assert isinstance(f.run_error, RuntimeError) and str(sleeper.pid) in str(f.run_error)


def test_worker_failed_record_fails_the_engine(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory()
    f.start()
    f.worker.quit.set()
    f.worker.join(5)
    assert f.worker.writer.write(_core.encode_worker_failed(0, "CUDA error: out of memory"), 5.0)
    f.add(1, [5, 6, 7], max_tokens=3)  # the engine now waits for a result that never comes
    while not any(isinstance(e, _core.EngineFailed) for e in f.other_events):
        f.next_event()
    failed = next(e for e in f.other_events if isinstance(e, _core.EngineFailed))
    assert "out of memory" in failed.message and failed.reason == _core.FailureReason.WORKER_DIED
    f.engine_thread.join(10)
    assert isinstance(f.run_error, RuntimeError)


def test_a_dead_rank_waits_briefly_for_rank_0_to_say_why(frontend_factory: FrontendFactory) -> None:
    # A tensor-parallel rank that refuses its shard exits at once; rank 0 reports the reason a little later.
    sibling = subprocess.Popen(["sleep", "60"])
    f = frontend_factory(worker_pids=[os.getpid(), sibling.pid])  # this process stands in for rank 0
    f.start()
    f.worker.quit.set()
    f.worker.join(5)
    f.add(1, [5, 6, 7], max_tokens=3)
    sibling.kill()
    sibling.wait()
    time.sleep(0.5)  # the engine has seen the death by now (it polls every 100 ms)
    assert f.worker.writer.write(_core.encode_worker_failed(0, "does not divide the model's 9 attention heads"), 5.0)
    while not any(isinstance(e, _core.EngineFailed) for e in f.other_events):
        f.next_event()
    failed = next(e for e in f.other_events if isinstance(e, _core.EngineFailed))
    assert "9 attention heads" in failed.message
    f.engine_thread.join(10)


def engine_failure(f: Frontend) -> _core.EngineFailed:
    while not any(isinstance(e, _core.EngineFailed) for e in f.other_events):
        f.next_event()
    return next(e for e in f.other_events if isinstance(e, _core.EngineFailed))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_whose_result_never_comes_fails_the_engine_naming_the_step_timeout(
    frontend_factory: FrontendFactory, async_scheduling: bool
) -> None:
    # A rank that is alive but stuck: its pid stays alive (this process), it just never answers.
    f = frontend_factory(worker_pids=[os.getpid()], step_timeout_s=0.5, async_scheduling=async_scheduling)
    f.start()
    f.add(1, [5, 6, 7], max_tokens=3)
    f.wait_finished([1])
    f.worker.quit.set()
    f.worker.join(5)
    f.add(2, [5, 6, 7], max_tokens=3)
    failed = engine_failure(f)
    assert failed.message.startswith("no step result within --step-timeout 0.5 s: a rank is alive but stuck")
    assert failed.reason == _core.FailureReason.STEP_TIMEOUT
    f.engine_thread.join(10)
    assert isinstance(f.run_error, RuntimeError) and "--step-timeout" in str(f.run_error)


def test_steps_and_a_slow_load_within_the_step_timeout_do_not_trip_it(frontend_factory: FrontendFactory) -> None:
    # Every step takes 0.1 s and a request's twelve steps together over the 1 s limit: the limit is per step.
    # Loading (the wait for WorkerReady) is not a step: it takes longer than the limit here.
    f = frontend_factory(delay=0.1, step_timeout_s=1.0)
    f.worker.ready_delay_s = 1.5
    f.start()
    f.add(1, [5, 6, 7], max_tokens=12)
    f.wait_finished([1])
    assert f.log[1].tokens == list(range(8, 20))
    assert not [e for e in f.other_events if isinstance(e, _core.EngineFailed)]


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_the_engine_refuses_a_step_timeout_out_of_range(seconds: float) -> None:
    rings = [_core.ShmRing.create(segment_name(role), RING_BYTES) for role in ("req", "evt", "step", "res")]
    try:
        with pytest.raises(ValueError, match="step_timeout_s must be >= 0"):
            _core.Engine(make_config(step_timeout_s=seconds), *(r.name for r in rings), [])
    finally:
        for ring in rings:
            ring.unlink()


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    launcher.add_serve_arguments(parser)
    return parser


def engine_process_args(flags: list[str], tmp_path: Path) -> argparse.Namespace:
    """What the engine process parses from the command line `ringserve serve FLAGS` starts it with."""
    engine = launcher.serve_engine_args(serve_parser().parse_args(flags))
    resolved = launcher.engine_args_for_model(engine, ModelSource("m", tmp_path / "m.gguf"), [EOS], 128)
    cmd = engine_process.engine_command(resolved, "/req", "/evt")
    return engine_main.parse_args(cmd[3:])  # after `python -m ringserve.backend.engine_main`


def test_serve_passes_priority_aging_to_the_engine_config(tmp_path: Path) -> None:
    parser = serve_parser()
    for flags, want in (([], 1000), (["--priority-aging-ms", "250"], 250), (["--priority-aging-ms", "0"], 0)):
        assert launcher.check_serve_arguments(parser.parse_args(flags)) is None
        assert engine_main.engine_config(engine_process_args(flags, tmp_path).engine).priority_aging_ms == want
    assert "--priority-aging-ms" in launcher.check_serve_arguments(parser.parse_args(["--priority-aging-ms", "-1"]))


def test_serve_passes_the_step_timeout_to_the_engine_config(tmp_path: Path) -> None:
    parser = serve_parser()
    for flags, want in (([], DEFAULT_STEP_TIMEOUT_S), (["--step-timeout", "2.5"], 2.5), (["--step-timeout", "0"], 0)):
        assert engine_main.engine_config(engine_process_args(flags, tmp_path).engine).step_timeout_s == want
    assert "--step-timeout must be >= 0" in launcher.check_serve_arguments(parser.parse_args(["--step-timeout", "-1"]))


def test_serve_passes_async_scheduling_to_the_engine_config(tmp_path: Path) -> None:
    for flags, want in (([], False), (["--async-scheduling", "off"], False), (["--async-scheduling", "on"], True)):
        assert engine_main.engine_config(engine_process_args(flags, tmp_path).engine).async_scheduling is want
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--async-scheduling", "maybe"])


def test_serve_passes_the_model_and_its_limits_to_the_engine(tmp_path: Path) -> None:
    args = engine_process_args(["--max-model-len", "4096", "--block-size", "32", "--no-enable-prefix-caching"],
                               tmp_path)  # fmt: skip
    assert (args.request_ring, args.event_ring, args.engine.model_path) == ("/req", "/evt", str(tmp_path / "m.gguf"))
    config = engine_main.engine_config(args.engine)
    assert (config.max_model_len, config.block_size, config.eos_token_ids) == (128, 32, [EOS])  # at most the model's
    assert not config.enable_prefix_caching
    shorter = engine_process_args(["--max-model-len", "64"], tmp_path).engine
    assert engine_main.engine_config(shorter).max_model_len == 64


def test_serve_passes_the_decode_latency_guard_to_the_engine_config(tmp_path: Path) -> None:
    parser = serve_parser()
    for flags, want in (([], DEFAULT_MAX_STEP_SLOWDOWN), (["--max-step-slowdown", "3.5"], 3.5),
                        (["--max-step-slowdown", "0"], 0.0)):  # fmt: skip
        with mock.patch.object(engine_process, "nvidia_gpu_present", return_value=False):
            assert launcher.check_serve_arguments(parser.parse_args(flags)) is None
            args = engine_process_args(flags, tmp_path)
        assert engine_main.engine_config(args.engine).max_step_slowdown == want
    # auto: the default, except where the workers replay decode steps as CUDA graphs (an NVIDIA GPU, one rank,
    # the Triton backend, --cuda-graphs other than off): there the guard is off.
    engine = launcher.serve_engine_args(parser.parse_args([]))
    for gpu, extra, want in ((False, {}, DEFAULT_MAX_STEP_SLOWDOWN), (True, {}, 0.0),
                             (True, {"cuda_graphs": "decode"}, 0.0), (True, {"cuda_graphs": "piecewise"}, 0.0),
                             (True, {"cuda_graphs": "off"}, DEFAULT_MAX_STEP_SLOWDOWN),
                             (True, {"tensor_parallel_size": 2}, DEFAULT_MAX_STEP_SLOWDOWN),
                             (True, {"attention_backend": "torch_sdpa"}, DEFAULT_MAX_STEP_SLOWDOWN),
                             (True, {"num_speculative_tokens": 3}, DEFAULT_MAX_STEP_SLOWDOWN),
                             (True, {"kv_transfer": "shm"}, DEFAULT_MAX_STEP_SLOWDOWN)):
        with mock.patch.object(engine_process, "nvidia_gpu_present", return_value=gpu):
            settings = dataclasses.replace(engine, **extra)
            assert engine_process.resolve_max_step_slowdown(settings) == want, (gpu, extra)
    with mock.patch.object(engine_process, "nvidia_gpu_present", return_value=True):
        two = launcher.serve_engine_args(parser.parse_args(["--max-step-slowdown", "2"]))
        assert engine_process.resolve_max_step_slowdown(two) == 2.0
    for bad in ("0.5", "-1", "nan", "fast"):
        message = launcher.check_serve_arguments(parser.parse_args(["--max-step-slowdown", bad]))
        assert message is not None and "--max-step-slowdown must be 0 (off) or >= 1" in message
    config = _core.EngineConfig()
    config.num_blocks, config.max_step_slowdown = 8, 0.5
    with pytest.raises(ValueError, match="max_step_slowdown"):
        _core.Scheduler(config)


def test_serve_passes_worker_threads_down_to_the_workers(tmp_path: Path) -> None:
    from ringserve.workers.worker_main import parse_args as worker_args

    for flags, want in (([], 0), (["--worker-threads", "1"], 1)):
        engine = engine_process_args(flags, tmp_path).engine
        worker = engine_main.worker_command(engine, 0, "/s", "/r")
        assert worker_args(worker[worker.index("--rank"):]).engine.worker_threads == want
    assert "--worker-threads" in launcher.check_serve_arguments(serve_parser().parse_args(["--worker-threads", "-2"]))


def test_a_rank_shares_its_hosts_cpus_only_with_the_ranks_on_that_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--worker-threads 0 divides the usable CPUs (less one) among the ranks on the host: every rank with the local
    executor, those on its node with Ray (its executor passes --ranks-on-host)."""
    from ringserve.workers import worker_main

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    engine = engine_process_args(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "4"], tmp_path).engine
    command = engine_main.worker_command(engine, 5, "/s", "/r")
    rank = command[command.index("--rank"):]
    assert worker_main.worker_threads(worker_main.parse_args(rank)) == 1  # (16 - 1) // 8
    assert worker_main.worker_threads(worker_main.parse_args([*rank, "--ranks-on-host", "2"])) == 7
    with pytest.raises(SystemExit):
        worker_main.parse_args([*rank, "--ranks-on-host", "9"])


def test_serve_passes_a_draft_tree_to_the_engine_and_workers(tmp_path: Path) -> None:
    from ringserve.workers.worker_main import parse_args as worker_args

    flags = ["--num-speculative-tokens", "4", "--draft", "layers:2", "--spec-tree", "2x2"]
    engine = engine_process_args(flags, tmp_path).engine
    assert engine_main.engine_config(engine).num_speculative_tokens == 14  # lookahead slots: every tree node
    worker = worker_args(engine_main.worker_command(engine, 0, "/s", "/r")[3:]).engine
    assert (worker.spec_tree, worker.num_speculative_tokens, worker.draft) == ("2x2", 4, "layers:2")
    assert worker.draft_tree() is not None and worker.draft_tree().num_nodes == 14
    chain = engine_process_args(flags[:4], tmp_path).engine
    assert engine_main.engine_config(chain).num_speculative_tokens == 4
    for bad, message in (
        (["--spec-tree", "2x2"], "--spec-tree needs"),
        (["--num-speculative-tokens", "2", "--draft", "layers:2", "--spec-tree", "2by2"], "expected WxD"),
        (["--num-speculative-tokens", "8", "--draft", "layers:2", "--spec-tree", "3x3"], "at most 64"),
    ):
        assert message in (launcher.check_serve_arguments(serve_parser().parse_args(bad)) or ""), bad


def test_an_abort_drops_kv_options_whose_request_never_came(frontend_factory: FrontendFactory) -> None:
    f = frontend_factory()
    f.start()
    options = _core.KvRequestOptions()
    options.request_id = 9
    options.mode = _core.KvMode.PREFILL_ONLY
    options.pin_timeout_ms = 60_000
    f.send(_core.encode_kv_request_options(options))
    f.send(_core.encode_abort_request(9))  # what the frontend sends when it could not write the AddRequest
    f.add(9, prompt_ending_at(100, 20), max_tokens=4)  # the id reused: an ordinary request, not a pinned prefill
    f.wait_finished([9])
    assert f.log[9].tokens == [101, 102, 103, 104] and f.log[9].finish == _core.FinishReason.LENGTH
    assert not any(isinstance(e, _core.KvPinned) for e in f.other_events)
