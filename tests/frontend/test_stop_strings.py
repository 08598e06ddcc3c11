"""Stop strings on streamed text: found across deltas and tokens, cut (or kept), never streamed before resolved."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ringserve.frontend.text.detokenizer import CompletionText, StopStrings
from ringserve.frontend.text.tokenizer import ModelTokenizer


def reference_cut(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """The completion a non-streaming server returns: cut at the stop string that ends first (longest on a tie)."""
    matches = [(text.find(s) + len(s), -len(s), s) for s in stop if s and s in text]
    if not matches:
        return text, False
    end, _, s = min(matches)
    return (text[:end] if include else text[:end - len(s)]), True


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(text)]:
        pieces.append(text[last:point])
        last = point
    return pieces


def stream_stop(stop: list[str], include: bool, deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStrings(stop, include)
    out = [matcher.push(delta) for delta in deltas]
    if matcher.matched is None:
        out.append(matcher.flush())
    return out, matcher.matched is not None


def test_stop_string_split_across_deltas_is_cut_before_it() -> None:
    out, stopped = stream_stop(["STOP"], False, ["abc S", "T", "OP and more"])
    assert stopped and out == ["abc ", "", ""]


def test_stop_string_is_kept_with_include_stop_str_in_output() -> None:
    out, stopped = stream_stop(["STOP"], True, ["abc S", "T", "OP and more"])
    assert stopped and "".join(out) == "abc STOP"


def test_possible_start_of_a_stop_string_is_held_then_released() -> None:
    matcher = StopStrings(["</end>"])
    assert matcher.push("x </") == "x "  # "</" may begin "</end>"
    assert matcher.push("e") == ""
    assert matcher.push("nd!") == "</end!"  # it can no longer become "</end>"
    assert matcher.flush() == ""


def test_held_text_is_flushed_when_the_completion_ends_without_a_match() -> None:
    matcher = StopStrings(["world"])
    assert matcher.push("hello wor") == "hello "
    assert matcher.flush() == "wor"


def test_the_stop_string_that_completes_first_wins() -> None:
    # "abc" starts first but "b" is produced first: the completion ends at "b".
    assert "".join(stream_stop(["abc", "b"], False, ["abc"])[0]) == "a"
    assert "".join(stream_stop(["abc", "b"], True, ["abc"])[0]) == "ab"
    # Two matches ending together: the longer one (it starts earlier).
    assert "".join(stream_stop(["c", "bc"], False, ["abcd"])[0]) == "a"


def test_nothing_is_emitted_after_a_match() -> None:
    matcher = StopStrings(["."])
    assert matcher.push("one. two") == "one"
    assert matcher.push(" three.") == ""
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])


stop_alphabet = st.sampled_from("ab€😀 \n")
stop_lists = st.lists(st.text(stop_alphabet, min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(text=st.text(stop_alphabet, max_size=40), stop=stop_lists, include=st.booleans(),
       cuts=st.lists(st.integers(0, 60), max_size=12))
def test_streamed_stop_matching_equals_cutting_the_whole_text(text: str, stop: list[str], include: bool,
                                                               cuts: list[int]) -> None:
    deltas = split_at(text, cuts)
    matcher = StopStrings(stop, include)
    expected, expect_stop = reference_cut(text, stop, include)
    emitted = ""
    pushed = ""
    for delta in deltas:
        emitted += matcher.push(delta)
        pushed += delta
        # Never streamed ahead of the answer, and never more held back than the longest stop string minus one.
        assert expected.startswith(emitted)
        if matcher.matched is None:
            assert len(pushed) - len(emitted) <= max(map(len, stop)) - 1
    if matcher.matched is None:
        emitted += matcher.flush()
    assert (emitted, matcher.matched is not None) == (expected, expect_stop)


def stream_completion(tokenizer: ModelTokenizer, ids: list[int], chunk_sizes: list[int], stop: list[str],
                      include: bool, skip: bool) -> tuple[list[str], bool]:
    completion = CompletionText(tokenizer, skip, stop, include)
    deltas: list[str] = []
    position = 0
    sizes = iter(chunk_sizes)
    stopped = False
    while position < len(ids) and not stopped:
        size = next(sizes, 1)
        delta, stopped = completion.push(ids[position:position + size])
        deltas.append(delta)
        position += size
    if not stopped:
        delta, stopped = completion.finish()
        deltas.append(delta)
    return deltas, stopped


def check_completion(tokenizer: ModelTokenizer, ids: list[int], chunk_sizes: list[int], stop: list[str],
                     include: bool, skip: bool) -> None:
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    deltas, stopped = stream_completion(tokenizer, ids, chunk_sizes, stop, include, skip)
    assert ("".join(deltas), stopped) == reference_cut(full, stop, include)
    if "\ufffd" not in full:
        assert all("\ufffd" not in delta for delta in deltas)


chunkings = st.lists(st.integers(min_value=1, max_value=4), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk_sizes=chunkings, include=st.booleans(), skip=st.booleans())
def test_byte_level_tokens_stream_with_stop_strings_like_the_full_decode(
        tiny_tokenizer: ModelTokenizer, data: st.DataObject, chunk_sizes: list[int], include: bool, skip: bool,
) -> None:  # fmt: skip
    ids = data.draw(st.lists(st.integers(0, tiny_tokenizer.vocab_size - 1), max_size=50))
    # Stop strings drawn from the decoded text itself, so they match (often across token boundaries).
    full = tiny_tokenizer.decode(ids, skip_special_tokens=skip)
    stop = data.draw(st.lists(st.one_of(st.text(st.sampled_from(full or "x"), min_size=1, max_size=4),
                                        st.text(min_size=1, max_size=3)), min_size=1, max_size=3))
    check_completion(tiny_tokenizer, ids, chunk_sizes, stop, include, skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.text(max_size=50), chunk_sizes=chunkings, include=st.booleans())
def test_real_tokenizer_streams_with_stop_strings_like_the_full_decode(
        real_tokenizer: ModelTokenizer, data: st.DataObject, text: str, chunk_sizes: list[int], include: bool,
) -> None:  # fmt: skip
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    if data.draw(st.booleans()):  # also random ids, biased to single bytes and special tokens
        ids += data.draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, real_tokenizer.vocab_size - 1)),
                                  max_size=30))
    full = real_tokenizer.decode(ids, skip_special_tokens=False)
    start = data.draw(st.integers(0, max(len(full) - 1, 0)))
    stop = [full[start:start + data.draw(st.integers(1, 6))] or "x"]
    check_completion(real_tokenizer, ids, chunk_sizes, stop, include, skip=False)


def test_stop_string_spanning_a_split_emoji_and_the_next_token(tiny_tokenizer: ModelTokenizer) -> None:
    ids = tiny_tokenizer.encode("a😀b end", add_special_tokens=False)
    deltas, stopped = stream_completion(tiny_tokenizer, ids, [1] * len(ids), ["😀b"], False, True)
    assert stopped and "".join(deltas) == "a" and all("\ufffd" not in d for d in deltas)
