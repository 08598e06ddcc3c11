"""docker/compose.yaml's `single` profile brought up and used from the host: healthy by the image's HEALTHCHECK, a
streamed Generate, the TorchServe Ping and KServe v2's ModelReady through the published gRPC port, a streamed OpenAI
completion through the published HTTP port, Prometheus metrics through the published metrics port counting what was
served, and `docker stop` (SIGTERM) draining a stream in flight before exiting 0."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import pytest
from docker_harness import BUILD_TIMEOUT_S, ComposeProject, inspect, logs, wait_healthy
from google.protobuf import empty_pb2
from prometheus_client.parser import text_string_to_metric_families
from ringserve.kserve import grpc_service_pb2 as kpb
from ringserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from ringserve.torchserve import inference_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)


def request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Once upon a time",
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def generation_tokens(metrics_port: int, at_least: float, timeout_s: float = 30.0) -> float:
    """ringserve_generation_tokens_total, once it reaches `at_least` or timeout_s passes: a request is counted when
    its call ends, which may come just after its client read the last byte."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        total = sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == "ringserve_generation_tokens_total")  # fmt: skip
        if total >= at_least or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


def streamed_completion(http_port: int, max_tokens: int) -> list[dict]:
    """POST /v1/completions with stream=true: the server-sent events' JSON chunks, up to `data: [DONE]`."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    post = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})  # fmt: skip
    chunks = []
    with urllib.request.urlopen(post, timeout=300) as reply:
        for line in reply:
            data = line.decode().strip().removeprefix("data: ")
            if data == "[DONE]":
                return chunks
            if data:
                chunks.append(json.loads(data))
    raise AssertionError(f"the stream ended without [DONE] after {chunks}")


def test_single_profile_serves_through_published_ports_and_drains_on_docker_stop(cpu_image: str) -> None:
    with ComposeProject("single", RINGSERVE_WORKER_THREADS="1", RINGSERVE_KV_CACHE_MEMORY_GIB="0.25") as project:
        cid = project.container("ringserve")
        wait_healthy(cid)
        channel = grpc.insecure_channel(f"127.0.0.1:{project.ports['GRPC']}")
        stub = generation_pb2_grpc.GenerationStub(channel)

        replies = list(stub.Generate(request(8), timeout=300))
        assert len(replies) > 1, "the reply came in one message, not streamed"
        assert sum(len(r.token_ids) for r in replies) == 8
        assert "".join(r.text for r in replies).strip()
        assert replies[-1].finish_reason == pb.FINISH_REASON_LENGTH

        ping = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(empty_pb2.Empty(), timeout=30)
        assert json.loads(ping.health) == {"status": "Healthy"}
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert kserve.ModelReady(kpb.ModelReadyRequest(name=info.model), timeout=30).ready

        chunks = streamed_completion(project.ports["HTTP"], 6)
        assert len(chunks) > 1, f"the HTTP reply came in one piece, not streamed: {chunks}"
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).strip(), chunks

        assert generation_tokens(project.ports["METRICS"], 8 + 6) >= 8 + 6

        # `docker stop` while a stream is running: the server drains it (RINGSERVE_SHUTDOWN_GRACE, under compose's
        # stop_grace_period), then stops the engine and workers and exits 0.
        first_token = threading.Event()
        drained: dict[str, object] = {}

        def stream() -> None:
            try:
                tokens = 0
                for reply in stub.Generate(request(32), timeout=300):
                    tokens += len(reply.token_ids)
                    first_token.set()
                    drained["finish"] = reply.finish_reason
                drained["tokens"] = tokens
            except grpc.RpcError as e:
                drained["error"] = f"{e.code()}: {e.details()}"
            finally:
                first_token.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_token.wait(timeout=300)
        project.run("stop", "ringserve", timeout=120)
        client.join(timeout=60)
        assert drained == {"tokens": 32, "finish": pb.FINISH_REASON_LENGTH}, f"{drained}\n{logs(cid)}"
        assert inspect(cid, "{{.State.ExitCode}}") == "0", logs(cid)
        assert "draining in-flight streams" in logs(cid, tail=200)
        channel.close()
