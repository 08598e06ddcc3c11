"""benchmarks/engine_loop.py runs the real engine loop over rings it created and ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ringserve import _core

ROOT = Path(__file__).resolve().parents[2]


def test_engine_loop_runs_over_the_rings_it_created_after_the_engine_unlinked_their_names():
    timing = _core.bench_engine_loop(4, prompt_len=16, num_steps=50)
    assert timing["steps"] == 50 and timing["us_per_step"] > 0


def test_short_run_reports_both_sizes_in_one_json_line():
    done = subprocess.run(
        [sys.executable, "benchmarks/engine_loop.py", "--quick", "--steps", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "engine_loop" and result["steps"] == 50
    assert set(result["us_per_step"]) == {"1", "256"}
    assert all(v > 0 for v in result["us_per_step"].values())
    assert result["baseline_us_per_step_1_running"] == result["us_per_step"]["1"]
