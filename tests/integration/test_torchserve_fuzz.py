"""Property: whatever JSON or bytes a client puts in a TorchServe prediction body, and whatever values it puts in a
management request, the real server answers with a result or a clear refusal (INVALID_ARGUMENT, NOT_FOUND,
FAILED_PRECONDITION, ...), never UNKNOWN or INTERNAL; afterwards it still serves.

Two runs of the same strategies: one derandomized (the same requests every run) and one from a fresh seed, printed
with any failure (set RINGSERVE_FUZZ_SEED to replay it), so CI keeps exploring new inputs.
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
from ringserve.torchserve import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, start_server

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.PERMISSION_DENIED}  # fmt: skip
FRESH_SEED = int(os.environ.get("RINGSERVE_FUZZ_SEED") or secrets.randbits(32))
SERVED = "served"  # the served model's name: requests that would change it are never drawn

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fuzz_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(model_path, tmp_path_factory.mktemp("fuzz"), "--served-model-name", SERVED,
                       "--num-kv-blocks", "128", "--max-num-seqs", "8", "--worker-threads", "1")  # fmt: skip
    with srv:
        yield srv
        srv.stop()


# -- prediction bodies ------------------------------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**20, max_value=10**400),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))  # fmt: skip
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip
KNOWN_KEYS = ["prompt", "text", "messages", "max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p",
              "seed", "stop", "n", "stop_token_ids", "ignore_eos", "repetition_penalty", "logprobs", "priority",
              "cache_salt", "presence_penalty", "frequency_penalty"]  # fmt: skip
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.text(max_size=20)})  # fmt: skip


@st.composite
def prediction_body(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["request", "request", "request", "any json", "deep", "long int", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        depth = draw(st.integers(30, 200_000))
        opener = draw(st.sampled_from(["[", '{"a":']))
        return (opener * depth).encode() + draw(st.binary(max_size=4))
    if kind == "long int":
        return b'{"prompt": "hi", "seed": ' + b"7" * draw(st.integers(4000, 20_000)) + b"}"
    if kind == "any json":
        return json.dumps(draw(json_value)).encode()
    body: dict[str, Any] = {"max_tokens": 1}
    body.update(draw(st.dictionaries(st.sampled_from(KNOWN_KEYS), json_value, max_size=5)))
    if draw(st.booleans()):
        body["prompt"] = draw(st.text(max_size=30))
    elif draw(st.booleans()):
        body["messages"] = draw(st.lists(message, max_size=3))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 2)  # a valid request stays short
    return json.dumps(body).encode()


def predict(server: RunningServer, key: str, body: bytes) -> grpc.StatusCode:
    request = inference_pb2.PredictionsRequest(model_name=SERVED, input={key: body})
    with server.channel() as channel:
        stream = inference_pb2_grpc.InferenceAPIsServiceStub(channel).StreamPredictions(request, timeout=60)
        try:
            next(stream, None)  # a stream that starts is an answer; no need to generate all of it
            stream.cancel()
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


# -- management requests ----------------------------------------------------------------------------------------------

names = st.one_of(st.text(max_size=12), st.sampled_from(["", "missing", "a/b", "../x", "\x00"]))
int32 = st.integers(-(2**31), 2**31 - 1)
query_value = st.one_of(st.text(max_size=8), st.integers().map(str), st.sampled_from(["", "1e9", "-1", "auto"]))
query = st.dictionaries(st.sampled_from(["tensor_parallel_size", "dtype", "max_model_len", "kv_cache_memory_gib",
                                         "data_parallel_size", "max_num_seqs", "bogus"]), query_value, max_size=3)


@st.composite
def management_call(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["register", "scale", "describe", "unregister", "default", "list"]))
    name = draw(names.filter(lambda n: n != SERVED))
    version = draw(st.sampled_from(["", "1.0", "2.0", "x"]))
    if kind == "register":
        path = draw(st.sampled_from(["/nonexistent/model.gguf", "", "http://example.com/m.gguf", "file:///nope",
                                     "/etc/passwd", "/tmp"]))  # fmt: skip
        pairs = draw(query)
        url = path + ("?" + "&".join(f"{k}={v}" for k, v in pairs.items()) if pairs else "")
        return "RegisterModel", management_pb2.RegisterModelRequest(
            url=url, model_name=name, initial_workers=draw(int32), batch_size=draw(int32),
            synchronous=draw(st.booleans()))  # fmt: skip
    if kind == "scale":
        return "ScaleWorker", management_pb2.ScaleWorkerRequest(
            model_name=name, model_version=version, min_worker=draw(int32), max_worker=draw(int32),
            synchronous=draw(st.booleans()))  # fmt: skip
    if kind == "describe":
        target = draw(st.one_of(names, st.just(SERVED)))
        return "DescribeModel", management_pb2.DescribeModelRequest(model_name=target, model_version=version)
    if kind == "unregister":
        return "UnregisterModel", management_pb2.UnregisterModelRequest(model_name=name, model_version=version)
    if kind == "default":
        return "SetDefault", management_pb2.SetDefaultRequest(model_name=name, model_version=version)
    return "ListModels", management_pb2.ListModelsRequest(limit=draw(int32), next_page_token=draw(int32))


def manage(server: RunningServer, method: str, request: Any) -> grpc.StatusCode:
    with server.channel() as channel:
        try:
            getattr(management_pb2_grpc.ManagementAPIsServiceStub(channel), method)(request, timeout=60)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, f"{method}({request}) -> {err.code()}: {err.details()}"
            return err.code()
    return grpc.StatusCode.OK


def still_serves(server: RunningServer) -> None:
    request = pb.GenerateRequest(model=SERVED, text="Hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    responses = list(server.stub().Generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 2


# -- the properties ---------------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=250, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
FRESH = settings(FUZZ, max_examples=120, derandomize=False)


def check_prediction(server: RunningServer, key: str, body: bytes) -> None:
    code = predict(server, key, body)
    assert code in ALLOWED, f"input[{key!r}] = {body[:200]!r}... -> {code} (fresh seed {FRESH_SEED})"


def check_management(server: RunningServer, call: tuple[str, Any]) -> None:
    try:
        manage(server, *call)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (fresh seed {FRESH_SEED})") from None


def test_prediction_bodies_get_a_clear_answer(fuzz_server: RunningServer) -> None:
    @FUZZ
    @given(key=st.sampled_from(["data", "body", "other"]), body=prediction_body())
    def run(key: str, body: bytes) -> None:
        check_prediction(fuzz_server, key, body)

    run()
    still_serves(fuzz_server)


def test_prediction_bodies_from_a_fresh_seed(fuzz_server: RunningServer) -> None:
    @FRESH
    @seed(FRESH_SEED)
    @given(key=st.sampled_from(["data", "body"]), body=prediction_body())
    def run(key: str, body: bytes) -> None:
        check_prediction(fuzz_server, key, body)

    run()
    still_serves(fuzz_server)


def test_management_requests_get_a_clear_answer(fuzz_server: RunningServer) -> None:
    @FUZZ
    @given(call=management_call())
    def run(call: tuple[str, Any]) -> None:
        check_management(fuzz_server, call)

    run()
    still_serves(fuzz_server)


def test_management_requests_from_a_fresh_seed(fuzz_server: RunningServer) -> None:
    @FRESH
    @seed(FRESH_SEED)
    @given(call=management_call())
    def run(call: tuple[str, Any]) -> None:
        check_management(fuzz_server, call)

    run()
    still_serves(fuzz_server)
