"""Record decoding under hostile input: over 100,000 random and mutated records through every decoder of the binding.

Every input either decodes into a record whose every field can be read, or raises _core.RecordError; nothing else
(no other exception, no crash). A record that survives a structural mutation (a truncation, a changed length,
count, type or version) and still decodes must re-encode to exactly its bytes: the decoders accept only what an
encoder would have written.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from ringserve import _core

pytestmark = pytest.mark.timeout(120)

DECODERS: list[Callable[[bytes], Any]] = [
    _core.decode_request_record,
    _core.decode_engine_event,
    _core.decode_worker_command,
    _core.decode_worker_result,
]
RECORD_TYPES = [1, 2, 3, 4, 16, 17, 18, 19, 20, 32, 33, 48, 49, 50]
U32_MAX = 2**32 - 1


# ---- random valid records -------------------------------------------------------------------------------------------


def ids(rng: random.Random, most: int = 40) -> list[int]:
    return [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(most + 1))]


def real(rng: random.Random) -> float:
    return rng.choice([0.0, 1.0, -1.5, rng.uniform(-1e3, 1e3)])


def text(rng: random.Random) -> str:
    return "".join(rng.choice("ab é€🙂\n") for _ in range(rng.randrange(30)))


def add_request(rng: random.Random) -> bytes:
    r = _core.AddRequest()
    r.request_id, r.seed, r.cache_salt = (rng.randrange(2**64) for _ in range(3))
    r.prompt_token_ids, r.stop_token_ids = ids(rng), ids(rng, 4)
    r.max_tokens, r.top_k, r.priority, r.min_tokens, r.num_logprobs = (rng.randrange(-99, 99) for _ in range(5))
    r.temperature, r.top_p, r.min_p = real(rng), real(rng), real(rng)
    r.repetition_penalty, r.frequency_penalty, r.presence_penalty = real(rng), real(rng), real(rng)
    r.has_seed, r.ignore_eos = rng.random() < 0.5, rng.random() < 0.5
    r.arrival_time_ns = rng.randrange(-(2**63), 2**63)
    r.trace_id, r.span_id, r.trace_flags = rng.randbytes(16), rng.randbytes(8), rng.randrange(256)
    return _core.encode_add_request(r)


def step_events(rng: random.Random) -> bytes:
    ev = _core.StepEvents()
    ev.step_id, ev.emit_time_ns = rng.randrange(2**64), rng.randrange(2**63)
    outputs = []
    for _ in range(rng.randrange(4)):
        o = _core.RequestOutput()
        o.request_id = rng.randrange(2**64)
        o.new_token_ids = ids(rng, 3)
        o.logprobs = [real(rng) for _ in o.new_token_ids]
        o.num_top = rng.randrange(3)
        o.top_token_ids = [rng.randrange(9) for _ in range(o.num_top * len(o.new_token_ids))]
        o.top_logprobs = [real(rng) for _ in o.top_token_ids]
        o.finish_reason = rng.choice(list(_core.FinishReason.__members__.values()))
        o.num_prompt_tokens, o.num_cached_tokens, o.num_preemptions = (rng.randrange(U32_MAX) for _ in range(3))
        o.num_computed_tokens, o.num_scheduled_tokens = rng.randrange(999), rng.randrange(999)
        o.arrival_time_ns, o.first_scheduled_time_ns, o.first_token_time_ns = (rng.randrange(2**62) for _ in range(3))
        outputs.append(o)
    ev.outputs = outputs
    return _core.encode_record(ev)


def engine_stats(rng: random.Random) -> bytes:
    s = _core.EngineStats()
    for name in ("query_id", "num_steps", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "total_prompt_tokens", "total_generation_tokens"):  # fmt: skip
        setattr(s, name, rng.randrange(2**64))
    for name in ("num_running", "num_waiting", "num_total_blocks", "num_free_blocks", "block_size",
                 "num_scheduled_tokens"):  # fmt: skip
        setattr(s, name, rng.randrange(U32_MAX))
    s.step_time_ns, s.kv_usage = rng.randrange(2**62), rng.random()
    return _core.encode_record(s)


def with_message(record: Any, rng: random.Random) -> Any:
    record.message = text(rng)
    return record


def step_plan(rng: random.Random) -> bytes:
    plan = _core.StepPlan()
    plan.step_id = rng.randrange(2**64)
    news = []
    for _ in range(rng.randrange(3)):
        n = _core.NewRequestData()
        n.token_ids = ids(rng)
        n.num_prompt_tokens = rng.randrange(len(n.token_ids) + 1)
        n.block_ids, n.suppress_token_ids = ids(rng, 8), ids(rng, 3)
        n.slot, n.num_computed_tokens, n.top_k, n.min_tokens, n.num_logprobs = (rng.randrange(99) for _ in range(5))
        n.temperature, n.top_p, n.min_p = real(rng), real(rng), real(rng)
        n.repetition_penalty, n.frequency_penalty, n.presence_penalty = real(rng), real(rng), real(rng)
        n.seed, n.has_seed = rng.randrange(2**64), rng.random() < 0.5
        news.append(n)
    appends = []
    for _ in range(rng.randrange(3)):
        a = _core.BlockAppend()
        a.slot, a.block_ids = rng.randrange(99), ids(rng, 4)
        appends.append(a)
    plan.new_requests, plan.block_appends = news, appends
    scheduled = rng.randrange(6)
    plan.sched_slots, plan.sched_start, plan.sched_len = [1] * scheduled, [0] * scheduled, [1] * scheduled
    plan.sched_sample = [rng.random() < 0.5 for _ in range(scheduled)]
    plan.finished_slots = ids(rng, 3)
    return _core.encode_record(plan)


def step_result(rng: random.Random) -> bytes:
    rows, n = rng.randrange(5), rng.randrange(3)
    top = (np.full((rows, n), 7, np.int32),
           np.full((rows, n), -0.5, np.float32)) if rng.random() < 0.5 else (None, None)  # fmt: skip
    return _core.encode_step_result(
        rng.randrange(2**64), np.arange(rows, dtype=np.int32), np.full(rows, 3, np.int32),
        np.zeros(rows, np.float32), *top,
    )  # fmt: skip


def ready(rng: random.Random) -> bytes:
    r = _core.EngineReady()
    r.num_total_blocks, r.block_size, r.max_model_len = (rng.randrange(U32_MAX) for _ in range(3))
    return _core.encode_record(r)


def rejected(rng: random.Random) -> bytes:
    r = with_message(_core.RequestRejected(), rng)
    r.request_id, r.status_code = rng.randrange(2**64), rng.choice([3, 8])
    return _core.encode_record(r)


def engine_failed(rng: random.Random) -> bytes:
    r = with_message(_core.EngineFailed(), rng)
    r.reason = rng.choice(list(_core.FailureReason.__members__.values()))
    return _core.encode_record(r)


GENERATORS: list[Callable[[random.Random], bytes]] = [
    add_request,
    lambda rng: _core.encode_abort_request(rng.randrange(2**64)),
    lambda rng: _core.encode_stats_query(rng.randrange(2**64)),
    lambda rng: _core.encode_shutdown(),
    step_events,
    engine_stats,
    rejected,
    ready,
    engine_failed,
    step_plan,
    lambda rng: _core.encode_record(_core.WorkerShutdown()),
    step_result,
    lambda rng: _core.encode_worker_ready(rng.randrange(8), rng.randrange(U32_MAX)),
    lambda rng: _core.encode_worker_failed(rng.randrange(8), text(rng)),
]


# ---- mutations ------------------------------------------------------------------------------------------------------


def put_u32(data: bytearray, at: int, value: int) -> None:
    if at + 4 <= len(data):
        struct.pack_into("<I", data, at, value)


def interesting_u32(rng: random.Random, data: bytes) -> int:
    return rng.choice([0, 1, 2, 7, 8, len(data), len(data) // 4, 2**31 - 1, 2**31, U32_MAX, rng.randrange(2**32)])


def truncate(rng: random.Random, data: bytes) -> bytes:
    cut = bytearray(data[: rng.randrange(len(data))])
    if rng.random() < 0.7:  # keep the length field honest so the decoder walks into the missing fields
        put_u32(cut, 0, len(cut))
    return bytes(cut)


def corrupt_length(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    put_u32(out, 0, interesting_u32(rng, data))
    return bytes(out)


def corrupt_count(rng: random.Random, data: bytes) -> bytes:
    """Overwrites a 4-byte field anywhere in the payload: array counts, nested-struct counts, fixed fields."""
    out = bytearray(data)
    if len(out) > 12:
        put_u32(out, rng.randrange(8, len(out) - 3), interesting_u32(rng, data))
    return bytes(out)


def corrupt_type(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    struct.pack_into("<H", out, 4, rng.choice([*RECORD_TYPES, 0, 5, 99, 0xFFFF]))
    return bytes(out)


def corrupt_version(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    struct.pack_into("<H", out, 6, rng.choice([0, 1, _core.LAYOUT_VERSION + 1, 0xFFFF]))
    return bytes(out)


def grow(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data + rng.randbytes(rng.choice([1, 4, 8, 16])))
    if rng.random() < 0.7:
        put_u32(out, 0, len(out))
    return bytes(out)


STRUCTURAL: list[Callable[[random.Random, bytes], bytes]] = [
    truncate, corrupt_length, corrupt_count, corrupt_type, corrupt_version, grow,
]  # fmt: skip


def flip_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def random_bytes(rng: random.Random) -> bytes:
    data = bytearray(rng.randbytes(rng.choice([0, 3, 8, 16, rng.randrange(200)])))
    if len(data) >= 8 and rng.random() < 0.7:  # a plausible header, so the payload checks run too
        struct.pack_into("<IHH", data, 0, len(data), rng.choice(RECORD_TYPES), _core.LAYOUT_VERSION)
    return bytes(data)


# ---- checks ---------------------------------------------------------------------------------------------------------


def read_every_field(record: Any) -> None:
    """Materializes every attribute (lists, arrays, strings), as a consumer would."""
    for name in dir(record):
        if name.startswith("_"):
            continue
        value = getattr(record, name)
        if isinstance(value, list):
            for item in value:
                if not isinstance(item, (int, float)):  # a nested record (RequestOutput, NewRequestData, ...)
                    read_every_field(item)
        elif isinstance(value, np.ndarray):
            value.tolist()


def decode_or_reject(decoder: Callable[[bytes], Any], data: bytes) -> Any | None:
    try:
        record = decoder(data)
    except _core.RecordError:
        return None
    read_every_field(record)
    return record


def reencoded(record: Any) -> bytes:
    return bytes(_core.encode_record(record))


def test_more_than_100k_random_and_mutated_records_decode_or_raise_record_error() -> None:
    rng = random.Random(20240404)
    inputs = 0
    rejected = 0
    accepted_mutants = 0
    valid = [gen(rng) for gen in GENERATORS for _ in range(40)]
    while inputs < 100_000:
        kind = rng.random()
        base = rng.choice(valid)
        structural = kind < 0.6
        if structural:
            data = rng.choice(STRUCTURAL)(rng, base)
        elif kind < 0.85:
            data = flip_bytes(rng, base)
        else:
            data = random_bytes(rng)
        for decoder in DECODERS:
            inputs += 1
            record = decode_or_reject(decoder, data)
            rejected += record is None
            if record is not None and structural and data != base:
                accepted_mutants += 1
                assert reencoded(record) == data, f"{decoder.__name__} accepted a non-canonical record {data.hex()}"
    assert inputs >= 100_000
    assert rejected > inputs // 2 and accepted_mutants > 0  # both outcomes were exercised


def test_every_valid_record_decodes_with_exactly_one_decoder_and_reencodes_to_itself() -> None:
    rng = random.Random(7)
    for gen in GENERATORS:
        for _ in range(50):
            data = gen(rng)
            decoded = [(d, r) for d in DECODERS if (r := decode_or_reject(d, data)) is not None]
            assert len(decoded) == 1, [d.__name__ for d, _ in decoded]
            assert reencoded(decoded[0][1]) == data


def test_every_truncation_of_every_record_kind_is_rejected() -> None:
    rng = random.Random(3)
    for gen in GENERATORS:
        data = gen(rng)
        for cut in range(len(data)):
            for honest_length in (False, True):
                prefix = bytearray(data[:cut])
                if honest_length:
                    put_u32(prefix, 0, cut)
                for decoder in DECODERS:
                    with pytest.raises(_core.RecordError):
                        decoder(bytes(prefix))


def test_a_cut_utf8_message_still_decodes_readably() -> None:
    failed = _core.EngineFailed()
    failed.message = "worker died: ü"
    data = bytearray(_core.encode_record(failed))
    # Cut the message inside the two-byte "ü" (as a sender truncating by bytes would) and keep the record valid.
    length_at = 8
    (n,) = struct.unpack_from("<I", data, length_at)
    struct.pack_into("<I", data, length_at, n - 1)
    data[length_at + 4 + n - 1] = 0
    decoded = _core.decode_engine_event(bytes(data))
    assert decoded.message == "worker died: \ufffd"
