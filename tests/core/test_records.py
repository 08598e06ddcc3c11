"""Ring records through the binding: every record round-trips, malformed bytes raise RecordError."""

from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from ringserve import _core


def make_add_request() -> _core.AddRequest:
    r = _core.AddRequest()
    r.request_id = 2**63 + 5
    r.prompt_token_ids = [1, 2, 3, 49151]
    r.max_tokens = 32
    r.temperature = 0.5
    r.top_p = 0.75
    r.top_k = 20
    r.seed = 7
    r.has_seed = True
    r.ignore_eos = True
    r.stop_token_ids = [9, 10]
    r.priority = 2
    r.arrival_time_ns = 1_700_000_000_123_456_789
    r.trace_id = bytes(range(16))
    r.span_id = bytes(range(8))
    r.trace_flags = 1
    return r


def test_record_error_is_a_value_error() -> None:
    assert issubclass(_core.RecordError, ValueError)


def test_add_request_round_trips_every_field() -> None:
    data = _core.encode_add_request(make_add_request())
    assert isinstance(data, bytes) and len(data) % 8 == 0
    r = _core.decode_request_record(data)
    assert isinstance(r, _core.AddRequest)
    assert r.request_id == 2**63 + 5
    assert r.prompt_token_ids == [1, 2, 3, 49151]
    assert (r.max_tokens, r.top_k, r.seed, r.priority) == (32, 20, 7, 2)
    assert r.temperature == pytest.approx(0.5) and r.top_p == pytest.approx(0.75)
    assert r.has_seed and r.ignore_eos
    assert r.stop_token_ids == [9, 10]
    assert r.arrival_time_ns == 1_700_000_000_123_456_789
    assert r.trace_id == bytes(range(16)) and r.span_id == bytes(range(8)) and r.trace_flags == 1


def test_trace_ids_must_have_their_exact_size() -> None:
    r = _core.AddRequest()
    assert r.trace_id == bytes(16)
    with pytest.raises(ValueError):
        r.trace_id = b"short"


def test_small_request_records_round_trip() -> None:
    assert _core.decode_request_record(_core.encode_abort_request(11)).request_id == 11
    assert _core.decode_request_record(_core.encode_stats_query(12)).query_id == 12
    assert isinstance(_core.decode_request_record(_core.encode_shutdown()), _core.Shutdown)


def test_engine_events_round_trip() -> None:
    out = _core.RequestOutput()
    out.request_id = 3
    out.new_token_ids = [5, 6]
    out.logprobs = [-0.5, -1.5]
    out.finish_reason = _core.FinishReason.STOP
    out.num_prompt_tokens = 4
    out.first_token_time_ns = 99
    ev = _core.StepEvents()
    ev.step_id = 8
    ev.emit_time_ns = 100
    ev.outputs = [out]
    got = _core.decode_engine_event(_core.encode_record(ev))
    assert isinstance(got, _core.StepEvents)
    assert got.step_id == 8 and got.emit_time_ns == 100
    (o,) = got.outputs
    assert o.new_token_ids == [5, 6] and o.logprobs == [-0.5, -1.5]
    assert o.finish_reason == _core.FinishReason.STOP and o.num_prompt_tokens == 4 and o.first_token_time_ns == 99

    rejected = _core.RequestRejected()
    rejected.request_id, rejected.status_code, rejected.message = 4, 8, "needs 9000 tokens"
    got = _core.decode_engine_event(_core.encode_record(rejected))
    assert (got.request_id, got.status_code, got.message) == (4, 8, "needs 9000 tokens")
    failed = _core.EngineFailed()
    assert failed.reason == _core.FailureReason.ENGINE_FAILED  # the default: none of the typed causes
    failed.message = "worker died"
    assert _core.decode_engine_event(_core.encode_record(failed)).message == "worker died"
    for reason in _core.FailureReason.__members__.values():
        got = _core.decode_engine_event(_core.encode_record(_core.EngineFailed(message="m", reason=reason)))
        assert (got.message, got.reason) == ("m", reason)
    data = bytearray(_core.encode_record(_core.EngineFailed(message="m")))
    data[8 + 4 + 1] = max(r.value for r in _core.FailureReason.__members__.values()) + 1  # the reason's byte
    with pytest.raises(_core.RecordError, match="unknown reason"):
        _core.decode_engine_event(bytes(data))


