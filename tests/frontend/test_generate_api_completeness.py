"""Issue #6 API additions against a scripted engine: stop strings, cache_salt, the waiting-queue bound,
Detokenize, ListModels, and the TorchServe JSON body's extra names."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from frontend_testkit import (
    COMPLETION,
    CONTEXT_LENGTH,
    MODEL,
    Harness,
    ScriptedEngine,
    completion_chunks,
    until,
)
from ringserve.frontend.api.server import build_server
from ringserve.frontend.api.torchserve import PredictionError, generate_request_from_prediction
from ringserve.frontend.api.validation import cache_salt_hash
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.torchserve import inference_pb2
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


async def start_bounded_harness(tokenizer: ModelTokenizer, engine: ScriptedEngine, max_waiting: int) -> Harness:
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=tokenizer.vocab_size)
    server = build_server(engine, tokenizer, info, host="127.0.0.1", port=0, max_waiting_requests=max_waiting)
    await server.start()
    return Harness(server, engine, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))


async def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request, timeout=10)]


def text_request(text: str = "hi there", **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))


# -- stop strings ---------------------------------------------------------------------------------------------
# The scripted completion arrives as "hell" | "o" | " " | "😀 wörld".

async def test_stop_string_across_outputs_ends_with_stop_and_aborts_the_engine_request(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request(stop=["lo "]))
    assert "".join(r.text for r in responses) == "hel"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == 4  # every token generated so far, "o" and " " included
    request_id = harness.engine.submitted[-1][0]
    assert harness.engine.aborted == [request_id]  # its blocks are freed; the client still sees STOP


async def test_include_stop_str_in_output_keeps_the_stop_string(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request(stop=["lo "], include_stop_str_in_output=True))
    assert "".join(r.text for r in responses) == "hello "
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


async def test_stop_string_in_the_last_output_needs_no_abort(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request(stop=["rld", "zzz"]))
    assert "".join(r.text for r in responses) == "hello 😀 wö"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert harness.engine.aborted == []


async def test_text_held_for_a_stop_string_that_never_completes_is_released_at_the_end(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request(stop=["o 😀 wörx"]))
    # "o" and " " could start the stop string: they wait (their messages carry only token ids) until resolved.
    assert [r.text for r in responses] == ["hell", "", "", "o 😀 wörld"]
    assert "".join(r.text for r in responses) == COMPLETION
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(("stop", "detail"), [
    ([f"s{i}" for i in range(17)], "sampling.stop has 17"),
    (["ok", ""], "sampling.stop[1]"),
    (["x" * 257], "sampling.stop[0]"),
])
async def test_invalid_stop_strings_are_invalid_argument(harness: Harness, stop: list[str], detail: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(harness.stub, text_request(stop=stop))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail in raised.value.details()
    assert not harness.engine.submitted


# -- cache_salt ---------------------------------------------------------------------------------------------

def test_cache_salt_hash_is_zero_only_for_no_salt() -> None:
    assert cache_salt_hash("") == 0
    salts = {cache_salt_hash(f"tenant-{i}") for i in range(1000)}
    assert 0 not in salts and len(salts) == 1000 and max(salts) < 2**64


async def test_cache_salt_reaches_the_engine_hashed(harness: Harness) -> None:
    for salt in ("tenant-a", "tenant-b", ""):
        request = text_request(max_tokens=4)
        request.cache_salt = salt
        await collect(harness.stub, request)
    assert [params.cache_salt for _, _, params in harness.engine.submitted] == [
        cache_salt_hash("tenant-a"), cache_salt_hash("tenant-b"), 0]


async def test_overlong_cache_salt_is_invalid_argument(harness: Harness) -> None:
    request = text_request()
    request.cache_salt = "s" * 1025
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(harness.stub, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in raised.value.details()


# -- the waiting queue --------------------------------------------------------------------------------------

async def test_requests_beyond_the_waiting_bound_get_resource_exhausted(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=0)  # nothing is ever scheduled
    h = await start_bounded_harness(tiny_tokenizer, engine, max_waiting=2)
    servicer = h.server.servicer
    try:
        waiting = [h.stub.Generate(text_request()) for _ in range(2)]
        await until(lambda: len(engine.submitted) == 2)
        assert servicer.num_waiting == 2
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(h.stub, text_request())
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-waiting-requests is 2" in raised.value.details()
        waiting[0].cancel()  # a place frees up
        await until(lambda: servicer.num_waiting == 1)
        with pytest.raises(grpc.aio.AioRpcError) as raised:  # n = 2 needs two places
            await collect(h.stub, text_request(n=2))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "n = 2" in raised.value.details()
        waiting.append(h.stub.Generate(text_request()))
        await until(lambda: len(engine.submitted) == 3)
        for call in waiting:
            call.cancel()
        await until(lambda: servicer.num_waiting == 0)
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_scheduled_requests_do_not_count_as_waiting(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=1)  # one output each, then running
    h = await start_bounded_harness(tiny_tokenizer, engine, max_waiting=1)
    try:
        calls = []
        for _ in range(3):
            call = h.stub.Generate(text_request())
            assert (await call.read()).token_ids  # it had output: scheduled, so its place is free again
            calls.append(call)
        assert h.server.servicer.num_waiting == 0
        for call in calls:
            call.cancel()
        await until(lambda: len(engine.aborted) == 3)
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_zero_bound_means_unbounded(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=0)
    h = await start_bounded_harness(tiny_tokenizer, engine, max_waiting=0)
    try:
        calls = [h.stub.Generate(text_request(n=16)) for _ in range(5)]
        await until(lambda: len(engine.submitted) == 5)
        assert h.server.servicer.num_waiting == 80
        for call in calls:
            call.cancel()
        await until(lambda: h.server.servicer.num_waiting == 0)
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


# -- Detokenize, GetModelInfo, ListModels -----------------------------------------------------------------

async def test_detokenize_round_trips_and_skips_special_tokens_by_default(harness: Harness,
                                                                          tiny_tokenizer: ModelTokenizer) -> None:
    ids = tiny_tokenizer.encode("hello 😀<|im_end|>", add_special_tokens=False)
    assert (await harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))).text == "hello 😀"
    kept = await harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False))
    assert kept.text == "hello 😀<|im_end|>"
    assert (await harness.stub.Detokenize(pb.DetokenizeRequest())).text == ""


async def test_detokenize_rejects_ids_outside_the_vocabulary(harness: Harness, tiny_tokenizer: ModelTokenizer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, tiny_tokenizer.vocab_size]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in raised.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await harness.stub.Detokenize(pb.DetokenizeRequest(model="other", token_ids=[1]))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def test_list_models_describes_the_served_model_and_its_state(harness: Harness) -> None:
    listing = await harness.stub.ListModels(pb.ListModelsRequest())
    assert listing.default_model == MODEL and [m.model for m in listing.models] == [MODEL]
    info = await harness.stub.GetModelInfo(pb.ModelInfoRequest())
    assert listing.models[0] == info
    assert info.state == pb.MODEL_STATE_READY
    assert (info.architecture, info.context_length, info.dtype, info.tensor_parallel_size, info.block_size,
            info.kv_capacity_tokens) == ("llama", CONTEXT_LENGTH, "float32", 1, 16, 1600)
    harness.engine.fail("worker 0 died")
    await asyncio.sleep(0)
    assert (await harness.stub.ListModels(pb.ListModelsRequest())).models[0].state == pb.MODEL_STATE_FAILED


# -- TorchServe JSON body ---------------------------------------------------------------------------------

def prediction(body: Any) -> inference_pb2.PredictionsRequest:
    return inference_pb2.PredictionsRequest(model_name="m", input={"data": json.dumps(body).encode()})


def test_torchserve_body_accepts_the_ringserve_sampling_names() -> None:
    request = generate_request_from_prediction(prediction({
        "prompt": "hi", "max_new_tokens": 9, "min_tokens": 2, "min_p": 0.1, "repetition_penalty": 1.2,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "stop": ["\n\n", "END"], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "priority": -3, "cache_salt": "tenant", "n": 1, "seed": 4,
    }))  # fmt: skip
    s = request.sampling
    assert (s.max_tokens, s.min_tokens, s.seed, list(s.stop), s.include_stop_str_in_output) == (
        9, 2, 4, ["\n\n", "END"], True)
    assert (s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == pytest.approx(
        (0.1, 1.2, 0.5, -0.5))
    assert (request.skip_special_tokens, request.priority, request.cache_salt) == (False, -3, "tenant")
    assert list(generate_request_from_prediction(prediction({"prompt": "hi", "stop": "."})).sampling.stop) == ["."]


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "min_p": "0.1"}, "min_p"),
    ({"prompt": "hi", "priority": 1.5}, "priority"),
    ({"prompt": "hi", "cache_salt": 7}, "cache_salt"),
    ({"prompt": "hi", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
])
def test_torchserve_body_with_a_wrong_type_names_the_key(body: dict[str, Any], field: str) -> None:
    with pytest.raises(PredictionError) as raised:
        generate_request_from_prediction(prediction(body))
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"input.data.{field}" in raised.value.message
