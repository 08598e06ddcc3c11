"""Disaggregated prefill/decode end to end (issue #8): router + one prefill server + one decode server, real processes
on loopback, the embedded model. Greedy output through the router equals the colocated output token for token; the
prefill server's prefix cache serves repeated prompts; every KV block is free again afterwards on both sides; a
prefill server that dies (before or after handing out a handle) and a decode server that dies are survived or
reported, and nothing stays pinned.
"""

from __future__ import annotations

import concurrent.futures
import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.internal import disagg_pb2 as dpb
from ringserve.internal import disagg_pb2_grpc as dpb_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc
from server_harness import RunningServer, compile_torchserve_stubs, free_port, real_model_path, start_server
from test_tracing import OtlpReceiver, trace_service_pb2_grpc

pytestmark = pytest.mark.timeout(600)

HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None or importlib.util.find_spec("nixl") is not None
POOL = ("--num-kv-blocks", "192", "--max-num-seqs", "8", "--max-num-batched-tokens", "128")
PROMPTS = [
    "The history of the old stone lighthouse on the northern cape begins",
    "Write a short haiku about the autumn rain falling on a quiet city",
    "List three prime numbers larger than one hundred and explain why",
    "def add(a: int, b: int) -> int:\n    \"\"\"Return the sum of a and b.",
    # Longer than one 128-token step: the prefill server chunks it.
    "In a distant galaxy, a small maintenance robot named Pip discovered a map. " * 6,
]


def greedy(text: str, max_tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))  # fmt: skip