def test_step_plan_round_trips_with_numpy_arrays() -> None:
    nr = _core.NewRequestData()
    nr.slot = 2
    nr.token_ids = np.arange(5, dtype=np.int32)
    nr.block_ids = [7, 8]
    ba = _core.BlockAppend()
    ba.slot = 1
    ba.block_ids = [9]
    plan = _core.StepPlan()
    plan.step_id = 77
    plan.new_requests = [nr]
    plan.block_appends = [ba]
    plan.sched_slots = [1, 2]
    plan.sched_start = [30, 0]
    plan.sched_len = [1, 5]
    plan.sched_sample = [True, False]
    plan.finished_slots = [0]
    got = _core.decode_worker_command(_core.encode_record(plan))
    assert isinstance(got, _core.StepPlan) and got.step_id == 77
    assert got.sched_slots.dtype == np.int32 and got.sched_sample.dtype == np.bool_
    assert got.sched_slots.tolist() == [1, 2] and got.sched_start.tolist() == [30, 0]
    assert got.sched_len.tolist() == [1, 5] and got.sched_sample.tolist() == [True, False]
    assert got.finished_slots.tolist() == [0]
    assert got.new_requests[0].token_ids.tolist() == [0, 1, 2, 3, 4]
    assert got.new_requests[0].block_ids.tolist() == [7, 8]
    assert got.block_appends[0].slot == 1 and got.block_appends[0].block_ids.tolist() == [9]
    assert isinstance(_core.decode_worker_command(_core.encode_record(_core.WorkerShutdown())), _core.WorkerShutdown)


def test_worker_results_round_trip() -> None:
    data = _core.encode_step_result(
        5, np.array([0, 3], np.int32), np.array([11, 12], np.int32), np.array([-0.25, -2.0], np.float32)
    )
    r = _core.decode_worker_result(data)
    assert r.step_id == 5 and r.slots.tolist() == [0, 3] and r.token_ids.tolist() == [11, 12]
    assert r.logprobs.tolist() == [-0.25, -2.0]
    ready = _core.decode_worker_result(_core.encode_worker_ready(0, 1234))
    assert isinstance(ready, _core.WorkerReady) and ready.num_kv_blocks == 1234
    failed = _core.decode_worker_result(_core.encode_worker_failed(1, "OOM"))
    assert isinstance(failed, _core.WorkerFailed) and failed.rank == 1 and failed.message == "OOM"


def test_step_result_arrays_must_match() -> None:
    with pytest.raises(_core.RecordError):
        _core.encode_step_result(1, np.array([0, 1], np.int32), np.array([5], np.int32), np.zeros(2, np.float32))


def with_u32(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<I", value) + data[offset + 4 :]


def with_u16(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + struct.pack("<H", value) + data[offset + 2 :]


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda d: d[:4], id="shorter-than-header"),
        pytest.param(lambda d: with_u32(d, 0, len(d) + 8), id="length-field-too-long"),
        pytest.param(lambda d: with_u32(d + bytes(3), 0, len(d) + 3), id="misaligned"),
        pytest.param(lambda d: with_u16(d, 6, _core.LAYOUT_VERSION + 1), id="wrong-version"),
        pytest.param(lambda d: with_u16(d, 4, 999), id="unknown-type"),
        pytest.param(lambda d: with_u32(d, 16, 1 << 30), id="truncated-prompt-array"),  # after header + request_id
        pytest.param(lambda d: with_u32(d[:88], 0, 88), id="truncated-record"),
        pytest.param(lambda d: with_u32(d + bytes(8), 0, len(d) + 8), id="trailing-bytes"),
    ],
)
def test_malformed_request_records_are_rejected(corrupt: Callable[[bytes], bytes]) -> None:
    data = _core.encode_add_request(make_add_request())
    with pytest.raises(_core.RecordError):
        _core.decode_request_record(corrupt(data))


def test_a_record_of_another_ring_is_rejected() -> None:
    with pytest.raises(_core.RecordError, match="unknown record type"):
        _core.decode_engine_event(_core.encode_shutdown())
    with pytest.raises(_core.RecordError):
        _core.decode_worker_command(_core.encode_worker_ready(0, 1))


def test_every_truncation_is_rejected() -> None:
    data = _core.encode_add_request(make_add_request())
    for cut in range(len(data)):
        prefix = data[:cut]
        if cut >= 4:
            prefix = with_u32(prefix, 0, cut)
        with pytest.raises(_core.RecordError):
            _core.decode_request_record(prefix)


def test_layout_version_is_5() -> None:
    assert _core.LAYOUT_VERSION == 5


def test_sampling_params_have_one_set_of_defaults_shared_by_every_record() -> None:
    defaults = dict(_core.SAMPLING_FIELDS)
    assert defaults["temperature"] == 1.0 and defaults["top_p"] == 1.0 and defaults["top_k"] == 0
    for record in (_core.AddRequest(), _core.NewRequestData(), _core.SamplingParams()):
        for name, default in defaults.items():
            assert getattr(record, name) == default, (type(record).__name__, name)
    assert _core.AddRequest().max_tokens == 256  # the public API's default


