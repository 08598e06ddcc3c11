"""benchmarks/throughput.py on a tiny random checkpoint: the keys issue #5 names, and figures made of its rounds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from workers_testkit import save_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_the_issue_keys_as_medians_of_its_rounds(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    done = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--quick", "--model", str(tmp_path), "--offline-rounds", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("offline_tok_s", "single_stream_tok_s", "hf_offline_tok_s", "ratio_vs_hf", "bandwidth_gb_s",
                "bandwidth_bound_tok_s"):  # fmt: skip
        assert result[key] > 0, key
    offline, hf, ratios = result["offline_rounds_tok_s"], result["hf_rounds_tok_s"], result["ratio_rounds"]
    assert len(offline) == len(hf) == len(ratios) == 3
    for o, h, r in zip(offline, hf, ratios, strict=True):
        assert r == pytest.approx(o / h, rel=1e-2)
    assert result["ratio_vs_hf"] == pytest.approx(statistics.median(ratios), abs=1e-3)
    assert result["offline_tok_s"] == pytest.approx(statistics.median(offline), abs=0.01)
    assert result["hf_offline_tok_s"] == pytest.approx(statistics.median(hf), abs=0.01)
    assert len(result["single_stream_rounds"]) == len(result["bandwidth_rounds_gb_s"]) == 2
    assert result["bandwidth_bound_tok_s"] == pytest.approx(
        result["bandwidth_gb_s"] * 1e9 / result["weight_bytes"], rel=1e-3
    )