def tokens(address: str, request: pb.GenerateRequest, metadata: tuple = ()) -> tuple[list[int], str]:
    with grpc.insecure_channel(address) as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300,
                                                                               metadata=metadata))  # fmt: skip
    assert responses[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


def stats(server: RunningServer) -> pb.EngineStats:
    with server.channel() as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetEngineStats(pb.EngineStatsRequest(), timeout=30)


def wait_all_free(*servers: RunningServer, timeout_s: float = 30.0) -> None:
    """Every KV block free (pins released or expired, nothing running) on each server."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            s = stats(server)
            if s.free_kv_blocks == s.total_kv_blocks and s.num_running == 0 and s.num_waiting == 0:
                break
            assert time.monotonic() < deadline, f"{server.address}: {s.free_kv_blocks}/{s.total_kv_blocks} free"
            time.sleep(0.2)


def kill_tree(server: RunningServer) -> None:
    """kill -9 the server and its engine and workers at once."""
    root = psutil.Process(server.proc.pid)
    tree = [root, *root.children(recursive=True)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=10)


class Router:
    def __init__(self, prefill: RunningServer, decode: RunningServer, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"router-{self.port}.log"
        cmd = [sys.executable, "-m", "ringserve.frontend.cli", "router", "--port", str(self.port),
               "--prefill", prefill.address, "--decode", decode.address, *extra]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == 1:
                        return
                except grpc.RpcError:
                    pass
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
                time.sleep(0.2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def deployment(request, tmp_path: Path) -> Iterator[tuple[RunningServer, RunningServer, Router]]:
    backend = request.param
    if backend == "nixl" and not HAS_NIXL:
        pytest.skip("nixl is not installed")
    if ctypes.util.find_library("ibverbs"):
        os.environ["UCX_MODULES"] = "^ib"  # NIXL crashes at exit with the ib module and no RDMA device
    model = real_model_path()
    # Every process exports its spans to a collector in this process: one trace spans router, prefill and decode.
    collector = OtlpReceiver()
    receiver = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    tracing = ("--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.add_insecure_port('127.0.0.1:0')}")
    receiver.start()
    prefill = start_server(model, tmp_path, "--role", "prefill", "--kv-transfer", backend, "--kv-pin-timeout", "20",
                           *POOL, *tracing)  # fmt: skip
    decode = start_server(model, tmp_path, "--role", "decode", "--kv-transfer", backend, *POOL, *tracing)
    router = Router(prefill, decode, tmp_path, *tracing)
    request.node.collector = collector
    try:
        yield prefill, decode, router
    finally:
        receiver.stop(0)
        router.stop()
        for server in (prefill, decode):
            server.__exit__(None, None, None)
        # kill -9 leaves the dead servers' rings and KV regions behind; remove them as the next `serve` would.
        from ringserve import _core

        _core.reclaim_stale_segments()


def check_equal_to_colocated(prefill: RunningServer, decode: RunningServer, router: Router) -> None:
    requests = [greedy(p) for p in PROMPTS] + [greedy(PROMPTS[0], max_tokens=1)]
    # Colocated: the decode server's ordinary Generate computes the prompt itself.
    expected = [tokens(decode.address, r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: tokens(router.address, r), requests))
    for prompt, want, have in zip([*PROMPTS, "max_tokens=1"], expected, got, strict=True):
        assert have == want, prompt
    assert len(got[-1][0]) == 1
    wait_all_free(prefill, decode)


def check_one_trace_across_the_three_processes(router: Router, collector: OtlpReceiver) -> None:
    trace_id, caller_span = "5bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{caller_span}-01"),)
    generated, _ = tokens(router.address, greedy(PROMPTS[3], max_tokens=6), metadata)
    names = {"ringserve.router.generate", "ringserve.prefill", "ringserve.generate", "kv_transfer", "decode"}
    deadline = time.monotonic() + 60  # each process's batch processor exports every few seconds
    while not names <= {s["name"] for s in collector.spans if s["trace_id"] == trace_id}:
        assert time.monotonic() < deadline, [(s["name"], s["trace_id"]) for s in collector.spans]
        collector.wait_for(names, timeout_s=60)
        time.sleep(0.5)
    time.sleep(1.0)  # the rest of the trace's batch
    spans = [s for s in collector.spans if s["trace_id"] == trace_id]
    by_name: dict[str, list[dict]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    by_id = {s["span_id"]: s for s in spans}
    router_span = by_name["ringserve.router.generate"][0]
    assert router_span["parent"] == caller_span
    # The prefill server's SERVER span sits under the router's prefill CLIENT span, with engine-timed children.
    prefill_rpc = by_name["ringserve.prefill"][0]
    assert by_id[prefill_rpc["parent"]]["name"] == "prefill" and by_id[prefill_rpc["parent"]]["kind"] == 3
    assert prefill_rpc["attributes"]["rpc.method"] == "Prefill"
    children = {s["name"] for s in spans if s["parent"] == prefill_rpc["span_id"]}
    assert {"tokenize", "queue", "prefill"} <= children
    # The decode server's span sits under the router's decode CLIENT span; its first step pulled the KV.
    decode_rpc = by_name["ringserve.generate"][0]
    assert by_id[decode_rpc["parent"]]["name"] == "decode"
    assert decode_rpc["attributes"]["rpc.method"] == "GenerateFromKv"
    pulled = [s for s in by_name["kv_transfer"] if s["parent"] == decode_rpc["span_id"]]
    assert len(pulled) == 1, [(s["name"], s["attributes"]) for s in spans if s["parent"] == decode_rpc["span_id"]]
    assert pulled[0]["attributes"]["ringserve.kv.blocks"] >= 1
    assert decode_rpc["start"] <= pulled[0]["start"] <= pulled[0]["end"] <= decode_rpc["end"]
    # Every token the client got is an event on the decode server's decode span (the first is the prefill's).
    server_decode = [s for s in by_name["decode"] if s["parent"] == decode_rpc["span_id"]]
    token_events = [e[2]["ringserve.token.id"] for e in server_decode[0]["events"] if e[0] == "token"]
    assert token_events == generated


def check_torchserve_inference_through_the_router(router: Router, tmp_path: Path) -> None:
    """A client built only from TorchServe's protos (in its own process) gets the router's greedy text."""
    client_dir = Path(__file__).parent / "torchserve_client"
    (tmp_path / "ts_stubs").mkdir()
    stubs = compile_torchserve_stubs(client_dir, tmp_path / "ts_stubs")
    with grpc.insecure_channel(router.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        model = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).model
        plain = pb.GenerateRequest(text=PROMPTS[1], sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
        text = "".join(r.text for r in stub.Generate(plain, timeout=120))
    run = subprocess.run([sys.executable, str(client_dir / "ts_predict.py"), str(stubs), router.address, model,
                          PROMPTS[1], "8"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    observed = json.loads(run.stdout)
    assert observed["ping"] == {"status": "Healthy"}
    assert observed["prediction"] == text and "".join(observed["stream_chunks"]) == text


@pytest.mark.parametrize("deployment", ["shm"], indirect=True)
def test_shm_disaggregated_serving_prefix_cache_handshake_and_prefill_death(deployment, request, tmp_path) -> None:
    prefill, decode, router = deployment
    check_equal_to_colocated(prefill, decode, router)
    check_one_trace_across_the_three_processes(router, request.node.collector)
    check_torchserve_inference_through_the_router(router, tmp_path)

    with grpc.insecure_channel(prefill.address) as channel:
        stub = dpb_grpc.DisaggregationStub(channel)
        # The prefill server's prefix cache serves a repeated prompt; both requests' pins share those blocks.
        fresh = greedy("A prompt no earlier request used, about tides and the moon and the sea. " * 4)
        first = stub.Prefill(dpb.PrefillRequest(request=fresh), timeout=120)
        again = stub.Prefill(dpb.PrefillRequest(request=fresh), timeout=120)
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16 * 3
        assert first.handle.block_ids[:3] == again.handle.block_ids[:3]
        assert stats(prefill).free_kv_blocks < stats(prefill).total_kv_blocks
        for pre in (first, again):
            stub.ReleaseKv(dpb.ReleaseKvRequest(engine_id=pre.handle.engine_id, request_id=pre.handle.request_id))
        wait_all_free(prefill)
        # A handle whose layout differs from the decode server's is refused by the handshake, with the reason.
        bad = dpb.PrefillResponse()
        bad.CopyFrom(first)
        bad.handle.block_size = 32
        with grpc.insecure_channel(decode.address) as dchannel, pytest.raises(grpc.RpcError) as refused:
            list(dpb_grpc.DisaggregationStub(dchannel).GenerateFromKv(
                dpb.GenerateFromKvRequest(request=fresh, prefill=bad), timeout=60))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block sizes differ" in refused.value.details()
        # kill -9 the prefill server after it handed out a handle: the decode server still completes the request
        # (pulling from the segment the dead workers left, or computing the prompt when it is gone).
        request = greedy(PROMPTS[2])
        expected = tokens(decode.address, request)
        handle = stub.Prefill(dpb.PrefillRequest(request=request), timeout=120)
    kill_tree(prefill)
    with grpc.insecure_channel(decode.address) as channel:
        responses = list(dpb_grpc.DisaggregationStub(channel).GenerateFromKv(
            dpb.GenerateFromKvRequest(request=request, prefill=handle), timeout=120))
    assert [t for r in responses for t in r.token_ids] == expected[0]
    # With the prefill server gone, the router's Prefill fails and the decode server runs the whole request.
    assert tokens(router.address, request) == expected
    wait_all_free(decode)


@pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed")
@pytest.mark.parametrize("deployment", ["nixl"], indirect=True)
def test_nixl_disaggregated_serving_and_decode_death(deployment) -> None:
    prefill, decode, router = deployment
    check_equal_to_colocated(prefill, decode, router)
    # kill -9 the decode server mid-stream: the client gets UNAVAILABLE naming it; the prefill pin is released.
    with grpc.insecure_channel(router.address) as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(greedy(PROMPTS[1], max_tokens=400), timeout=120)
        next(stream)
        next(stream)
        kill_tree(decode)
        with pytest.raises(grpc.RpcError) as failed:
            list(stream)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode server" in failed.value.details()
    wait_all_free(prefill)
