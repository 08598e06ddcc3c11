"""Prometheus /metrics of a real server after a few requests: counts and histogram sample counts match what was sent."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ringserve.v1 import generation_pb2 as pb
from server_harness import free_port, start_server

MAX_TOKENS = (3, 5, 7)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def test_metrics_count_what_was_served(model_path: Path, tmp_path: Path) -> None:
    metrics_port = free_port()
    with start_server(model_path, tmp_path, "--metrics-port", str(metrics_port), "--num-kv-blocks", "64",
                      "--metrics-stats-interval", "0.2") as server:  # fmt: skip
        stub = server.stub()
        prompt_tokens = 0
        for n in MAX_TOKENS:
            request = pb.GenerateRequest(text="The capital of France is",
                                         sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            responses = list(stub.Generate(request, timeout=120))
            assert sum(len(r.token_ids) for r in responses) == n
            prompt_tokens += responses[-1].usage.prompt_tokens
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=2.0)), timeout=30))
        time.sleep(1.0)  # a few engine stats intervals
        samples = scrape(metrics_port)
        assert server.stop() == 0
    model = (("model_name", model_path.stem),)

    def value(name: str, *labels: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted(model + labels)))]

    success = value("ringserve_request_success_total", ("finished_reason", "length"), ("api", "ringserve"))
    assert success == len(MAX_TOKENS)
    assert value("ringserve_request_errors_total", ("code", "INVALID_ARGUMENT"), ("api", "ringserve")) == 1
    assert value("ringserve_prompt_tokens_total") == prompt_tokens
    assert value("ringserve_generation_tokens_total") == sum(MAX_TOKENS)
    assert value("ringserve_prefix_cache_queries_total") == prompt_tokens
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time"):  # fmt: skip
        assert value(f"ringserve_{histogram}_seconds_count") == len(MAX_TOKENS), histogram
        assert value(f"ringserve_{histogram}_seconds_bucket", ("le", "+Inf")) == len(MAX_TOKENS), histogram
    assert value("ringserve_inter_token_latency_seconds_count") == sum(n - 1 for n in MAX_TOKENS)
    assert value("ringserve_time_to_first_token_seconds_sum") > 0
    # The engine is idle by now: nothing running or waiting, no KV blocks held.
    assert value("ringserve_num_requests_running") == 0
    assert value("ringserve_num_requests_waiting") == 0
    assert value("ringserve_kv_cache_usage_perc") == 0
    assert value("ringserve_num_preemptions_total") == 0
