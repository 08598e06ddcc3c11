"""KServe v2 requests read as RingServe's Generate requests (pure functions), and the protos are Triton's own."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest
from ringserve.frontend.api.kserve import (
    InferError,
    infer_response,
    model_metadata,
    read_infer_request,
)
from ringserve.frontend.api.validation import RequestError, json_generate_fields
from ringserve.kserve import grpc_service_pb2 as kpb
from ringserve.kserve import model_config_pb2
from ringserve.v1 import generation_pb2 as pb

PROTOS = Path(__file__).resolve().parents[2] / "protos" / "ringserve" / "kserve"
Tensor = kpb.ModelInferRequest.InferInputTensor


def raw_bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def request(prompt: str = "Hello", sampling: Any = None, stream: bool | None = None, raw: bool = True,
            **fields: Any) -> kpb.ModelInferRequest:
    """A request as tritonclient sends it (raw contents), or with typed contents (`raw=False`)."""
    out = kpb.ModelInferRequest(model_name="tiny", **fields)
    tensors: list[tuple[str, str, bytes | bool]] = [("text_input", "BYTES", prompt.encode())]
    if sampling is not None:
        tensors.append(("sampling_parameters", "BYTES",
                        sampling if isinstance(sampling, bytes) else json.dumps(sampling).encode()))
    if stream is not None:
        tensors.append(("stream", "BOOL", stream))
    for name, datatype, value in tensors:
        tensor = out.inputs.add(name=name, datatype=datatype, shape=[1])
        if raw:
            out.raw_input_contents.append(raw_bytes(value) if datatype == "BYTES" else bytes([bool(value)]))
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.append(value)  # type: ignore[arg-type]
        else:
            tensor.contents.bool_contents.append(bool(value))
    return out


def refusal(message: kpb.ModelInferRequest) -> InferError:
    with pytest.raises(InferError) as caught:
        read_infer_request(message)
    return caught.value


@pytest.mark.parametrize("raw", [True, False])
def test_a_request_becomes_a_generate_request_with_its_sampling_fields(raw: bool) -> None:
    sampling = {"max_tokens": 8, "temperature": 0, "top_k": 5, "stop": ["\n"], "seed": 7, "stop_token_ids": [2],
                "skip_special_tokens": False, "priority": 3}
    call = read_infer_request(request("Hi €", sampling, stream=True, raw=raw, id="req-1"))
    assert call.stream and call.prompt == "Hi €" and not call.exclude_input
    expected = pb.GenerateRequest(model="tiny", request_id="req-1", text="Hi €", skip_special_tokens=False, priority=3,
                                  sampling=pb.SamplingParams(max_tokens=8, temperature=0, top_k=5, stop=["\n"],
                                                             seed=7, stop_token_ids=[2]))  # fmt: skip
    assert call.generate == expected


def test_numbers_and_booleans_may_come_as_strings_as_tritons_vllm_backend_takes_them() -> None:
    call = read_infer_request(request(sampling={"temperature": "0.5", "max_tokens": "4", "ignore_eos": "true",
                                                "top_k": 3.0, "stop": "END"}))  # fmt: skip
    sampling = call.generate.sampling
    assert (sampling.temperature, sampling.max_tokens, sampling.ignore_eos, sampling.top_k) == (0.5, 4, True, 3)
    assert list(sampling.stop) == ["END"]


@pytest.mark.parametrize(("sampling", "field"), [
    ({"best_of": 2}, "sampling_parameters.best_of"),
    ({"max_tokens": 2.5}, "sampling_parameters.max_tokens"),
    ({"max_tokens": "many"}, "sampling_parameters.max_tokens"),
    ({"temperature": "nan"}, "sampling_parameters.temperature"),
    ({"temperature": 10**400}, "sampling_parameters.temperature"),
    ({"ignore_eos": "yes"}, "sampling_parameters.ignore_eos"),
    ({"seed": -1}, "sampling_parameters.seed"),
    ({"seed": 2**64}, "sampling_parameters.seed"),
    ({"stop": [1]}, "sampling_parameters.stop"),
    ({"stop_token_ids": [-1]}, "sampling_parameters.stop_token_ids"),
    ({"n": 2}, "sampling_parameters.n"),
    ({"logprobs": 3}, "sampling_parameters.logprobs"),
    ([1, 2], "sampling_parameters"),
])  # fmt: skip
def test_bad_sampling_parameters_are_invalid_argument_naming_the_key(sampling: Any, field: str) -> None:
    error = refusal(request(sampling=sampling))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith(f"{field}:"), error.message


@pytest.mark.parametrize("body", [b"not json", b"[" * 100_000, b'{"seed": ' + b"7" * 20_000 + b"}", b"\xff\xfe"])
def test_malformed_sampling_json_is_invalid_argument_not_a_crash(body: bytes) -> None:
    error = refusal(request(sampling=body))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith("sampling_parameters:"), error.message


def test_tensor_errors_name_the_tensor() -> None:
    missing = kpb.ModelInferRequest(model_name="tiny")
    assert "'text_input'" in refusal(missing).message
    unknown = request()
    unknown.inputs.add(name="images", datatype="FP32", shape=[1])
    unknown.raw_input_contents.append(b"\0\0\0\0")
    assert "'images'" in refusal(unknown).message
    wrong_type = request()
    wrong_type.inputs[0].datatype = "INT32"
    assert refusal(wrong_type).message.startswith("text_input: datatype must be BYTES")
    two = request()
    two.inputs[0].shape[:] = [2]
    assert refusal(two).message.startswith("text_input: shape")
    truncated = request()
    truncated.raw_input_contents[0] = struct.pack("<I", 99) + b"short"
    assert refusal(truncated).message.startswith("text_input: raw BYTES element")
    uneven = request()
    uneven.raw_input_contents.append(b"extra")
    assert refusal(uneven).message.startswith("raw_input_contents:")
    not_utf8 = request()
    not_utf8.raw_input_contents[0] = raw_bytes(b"\xff")
    assert refusal(not_utf8).message.startswith("text_input: not UTF-8")


def test_unknown_outputs_parameters_and_versions_are_refused() -> None:
    outputs = request()
    outputs.outputs.add(name="logits")
    assert refusal(outputs).message.startswith("outputs:")
    parameters = request()
    parameters.parameters["sequence_id"].int64_param = 4
    assert refusal(parameters).message.startswith("parameters.sequence_id:")
    empty_final = request()
    empty_final.parameters["triton_enable_empty_final_response"].bool_param = True
    read_infer_request(empty_final)  # tritonclient's stream flag is accepted
    version = request(model_version="2")
    assert refusal(version).code == grpc.StatusCode.NOT_FOUND


def test_json_generate_fields_is_shared_validation_raising_request_error() -> None:
    out = pb.GenerateRequest()
    json_generate_fields({"min_p": 0.1, "cache_salt": "tenant"}, "body", out)
    assert out.sampling.min_p == pytest.approx(0.1) and out.cache_salt == "tenant"
    with pytest.raises(RequestError) as caught:
        json_generate_fields({"cache_salt": 5}, "body", out)
    assert caught.value.field == "body.cache_salt"


def test_a_response_carries_text_output_as_length_prefixed_bytes_and_the_final_flag() -> None:
    call = read_infer_request(request(id="r"))
    response = infer_response(call, "tiny", "wörld", final=True)
    assert (response.model_name, response.id, response.outputs[0].name) == ("tiny", "r", "text_output")
    assert response.raw_output_contents[0] == raw_bytes("wörld".encode())
    assert response.parameters["triton_final_response"].bool_param is True
    assert "triton_final_response" not in infer_response(call, "tiny", "x", final=None).parameters


def test_model_metadata_describes_the_llm_tensors() -> None:
    metadata = model_metadata("tiny")
    inputs = {t.name: t.datatype for t in metadata.inputs}
    assert inputs == {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES",
                      "exclude_input_in_output": "BOOL"}  # fmt: skip
    assert [(t.name, t.datatype) for t in metadata.outputs] == [("text_output", "BYTES")]


def test_the_protos_are_the_recorded_release_files_byte_for_byte() -> None:
    readme = (PROTOS / "README.md").read_text()
    recorded = dict(re.findall(r"^\| (\w+\.proto) \| ([0-9a-f]{64}) \|$", readme, re.MULTILINE))
    assert set(recorded) == {path.name for path in PROTOS.glob("*.proto")}
    for name, digest in recorded.items():
        assert hashlib.sha256((PROTOS / name).read_bytes()).hexdigest() == digest, name


def test_the_compiled_protocol_equals_tritonclients() -> None:
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    triton_config = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    assert kpb.DESCRIPTOR.serialized_pb == service_pb2.DESCRIPTOR.serialized_pb
    assert model_config_pb2.DESCRIPTOR.serialized_pb == triton_config.DESCRIPTOR.serialized_pb
