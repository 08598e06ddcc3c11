"""`ringserve.v1` GenerateResponses into OpenAI's response bodies and Server-Sent Events.

A request's streams (one per prompt, each with n interleaved completions) arrive as (prompt index, response)
pairs; choice `prompt * n + response.index` is what OpenAI calls the choice's index. `Choices` keeps each choice's
text, finish reason and log-probabilities and the request's usage; `ChatFormat` and `CompletionFormat` turn one
response into a chunk (streaming) or the whole into one body.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

from ringserve.frontend.api.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from ringserve.frontend.text.tokenizer import ModelTokenizer, byte_alphabet
from ringserve.v1 import generation_pb2 as pb

DONE = b"data: [DONE]\n\n"
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_MIN_LOGPROB = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity), as vLLM does


def sse(json_text: str) -> bytes:
    return b"data: " + json_text.encode() + b"\n\n"


class TokenTexts:
    """Token ids as OpenAI's log-probabilities show them: each token's text alone and its UTF-8 bytes."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        """The token's own bytes: a byte-level BPE token spells them (a token may hold part of a character, which
        its text shows as U+FFFD); any other token's text is encoded."""
        piece = self._tokenizer.backend.id_to_token(token_id) or ""
        byte_of = _byte_of_char()
        if piece and all(ch in byte_of for ch in piece):
            return tuple(byte_of[ch] for ch in piece)
        return tuple(self.text(token_id).encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    return {char: byte for byte, char in byte_alphabet().items()}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


@dataclass
class RequestMeta:
    """What every chunk and body of one request repeats."""

    id: str
    model: str
    n: int  # completions per prompt
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # its first chunk went out (a chat stream names the role once)
    chat_logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    offset: int = 0  # characters of text so far, for text_offset


class Choices:
    """Every choice of a request and its usage, fed one (prompt index, response) at a time."""

    def __init__(self, meta: RequestMeta, num_prompts: int) -> None:
        self.meta = meta
        self._choices = [_Choice() for _ in range(num_prompts * meta.n)]
        self._prompt_tokens = [0] * num_prompts
        self._cached_tokens = [0] * num_prompts
        self._completion_tokens = 0

    def choice(self, index: int) -> _Choice:
        return self._choices[index]

    def __len__(self) -> int:
        return len(self._choices)

    def add(self, prompt: int, response: pb.GenerateResponse) -> int:
        """Record the response; its choice's index."""
        index = prompt * self.meta.n + response.index
        choice = self._choices[index]
        if response.text:
            choice.text.append(response.text)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = _FINISH_REASONS.get(response.finish_reason, "abort")
            usage = response.usage
            self._prompt_tokens[prompt] = usage.prompt_tokens
            self._cached_tokens[prompt] = max(self._cached_tokens[prompt], usage.cached_tokens)
            self._completion_tokens += usage.completion_tokens
        return index

    def usage(self) -> Usage:
        prompt = sum(self._prompt_tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=self._completion_tokens,
                     total_tokens=prompt + self._completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached_tokens)))


class ChatFormat:
    """Chat completions: `chat.completion` bodies and `chat.completion.chunk` events."""

    def __init__(self, choices: Choices, texts: TokenTexts, logprobs: bool, include_usage: bool) -> None:
        self.choices = choices
        self._texts = texts
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._exclude = None if include_usage else {"usage"}

    def add(self, prompt: int, response: pb.GenerateResponse) -> ChatChunkChoice:
        index = self.choices.add(prompt, response)
        choice = self.choices.choice(index)
        entries = self._token_logprobs(response) if self._logprobs else None
        if entries is not None:
            choice.chat_logprobs.extend(entries)
        delta = Delta(content=response.text)
        if not choice.started:
            choice.started = True
            delta.role = "assistant"
        return ChatChunkChoice(index=index, delta=delta,
                               logprobs=ChatLogprobs(content=entries) if entries is not None else None,
                               finish_reason=choice.finish_reason)  # fmt: skip

    def chunk(self, prompt: int, response: pb.GenerateResponse) -> bytes:
        meta = self.choices.meta
        body = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                   choices=[self.add(prompt, response)])
        return sse(body.model_dump_json(exclude=self._exclude))

    def usage_chunk(self) -> bytes | None:
        if not self._include_usage:
            return None
        meta = self.choices.meta
        return sse(ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[],
                                       usage=self.choices.usage()).model_dump_json())  # fmt: skip

    def body(self) -> ChatCompletion:
        meta = self.choices.meta
        choices = []
        for index in range(len(self.choices)):
            choice = self.choices.choice(index)
            logprobs = ChatLogprobs(content=choice.chat_logprobs) if self._logprobs else None
            choices.append(ChatChoice(index=index, message=AssistantMessage(content="".join(choice.text)),
                                      logprobs=logprobs, finish_reason=choice.finish_reason))  # fmt: skip
        return ChatCompletion(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                              usage=self.choices.usage())

    def _token_logprobs(self, response: pb.GenerateResponse) -> list[TokenLogprob]:
        texts = self._texts
        entries = []
        tops = response.top_logprobs
        for position, (token_id, logprob) in enumerate(zip(response.token_ids, response.logprobs, strict=False)):
            top = []
            if position < len(tops):
                top = [TopLogprob(token=texts.text(t), logprob=_logprob(lp), bytes=list(texts.bytes(t)))
                       for t, lp in zip(tops[position].token_ids, tops[position].logprobs, strict=False)]
            entries.append(TokenLogprob(token=texts.text(token_id), logprob=_logprob(logprob),
                                        bytes=list(texts.bytes(token_id)), top_logprobs=top))  # fmt: skip
        return entries


