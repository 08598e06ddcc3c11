"""Property tests: the C++ scheduler (prefix cache, chunked prefill, preemption, priorities) driven through the
binding by a fake worker that keeps a simulated paged KV cache and samples deterministic tokens.

The fake "model" samples a token that is a function of every token of the request so far, so a request's output is
fixed by its prompt alone: whatever the batching, caching, preemption or chunking, it must equal a solo run.
The simulated KV cache stores, per block and position, the token whose KV was written there; before computing a
chunk the worker checks that every earlier position of the request reads back its own tokens, which is exactly
what a wrong prefix-cache hit, a premature eviction or a bad block table would break.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ringserve import _core

EOS = 2
MS = 1_000_000  # ns
BASES = [list(range(100, 160)), list(range(300, 340)), [7] * 50]


def next_token(tokens: list[int]) -> int:
    """The fake model: deterministic in the whole sequence; EOS now and then."""
    h = (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) & 0xFFFFFFFF
    return EOS if h % 23 == 0 else 10 + h % 500


def prefix_digests(tokens: list[int]) -> list[int]:
    """digest[i] identifies tokens[:i + 1], position included: what the KV at position i depends on in a real model."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


def solo_output(prompt: list[int], max_tokens: int, ignore_eos: bool, stop_ids: list[int]) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if (t == EOS and not ignore_eos) or t in stop_ids:
            return out, "STOP"
        if len(out) >= max_tokens:
            return out, "LENGTH"


