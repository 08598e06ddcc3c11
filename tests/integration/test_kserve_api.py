"""KServe v2 clients work unchanged: Triton's own tritonclient.grpc talks to a real RingServe server."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, start_server

grpcclient = pytest.importorskip("tritonclient.grpc")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException

SERVED = "smollm"
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def kserve_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("kserve"), "--served-model-name", SERVED,
                       "--num-kv-blocks", "128", "--max-num-seqs", "8", "--worker-threads", "1")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"


@pytest.fixture
def client(kserve_server: RunningServer) -> Iterator[Any]:
    c = grpcclient.InferenceServerClient(kserve_server.address)
    yield c
    c.close()


def inputs(prompt: str, sampling: dict[str, Any] | None = None, stream: bool = False,
           exclude_input: bool = True) -> list[Any]:
    tensors = [("text_input", "BYTES", np.array([prompt.encode()], dtype=object)),
               ("stream", "BOOL", np.array([stream])),
               ("exclude_input_in_output", "BOOL", np.array([exclude_input]))]
    if sampling is not None:
        tensors.append(("sampling_parameters", "BYTES", np.array([json.dumps(sampling).encode()], dtype=object)))
    out = []
    for name, datatype, data in tensors:
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(data)
        out.append(tensor)
    return out


def text_of(result: Any) -> str:
    return b"".join(result.as_numpy("text_output")).decode()


def is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def ringserve_text(server: RunningServer, prompt: str, max_tokens: int) -> str:
    request = pb.GenerateRequest(model=SERVED, text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                                                       temperature=0))
    return "".join(r.text for r in server.stub().Generate(request, timeout=120))


def stream_results(client: Any, *requests: dict[str, Any], timeout_s: float = 120.0) -> list[tuple[Any, Any]]:
    """Send `requests` on one stream (start_stream / async_stream_infer) and collect until each has ended: with its
    final response, or with an error (which tritonclient hands over without the request's id)."""
    received: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for request in requests:
            client.async_stream_infer(**request)
        items: list[tuple[Any, Any]] = []
        while sum(error is not None or is_final(result) for result, error in items) < len(requests):
            items.append(received.get(timeout=timeout_s))
        return items
    finally:
        client.stop_stream()


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(SERVED) and not client.is_model_ready("missing")
    metadata = client.get_model_metadata(SERVED, as_json=True)
    assert metadata["name"] == SERVED
    assert {(t["name"], t["datatype"]) for t in metadata["inputs"]} == {
        ("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"),
        ("exclude_input_in_output", "BOOL")}  # fmt: skip
    assert [t["name"] for t in metadata["outputs"]] == ["text_output"]


def test_streamed_and_whole_greedy_text_equal_ringserve_generates(kserve_server: RunningServer, client: Any) -> None:
    expected = ringserve_text(kserve_server, PROMPT, GREEDY["max_tokens"])
    assert expected
    items = stream_results(client, {"model_name": SERVED, "inputs": inputs(PROMPT, GREEDY, stream=True),
                                    "request_id": "greedy"})  # fmt: skip
    assert all(error is None for _, error in items)
    results = [result for result, _ in items]
    assert len(results) > 1 and [is_final(r) for r in results][-1] and not any(is_final(r) for r in results[:-1])
    assert "".join(text_of(r) for r in results) == expected
    assert text_of(client.infer(SERVED, inputs(PROMPT, GREEDY))) == expected
    assert text_of(client.infer(SERVED, inputs(PROMPT, GREEDY, exclude_input=False))) == PROMPT + expected


def test_bad_requests_get_the_protocols_statuses_naming_the_field(client: Any) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(SERVED, inputs(PROMPT, {"temperature": -1}))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "sampling_parameters.temperature" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("missing", inputs(PROMPT, GREEDY))
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    items = stream_results(client, {"model_name": SERVED, "inputs": inputs(PROMPT, {"max_tokens": 0}, stream=True),
                                    "request_id": "zero"})  # fmt: skip
    [(_, error)] = items
    assert str(error).startswith("INVALID_ARGUMENT: sampling_parameters.max_tokens")


def test_a_stream_cancelled_mid_generation_frees_its_request(kserve_server: RunningServer, client: Any) -> None:
    received: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer(SERVED, inputs(PROMPT, {"max_tokens": 2000, "ignore_eos": True}, stream=True),
                              request_id="long")  # fmt: skip
    for _ in range(3):
        result, error = received.get(timeout=120)
        assert error is None and not is_final(result)
    stub = kserve_server.stub()
    assert stub.GetEngineStats(pb.EngineStatsRequest(model=SERVED), timeout=10).num_running == 1
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 30
    while True:
        stats = stub.GetEngineStats(pb.EngineStatsRequest(model=SERVED), timeout=10)
        if stats.num_running == stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
            break
        assert time.monotonic() < deadline, f"the cancelled request still holds the engine: {stats}"
        time.sleep(0.1)
    assert text_of(client.infer(SERVED, inputs(PROMPT, GREEDY)))  # and the server still serves


def test_unimplemented_triton_rpcs_answer_unimplemented(kserve_server: RunningServer) -> None:
    with kserve_server.channel() as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelStatistics",
                                   request_serializer=lambda _: b"", response_deserializer=bytes)  # fmt: skip
        with pytest.raises(grpc.RpcError) as caught:
            call(None, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
