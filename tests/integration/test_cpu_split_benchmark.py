"""benchmarks/cpu_split.py, quick, two worker threads: every process's CPU per token is counted, and the worker runs
PyTorch's OpenMP with the wait policy the engine gives it (backend/process.py's worker_environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_counts_each_process_and_the_worker_does_not_spin():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    done = subprocess.run(
        [sys.executable, "benchmarks/cpu_split.py", "--quick", "--threads", "2", "--num-prompts", "4",
         "--output-len", "4", "--single-len", "8", "--ttft-len", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    server = json.loads(done.stdout.strip().splitlines()[-1])["by_threads"]["2"]
    assert server["worker_openmp_env"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert server["offline"]["tok_s"] > 0 and server["single"]["tok_s"] > 0 and server["ttft"]["ttft_ms"] > 0
    roles = server["offline"]["per_1k_tokens"]
    assert {"frontend", "engine", "worker.main", "client"} <= set(roles)
    assert roles["worker.main"]["cpu_ms"] > 0 and roles["worker.main"]["threads"] == 1
