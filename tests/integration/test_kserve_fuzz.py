"""Property: whatever tensors, contents, sampling JSON or bytes a client sends to KServe's ModelInfer and
ModelStreamInfer, the real server answers with a result or a clear refusal, never UNKNOWN or INTERNAL (on a stream:
no INTERNAL error_message either); afterwards it still serves.

One derandomized run (the same requests every time) and one from a fresh seed, printed with any failure (set
RINGSERVE_FUZZ_SEED to replay it).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from ringserve.kserve import grpc_service_pb2 as kpb
from ringserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, start_server

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}  # fmt: skip
FRESH_SEED = int(os.environ.get("RINGSERVE_FUZZ_SEED") or secrets.randbits(32))
SERVED = "served"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fuzz_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("kserve-fuzz"), "--served-model-name", SERVED,
                       "--num-kv-blocks", "128", "--max-num-seqs", "8", "--worker-threads", "1")  # fmt: skip
    with srv:
        yield srv
        srv.stop()


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**20, max_value=10**400),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                      st.sampled_from(["0.5", "true", "nan", "-1", "1e999"]))  # fmt: skip
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)  # fmt: skip
SAMPLING_KEYS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stop_token_ids",
                 "ignore_eos", "repetition_penalty", "logprobs", "priority", "cache_salt", "min_tokens",
                 "skip_special_tokens", "best_of"]  # fmt: skip


@st.composite
def sampling_json(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["fields", "fields", "any json", "deep", "long int", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=32))
    if kind == "deep":
        return (draw(st.sampled_from(["[", '{"a":'])) * draw(st.integers(30, 100_000))).encode()
    if kind == "long int":
        return b'{"seed": ' + b"7" * draw(st.integers(4000, 20_000)) + b"}"
    if kind == "any json":
        return json.dumps(draw(json_value)).encode()
    body: dict[str, Any] = {"max_tokens": 1}
    body.update(draw(st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_value, max_size=4)))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 2)  # a valid request stays short
    return json.dumps(body).encode()


def raw_bytes(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value


@st.composite
def infer_request(draw: st.DrawFn) -> kpb.ModelInferRequest:
    request = kpb.ModelInferRequest(model_name=draw(st.sampled_from([SERVED, SERVED, "", "missing"])),
                                    model_version=draw(st.sampled_from(["", "", "1", "2"])),
                                    id=draw(st.text(max_size=8)))  # fmt: skip
    names = ["text_input", "stream", "sampling_parameters", "exclude_input_in_output", "other"]
    tensors = draw(st.lists(st.sampled_from(names), max_size=5))
    if draw(st.booleans()):
        tensors = ["text_input", "sampling_parameters", *tensors[:2]]
    raw = draw(st.booleans())
    for name in tensors:
        datatype = draw(st.sampled_from(["BYTES", "BOOL", "FP32", ""]))
        if name in ("text_input", "sampling_parameters") and draw(st.integers(0, 3)):
            datatype = "BYTES"
        shape = draw(st.sampled_from([[1], [1], [1, 1], [], [2], [-1], [2**40]]))
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if name == "sampling_parameters":
            value = draw(sampling_json())
        elif datatype == "BYTES":
            value = draw(st.one_of(st.text(max_size=20).map(str.encode), st.binary(max_size=8)))
        else:
            value = draw(st.binary(max_size=2))
        if raw:
            request.raw_input_contents.append(raw_bytes(value) if draw(st.integers(0, 4)) else value)
        elif datatype == "BOOL":
            tensor.contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=2)))
        else:
            tensor.contents.bytes_contents.append(value)
    if "sampling_parameters" not in tensors:  # keeps a valid request short (the default max_tokens is 256)
        tensor = request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        short = b'{"max_tokens": 1}'
        if raw:
            request.raw_input_contents.append(raw_bytes(short))
        else:
            tensor.contents.bytes_contents.append(short)
    if raw and draw(st.integers(0, 5)) == 0:
        request.raw_input_contents.append(b"extra")
    for key in draw(st.lists(st.sampled_from(["triton_enable_empty_final_response", "priority", "x"]), max_size=2)):
        request.parameters[key].bool_param = True
    for name in draw(st.lists(st.sampled_from(["text_output", "logits"]), max_size=2)):
        request.outputs.add(name=name)
    return request


def check(server: RunningServer, request: kpb.ModelInferRequest, streaming: bool) -> None:
    where = f"{'ModelStreamInfer' if streaming else 'ModelInfer'}({request}) (fresh seed {FRESH_SEED})"
    with server.channel() as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        try:
            if streaming:  # the first response is the answer; no need to generate all of it
                call = stub.ModelStreamInfer(iter([request]), timeout=60)
                response = next(call, None)
                call.cancel()
                assert response is None or not response.error_message.startswith(("INTERNAL", "UNKNOWN")), \
                    f"{where}: {response}"
            else:
                stub.ModelInfer(request, timeout=60)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, f"{where} -> {err.code()}: {err.details()}"


def check_bytes(server: RunningServer, data: bytes) -> None:
    """Bytes that may not be a message at all."""
    with server.channel() as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda raw: raw, response_deserializer=bytes)  # fmt: skip
        try:
            call(data, timeout=60)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, f"{data!r} -> {err.code()}: {err.details()}"


def still_serves(server: RunningServer) -> None:
    request = pb.GenerateRequest(model=SERVED, text="Hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    assert sum(len(r.token_ids) for r in server.stub().Generate(request, timeout=60)) == 2
    with server.channel() as channel:
        live = kpb_grpc.GRPCInferenceServiceStub(channel).ModelReady(kpb.ModelReadyRequest(name=SERVED), timeout=10)
    assert live.ready


FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
FRESH = settings(FUZZ, max_examples=100, derandomize=False)


def test_infer_requests_get_a_clear_answer(fuzz_server: RunningServer) -> None:
    @FUZZ
    @given(request=infer_request(), streaming=st.booleans())
    def run(request: kpb.ModelInferRequest, streaming: bool) -> None:
        check(fuzz_server, request, streaming)

    run()
    still_serves(fuzz_server)


def test_infer_requests_from_a_fresh_seed(fuzz_server: RunningServer) -> None:
    @FRESH
    @seed(FRESH_SEED)
    @given(request=infer_request(), streaming=st.booleans())
    def run(request: kpb.ModelInferRequest, streaming: bool) -> None:
        check(fuzz_server, request, streaming)

    run()
    still_serves(fuzz_server)


def test_bytes_that_are_not_a_message_are_invalid_argument(fuzz_server: RunningServer) -> None:
    @FUZZ
    @given(data=st.binary(max_size=64))
    def run(data: bytes) -> None:
        check_bytes(fuzz_server, data)

    run()
    still_serves(fuzz_server)
