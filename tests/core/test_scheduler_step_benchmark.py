"""benchmarks/scheduler_step.py ends with the one JSON line issue #3 names, its rounds interleaving the sizes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_run_reports_every_size_and_the_growth_of_each_round():
    done = subprocess.run(
        [sys.executable, "benchmarks/scheduler_step.py", "--steps", "30", "--rounds", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "scheduler_step" and result["steps"] == 30
    # It re-executes itself with the engine process's huge-page malloc unless switched off.
    assert result["malloc_huge_pages"] is (os.environ.get("RINGSERVE_ENGINE_HUGE_PAGES", "1") != "0")
    for key in ("step_us_median", "step_us_p99"):
        assert set(result[key]) == {"64", "256", "1024"}
        assert all(v > 0 for v in result[key].values())
    # Each size's median is its best round, so it is at most its p99 (same round).
    assert all(result["step_us_median"][n] <= result["step_us_p99"][n] for n in ("64", "256", "1024"))
    for n, us in result["step_us_median"].items():
        assert abs(result["ns_per_request"][n] - 1000 * us / int(n)) < 0.01
    rounds = result["growth_rounds"]
    assert len(rounds) == 3 and all(g > 0 for g in rounds)
    assert abs(result["growth_256_to_1024"] - statistics.median(rounds)) < 1e-3
