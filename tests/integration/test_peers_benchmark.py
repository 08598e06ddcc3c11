"""benchmarks/peers.py with no peer installed: RingServe's figures, the peers' keys null with a reason each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_without_peers_reports_ringserve_and_says_why_the_peers_are_missing(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/peers.py", "--quick", "--threads", "1", "--peers-dir", str(tmp_path),
         "--num-prompts", "4", "--output-len", "4", "--single-len", "8", "--ttft-len", "64"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "peers" and result["threads"] == 1
    for key in ("offline_tok_s", "single_tok_s", "ttft_1k_ms"):
        assert result[key] > 0, key
    for key in ("vllm_offline_tok_s", "vllm_single_tok_s", "llamacpp_single_tok_s", "llamacpp_ttft_1k_ms",
                "vllm_ttft_1k_ms", "ratio_offline_vs_vllm", "ratio_single_vs_llamacpp", "vllm_rss_mib",
                "llamacpp_rss_mib"):  # fmt: skip
        assert result[key] is None, key
    for peer in ("vllm", "llamacpp"):
        assert "not installed" in result["unavailable"][peer] and str(tmp_path) in result["unavailable"][peer]
    assert all(result["ringserve_rss_mib"][process] > 0 for process in ("frontend", "engine", "worker"))
    cache = result["kv_cache"]["ringserve"]
    assert cache["tokens"] == cache["blocks"] * cache["block_size"] > 0 and cache["bytes"] > 0
    assert result["blocks_leaked"] == 0
    assert result["workload"] == {"num_prompts": 4, "output_len": 4, "single_len": 8, "ttft_len": 64, "rounds": 1,
                                  "prompt_tokens": result["workload"]["prompt_tokens"]}  # fmt: skip
