"""Incremental detokenization: deltas add up to the full decode and never show half a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ringserve.frontend.text.detokenizer import IncrementalDetokenizer
from ringserve.frontend.text.tokenizer import ModelTokenizer


def stream(tokenizer: ModelTokenizer, ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas: list[str] = []
    position = 0
    sizes = iter(chunk_sizes)
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.push(ids[position:position + size]))
        position += size
    deltas.append(detokenizer.finish())
    return deltas


def check_stream_properties(tokenizer: ModelTokenizer, ids: list[int], chunk_sizes: list[int], skip: bool) -> None:
    deltas = stream(tokenizer, ids, chunk_sizes, skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in delta for delta in deltas)


chunkings = st.lists(st.integers(min_value=1, max_value=4), max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk_sizes=chunkings, skip=st.booleans())
def test_random_token_streams_add_up_to_full_decode(tiny_tokenizer: ModelTokenizer, data: st.DataObject,
                                                     chunk_sizes: list[int], skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tiny_tokenizer.vocab_size - 1), max_size=60))
    check_stream_properties(tiny_tokenizer, ids, chunk_sizes, skip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), chunk_sizes=chunkings)
def test_valid_text_streams_without_replacement_characters(tiny_tokenizer: ModelTokenizer, text: str,
                                                           chunk_sizes: list[int]) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tiny_tokenizer, ids, chunk_sizes, skip_special_tokens=False)
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas if "\ufffd" not in text)


def test_split_emoji_is_held_until_complete(tiny_tokenizer: ModelTokenizer) -> None:
    ids = tiny_tokenizer.encode("a😀b", add_special_tokens=False)
    assert len(ids) == 4  # "a", two halves of the emoji, "b"
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    assert [detokenizer.push([token]) for token in ids] == ["a", "", "😀", "b"]
    assert detokenizer.finish() == ""


def test_special_tokens_skipped_or_kept(tiny_tokenizer: ModelTokenizer) -> None:
    ids = tiny_tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tiny_tokenizer, ids, [], skip_special_tokens=True)) == "hi"
    assert "".join(stream(tiny_tokenizer, ids, [], skip_special_tokens=False)) == "hi<|im_end|>"


def test_dangling_partial_character_is_flushed_by_finish(tiny_tokenizer: ModelTokenizer) -> None:
    first_half_of_emoji = tiny_tokenizer.encode("😀", add_special_tokens=False)[0]
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    assert detokenizer.push([first_half_of_emoji]) == ""
    assert detokenizer.finish() == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk_sizes=chunkings)
def test_real_tokenizer_random_streams(real_tokenizer: ModelTokenizer, data: st.DataObject, chunk_sizes: list[int],
                                       skip: bool) -> None:
    # Bias towards low ids (special tokens, single bytes) where partial characters are common.
    token = st.one_of(st.integers(0, 300), st.integers(0, real_tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=60))
    check_stream_properties(real_tokenizer, ids, chunk_sizes, skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_real_tokenizer_text_round_trips_token_by_token(real_tokenizer: ModelTokenizer, text: str) -> None:
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(real_tokenizer, ids, [], skip_special_tokens=False)
    full = real_tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(deltas) == full
    # Not `text`: a byte missing from the vocabulary (unassigned planes) is dropped and decodes as U+FFFD.
    if "\ufffd" not in full:
        assert all("\ufffd" not in delta for delta in deltas)
