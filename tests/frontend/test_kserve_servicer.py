"""KServe v2's GRPCInferenceService over a scripted engine, spoken to by tritonclient's asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from frontend_testkit import (
    COMPLETION,
    CONTEXT_LENGTH,
    MODEL,
    Harness,
    ScriptedEngine,
    completion_chunks,
    start_harness,
    until,
)
from ringserve.frontend.api.security import ServerSecurity
from ringserve.frontend.api.server import build_server
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb

grpcclient = pytest.importorskip("tritonclient.grpc")
aioclient = pytest.importorskip("tritonclient.grpc.aio")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException


def inputs(prompt: str, sampling: str | None = None, stream: bool | None = None,
           exclude_input: bool | None = None) -> list[Any]:
    tensors = [("text_input", "BYTES", np.array([prompt.encode()], dtype=object))]
    if sampling is not None:
        tensors.append(("sampling_parameters", "BYTES", np.array([sampling.encode()], dtype=object)))
    if stream is not None:
        tensors.append(("stream", "BOOL", np.array([stream], dtype=bool)))
    if exclude_input is not None:
        tensors.append(("exclude_input_in_output", "BOOL", np.array([exclude_input], dtype=bool)))
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


@pytest.fixture
async def client(harness: Harness) -> AsyncIterator[Any]:
    c = aioclient.InferenceServerClient(f"127.0.0.1:{harness.server.port}")
    yield c
    await c.close()


async def stream_of(client: Any, *requests: dict[str, Any]) -> list[tuple[Any, Any]]:
    async def requests_iterator() -> AsyncIterator[dict[str, Any]]:
        for request in requests:
            yield request

    return [item async for item in client.stream_infer(requests_iterator())]


async def test_health_and_metadata_answer_as_triton_does(client: Any) -> None:
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready(MODEL)
    assert not await client.is_model_ready("missing")
    metadata = await client.get_model_metadata(MODEL, as_json=True)
    assert metadata["name"] == MODEL and metadata["versions"] == ["1"]
    assert {t["name"] for t in metadata["inputs"]} == {"text_input", "stream", "sampling_parameters",
                                                       "exclude_input_in_output"}  # fmt: skip
    with pytest.raises(InferenceServerException) as caught:
        await client.get_model_metadata("missing")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert (await client.get_server_metadata(as_json=True))["name"] == "ringserve"
    config = (await client.get_model_config(MODEL, as_json=True))["config"]
    assert config["model_transaction_policy"]["decoupled"] and config.get("max_batch_size", 0) == 0
    assert {(t["name"], t["data_type"]) for t in config["input"]} >= {("text_input", "TYPE_STRING"),
                                                                      ("stream", "TYPE_BOOL")}  # fmt: skip


async def test_infer_answers_the_prompt_and_its_completion_unless_the_input_is_excluded(client: Any) -> None:
    result = await client.infer(MODEL, inputs("Hi", '{"max_tokens": 8}'), request_id="r-1")
    assert text_of(result) == "Hi" + COMPLETION
    assert result.get_response().id == "r-1"
    result = await client.infer(MODEL, inputs("Hi", exclude_input=True))
    assert text_of(result) == COMPLETION


async def test_stream_infer_sends_one_response_per_piece_the_last_flagged_final(client: Any) -> None:
    items = await stream_of(client, {"model_name": MODEL, "inputs": inputs("Hi", stream=True), "request_id": "s"})
    assert all(error is None for _, error in items)
    results = [result for result, _ in items]
    assert len(results) > 1 and "".join(text_of(r) for r in results) == COMPLETION
    assert [is_final(r) for r in results] == [False] * (len(results) - 1) + [True]
    assert {r.get_response().id for r in results} == {"s"}


async def test_a_stream_serves_several_requests_and_reports_errors_in_band(client: Any) -> None:
    items = await stream_of(
        client,
        {"model_name": MODEL, "inputs": inputs("Hi", '{"temperature": -1}'), "request_id": "bad"},
        {"model_name": MODEL, "inputs": inputs("Hi", exclude_input=True), "request_id": "good"},
        {"model_name": "missing", "inputs": inputs("Hi"), "request_id": "nowhere"},
    )  # fmt: skip
    errors = sorted(str(error) for _, error in items if error is not None)
    assert len(errors) == 2
    assert errors[0].startswith("INVALID_ARGUMENT: sampling_parameters.temperature")
    assert errors[1].startswith("NOT_FOUND: model 'missing'")
    finals = [result for result, error in items if error is None]
    assert [(r.get_response().id, text_of(r), is_final(r)) for r in finals] == [("good", COMPLETION, True)]


async def test_errors_map_to_the_protocols_statuses(client: Any) -> None:
    cases = [(inputs("Hi", '{"top_p": 0}'), "INVALID_ARGUMENT", "sampling_parameters.top_p"),
             (inputs("Hi", "{}", stream=True), "INVALID_ARGUMENT", "stream:"),
             (inputs("Hi", '{"frobnicate": 1}'), "INVALID_ARGUMENT", "sampling_parameters.frobnicate")]
    for tensors, status, field in cases:
        with pytest.raises(InferenceServerException) as caught:
            await client.infer(MODEL, tensors)
        assert caught.value.status() == f"StatusCode.{status}" and field in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        await client.infer("missing", inputs("Hi"))
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as caught:
        await client.get_inference_statistics(MODEL)
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"


async def test_a_stream_cancelled_mid_generation_aborts_its_request(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=2)
    harness = await start_harness(tiny_tokenizer, engine)
    client = aioclient.InferenceServerClient(f"127.0.0.1:{harness.server.port}")
    try:
        async def requests_iterator() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": MODEL, "inputs": inputs("Hi", stream=True)}
            await asyncio.Event().wait()  # keep the stream open

        responses = client.stream_infer(requests_iterator())
        result, error = await anext(responses)
        assert error is None and not is_final(result)
        await engine.hanging.wait()
        responses.cancel()  # tritonclient's way to end a stream early
        await until(lambda: len(engine.aborted) == 1)
    finally:
        await client.close()
        await harness.channel.close()
        await harness.server.stop(grace=None)


async def test_with_api_keys_only_server_live_and_ready_answer_without_one(tiny_tokenizer: ModelTokenizer) -> None:
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tiny_tokenizer.eos_token_ids, vocab_size=tiny_tokenizer.vocab_size)
    server = build_server(ScriptedEngine(completion_chunks(tiny_tokenizer)), tiny_tokenizer, info, port=0,
                          security=ServerSecurity(api_keys=["key-1"]))  # fmt: skip
    await server.start()
    client = aioclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        await until(lambda: server.serving)
        assert await client.is_server_live() and await client.is_server_ready()
        for call in (client.is_model_ready(MODEL), client.get_model_metadata(MODEL), client.infer(MODEL, inputs("Hi"))):
            with pytest.raises(InferenceServerException) as caught:
                await call
            assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        keyed = {"authorization": "Bearer key-1"}
        assert text_of(await client.infer(MODEL, inputs("Hi", exclude_input=True), headers=keyed)) == COMPLETION
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_generate_sees_kserve_as_the_requests_api() -> None:
    """Metrics and traces label a request with its context's `api`: KServe's are not counted as ringserve.v1's."""
    from ringserve.frontend.api.kserve import _ContextWithoutAbort

    wrapped = _ContextWithoutAbort(object())  # type: ignore[arg-type]
    assert getattr(wrapped, "api", "ringserve") == "kserve"
