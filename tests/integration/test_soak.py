"""benchmarks/soak.py --quick --chaos against a real server: mixed traffic (bad requests among it) while a worker or
the engine is killed; every request ends as expected (UNAVAILABLE only for those caught in a kill) and nothing
leaks: KV blocks, /dev/shm segments, processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_chaos_soak_has_no_unexpected_error_and_leaks_nothing(model_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    run = subprocess.run([sys.executable, "benchmarks/soak.py", "--quick", "--chaos", "--model", str(model_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert run.stdout.strip(), run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\n[soak] {json.dumps(result)}")
    assert run.returncode == 0, (result, run.stderr[-3000:])
    assert result["unexpected_errors"] == 0, result["unexpected_samples"]
    outcomes = result["outcomes"]
    assert outcomes.get("completed", 0) > 0 and outcomes.get("refused", 0) > 0  # the mix reached the server
    assert set(result["errors_by_status"]) <= {"INVALID_ARGUMENT", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"}
    assert sum(result["kills"].values()) >= 1 and result["restarts"] >= 1
    assert len(result["times_to_serving_s"]) == sum(result["kills"].values())
    assert result["kv_blocks"]["free_idle"] == result["kv_blocks"]["total"] > 0
    assert result["shm_segments"] == {"serving": 0, "after_stop": 0, "left": []}
    assert result["processes_left"] == [] and result["server_exit_code"] == 0
    assert result["leaked"] is False
    for key in ("frontend_rss_mib", "engine_rss_mib", "workers_rss_mib", "frontend_anon_mib", "engine_anon_mib",
                "workers_anon_mib"):
        assert result[key]["end"] is not None, key
    assert result["open_fds"]["frontend"]["start"] > 0