class CompletionFormat:
    """Text completions: `text_completion` bodies and chunks (the same shape); `echo` puts each prompt's text first."""

    def __init__(self, choices: Choices, texts: TokenTexts, logprobs: bool, include_usage: bool,
                 echoed: list[str] | None = None) -> None:  # fmt: skip
        self.choices = choices
        self._texts = texts
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._echoed = echoed  # per prompt, with echo
        self._exclude = None if include_usage else {"usage"}

    def add(self, prompt: int, response: pb.GenerateResponse) -> CompletionChoice:
        index = self.choices.add(prompt, response)
        choice = self.choices.choice(index)
        text = response.text
        if not choice.started:
            choice.started = True
            if self._echoed is not None:
                text = self._echoed[prompt] + text
                choice.offset = len(self._echoed[prompt])
        logprobs = self._completion_logprobs(choice, response) if self._logprobs else None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason)

    def chunk(self, prompt: int, response: pb.GenerateResponse) -> bytes:
        meta = self.choices.meta
        body = Completion(id=meta.id, created=meta.created, model=meta.model, choices=[self.add(prompt, response)])
        return sse(body.model_dump_json(exclude=self._exclude))

    def usage_chunk(self) -> bytes | None:
        if not self._include_usage:
            return None
        meta = self.choices.meta
        return sse(Completion(id=meta.id, created=meta.created, model=meta.model, choices=[],
                              usage=self.choices.usage()).model_dump_json())  # fmt: skip

    def body(self) -> Completion:
        meta = self.choices.meta
        choices = []
        for index in range(len(self.choices)):
            choice = self.choices.choice(index)
            text = "".join(choice.text)
            if self._echoed is not None:
                text = self._echoed[index // meta.n] + text
            choices.append(CompletionChoice(index=index, text=text, finish_reason=choice.finish_reason,
                                            logprobs=choice.completion_logprobs if self._logprobs else None))
        return Completion(id=meta.id, created=meta.created, model=meta.model, choices=choices,
                          usage=self.choices.usage())

    def _completion_logprobs(self, choice: _Choice, response: pb.GenerateResponse) -> CompletionLogprobs:
        """This response's tokens' log-probabilities (returned for the chunk) added to the choice's (the body's)."""
        texts = self._texts
        part = CompletionLogprobs()
        offset = choice.offset
        tops = response.top_logprobs
        for position, (token_id, logprob) in enumerate(zip(response.token_ids, response.logprobs, strict=False)):
            token = texts.text(token_id)
            top: dict[str, float] = {}
            if position < len(tops):
                for t, lp in zip(tops[position].token_ids, tops[position].logprobs, strict=False):
                    top.setdefault(texts.text(t), _logprob(lp))
            top.setdefault(token, _logprob(logprob))  # the sampled token is always listed, as vLLM does
            part.tokens.append(token)
            part.token_logprobs.append(_logprob(logprob))
            part.top_logprobs.append(top)
            part.text_offset.append(offset)
            offset += len(token)
        choice.offset = offset
        whole = choice.completion_logprobs
        whole.tokens += part.tokens
        whole.token_logprobs += part.token_logprobs
        whole.top_logprobs += part.top_logprobs
        whole.text_offset += part.text_offset
        return part