@dataclass
class Slot:
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class FakeWorker:
    block_size: int
    num_blocks: int
    slots: dict[int, Slot] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, offset) -> prefix digest of its KV

    def execute(self, plan: _core.StepPlan, threshold: int) -> _core.StepResult:
        for slot in plan.finished_slots.tolist():
            self.slots.pop(slot, None)
        for new in plan.new_requests:
            assert new.slot not in self.slots, "a slot was reused before the workers dropped it"
            assert new.num_computed_tokens % self.block_size == 0
            assert 0 <= new.num_computed_tokens < len(new.token_ids), "the last token must always be computed"
            assert 0 < new.num_prompt_tokens <= len(new.token_ids)
            self.slots[new.slot] = Slot(new.token_ids.tolist(), new.block_ids.tolist(), new.num_computed_tokens)
        for append in plan.block_appends:
            self.slots[append.slot].blocks.extend(append.block_ids.tolist())
        # A block backing two live slots must be read-only: fully computed in each of them.
        holders: dict[int, int] = {}
        for s in self.slots.values():
            for b in s.blocks:
                holders[b] = holders.get(b, 0) + 1
        for s in self.slots.values():
            for j, b in enumerate(s.blocks):
                if holders[b] > 1:
                    assert (j + 1) * self.block_size <= s.computed, f"block {b} shared while still written"
        new_slots = {n.slot for n in plan.new_requests}
        slots, tokens = [], []
        for slot, start, length, sample in zip(plan.sched_slots.tolist(), plan.sched_start.tolist(),
                                               plan.sched_len.tolist(), plan.sched_sample.tolist(), strict=True):
            s = self.slots[slot]
            assert start == s.computed and length > 0
            if threshold and (slot in new_slots or start + length < len(s.tokens)):
                assert length <= threshold, "a prefill chunk exceeded long_prefill_token_threshold"
            assert len(s.blocks) * self.block_size >= start + length
            digests = prefix_digests(s.tokens)
            for pos in range(start):  # the attention context: cached or computed earlier, never clobbered
                assert self.kv.get(self.where(s, pos)) == digests[pos], f"KV at position {pos} is wrong"
            for pos in range(start, start + length):
                self.kv[self.where(s, pos)] = digests[pos]
            s.computed += length
            assert sample == (s.computed == len(s.tokens))
            if sample:
                t = next_token(s.tokens)
                s.tokens.append(t)
                slots.append(slot)
                tokens.append(t)
        result = _core.StepResult()
        result.step_id = plan.step_id
        result.slots = np.array(slots, np.int32)
        result.token_ids = np.array(tokens, np.int32)
        result.logprobs = np.full(len(slots), -1.0, np.float32)
        return result

    def where(self, s: Slot, pos: int) -> tuple[int, int]:
        return s.blocks[pos // self.block_size], pos % self.block_size


request_strategy = st.fixed_dictionaries({
    "arrival": st.integers(0, 40),
    "base": st.integers(0, len(BASES) - 1),
    "prefix_len": st.integers(0, 50),
    "tail": st.lists(st.integers(3, 60000), max_size=12),
    "max_tokens": st.integers(1, 24),
    "priority": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "salt": st.sampled_from([0, 0, 0, 1]),
    "abort_after": st.one_of(st.none(), st.integers(0, 30)),
})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([2, 4, 8]),
    num_blocks=st.integers(6, 48),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(4, 64),
    threshold=st.sampled_from([0, 0, 3, 8]),
    caching=st.booleans(),
    aging_ms=st.sampled_from([0, 0, 1, 4]),
    slowdown=st.sampled_from([0.0, 0.0, 1.0, 1.5, 3.0]),
    step_cost=st.tuples(st.integers(0, 2000), st.integers(1, 100), st.sampled_from([0, 0, 1, 3])),
    requests=st.lists(request_strategy, min_size=1, max_size=14),
)
def test_every_request_finishes_once_with_its_solo_output(block_size: int, num_blocks: int, max_num_seqs: int,
                                                         budget: int, threshold: int, caching: bool, aging_ms: int,
                                                         slowdown: float, step_cost: tuple[int, int, int],
                                                         requests: list[dict]) -> None:
    config = _core.EngineConfig()
    config.block_size, config.num_blocks, config.max_num_seqs = block_size, num_blocks, max_num_seqs
    config.max_num_batched_tokens, config.long_prefill_token_threshold = budget, threshold
    config.enable_prefix_caching, config.priority_aging_ms = caching, aging_ms
    config.max_step_slowdown = slowdown  # the decode-latency guard, fed a linear step cost below
    config.eos_token_ids = [EOS]
    scheduler = _core.Scheduler(config)
    worker = FakeWorker(block_size, num_blocks)
    fixed_ns, per_token_ns, per_pair_ns = step_cost  # the "measured" step time: a known function of the plan

    expected: dict[int, tuple[list[int], str]] = {}
    abort_at: dict[int, int] = {}
    arrivals: dict[int, list[_core.AddRequest]] = {}
    for rid, spec in enumerate(requests, start=1):
        r = _core.AddRequest()
        r.request_id = rid
        r.prompt_token_ids = (BASES[spec["base"]][: spec["prefix_len"]] + spec["tail"]) or [5]
        r.max_tokens, r.priority, r.ignore_eos = spec["max_tokens"], spec["priority"], spec["ignore_eos"]
        r.cache_salt = spec["salt"]
        arrivals.setdefault(spec["arrival"], []).append(r)
        expected[rid] = solo_output(r.prompt_token_ids, r.max_tokens, r.ignore_eos, [])
        if spec["abort_after"] is not None:
            abort_at[rid] = spec["arrival"] + spec["abort_after"]

    got: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    accepted: set[int] = set()
    step = 0
    while step <= 40 or scheduler.has_unfinished:
        assert step < 5000, "the workload did not drain: a request starved"
        for r in arrivals.get(step, []):
            rejected = scheduler.add_request(r, step * MS)  # steps are 1 ms apart (it matters only to aging)
            fits = len(r.prompt_token_ids) + r.max_tokens <= num_blocks * block_size
            assert (rejected is None) == fits
            if rejected is None:
                accepted.add(r.request_id)
            else:
                assert rejected.status_code == 8
        for rid, at in abort_at.items():
            if at == step and rid in accepted:
                scheduler.abort_request(rid)
        guard_ns, fit = scheduler.prefill_time_budget, scheduler.step_cost
        plan = scheduler.schedule(step * MS)
        if plan is not None:
            lens, starts = plan.sched_len.tolist(), plan.sched_start.tolist()
            assert sum(lens) <= budget
            pairs = [n * (s + n) for n, s in zip(lens, starts, strict=True)]
            if fit is not None:  # the guard: prefill rows within its time, or a single row of at most a block
                chunks = [(n, p) for n, p in zip(lens, pairs, strict=True) if n > 1]
                spent = sum(fit[1] * n + fit[2] * p for n, p in chunks)
                assert spent <= guard_ns * (1 + 1e-9) + 1e-6 or (len(chunks) == 1 and chunks[0][0] <= block_size)
            assert len(plan.sched_slots) <= max_num_seqs and scheduler.num_running <= max_num_seqs
            scheduler.update(worker.execute(plan, threshold), step * MS)
            scheduler.observe_step_time(fixed_ns + per_token_ns * sum(lens) + per_pair_ns * sum(pairs))
        for o in scheduler.take_outputs():
            assert o.request_id not in finished, "an output after the final one"
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.num_cached_tokens <= o.num_prompt_tokens
            if o.finish_reason != _core.FinishReason.NONE:
                finished[o.request_id] = o.finish_reason.name
        scheduler.check_invariants()  # free-or-referenced, ref counts == holders, priority order, slots
        step += 1

    assert set(finished) == accepted, "every accepted request finishes exactly once"
    for rid in accepted:
        want_tokens, want_reason = expected[rid]
        if finished[rid] == "ABORT":
            assert got.get(rid, []) == want_tokens[: len(got.get(rid, []))]
        else:
            assert (got[rid], finished[rid]) == (want_tokens, want_reason)
    # After the drain every block is free (cached blocks are free too, just still findable).
    assert scheduler.num_free_blocks == num_blocks
    if not caching:
        assert scheduler.num_cached_blocks == 0


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_output() -> None:
    config = _core.EngineConfig()
    config.block_size, config.num_blocks, config.eos_token_ids = 4, 64, [EOS]
    scheduler = _core.Scheduler(config)
    worker = FakeWorker(4, 64)
    outputs: dict[int, list[_core.RequestOutput]] = {}

    def run(rid: int, prompt: list[int]) -> None:
        r = _core.AddRequest()
        r.request_id, r.prompt_token_ids, r.max_tokens, r.ignore_eos = rid, prompt, 6, True
        assert scheduler.add_request(r) is None
        while (plan := scheduler.schedule()) is not None:
            scheduler.update(worker.execute(plan, 0))
            for o in scheduler.take_outputs():
                outputs.setdefault(o.request_id, []).append(o)

    run(1, BASES[0][:40])
    run(2, BASES[0][:40])
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    assert tokens[1] == tokens[2] == solo_output(BASES[0][:40], 6, True, [])[0]
    assert outputs[1][-1].num_cached_tokens == 0 and outputs[2][-1].num_cached_tokens == 36
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 36 and stats.prefix_cache_queries == 80


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    aging_ms=st.integers(1, 6),
    low_priority=st.integers(1, 4),
    low_arrival=st.integers(0, 5),
    max_num_seqs=st.integers(1, 3),
    budget=st.integers(4, 32),
    per_step=st.integers(1, 2),
    stream=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 4)), min_size=1, max_size=8),
    num_blocks=st.integers(12, 40),
)
def test_aging_serves_a_low_priority_request_despite_a_stream_of_better_ones(
        aging_ms: int, low_priority: int, low_arrival: int, max_num_seqs: int, budget: int, per_step: int,
        stream: list[tuple[int, int]], num_blocks: int) -> None:
    """Better requests arrive every step (often more work than the scheduler can finish, so without aging the queue
    never empties and the low one starves), yet the low-priority request finishes, and no better request that
    arrived more than (priority gap) x aging after it is scheduled before it."""
    config = _core.EngineConfig()
    config.block_size, config.num_blocks, config.max_num_seqs = 4, num_blocks, max_num_seqs
    config.max_num_batched_tokens, config.priority_aging_ms, config.eos_token_ids = budget, aging_ms, [EOS]
    scheduler = _core.Scheduler(config)
    worker = FakeWorker(4, num_blocks)
    low_id = 1
    arrival: dict[int, int] = {}
    first_scheduled: dict[int, int] = {}
    finished: set[int] = set()
    next_id, step = 2, 0
    while low_id not in finished:
        assert step < 3000, "the low-priority request starved"
        if step == low_arrival:
            r = _core.AddRequest()
            r.request_id, r.prompt_token_ids, r.max_tokens = low_id, list(range(200, 206)), 3
            r.priority, r.ignore_eos = low_priority, True
            assert scheduler.add_request(r, step * MS) is None
            arrival[low_id] = step
        for k in range(per_step):  # the stream of better requests never stops while the low one waits
            prompt_len, max_tokens = stream[(step * per_step + k) % len(stream)]
            r = _core.AddRequest()
            r.request_id, r.prompt_token_ids = next_id, [300 + next_id % 50 + i for i in range(prompt_len)]
            r.max_tokens, r.ignore_eos = max_tokens, True
            assert scheduler.add_request(r, step * MS) is None
            arrival[next_id] = step
            next_id += 1
        plan = scheduler.schedule(step * MS)
        if plan is not None:
            scheduler.update(worker.execute(plan, 0), step * MS)
        for o in scheduler.take_outputs():
            first_scheduled.setdefault(o.request_id, step)
            if o.finish_reason != _core.FinishReason.NONE:
                finished.add(o.request_id)
        scheduler.check_invariants()
        step += 1
    # The queue order: requests of priority 0 that arrived after the low one's effective priority reached 0 waited
    # behind it (the same step at the earliest, when both fit).
    reached_zero = arrival[low_id] + low_priority * aging_ms
    overtook = [rid for rid, at in arrival.items()
                if rid != low_id and at > reached_zero and first_scheduled.get(rid, step) < first_scheduled[low_id]]
    assert not overtook, f"requests {overtook[:5]} overtook the aged request"
