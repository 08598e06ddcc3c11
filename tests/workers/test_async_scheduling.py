"""Async scheduling with a real model: the scheduler plans step N+1 before step N's tokens are known, and the model
runner computes each pending token from the token it sampled itself. Greedy and seeded outputs must equal those of
the synchronous loop (tiny random Llama, CPU), through stop ids, max_tokens, chunked prompts, shared prefixes and an
abort, with every block back in the pool at the end."""

from __future__ import annotations

import runpy
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from ringserve import _core
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model_runner import ModelRunner
from ringserve.workers.worker_main import encode_result
from workers_testkit import save_tiny_hf_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ABORTED = 1  # aborted once it has streamed a token


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf_model("llama", path)
    return path


def requests() -> dict[int, list[_core.AddRequest]]:
    """Arrivals by loop iteration: greedy and seeded requests, a shared prefix, a stop id, a long prompt."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 256, 12).tolist()
    arrivals: dict[int, list[_core.AddRequest]] = {}
    for rid in range(1, 9):
        prompt = (shared if rid % 3 == 0 else []) + rng.integers(3, 256, int(rng.integers(2, 30))).tolist()
        max_tokens = 12 if rid == ABORTED else int(rng.integers(1, 11))
        r = _core.AddRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens)
        if rid % 2 == 0:
            r.temperature, r.top_k, r.seed, r.has_seed = 0.9, 40, 1000 + rid, True
        else:
            r.temperature = 0.0
        if rid == 5:
            r.stop_token_ids = [int(t) for t in range(3, 256, 3)]  # a third of the vocabulary ends it
        arrivals.setdefault(int(rng.integers(0, 12)), []).append(r)
    return arrivals


def serve(folder: Path, async_scheduling: bool) -> tuple[dict, dict, int]:
    """Plays Engine::run over a real ModelRunner; returns tokens and finish reasons per request, and how many steps
    were planned ahead. Request ABORTED is aborted once it has streamed a token (with a step in flight, async)."""
    runner = ModelRunner(load_hf_model(folder, torch.float32), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    config = _core.EngineConfig()
    config.block_size, config.num_blocks = BLOCK_SIZE, NUM_BLOCKS
    config.max_num_seqs, config.max_num_batched_tokens = 4, 24
    config.async_scheduling = async_scheduling
    scheduler = _core.Scheduler(config)
    arrivals = requests()
    sent: deque = deque()
    tokens: dict[int, list[int]] = {}
    finish: dict[int, object] = {}
    ahead = 0
    for iteration in range(2000):
        for r in arrivals.pop(iteration, []):
            assert scheduler.add_request(r) is None
        if tokens.get(ABORTED) and ABORTED not in finish:
            assert scheduler.abort_request(ABORTED)
        if scheduler.num_steps_in_flight == 0:
            plan = scheduler.schedule()
            if plan is None:
                if not arrivals and not scheduler.has_unfinished:
                    break
                continue
            sent.append(plan)
        if async_scheduling and (plan := scheduler.schedule_ahead()) is not None:
            sent.append(plan)
            ahead += 1
        out = runner.execute(sent.popleft())
        scheduler.update(_core.decode_worker_result(encode_result(_core, out)))
        for o in scheduler.take_outputs():  # (an abort's output comes with the next step's)
            assert o.request_id not in finish, "an output after the final one"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason != _core.FinishReason.NONE:
                finish[o.request_id] = o.finish_reason
        scheduler.check_invariants()
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not scheduler.has_unfinished and not sent
    return tokens, finish, ahead


def test_greedy_and_seeded_outputs_are_the_same_with_async_scheduling(folder: Path) -> None:
    sync_tokens, sync_finish, none_ahead = serve(folder, False)
    async_tokens, async_finish, ahead = serve(folder, True)
    assert none_ahead == 0 and ahead > 10
    assert len(sync_finish) == 8 and sync_finish == async_finish
    assert sync_finish[ABORTED] == _core.FinishReason.ABORT and 1 <= len(async_tokens.pop(ABORTED)) < 12
    del sync_tokens[ABORTED]  # where the abort lands in its stream differs
    assert sync_tokens == async_tokens
    assert _core.FinishReason.STOP in sync_finish.values() and _core.FinishReason.LENGTH in sync_finish.values()


def test_the_benchmark_drives_the_engine_and_a_worker_both_ways(tmp_path: Path) -> None:
    """benchmarks/async_scheduling.py's run() (its warm-up size): the engine loop and the worker's step loop together,
    so that the benchmark keeps up with the APIs it calls."""
    from ringserve.frontend.model_source import ModelNotFoundError, embedded_model_path

    try:
        embedded_model_path()  # random_model.py writes its tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "async_scheduling.py"),
                           run_name="async_scheduling_benchmark")  # fmt: skip
    bench["write_model"](tmp_path / "toy", "toy")
    for async_scheduling in (False, True):
        result = bench["run"](tmp_path / "toy", async_scheduling, 2, 16, 8)  # asserts every token arrived
        assert result["steps"] >= 8 and result["tok_s"] > 0
        assert {"worker_wait", "input_prep", "model", "sampling", "result"} <= set(result["us_per_step"])
