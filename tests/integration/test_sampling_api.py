"""Issue #6 sampling controls through the public API on the real model: top-n logprobs, min_tokens, penalties."""

from __future__ import annotations

import grpc
import pytest
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from server_harness import RunningServer

TIMEOUT_S = 120.0
MIN_TOKENS = 16  # more than the model answers to "Hi!" before its end-of-turn token (10 with SmolLM2-135M)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> pb_grpc.GenerationStub:
    return server.stub()


def generate(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def greet(**sampling: object) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")])
    return pb.GenerateRequest(messages=chat, sampling=pb.SamplingParams(temperature=0.0, **sampling))


def test_greedy_top_logprobs_lead_with_the_sampled_token(stub: pb_grpc.GenerationStub) -> None:
    request = pb.GenerateRequest(text="The capital of France is",
                                 sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3))
    responses = generate(stub, request)
    ids = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    tops = [top for r in responses for top in r.top_logprobs]
    assert len(ids) == len(tops) == len(logprobs) == 5
    for token_id, logprob, top in zip(ids, logprobs, tops, strict=True):
        assert len(top.token_ids) == 3 and len(top.logprobs) == 3
        assert top.token_ids[0] == token_id  # greedy picks the most likely token
        assert top.logprobs[0] == pytest.approx(logprob, abs=1e-3)
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert len(set(top.token_ids)) == 3


def test_min_tokens_keeps_generating_past_the_natural_stop(stub: pb_grpc.GenerationStub) -> None:
    natural = generate(stub, greet(max_tokens=MIN_TOKENS + 4))[-1]
    assert natural.finish_reason == pb.FINISH_REASON_STOP, "the model no longer stops early on this prompt"
    assert natural.usage.completion_tokens < MIN_TOKENS, "the model no longer stops early on this prompt"
    forced = generate(stub, greet(max_tokens=MIN_TOKENS + 4, min_tokens=MIN_TOKENS))[-1]
    assert forced.usage.completion_tokens >= MIN_TOKENS


def test_large_repetition_penalty_changes_greedy_output(stub: pb_grpc.GenerationStub) -> None:
    def greedy(**sampling: object) -> pb.GenerateRequest:
        return pb.GenerateRequest(text="one two one two one two one two",
                                  sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                             **sampling))

    def greedy_ids(**sampling: object) -> list[int]:
        return [t for r in generate(stub, greedy(**sampling)) for t in r.token_ids]

    assert greedy_ids(repetition_penalty=3.0) != greedy_ids()


def test_priority_is_accepted(stub: pb_grpc.GenerationStub) -> None:
    request = greet(max_tokens=4, ignore_eos=True)
    request.priority = -7
    assert generate(stub, request)[-1].usage.completion_tokens == 4


@pytest.mark.parametrize(("field", "value"), [
    ("min_tokens", 21), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("frequency_penalty", -2.5), ("presence_penalty", float("nan")), ("logprobs", 21),
])
def test_out_of_range_sampling_value_is_invalid_argument_naming_it(stub: pb_grpc.GenerationStub, field: str,
                                                                   value: float) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        generate(stub, greet(max_tokens=20, **{field: value}))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in raised.value.details()
