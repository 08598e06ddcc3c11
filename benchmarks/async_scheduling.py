"""Async scheduling on and off: the C++ engine loop and a real worker (ModelRunner on a random-weight model, CPU)
over shared-memory rings in one process, the engine on its own thread (it runs without the GIL), N greedy streams.
Reports output tokens/s and the host work per step by phase, with and without --async-scheduling, measured in
alternating rounds of the same run:

- worker_wait: the worker waiting for its next plan after answering a step (the engine's update, scheduling and
  plan write, plus the ring's wake-up, when nothing is planned ahead);
- input_prep: applying the plan's deltas and preparing the batch's input tensors;
- model: the forward pass; sampling: the sampler, including appending the tokens to the batch;
- result: writing the StepResult to the ring.

    python benchmarks/async_scheduling.py [--quick] [--shape toy] [--streams 8]

The last line of output is one JSON object: per mode tok_s and us_per_step by phase, and tok_s_ratio (on / off).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ringserve import _core
from ringserve.workers import worker_main
from ringserve.workers.loader import load_model
from ringserve.workers.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_model import SHAPES, write_model

RING_BYTES = 1 << 22
BLOCK_SIZE = 16


class Phases:
    """Seconds spent per phase, summed over the steps of one run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return wrapper

    def us_per_step(self) -> dict[str, float]:
        return {k: round(v * 1e6 / max(1, self.steps), 1) for k, v in sorted(self.seconds.items())}


class TimedReader:
    """The step ring's reader, timing how long the worker waits for each plan once it has answered a step."""

    def __init__(self, reader: Any, phases: Phases) -> None:
        self.reader, self.phases = reader, phases

    def read(self, timeout_s: float) -> Any:
        start = time.perf_counter()
        record = self.reader.read(timeout_s)
        if record is not None and self.phases.steps > 0:
            self.phases.seconds["worker_wait"] += time.perf_counter() - start
        return record


class TimedWriter:
    """The result ring's writer, timing each StepResult's write."""

    def __init__(self, writer: Any, phases: Phases) -> None:
        self.write = phases.timed("result", writer.write)


def run(folder: Path, async_scheduling: bool, streams: int, prompt_len: int, gen: int) -> dict[str, Any]:
    names = {role: f"/ringserve-{os.getpid()}-{secrets.token_hex(8)}-{role}" for role in ("req", "evt", "step", "res")}
    rings = {role: _core.ShmRing.create(name, RING_BYTES) for role, name in names.items()}
    config = _core.EngineConfig()
    config.block_size, config.max_num_seqs, config.max_num_batched_tokens = BLOCK_SIZE, max(streams, 1), 2048
    config.async_scheduling = async_scheduling
    config.stats_interval_ms = 0
    phases = Phases()
    runner = ModelRunner(load_model(folder, torch.float32), block_size=BLOCK_SIZE,
                         num_kv_blocks=streams * (-(-(prompt_len + gen) // BLOCK_SIZE) + 1) + 8)  # fmt: skip
    runner.apply_plan_deltas = phases.timed("input_prep", runner.apply_plan_deltas)  # type: ignore[method-assign]
    runner.batch.prepare = phases.timed("input_prep", runner.batch.prepare)  # type: ignore[method-assign]
    runner.model.forward = phases.timed("model", runner.model.forward)  # type: ignore[method-assign]
    sample = phases.timed("sampling", runner._sample)

    def counted_sample(*args: Any) -> Any:
        phases.steps += 1
        return sample(*args)

    runner._sample = counted_sample  # type: ignore[method-assign]
    engine = _core.Engine(config, *(names[r] for r in ("req", "evt", "step", "res")), [])
    stop = threading.Event()

    def work() -> None:
        writer = TimedWriter(_core.RingWriter(_core.ShmRing.attach(names["res"])), phases)
        reader = TimedReader(_core.RingReader(_core.ShmRing.attach(names["step"])), phases)
        assert writer.write(_core.encode_worker_ready(0, runner.num_kv_blocks), 10.0)
        worker_main.serve_steps(_core, reader, writer, runner, lambda: not stop.is_set())

    threads = [threading.Thread(target=work, daemon=True), threading.Thread(target=engine.run, daemon=True)]
    for t in threads:
        t.start()
    requests, events = _core.RingWriter(rings["req"]), _core.RingReader(rings["evt"])
    assert isinstance(_core.decode_engine_event(events.read(60.0)), _core.EngineReady)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for rid in range(1, streams + 1):
        r = _core.AddRequest(request_id=rid, prompt_token_ids=rng.integers(10, 1000, prompt_len).tolist(),
                             max_tokens=gen, temperature=0.0, ignore_eos=True)  # fmt: skip
        assert requests.write(_core.encode_add_request(r), 10.0)
    finished, tokens = 0, 0
    while finished < streams:
        record = events.read(60.0)
        assert record is not None, "the engine stopped answering"
        event = _core.decode_engine_event(record)
        if isinstance(event, _core.StepEvents):
            for out in event.outputs:
                tokens += len(out.new_token_ids)
                finished += out.finish_reason != _core.FinishReason.NONE
    elapsed = time.perf_counter() - start
    requests.write(_core.encode_shutdown(), 10.0)
    for t in threads:
        t.join(30)
    stop.set()
    for ring in rings.values():
        ring.unlink()
    assert tokens == streams * gen
    return {"tok_s": round(tokens / elapsed, 1), "steps": phases.steps, "us_per_step": phases.us_per_step()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of each mode, fewer tokens (< 60 s)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="toy", help="random model shape (default toy)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, gen = (1, 64) if args.quick else (3, 128)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.shape
        write_model(folder, args.shape)
        results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        run(folder, True, 2, 16, 8)  # warm-up: imports, allocator, first-step paths
        for _ in range(rounds):
            for mode in ("off", "on"):
                results[mode].append(run(folder, mode == "on", args.streams, 32, gen))
                print(mode, results[mode][-1], flush=True)

    def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]

    best = {mode: median_run(runs) for mode, runs in results.items()}
    ratios = [on["tok_s"] / off["tok_s"] for on, off in zip(results["on"], results["off"], strict=True)]
    print(json.dumps({
        "benchmark": "async_scheduling",
        "shape": args.shape,
        "streams": args.streams,
        "gen_tokens": gen,
        "rounds": rounds,
        "worker_threads": args.threads,
        "off": best["off"],
        "on": best["on"],
        "tok_s_ratio": round(statistics.median(ratios), 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }))


if __name__ == "__main__":
    main()
