"""Draining after SIGTERM is visible: health answers NOT_SERVING on a port that still accepts, new requests get
UNAVAILABLE saying the server is draining, in-flight streams finish, and a stream still running when the grace
period ends is cut with UNAVAILABLE saying so (not gRPC's generic 'Cancelling all calls')."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server

GRACE_S = 4.0


def request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Once upon a time",
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_sigterm_drains_visibly_then_cuts_what_is_left_with_a_message(model_path: Path, tmp_path: Path) -> None:
    with start_server(model_path, tmp_path, "--worker-threads", "1", "--num-kv-blocks", "256",
                      "--shutdown-grace", str(GRACE_S)) as server:  # fmt: skip
        stub = server.stub()
        results: dict[str, object] = {}

        def read(name: str, max_tokens: int) -> None:
            stream = stub.Generate(request(max_tokens), timeout=300)
            tokens = 0
            try:
                for response in stream:
                    tokens += len(response.token_ids)
                    if tokens == 1:
                        results[f"{name}-started"] = True
                results[name] = tokens
            except grpc.RpcError as error:
                results[name] = error

        threads = [threading.Thread(target=read, args=("long", 3000)),
                   threading.Thread(target=read, args=("short", 24))]  # fmt: skip
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not ("long-started" in results and "short-started" in results):
            assert time.monotonic() < deadline and "long" not in results and "short" not in results, results
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        with server.channel() as channel:  # the port still accepts while the streams drain
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:  # fmt: skip
                assert time.monotonic() - sigterm_at < 5, "health still SERVING after SIGTERM"
                time.sleep(0.02)
            try:
                list(pb_stub(channel).Generate(request(4), timeout=10))
                refused = None
            except grpc.RpcError as error:
                refused = error
        assert time.monotonic() - sigterm_at < GRACE_S, "checked after the grace period: the test proves nothing"
        assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.details() or ""), refused.details()
        for thread in threads:
            thread.join(timeout=60)
        assert results["short"] == 24, results  # finished within the grace period
        cut = results["long"]
        assert isinstance(cut, grpc.RpcError) and cut.code() == grpc.StatusCode.UNAVAILABLE, cut
        assert "draining" in (cut.details() or "") and "grace period" in (cut.details() or ""), cut.details()
        assert server.proc.wait(timeout=60) == 0, server.log()


def pb_stub(channel: grpc.Channel):  # type: ignore[no-untyped-def]
    from ringserve.v1 import generation_pb2_grpc

    return generation_pb2_grpc.GenerationStub(channel)
