"""benchmarks/serve.py loads the three front doors on one server it starts and ends with its one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_loads_every_api_and_reports_each_apis_figures():
    done = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--quick", "--no-progress", "--api", "ringserve,openai,kserve",
         "--server-arg=--worker-threads=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "serve" and result["api"] == "ringserve"
    assert set(result["apis"]) == {"ringserve", "openai", "kserve"}
    assert result["errors"] == 0 and result["blocks_leaked"] == 0
    for api in ("ringserve", "openai", "kserve"):
        assert result[f"{api}_output_tok_s"] > 0
        assert result[f"{api}_ttft_ms_median"] > 0
        assert result["apis"][api]["completed"] > 0
    for api in ("openai", "kserve"):
        expected = round(result[f"{api}_output_tok_s"] / result["ringserve_output_tok_s"], 3)
        assert result[f"{api}_vs_ringserve_output_tok_s"] == expected