def test_sampling_params_are_one_struct_embedded_in_the_request_and_the_new_request() -> None:
    r = _core.AddRequest()
    r.sampling = _core.SamplingParams(temperature=0.5, top_k=7, seed=3, has_seed=True)
    assert r.temperature == 0.5 and r.top_k == 7  # each field also reads by its own name
    r.sampling.top_p = 0.25  # the nested struct is the record's own, not a copy
    assert _core.decode_request_record(_core.encode_add_request(r)).sampling.top_p == 0.25
    n = _core.NewRequestData()
    n.sampling = r.sampling
    assert n.temperature == 0.5 and n.sampling.seed == 3
    with pytest.raises(TypeError, match="unknown field"):
        _core.SamplingParams(temprature=0.5)


def test_every_record_is_built_from_its_fields_by_name() -> None:
    output = _core.RequestOutput(request_id=7, new_token_ids=[3, 4], logprobs=[-0.5, -1.0], num_spec_proposed_tokens=2,
                                 finish_reason=_core.FinishReason.STOP)  # fmt: skip
    got = _core.decode_engine_event(_core.encode_record(_core.StepEvents(step_id=1, outputs=[output]))).outputs[0]
    assert (got.request_id, got.new_token_ids, got.finish_reason) == (7, [3, 4], _core.FinishReason.STOP)
    assert got.num_spec_proposed_tokens == 2 and got.num_cached_tokens == 0  # the rest keep their defaults
    request = _core.AddRequest(request_id=9, temperature=0.5, trace_id=b"\x01" * 16)  # a nested field by its name
    assert (request.sampling.temperature, request.trace_id, request.max_tokens) == (0.5, b"\x01" * 16, 256)
    assert _core.NewRequestData(slot=2, token_ids=[1, 2], top_k=4).token_ids.tolist() == [1, 2]
    assert _core.EngineReady(max_model_len=64).max_model_len == 64
    for cls in (_core.EngineStats, _core.StepPlan, _core.SamplingParams):
        with pytest.raises(TypeError, match="unknown field 'bogus'"):
            cls(bogus=1)
    with pytest.raises(ValueError, match="trace_id"):  # converted and checked as an assignment is
        _core.AddRequest(trace_id=b"short")


def test_the_lookahead_limit_is_exposed_once() -> None:
    assert _core.MAX_LOOKAHEAD_SLOTS == 64


def test_add_request_v2_fields_round_trip() -> None:
    r = make_add_request()
    r.min_tokens, r.num_logprobs, r.cache_salt = 3, 5, 2**64 - 1
    r.min_p, r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 0.05, 1.25, 0.5, -0.5
    got = _core.decode_request_record(_core.encode_add_request(r))
    assert (got.min_tokens, got.num_logprobs, got.cache_salt) == (3, 5, 2**64 - 1)
    assert got.min_p == pytest.approx(0.05) and got.repetition_penalty == pytest.approx(1.25)
    assert got.frequency_penalty == pytest.approx(0.5) and got.presence_penalty == pytest.approx(-0.5)
    defaults = _core.AddRequest()
    assert (defaults.min_tokens, defaults.min_p, defaults.repetition_penalty) == (0, 0, 1)
    assert (defaults.frequency_penalty, defaults.presence_penalty) == (0, 0)
    assert (defaults.num_logprobs, defaults.cache_salt) == (0, 0)


def test_new_request_data_v2_fields_round_trip() -> None:
    nr = _core.NewRequestData()
    nr.slot = 1
    nr.token_ids = np.arange(6, dtype=np.int32)
    nr.num_prompt_tokens = 4
    nr.min_tokens, nr.num_logprobs = 2, 3
    nr.min_p, nr.repetition_penalty, nr.frequency_penalty, nr.presence_penalty = 0.1, 1.1, 0.2, 0.3
    nr.suppress_token_ids = np.array([2, 9], np.int32)
    plan = _core.StepPlan()
    plan.new_requests = [nr]
    (got,) = _core.decode_worker_command(_core.encode_record(plan)).new_requests
    assert got.num_prompt_tokens == 4 and got.min_tokens == 2 and got.num_logprobs == 3
    assert got.min_p == pytest.approx(0.1) and got.repetition_penalty == pytest.approx(1.1)
    assert got.frequency_penalty == pytest.approx(0.2) and got.presence_penalty == pytest.approx(0.3)
    assert got.suppress_token_ids.dtype == np.int32 and got.suppress_token_ids.tolist() == [2, 9]


