"""benchmarks/gpu.py works before GPU time is spent on it: its --dry-run takes every section's code path on CPU."""

from __future__ import annotations

import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def run_script(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent
    )


def test_dry_run_fills_every_section_and_ends_with_one_json_line(tmp_path):
    done = run_script("--dry-run", "--json-out", str(tmp_path / "gpu.json"))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "gpu.json").read_text()) == report
    assert report["errors"] == {}
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["tests"]["returncode"] == 0 and "skipped" in report["tests"]["summary"]  # CUDA tests skip here
    assert report["bandwidth_gb_s"] > 0
    toy = report["models"]["toy"]
    assert toy["offline_tok_s"] > 0 and toy["single_stream_tok_s"] > 0 and toy["bandwidth_bound_tok_s"] > 0
    # Mixed steps through the graphs' static buffers and cuts (run eagerly here) give the eager tokens (float32).
    assert toy["mixed_step_ms"] > 0 and toy["mixed_step_ms_eager"] > 0 and toy["mixed_tokens_match_eager"] == 1.0
    if importlib.util.find_spec("triton") is not None:  # as on the GPU: triton_paged, then the baseline
        assert toy["attention_backend"] == "triton_paged"
        assert toy["offline_tok_s_torch_sdpa"] > 0 and toy["offline_speedup_vs_torch_sdpa"] > 0
    if importlib.util.find_spec("transformers") is not None:  # the outside baseline, on the same prompts
        assert toy["hf_offline_tok_s"] > 0 and toy["offline_speedup_vs_hf"] > 0
    assert toy["streamed_bytes_per_token"] == toy["weight_bytes"]  # tied embedding: streamed once, as the LM head
    # The host CPU's quantized products: the fastest path and the AVX2 one give the same bits (the same path here,
    # unless this CPU has AVX-512 VNNI), every shape and row count timed.
    int8 = report["host_cpu_int8"]
    if "skipped" not in int8:
        assert int8["same_bits"] is True
        assert len(int8["shapes"]) == 15
        assert all(v["fastest_ms"] > 0 and v["avx2_ms"] > 0 for v in int8["shapes"].values())
        assert set(int8["step"]) == {"m1", "m8", "m64"}
    for kind in ("attention_decode", "attention_prefill"):
        if importlib.util.find_spec("triton") is None:
            assert report[kind] is None
            continue
        (row,) = report[kind]
        assert row["triton_paged_us"] > 0 and row["torch_sdpa_us"] > 0
        assert row["max_abs_diff"] < 1e-4  # the interpreted Triton kernels agree with gather + SDPA


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_run_stops_at_once_and_says_why():
    done = run_script("--quick")
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "--dry-run" in done.stderr
    assert done.stdout == ""


def test_a_failing_section_is_recorded_and_the_others_still_report(monkeypatch, capsys):
    script = runpy.run_path(str(SCRIPT), run_name="gpu_benchmark")
    main = script["main"]

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    # run_path gives main its own globals: patch the functions it looks up there.
    monkeypatch.setitem(main.__globals__, "bench_model", broken)
    monkeypatch.setitem(main.__globals__, "bench_attention", broken)
    assert main(["--dry-run", "--skip-tests"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bandwidth_gb_s"] > 0  # measured although later sections failed
    assert report["models"] == {}
    failed = {"model toy", "attention decode", "attention prefill"}
    if importlib.util.find_spec("triton") is None:
        failed -= {"attention decode", "attention prefill"}
    assert set(report["errors"]) == failed
    assert all("out of memory, say" in message for message in report["errors"].values())
