"""Incremental detokenization: text deltas for a stream of token ids.

A token may end in the middle of a multi-byte UTF-8 character, and some decoders change how a token reads depending
on its neighbours, so a token cannot be decoded alone. We keep two offsets into the request's tokens (as vLLM and
TGI do): text is emitted only once the window decodes to something that does not end in U+FFFD (an incomplete
character), and the window then moves on. Concatenating every delta plus `finish()` equals `decode(all tokens)`.
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