def test_step_result_carries_optional_top_logprobs() -> None:
    slots, tokens, logprobs = np.array([0, 3], np.int32), np.array([11, 12], np.int32), np.zeros(2, np.float32)
    top_ids = np.array([[11, 4, 5], [12, -1, -1]], np.int32)
    top_lp = np.array([[-0.1, -2.0, -3.0], [-0.2, 0.0, 0.0]], np.float32)
    r = _core.decode_worker_result(_core.encode_step_result(1, slots, tokens, logprobs, top_ids, top_lp))
    assert r.num_top == 3 and r.top_token_ids.shape == (2, 3)
    assert r.top_token_ids.tolist() == top_ids.tolist() and np.allclose(r.top_logprobs, top_lp)
    plain = _core.decode_worker_result(_core.encode_step_result(2, slots, tokens, logprobs))
    assert plain.num_top == 0 and plain.top_token_ids.shape == (2, 0)
    with pytest.raises(ValueError):
        _core.encode_step_result(3, slots, tokens, logprobs, top_ids[:1], top_lp[:1])  # wrong row count
    with pytest.raises(ValueError):
        _core.encode_step_result(3, slots, tokens, logprobs, top_ids, None)  # both or neither


def test_request_output_and_engine_stats_v2_fields_round_trip() -> None:
    out = _core.RequestOutput()
    out.request_id = 1
    out.new_token_ids, out.logprobs = [5], [-0.5]
    out.num_top, out.top_token_ids, out.top_logprobs = 2, [5, 6], [-0.5, -1.0]
    out.num_computed_tokens, out.num_scheduled_tokens, out.num_preemptions = 10, 3, 1
    ev = _core.StepEvents()
    ev.outputs = [out]
    (o,) = _core.decode_engine_event(_core.encode_record(ev)).outputs
    assert (o.num_top, o.top_token_ids, o.top_logprobs) == (2, [5, 6], [-0.5, -1.0])
    assert (o.num_computed_tokens, o.num_scheduled_tokens, o.num_preemptions) == (10, 3, 1)
    stats = _core.EngineStats()
    stats.num_scheduled_tokens, stats.step_time_ns, stats.kv_usage = 7, 1234, 0.5
    stats.prefix_cache_queries, stats.prefix_cache_hits = 100, 64
    stats.total_prompt_tokens, stats.total_generation_tokens = 300, 400
    got = _core.decode_engine_event(_core.encode_record(stats))
    assert (got.num_scheduled_tokens, got.step_time_ns, got.kv_usage) == (7, 1234, 0.5)
    assert (got.prefix_cache_queries, got.prefix_cache_hits) == (100, 64)
    assert (got.total_prompt_tokens, got.total_generation_tokens) == (300, 400)


def test_engine_config_v2_defaults() -> None:
    config = _core.EngineConfig()
    assert config.enable_prefix_caching is True
    assert config.long_prefill_token_threshold == 0 and config.stats_interval_ms == 100


def test_step_result_carries_several_tokens_per_row_with_speculation() -> None:
    record = _core.encode_step_result(
        9, np.array([3, 1], np.int32), np.array([5, 6, 7, 8], np.int32), np.zeros(4, np.float32),
        token_counts=np.array([3, 1], np.int32), num_proposed=np.array([4, 0], np.int32),
    )  # fmt: skip
    r = _core.decode_worker_result(record)
    assert r.token_ids.tolist() == [5, 6, 7, 8]
    assert r.token_counts.tolist() == [3, 1] and r.num_proposed.tolist() == [4, 0]
    with pytest.raises(_core.RecordError, match="one entry per token"):  # counts say 4 tokens, 3 given
        _core.encode_step_result(9, np.array([3, 1], np.int32), np.array([5, 6, 7], np.int32), np.zeros(3, np.float32),
                                 token_counts=np.array([3, 1], np.int32))  # fmt: skip


def test_step_plan_lookahead_and_trims_round_trip_as_views() -> None:
    plan = _core.StepPlan()
    plan.step_id = 4
    plan.sched_slots = np.array([0, 2], np.int32)
    plan.sched_start = np.array([10, 20], np.int32)
    plan.sched_len = np.array([1, 1], np.int32)
    plan.sched_sample = np.array([True, True])
    plan.sched_lookahead = np.array([4, 0], np.int32)
    plan.trim_slots = np.array([2], np.int32)
    plan.trim_num_blocks = np.array([3], np.int32)
    decoded = _core.decode_worker_command(_core.encode_record(plan))
    assert decoded.sched_lookahead.tolist() == [4, 0]
    assert decoded.trim_slots.tolist() == [2] and decoded.trim_num_blocks.tolist() == [3]
    plan.sched_lookahead = np.array([4], np.int32)  # neither empty nor one per entry
    with pytest.raises(_core.RecordError, match="sched_lookahead"):
        _core.encode_record(plan)


def test_engine_config_speculation_defaults_are_off() -> None:
    config = _core.EngineConfig()
    assert config.num_speculative_tokens == 0 and config.spec_max_batch == 16
    assert config.spec_min_acceptance == pytest.approx(0.25) and config.spec_backoff_steps == 16


def test_the_committed_core_stub_is_current() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "scripts" / "gen_core_stub.py"), "--check"], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
