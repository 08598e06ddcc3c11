"""Request validation as pure functions: one test per rule, each checking the status and that the message names
the field at fault (no servicer, no server, no event loop)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from ringserve.frontend.api.validation import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    TOKENIZE_INPUTS,
    ModelLimits,
    RequestError,
    check_model,
    check_prompt,
    generation_options,
    prompt_bytes_bound,
    prompt_input,
    require_one_sample,
)
from ringserve.v1 import generation_pb2 as pb

LIMITS = ModelLimits(model="tiny", context_length=64, kv_capacity_tokens=48, vocab_size=100, default_max_tokens=256)


def refused(check: Callable[[], Any]) -> RequestError:
    with pytest.raises(RequestError) as raised:
        check()
    return raised.value


def assert_refused(check: Callable[[], Any], field: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
                   ) -> RequestError:
    error = refused(check)
    assert error.code == code
    assert error.field == field
    assert field in error.message
    return error


def sampled(prompt_len: int = 4, **sampling: Any) -> Callable[[], Any]:
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
    return lambda: generation_options(request, prompt_len, LIMITS)


# -- the model and the input --------------------------------------------------------------------------------

def test_another_models_name_is_not_found() -> None:
    assert_refused(lambda: check_model("other", LIMITS), "model", grpc.StatusCode.NOT_FOUND)
    check_model("", LIMITS)
    check_model("tiny", LIMITS)


def test_a_request_without_input_is_refused() -> None:
    error = assert_refused(lambda: prompt_input(pb.GenerateRequest(), LIMITS), "input")
    assert "`text`, `messages`, `token_ids`" in error.message


def test_a_request_with_two_inputs_is_refused() -> None:
    request = pb.GenerateRequest(text="a", token_ids=pb.TokenIds(ids=[1]))
    error = assert_refused(lambda: prompt_input(request, LIMITS), "input")
    assert "text and token_ids" in error.message


def test_tokenize_takes_no_token_ids() -> None:
    request = pb.TokenizeRequest(text="a")
    assert prompt_input(request, LIMITS, TOKENIZE_INPUTS).text == "a"


def test_empty_text_is_refused() -> None:
    assert_refused(lambda: prompt_input(pb.GenerateRequest(text=""), LIMITS), "text")


def test_a_chat_without_messages_is_refused() -> None:
    request = pb.GenerateRequest(messages=pb.ChatMessages())
    assert_refused(lambda: prompt_input(request, LIMITS), "messages.messages")


def test_a_message_without_role_is_refused() -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage(content="b")])
    assert_refused(lambda: prompt_input(pb.GenerateRequest(messages=chat), LIMITS), "messages.messages[1].role")


def test_a_chat_keeps_its_conversation_and_generation_prompt_flag() -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")], add_generation_prompt=False)
    prompt = prompt_input(pb.GenerateRequest(messages=chat), LIMITS)
    assert prompt.conversation == ({"role": "user", "content": "a"},) and not prompt.add_generation_prompt


def test_empty_token_ids_are_refused() -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds())
    assert_refused(lambda: prompt_input(request, LIMITS), "token_ids.ids")


def test_a_token_id_outside_the_vocabulary_is_refused() -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 100]))
    error = assert_refused(lambda: prompt_input(request, LIMITS), "token_ids.ids[1]")
    assert "100 is out of range" in error.message


# -- the tokenized prompt -----------------------------------------------------------------------------------

def test_a_prompt_that_tokenizes_to_nothing_is_refused() -> None:
    assert_refused(lambda: check_prompt([], "text", LIMITS), "text")


def test_a_prompt_that_leaves_no_room_in_the_context_is_refused() -> None:
    assert_refused(lambda: check_prompt([1] * 64, "text", LIMITS), "prompt")
    check_prompt([1] * 40, "text", LIMITS)


def test_a_prompt_larger_than_the_kv_cache_is_resource_exhausted() -> None:
    assert_refused(lambda: check_prompt([1] * 48, "text", LIMITS), "prompt", grpc.StatusCode.RESOURCE_EXHAUSTED)


# -- sampling -----------------------------------------------------------------------------------------------

def test_max_tokens_must_be_positive() -> None:
    assert_refused(sampled(max_tokens=0), "sampling.max_tokens")


def test_max_tokens_is_cut_to_the_room_left_in_the_context() -> None:
    assert sampled(prompt_len=60, max_tokens=100)().params.max_tokens == 4
    assert sampled(prompt_len=4)().params.max_tokens == 60  # the default, cut too


@pytest.mark.parametrize("temperature", [-0.1, math.inf, math.nan])
def test_temperature_must_be_finite_and_not_negative(temperature: float) -> None:
    assert_refused(sampled(temperature=temperature), "sampling.temperature")


@pytest.mark.parametrize("top_p", [0.0, 1.5, math.nan])
def test_top_p_must_be_in_zero_one(top_p: float) -> None:
    assert_refused(sampled(top_p=top_p), "sampling.top_p")


def test_top_k_must_not_be_negative() -> None:
    assert_refused(sampled(top_k=-1), "sampling.top_k")


def test_a_stop_token_id_outside_the_vocabulary_is_refused() -> None:
    assert_refused(sampled(stop_token_ids=[3, 200]), "sampling.stop_token_ids[1]")


def test_min_tokens_must_not_exceed_max_tokens() -> None:
    error = assert_refused(sampled(max_tokens=5, min_tokens=6), "sampling.min_tokens")
    assert "max_tokens = 5" in error.message


@pytest.mark.parametrize("min_p", [-0.1, 1.1, math.nan])
def test_min_p_must_be_in_zero_one(min_p: float) -> None:
    assert_refused(sampled(min_p=min_p), "sampling.min_p")


@pytest.mark.parametrize("penalty", [0.0, -1.0, math.inf])
def test_repetition_penalty_must_be_positive_and_finite(penalty: float) -> None:
    assert_refused(sampled(repetition_penalty=penalty), "sampling.repetition_penalty")


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [-2.5, 2.5, math.nan])
def test_frequency_and_presence_penalties_must_be_in_minus_two_two(name: str, value: float) -> None:
    assert_refused(sampled(**{name: value}), f"sampling.{name}")


def test_logprobs_are_capped() -> None:
    assert_refused(sampled(logprobs=MAX_LOGPROBS + 1), "sampling.logprobs")
    assert sampled(logprobs=MAX_LOGPROBS)().params.sampling.num_logprobs == MAX_LOGPROBS


def test_a_cache_salt_that_is_too_long_is_refused() -> None:
    request = pb.GenerateRequest(text="hi", cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1))
    assert_refused(lambda: generation_options(request, 4, LIMITS), "cache_salt")


@pytest.mark.parametrize("n", [0, MAX_N + 1])
def test_n_must_be_in_range(n: int) -> None:
    assert_refused(sampled(n=n), "sampling.n")


def test_requests_that_carry_kv_take_one_sample() -> None:
    error = assert_refused(lambda: require_one_sample(2, "a disaggregated prefill"), "sampling.n")
    assert "a disaggregated prefill" in error.message
    require_one_sample(1, "a disaggregated prefill")


def test_too_many_stop_strings_are_refused() -> None:
    assert_refused(sampled(stop=["x"] * (MAX_STOP_STRINGS + 1)), "sampling.stop")


def test_an_empty_stop_string_is_refused() -> None:
    assert_refused(sampled(stop=["ok", ""]), "sampling.stop[1]")


def test_a_stop_string_that_is_too_long_is_refused() -> None:
    assert_refused(sampled(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "sampling.stop[0]")


def test_a_valid_request_keeps_every_option() -> None:
    request = pb.GenerateRequest(text="hi", priority=3, skip_special_tokens=False, sampling=pb.SamplingParams(
        max_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=7, n=2, stop=["\n"], include_stop_str_in_output=True,
        min_tokens=1, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5, logprobs=2))
    options = generation_options(request, 4, LIMITS)
    params = options.params
    assert (params.max_tokens, params.sampling.temperature, params.sampling.top_k, params.seed,
            params.priority) == (8, 0.5, 4, 7, 3)
    assert (params.sampling.min_tokens, params.sampling.num_logprobs) == (1, 2)
    assert (options.n, options.stop, options.include_stop_str_in_output, options.skip_special_tokens) == (
        2, ("\n",), True, False)


# -- the size bound before tokenizing -----------------------------------------------------------------------

SIZED = ModelLimits(model="tiny", context_length=64, max_prompt_bytes=prompt_bytes_bound(64, 10))


def test_prompt_bytes_bound_is_what_context_length_minus_one_tokens_can_spell() -> None:
    assert prompt_bytes_bound(64, 10) == 630
    assert prompt_bytes_bound(0, 10) == 0 and prompt_bytes_bound(64, 0) == 0  # unknown: no bound
    assert ModelLimits.of(pb.ModelInfo(model="m", context_length=64), 100, max_bytes_per_token=10).max_prompt_bytes \
        == 630


def test_a_text_over_the_size_bound_is_refused_naming_the_field() -> None:
    prompt_input(pb.GenerateRequest(text="a" * 630), SIZED)
    error = assert_refused(lambda: prompt_input(pb.GenerateRequest(text="a" * 631), SIZED), "text")
    assert "630 bytes" in error.message and "64 tokens" in error.message
    # Bytes, not characters: 158 four-byte characters are 632 bytes.
    assert_refused(lambda: prompt_input(pb.GenerateRequest(text="😀" * 158), SIZED), "text")
    prompt_input(pb.GenerateRequest(text="😀" * 157), SIZED)
    prompt_input(pb.GenerateRequest(text="a" * 10_000), LIMITS)  # no bound known: tokenizing decides


def test_a_conversation_over_the_size_bound_is_refused_by_its_contents_together() -> None:
    def chat(*contents: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content=c) for c in contents]))

    prompt_input(chat("a" * 315, "b" * 315), SIZED)
    assert_refused(lambda: prompt_input(chat("a" * 315, "b" * 316), SIZED), "messages")
    assert_refused(lambda: prompt_input(chat("a" * 10_000_000), SIZED), "messages")
