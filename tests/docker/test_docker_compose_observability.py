"""docker/compose.yaml's `observability` profile: the server container exports each request's trace over OTLP/gRPC to
Arize Phoenix, a real trace backend run on the host in Jaeger's place (tests/docker/compose.observability-test.yaml
points the server at it), and Phoenix's REST API returns the span tree ringserve.generate -> tokenize, queue, prefill,
decode (one event per token) under the project the server's resource names; the profile's Prometheus (prom/prometheus,
or Debian's prometheus where that cannot be pulled) scrapes the server: its query API returns
ringserve_generation_tokens_total above zero."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from docker_harness import BUILD_TIMEOUT_S, ComposeProject, logs, wait_healthy
from phoenix_backend import phoenix_backend
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)

TEST_COMPOSE = Path(__file__).with_name("compose.observability-test.yaml")
STANDIN_PROMETHEUS = "ringserve-test/prometheus"  # scripts/docker-env.sh builds it when prom/prometheus is missing
TRACE_ID, CALLER_SPAN = "6cf92f3577b34da6a3ce929d0e0e4736", "20f067aa0ba902b7"
TRACE_PROJECT = "ringserve-compose"  # Phoenix files spans by the resource's openinference.project.name
MAX_TOKENS = 6


def prometheus_image() -> str:
    missing = subprocess.run(["docker", "image", "inspect", STANDIN_PROMETHEUS], capture_output=True).returncode
    return STANDIN_PROMETHEUS if missing == 0 else ""  # "" keeps compose.yaml's prom/prometheus


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_observability_profile_exports_the_span_tree_and_prometheus_scrapes(
    cpu_image: str, phoenix_venv: Path, tmp_path: Path
) -> None:
    image = {"PROMETHEUS_IMAGE": prometheus_image()} if prometheus_image() else {}
    with phoenix_backend(phoenix_venv, tmp_path) as phoenix, ComposeProject(
        "observability", TEST_COMPOSE, services=("ringserve-observed", "prometheus"),
        TEST_OTLP_PORT=str(phoenix.grpc_port), TEST_TRACE_PROJECT=TRACE_PROJECT, RINGSERVE_WORKER_THREADS="1",
        RINGSERVE_KV_CACHE_MEMORY_GIB="0.25", **image,
    ) as project:  # fmt: skip
        wait_healthy(project.container("ringserve-observed"))
        phoenix.wait_ready()  # started before compose, so that the two start together
        prom = project.container("prometheus")
        with grpc.insecure_channel(f"127.0.0.1:{project.ports['GRPC']}") as channel:
            request = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))  # fmt: skip
            metadata = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),)
            replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata,
                                                                                timeout=300))  # fmt: skip
        generated = [t for r in replies for t in r.token_ids]
        assert len(generated) == MAX_TOKENS

        names = {"ringserve.generate", "tokenize", "queue", "prefill", "decode"}
        deadline = time.monotonic() + 120  # the batch exporter's delay, then Phoenix's own insert batching
        spans = phoenix.spans(TRACE_PROJECT, TRACE_ID)
        while not names <= {s["name"] for s in spans}:
            assert time.monotonic() < deadline, (f"Phoenix has {sorted(s['name'] for s in spans)} for the trace; "
                                                 f"projects: {phoenix.get('/v1/projects')}\n{phoenix.log_tail()}")
            time.sleep(1)
            spans = phoenix.spans(TRACE_PROJECT, TRACE_ID)
        assert {s["context"]["trace_id"] for s in spans} == {TRACE_ID}
        root = next(s for s in spans if s["name"] == "ringserve.generate")
        assert root["parent_id"] == CALLER_SPAN
        children = {s["name"]: s for s in spans if s["parent_id"] == root["context"]["span_id"]}
        assert {"tokenize", "queue", "prefill", "decode"} <= children.keys(), sorted(children)
        token_events = [e["attributes"]["ringserve.token.id"] for e in children["decode"]["events"]
                        if e["name"] == "token"]  # fmt: skip
        assert token_events == generated

        deadline = time.monotonic() + 180  # scrape_interval 5s; Prometheus may still be starting
        result: list[dict] | str = []
        while True:
            try:
                result = query(project.ports["PROMETHEUS"], "sum(ringserve_generation_tokens_total)")
            except urllib.error.URLError as error:  # not listening yet
                result = str(error)
            if result and isinstance(result, list) and float(result[0]["value"][1]) >= MAX_TOKENS:
                break
            assert time.monotonic() < deadline, f"Prometheus has no generated tokens: {result}\n{logs(prom)}"
            time.sleep(2)
        targets = query(project.ports["PROMETHEUS"], 'up{job="ringserve"}')
        assert [t["value"][1] for t in targets] == ["1"], targets
