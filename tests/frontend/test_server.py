"""The Generation servicer in-process on a loopback port, against a scripted fake engine."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import grpc
import pytest
from frontend_testkit import (
    COMPLETION,
    CONTEXT_LENGTH,
    MODEL,
    Harness,
    ScriptedEngine,
    completion_chunks,
    engine_ready,
    start_harness,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ringserve import _core
from ringserve.frontend.api.server import describe_model
from ringserve.frontend.engine_client import EngineBusyError, EngineUnavailableError
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


async def collect(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request, timeout=10)]


def text_request(text: str = "hi there", **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))


async def test_generate_streams_token_ids_and_text_deltas(harness: Harness, tiny_tokenizer: ModelTokenizer) -> None:
    request = text_request("hi", max_tokens=8)
    request.request_id = "client-42"
    responses = await collect(harness.stub, request)
    all_ids = [i for r in responses for i in r.token_ids]
    assert all_ids == tiny_tokenizer.encode(COMPLETION, add_special_tokens=False)
    assert "".join(r.text for r in responses) == COMPLETION
    assert all("\ufffd" not in r.text for r in responses)
    assert all(r.request_id == "client-42" for r in responses)
    assert [r.finish_reason for r in responses[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1)
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(tiny_tokenizer.encode("hi"))
    assert last.usage.completion_tokens == len(all_ids)
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    _, prompt, params = harness.engine.submitted[-1]
    assert prompt == tiny_tokenizer.encode("hi") and params.max_tokens == 8


async def test_generate_assigns_a_request_id_when_none_given(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request())
    assert responses[0].request_id and len({r.request_id for r in responses}) == 1


async def test_messages_are_rendered_with_the_chat_template(harness: Harness, tiny_tokenizer: ModelTokenizer) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi 😀")])
    await collect(harness.stub, pb.GenerateRequest(messages=chat))
    expected = tiny_tokenizer.encode_chat([{"role": "user", "content": "hi 😀"}], add_generation_prompt=True)
    assert harness.engine.submitted[-1][1] == expected


async def test_token_ids_input_is_passed_through(harness: Harness) -> None:
    await collect(harness.stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7])))
    assert harness.engine.submitted[-1][1] == [5, 6, 7]


async def test_sampling_defaults_and_context_cap(harness: Harness) -> None:
    await collect(harness.stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 10)))
    params = harness.engine.submitted[-1][2]
    # The default of 256 is capped so prompt + max_tokens fits the context.
    assert params.max_tokens == CONTEXT_LENGTH - 10
    assert params.sampling == _core.SamplingParams()  # the records' defaults, unchanged
    assert (params.seed, params.ignore_eos) == (None, False)
    await collect(harness.stub, text_request(temperature=0.0, top_p=0.5, top_k=3, seed=7, ignore_eos=True,
                                             stop_token_ids=[4]))
    params = harness.engine.submitted[-1][2]
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, params.seed, params.ignore_eos,
            params.stop_token_ids) == (0.0, 0.5, 3, 7, True, (4,))


async def test_penalties_min_tokens_logprobs_and_priority_reach_the_engine(harness: Harness) -> None:
    await collect(harness.stub, text_request(max_tokens=8))
    params = harness.engine.submitted[-1][2]
    s = params.sampling
    assert (s.min_tokens, s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.num_logprobs,
            params.priority) == (0, 0.0, 1.0, 0.0, 0.0, 0, 0)
    request = text_request(max_tokens=8, min_tokens=8, min_p=0.25, repetition_penalty=1.5, frequency_penalty=-2.0,
                           presence_penalty=0.5, logprobs=20)
    request.priority = -3
    await collect(harness.stub, request)
    params = harness.engine.submitted[-1][2]
    s = params.sampling
    assert (s.min_tokens, s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.num_logprobs,
            params.priority) == (8, 0.25, 1.5, -2.0, 0.5, 20, -3)


async def test_top_logprobs_has_one_entry_per_new_token(harness: Harness) -> None:
    responses = await collect(harness.stub, text_request(max_tokens=8, logprobs=2))
    for response in responses:
        assert [list(top.token_ids) for top in response.top_logprobs] == [[i, i + 1] for i in response.token_ids]
        assert [list(top.logprobs) for top in response.top_logprobs] == [[-0.5, -1.5]] * len(response.token_ids)
    assert sum(len(r.top_logprobs) for r in responses) > 0
    without = await collect(harness.stub, text_request(max_tokens=8))
    assert all(not r.top_logprobs for r in without)


INVALID_REQUESTS = {
    "no input": (pb.GenerateRequest(), "input"),
    "empty text": (pb.GenerateRequest(text=""), "text"),
    "empty messages": (pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
    "message without role": (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(content="x")])),
                             "messages.messages[0].role"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    "token id past vocab": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10_000_000])), "token_ids.ids[1]"),
    "zero max_tokens": (text_request(max_tokens=0), "max_tokens"),
    "negative max_tokens": (text_request(max_tokens=-5), "max_tokens"),
    "negative temperature": (text_request(temperature=-0.1), "temperature"),
    "top_p zero": (text_request(top_p=0.0), "top_p"),
    "top_p above one": (text_request(top_p=1.5), "top_p"),
    "negative top_k": (text_request(top_k=-1), "top_k"),
    "stop token past vocab": (text_request(stop_token_ids=[10_000_000]), "stop_token_ids"),
    "negative min_tokens": (text_request(min_tokens=-1), "sampling.min_tokens"),
    "min_tokens above max_tokens": (text_request(max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    "negative min_p": (text_request(min_p=-0.1), "sampling.min_p"),
    "min_p above one": (text_request(min_p=1.5), "sampling.min_p"),
    "NaN min_p": (text_request(min_p=float("nan")), "sampling.min_p"),
    "zero repetition_penalty": (text_request(repetition_penalty=0.0), "sampling.repetition_penalty"),
    "infinite repetition_penalty": (text_request(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    "NaN repetition_penalty": (text_request(repetition_penalty=float("nan")), "sampling.repetition_penalty"),
    "frequency_penalty below -2": (text_request(frequency_penalty=-2.5), "sampling.frequency_penalty"),
    "NaN frequency_penalty": (text_request(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    "presence_penalty above 2": (text_request(presence_penalty=2.5), "sampling.presence_penalty"),
    "infinite presence_penalty": (text_request(presence_penalty=-float("inf")), "sampling.presence_penalty"),
    "negative logprobs": (text_request(logprobs=-1), "sampling.logprobs"),
    "logprobs above 20": (text_request(logprobs=21), "sampling.logprobs"),
    "NaN temperature": (text_request(temperature=float("nan")), "sampling.temperature"),
    "NaN top_p": (text_request(top_p=float("nan")), "sampling.top_p"),
    "prompt longer than context": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * CONTEXT_LENGTH)),
                                   f"context length is {CONTEXT_LENGTH}"),
}


@pytest.mark.parametrize("name", list(INVALID_REQUESTS))
async def test_invalid_request_names_the_field_and_server_keeps_serving(harness: Harness, name: str) -> None:
    request, field = INVALID_REQUESTS[name]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(harness.stub, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()
    assert not harness.engine.submitted  # rejected before reaching the engine
    responses = await collect(harness.stub, text_request())
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_unknown_model_is_not_found(harness: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(harness.stub, pb.GenerateRequest(model="gpt-9", text="hi"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "gpt-9" in raised.value.details()
    await collect(harness.stub, pb.GenerateRequest(model=MODEL, text="hi"))  # the served name is accepted


async def test_client_cancellation_aborts_the_request_in_the_engine(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=1)
    h = await start_harness(tiny_tokenizer, engine)
    try:
        call = h.stub.Generate(text_request())
        first = await call.read()
        assert first.token_ids
        await asyncio.wait_for(engine.hanging.wait(), 10)
        call.cancel()
        await asyncio.wait_for(engine.aborted_event.wait(), 10)
        assert engine.aborted == [engine.submitted[0][0]]
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_deadline_aborts_the_request_in_the_engine(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=0)
    h = await start_harness(tiny_tokenizer, engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in h.stub.Generate(text_request(), timeout=0.5):
                pass
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(engine.aborted_event.wait(), 10)
        assert engine.aborted == [engine.submitted[0][0]]
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


@pytest.mark.parametrize(("error", "code"), [
    (EngineBusyError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError("worker 0 died"), grpc.StatusCode.UNAVAILABLE),
])
async def test_engine_errors_map_to_status_codes(tiny_tokenizer: ModelTokenizer, error: Exception,
                                                 code: grpc.StatusCode) -> None:
    h = await start_harness(tiny_tokenizer, ScriptedEngine([[1]], error=error))  # type: ignore[arg-type]
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(h.stub, text_request())
        assert raised.value.code() == code
        assert str(error) in raised.value.details()
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_tokenize_model_info_and_stats(harness: Harness, tiny_tokenizer: ModelTokenizer) -> None:
    tokens = await harness.stub.Tokenize(pb.TokenizeRequest(text="hello 😀"))
    assert list(tokens.token_ids) == tiny_tokenizer.encode("hello 😀") and tokens.prompt == "hello 😀"
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    rendered = await harness.stub.Tokenize(pb.TokenizeRequest(messages=chat))
    assert rendered.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    info = await harness.stub.GetModelInfo(pb.ModelInfoRequest())
    assert (info.model, info.context_length, info.vocab_size) == (MODEL, CONTEXT_LENGTH, tiny_tokenizer.vocab_size)
    stats = await harness.stub.GetEngineStats(pb.EngineStatsRequest())
    assert (stats.num_running, stats.free_kv_blocks, stats.num_steps) == (2, 40, 1234)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await harness.stub.GetModelInfo(pb.ModelInfoRequest(model="other"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def wait_for_health(channel: grpc.aio.Channel, expected: int) -> None:
    for _ in range(200):
        if await health_status(channel) == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"health never became {expected}")


async def test_health_follows_engine_readiness_and_failure(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine([[1]], ready=False)
    h = await start_harness(tiny_tokenizer, engine)
    try:
        assert await health_status(h.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        engine.mark_ready()
        await wait_for_health(h.channel, health_pb2.HealthCheckResponse.SERVING)
        assert await health_status(h.channel, "ringserve.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
        engine.fail("worker 0 died")
        await wait_for_health(h.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_reflection_lists_the_generation_service(harness: Harness) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)

    async def one_request() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names: list[str] = []
    async for response in stub.ServerReflectionInfo(one_request(), timeout=5):
        names = [service.name for service in response.list_services_response.service]
    assert "ringserve.v1.Generation" in names
    assert "grpc.health.v1.Health" in names


def test_describe_model_takes_limits_from_engine_ready(tiny_tokenizer: ModelTokenizer) -> None:
    ready = engine_ready(max_model_len=2048)
    info = describe_model("smollm2", "llama", "float32", 1, ready, tiny_tokenizer)
    assert (info.context_length, info.block_size, info.kv_capacity_tokens) == (2048, 16, 1600)
    assert list(info.eos_token_ids) == tiny_tokenizer.eos_token_ids
    assert info.vocab_size == tiny_tokenizer.vocab_size and info.bos_token_id == tiny_tokenizer.bos_token_id


async def test_a_refused_request_is_freed_when_its_call_ends(harness: Harness) -> None:
    """A refusal aborts the call; grpc keeps the abort in the call's state, and the frames it passed through held
    the request: a reference cycle that kept every refused request (a 10 MiB prompt, say) in memory until the
    cycle collector ran. With the collector off, nothing of a refused call may stay alive."""
    gc.collect()
    gc.disable()
    try:
        marker = "freed-check"
        refusals = [pb.GenerateRequest(request_id=marker, text="a" * 100_000),  # over the size bound
                    pb.GenerateRequest(request_id=marker, text="hi", sampling=pb.SamplingParams(temperature=-1.0)),
                    pb.GenerateRequest(request_id=marker, model="other", text="hi")]
        for request in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(harness.stub, request)
            assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await harness.stub.Tokenize(pb.TokenizeRequest(text=marker * 10_000), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        del refusals, refused, request
        await asyncio.sleep(0.1)
        alive = [o for o in gc.get_objects() if (isinstance(o, pb.GenerateRequest) and o.request_id == marker)
                 or (isinstance(o, pb.TokenizeRequest) and o.text.startswith(marker))]
        assert not alive, f"{len(alive)} refused request(s) still referenced"
    finally:
        gc.enable()
