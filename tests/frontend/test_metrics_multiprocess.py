"""prometheus-client multiprocess mode: several frontend processes write samples, any one of them serves the sum.

prometheus-client picks its value store when it is first imported, so every process here is a fresh interpreter
started with PROMETHEUS_MULTIPROC_DIR set, exactly as a deployment with several frontends would run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"

# One frontend's work: `requests` finished requests of 3 tokens each (2 inter-token gaps), then one engine stats
# sample. With --serve it then serves /metrics and prints the port until stdin closes.
_FRONTEND = textwrap.dedent("""
    import sys, time
    from ringserve import _core
    from ringserve.frontend.engine_client import TimedOutput
    from ringserve.frontend.observability.metrics import ServingMetrics, serve_metrics
    from ringserve.frontend.observability.timeline import RequestTimeline

    requests, running, serve = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "serve"
    metrics = ServingMetrics("tiny")
    for i in range(requests):
        t = RequestTimeline("tiny")
        t.params = object()
        t.prompt_tokens = 5
        base = time.time_ns()
        for step in range(3):
            t.on_output(TimedOutput(_core.RequestOutput(
                new_token_ids=[7], logprobs=[-0.5], num_scheduled_tokens=5 if step == 0 else 1, num_computed_tokens=5,
                num_cached_tokens=0, arrival_time_ns=base - 2_000_000, first_scheduled_time_ns=base - 1_000_000,
                first_token_time_ns=base, num_preemptions=0),
                base + step * 1_000_000, base + step * 1_000_000 + 1000))
        t.finish_reason = "length"
        t.finish()
        metrics.observe_request(t)
    metrics.observe_engine_stats(_core.EngineStats(num_running=running, kv_usage=0.5))
    if serve:
        server = serve_metrics(metrics, "127.0.0.1", 0)
        print(server.server_port, flush=True)
        sys.stdin.read()
        server.shutdown()
""")


def _frontend(multiproc_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir)}
    return subprocess.Popen([sys.executable, "-c", _FRONTEND, *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_any_frontend_serves_the_sum_of_every_frontends_samples(tmp_path: Path) -> None:
    first = _frontend(tmp_path, "2", "3", "quiet")
    first.communicate(timeout=60)
    assert first.returncode == 0
    serving = _frontend(tmp_path, "3", "4", "serve")
    try:
        assert serving.stdout is not None
        port = int(serving.stdout.readline())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            samples = _samples(response.read().decode())
    finally:
        serving.communicate(input="", timeout=30)
    model = ("model_name", MODEL)

    def value(name: str, *labels: tuple[str, str]) -> float:
        return samples[(name, frozenset((model, *labels)))]

    # Counters and histograms are summed over both processes: 2 + 3 requests.
    assert value("ringserve_request_success_total", ("finished_reason", "length"), ("api", "ringserve")) == 5
    assert value("ringserve_prompt_tokens_total") == 5 * 5
    assert value("ringserve_generation_tokens_total") == 5 * 3
    assert value("ringserve_time_to_first_token_seconds_count") == 5
    assert value("ringserve_inter_token_latency_seconds_count") == 5 * 2
    assert value("ringserve_inter_token_latency_seconds_bucket", ("le", "0.001")) == 5 * 2
    # Gauges report the most recent value written by any process, not a sum.
    assert value("ringserve_num_requests_running") == 4
    assert value("ringserve_kv_cache_usage_perc") == 0.5
