"""docker/compose.yaml's `disagg` profile (plus a second decode server, tests/docker/compose.disagg-test.yaml), each
server its own container: requests through the router's published port stream, the decode servers pull the prefill's
KV blocks over NIXL/UCX (TCP between containers), shown by their `kv_transfer` spans, and `docker kill -s KILL` of the
decode container serving a stream ends that stream with UNAVAILABLE naming it, within seconds, while the router goes
on serving with the other decode server."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from docker_harness import BUILD_TIMEOUT_S, ComposeProject, docker, logs, otlp_receiver, wait_healthy
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 1200)

TEST_COMPOSE = Path(__file__).with_name("compose.disagg-test.yaml")
DECODERS = ("ringserve-decode", "ringserve-decode-2")
STREAM_DEADLINE_S = 60


def request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def streamed_tokens(stub: generation_pb2_grpc.GenerationStub, prompt: str, max_tokens: int) -> int:
    replies = list(stub.Generate(request(prompt, max_tokens), timeout=300))
    assert len(replies) > 1 and replies[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return sum(len(r.token_ids) for r in replies)


def test_disagg_profile_moves_kv_over_nixl_and_survives_a_killed_decode_container(cpu_image: str) -> None:
    with otlp_receiver() as (receiver, otlp_port), ComposeProject(
        "disagg", TEST_COMPOSE, TEST_OTLP_PORT=str(otlp_port), RINGSERVE_WORKER_THREADS="1",
        RINGSERVE_KV_CACHE_MEMORY_GIB="0.25",
    ) as project:  # fmt: skip
        router = project.container("ringserve-router")
        wait_healthy(router)
        decoders = {name: project.container(name) for name in DECODERS}
        channel = grpc.insecure_channel(f"127.0.0.1:{project.ports['GRPC']}")
        stub = generation_pb2_grpc.GenerationStub(channel)

        assert streamed_tokens(stub, "The capital of France is", 8) == 8
        # The decode server pulled the prompt's blocks from the prefill container: its GenerateFromKv span holds a
        # kv_transfer span over at least one block.
        spans = receiver.wait_for({"kv_transfer", "ringserve.generate"}, timeout_s=120)
        pulls = [s for s in spans if s["name"] == "kv_transfer" and s["resource"].get("service.name") in DECODERS]
        assert pulls and pulls[0]["attributes"]["ringserve.kv.blocks"] >= 1, [(s["name"], s["resource"]) for s in spans]

        # kill -s KILL the decode container serving a stream (with nothing else in flight the router picks the first
        # listed): the client hears UNAVAILABLE naming it, promptly.
        # The stream deadline bounds how long the UNAVAILABLE may take (a later one would be DEADLINE_EXCEEDED).
        stream = stub.Generate(request("Once upon a time", 400), timeout=STREAM_DEADLINE_S)
        next(stream)
        serving = DECODERS[0]
        docker("kill", "-s", "KILL", decoders[serving])
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stream:
                pass
        waited = f"{time.monotonic() - killed_at:.1f}s after the kill"
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, f"{failed.value.details()} ({waited})"
        assert f"decode server {serving}" in (failed.value.details() or ""), failed.value.details()

        # The router serves on with the other decode server, request after request.
        for _ in range(3):
            assert streamed_tokens(stub, "The capital of France is", 8) == 8
        other = next(name for name in DECODERS if name != serving)
        assert docker("inspect", "-f", "{{.State.Running}}", decoders[other]).stdout.strip() == "true"
        assert docker("inspect", "-f", "{{.State.Running}}", router).stdout.strip() == "true", logs(router)
        channel.close()
