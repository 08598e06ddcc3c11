"""worker_main: flag checks, the step loop against fake rings, and (when `_core` is built) a real-process smoke test."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ringserve.formats.engine_args import EngineArgs
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model_runner import ModelRunner
from ringserve.workers.worker_main import encode_result, parse_args, serve_steps
from workers_testkit import NewRequest, ids, plan, save_tiny_hf_model

# The settings the frontend resolves before it starts an engine (a worker refuses `auto` there).
RESOLVED = EngineArgs(model_path="m", dtype="float32", max_model_len=64, max_step_slowdown="0", kv_transfer="none")


def worker_flags(engine: EngineArgs = RESOLVED, *extra: str) -> list[str]:
    return ["--step-ring", "/s", "--result-ring", "/r", "--engine-args", engine.to_json(), *extra]


def test_tensor_parallel_size_below_one_is_refused_with_a_clear_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--step-ring", "/s", "--result-ring", "/r", "--engine-args", '{"tensor_parallel_size": 0}'])
    assert exit_info.value.code == 2
    assert "--tensor-parallel-size must be at least 1 (got 0)" in capsys.readouterr().err


def test_rank_outside_the_world_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(worker_flags(replace(RESOLVED, tensor_parallel_size=2), "--rank", "2"))
    assert "--rank 2" in capsys.readouterr().err
    stages = replace(RESOLVED, tensor_parallel_size=2, pipeline_parallel_size=2)  # ranks 0..3
    assert parse_args(worker_flags(stages, "--rank", "3")).rank == 3
    with pytest.raises(SystemExit):
        parse_args(worker_flags(stages, "--rank", "4"))
    message = "--rank 4 is outside [0, 4) (--tensor-parallel-size 2 x --pipeline-parallel-size 2)"
    assert message in capsys.readouterr().err


def test_settings_the_frontend_leaves_to_resolve_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(worker_flags(replace(RESOLVED, dtype="auto")))
    assert "--dtype" in capsys.readouterr().err


def test_flags_have_the_documented_defaults():
    args = parse_args(worker_flags())
    assert (args.rank, args.device, args.seed, args.parent_pid) == (0, "auto", 0, None)
    assert args.engine == RESOLVED
    assert (args.engine.tensor_parallel_size, args.engine.block_size) == (1, 16)
    assert args.engine.num_kv_blocks == 0 and args.engine.kv_cache_memory_gib == 1.0  # 0 = from the memory budget


class WorkerShutdown:
    pass


class FakeReader:
    def __init__(self, records: list[object]) -> None:
        self.records = list(records)

    def read(self, timeout_s: float) -> object | None:
        return self.records.pop(0) if self.records else None


class FakeWriter:
    def __init__(self, full_times: int = 0) -> None:
        self.records: list[object] = []
        self.full_times = full_times

    def write(self, record: object, timeout_s: float) -> bool:
        if self.full_times:
            self.full_times -= 1
            return False
        self.records.append(record)
        return True


FAKE_CORE = SimpleNamespace(
    decode_worker_command=lambda record: record,  # the fake ring already carries decoded objects
    WorkerShutdown=WorkerShutdown,
    encode_step_result=lambda step_id, slots, tokens, logprobs, top_ids, top_logprobs: (
        step_id,
        slots.tolist(),
        tokens.tolist(),
        logprobs,
    ),
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_model("llama", folder)
    return folder


def test_step_loop_answers_each_plan_and_exits_cleanly_on_shutdown(tiny_folder):
    runner = ModelRunner(load_hf_model(tiny_folder, torch.float32), block_size=4, num_kv_blocks=8)
    reader = FakeReader(
        [
            None,  # idle read timeout
            plan(0, [(1, 0, 3, True)], new_requests=[NewRequest(1, ids(4, 5, 6), ids(2), temperature=0.0)]),
            plan(1, [(1, 3, 1, True)]),
            WorkerShutdown(),
        ]
    )
    writer = FakeWriter(full_times=2)  # a full result ring is waited out, not dropped
    assert serve_steps(FAKE_CORE, reader, writer, runner, keep_running=lambda: True) == 0
    assert [(r[0], r[1]) for r in writer.records] == [(0, [1]), (1, [1])]
    assert runner.tokens_of(1)[3:] == [writer.records[0][2][0], writer.records[1][2][0]]
    assert all(isinstance(r[3], np.ndarray) and r[3].dtype == np.float32 for r in writer.records)


def test_step_loop_exits_when_the_parent_is_gone(tiny_folder):
    runner = ModelRunner(load_hf_model(tiny_folder, torch.float32), block_size=4, num_kv_blocks=8)
    assert serve_steps(FAKE_CORE, FakeReader([]), FakeWriter(), runner, keep_running=lambda: False) == 1


def test_a_bad_plan_raises_for_the_caller_to_report(tiny_folder):
    runner = ModelRunner(load_hf_model(tiny_folder, torch.float32), block_size=4, num_kv_blocks=8)
    reader = FakeReader([plan(0, [(3, 0, 1, True)])])  # slot 3 was never added
    with pytest.raises(ValueError, match="slot 3"):
        serve_steps(FAKE_CORE, reader, FakeWriter(), runner, keep_running=lambda: True)


def test_worker_process_attaches_to_real_rings_and_announces_ready(tiny_folder):
    core = pytest.importorskip("ringserve._core")
    token = secrets.token_hex(8)
    step = core.ShmRing.create(f"/ringserve-{os.getpid()}-{token}-step", 1 << 20, 1)
    result = core.ShmRing.create(f"/ringserve-{os.getpid()}-{token}-res", 1 << 20, 1)
    engine = replace(RESOLVED, model_path=str(tiny_folder), block_size=4, num_kv_blocks=16, worker_threads=1)
    command = [sys.executable, "-m", "ringserve.workers.worker_main", "--parent-pid", str(os.getpid())]
    command += ["--step-ring", step.name, "--result-ring", result.name, "--engine-args", engine.to_json()]
    proc = subprocess.Popen(command)
    try:
        record = core.RingReader(result).read(120.0)
        assert record is not None, "worker never wrote WorkerReady"
        if hasattr(core, "decode_worker_result"):
            ready = core.decode_worker_result(record)
            assert type(ready).__name__ == "WorkerReady" and ready.num_kv_blocks == 16
        if hasattr(core, "encode_worker_shutdown"):
            assert core.RingWriter(step).write(core.encode_worker_shutdown(), 5.0)
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        step.unlink()
        result.unlink()


def test_step_result_carries_top_logprobs_through_the_real_record(tiny_folder):
    core = pytest.importorskip("ringserve._core")
    runner = ModelRunner(load_hf_model(tiny_folder, torch.float32), block_size=4, num_kv_blocks=8)
    reqs = [NewRequest(0, ids(4, 5), ids(1), num_logprobs=2, temperature=0.0), NewRequest(1, ids(6), ids(2),
                                                                                          temperature=0.0)]
    out = runner.execute(plan(7, [(0, 0, 2, True), (1, 0, 1, True)], new_requests=reqs))
    result = core.decode_worker_result(encode_result(core, out))
    assert result.step_id == 7 and list(result.slots) == [0, 1]
    assert np.asarray(result.top_token_ids).reshape(2, 2).tolist() == out.top_token_ids.tolist()
    assert np.asarray(result.top_token_ids).reshape(2, 2)[1].tolist() == [-1, -1]
