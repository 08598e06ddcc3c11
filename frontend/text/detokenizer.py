"""Incremental detokenization and stop strings: the text deltas a completion streams for its token ids.

A token may end in the middle of a multi-byte UTF-8 character, and some decoders change how a token reads depending
on its neighbours, so a token cannot be decoded alone. We keep two offsets into the request's tokens (as vLLM and
TGI do): text is emitted only once the window decodes to something that does not end in U+FFFD (an incomplete
character), and the window then moves on. Concatenating every delta plus `finish()` equals `decode(all tokens)`.

Stop strings are matched on that text, so they are found across token boundaries; text that could still become
the start of a stop string is held back until the next tokens resolve it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-request state; `push()` the new ids of each step, then `finish()` once."""

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # Text for tokens[:read_offset] has been emitted; tokens[prefix_offset:read_offset] give decoding context.
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_token_ids: Sequence[int]) -> str:
        """The text these tokens complete (possibly empty while a character is still partial)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            # Nothing new yet, or the last character is still incomplete: wait for the next token.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return window_text[len(prefix_text):]

    def finish(self) -> str:
        """Whatever is still held back (e.g. bytes that never formed a valid character, shown as U+FFFD)."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self.token_ids))
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return window_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip_special_tokens)


class StopStrings:
    """Cuts streamed text at the first stop string that completes; `push()` each delta, `flush()` at the end.

    Invariant: the held-back text is the longest suffix of the text so far that is a proper prefix of some stop
    string. So a stop string can only start inside the held text or in text not yet pushed, and everything before
    the held text is safe to emit.
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_in_output
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> str:
        """The text that is now safe to emit; after a match, the text up to the cut and nothing more."""
        if self.matched is not None or not delta:
            return ""
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[:start + len(stop)] if self._include else text[:start]
        held = self._held_length(text)
        self._held = text[len(text) - held:] if held else ""
        return text[:len(text) - held]

    def flush(self) -> str:
        """The held-back text, at the end of a completion that no stop string ended."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; of two ending together, the longer one."""
        best: tuple[int, str] | None = None
        best_end = 0
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best_end or (end == best_end and start < best[0]):
                best, best_end = (start, stop), end
        return best

    def _held_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        last = text[-1]
        best = 0
        for stop in self._stop:
            # Candidate prefix lengths k end with the text's last character: stop[k - 1] == last.
            k = stop.rfind(last, 0, min(len(stop) - 1, len(text))) + 1
            while k > best:
                if text.endswith(stop[:k]):
                    best = k
                    break
                k = stop.rfind(last, 0, k - 1) + 1
        return best


class CompletionText:
    """The streamed text of one completion: incremental detokenization, then stop strings.

    `push()` the new ids of each engine output, `finish()` once when the engine ends the completion. Both return
    (text delta, stopped); once a stop string matched, the completion is over and later calls return ("", True).
    """

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stop = StopStrings(stop, include_stop_str_in_output) if stop else None

    @property
    def stopped(self) -> bool:
        return self._stop is not None and self._stop.matched is not None

    def push(self, new_token_ids: Sequence[int]) -> tuple[str, bool]:
        if self._stop is None:
            return self.detokenizer.push(new_token_ids), False
        if self._stop.matched is not None:
            return "", True
        text = self._stop.push(self.detokenizer.push(new_token_ids))
        return text, self._stop.matched is not None

    def finish(self) -> tuple[str, bool]:
        if self._stop is None:
            return self.detokenizer.finish(), False
        if self._stop.matched is not None:
            return "", True
        text = self._stop.push(self.detokenizer.finish())
        if self._stop.matched is not None:
            return text, True
        return text + self._stop.flush(), False
