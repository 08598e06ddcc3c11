"""Test helpers for the frontend: the real GGUF path (from RINGSERVE_TEST_GGUF), a tiny byte-level tokenizer."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import pytest
from ringserve import _core
from ringserve.frontend.api.server import FrontendServer, build_server
from ringserve.frontend.engine_client import EngineError, SamplingOptions
from ringserve.frontend.text.tokenizer import ModelTokenizer, byte_alphabet
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def real_gguf_path() -> Path | None:
    value = os.environ.get("RINGSERVE_TEST_GGUF")
    return Path(value) if value else None


requires_real_gguf = pytest.mark.skipif(real_gguf_path() is None, reason="set RINGSERVE_TEST_GGUF to a .gguf file")


def build_tiny_tokenizer() -> ModelTokenizer:
    """A byte-level BPE over the 256 byte symbols plus a few merges (some forming multi-byte UTF-8 pieces)."""
    alphabet = byte_alphabet()
    vocab = {symbol: index for index, symbol in enumerate(alphabet[b] for b in range(256))}
    merges: list[tuple[str, str]] = []

    def add_merge(left: str, right: str) -> None:
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))

    add_merge("h", "e")
    add_merge("he", "l")
    add_merge("Ġ", "w")
    euro = "".join(alphabet[b] for b in "€".encode())  # 3 bytes: the merge leaves a 2-byte partial token
    add_merge(euro[0], euro[1])
    smile = "".join(alphabet[b] for b in "😀".encode())  # 4 bytes
    add_merge(smile[0], smile[1])
    add_merge(smile[2], smile[3])
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    eos_id = backend.token_to_id("<|im_end|>")
    return ModelTokenizer(backend=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                          unk_token="<|endoftext|>", pad_token="<|im_end|>",
                          chat_template_source=TINY_CHAT_TEMPLATE, eos_token_ids=[eos_id])


def fake_top_logprobs(ids: list[int], num_top: int) -> tuple[list[int], list[float]]:
    """Alternatives for each sampled id: the id itself, then ids + 1, ... (flattened), with falling logprobs."""
    top_ids = [token_id + rank for token_id in ids for rank in range(num_top)]
    top_logprobs = [-0.5 - rank for _ in ids for rank in range(num_top)]
    return top_ids, top_logprobs


def engine_stats() -> _core.EngineStats:
    """The EngineStats the scripted engine answers a stats query with."""
    return _core.EngineStats(query_id=1, num_running=2, num_waiting=1, num_total_blocks=100, num_free_blocks=40,
                             block_size=16, num_steps=1234, num_preemptions=3)


def engine_ready(max_model_len: int = 64) -> _core.EngineReady:
    return _core.EngineReady(num_total_blocks=100, block_size=16, max_model_len=max_model_len)


class ScriptedEngine:
    """Same interface as EngineClient; streams `chunks` of token ids for every request, then `finish`, as the real
    `_core` records (RequestOutput, EngineStats, EngineReady) an EngineClient yields.

    With `hang_after=n` it stops after n chunks and waits forever (until the consumer cancels), which is how tests
    observe that cancellation aborts the request in the engine.
    """

    def __init__(self, chunks: list[list[int]], finish: str = "LENGTH", hang_after: int | None = None,
                 error: EngineError | None = None, ready: bool = True) -> None:
        self.chunks = chunks
        self.finish = _core.FinishReason.__members__[finish]
        self.hang_after = hang_after
        self.error = error
        self.submitted: list[tuple[int, list[int], SamplingOptions]] = []
        self.aborted: list[int] = []
        self.aborted_event = asyncio.Event()
        self.hanging = asyncio.Event()
        self.failure: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._ready = asyncio.Event()
        if ready:
            self._ready.set()
        self._ids = itertools.count(1)

    def allocate_request_id(self) -> int:
        return next(self._ids)

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[_core.RequestOutput]:
        if self.error is not None:
            raise self.error
        self.submitted.append((request_id, list(prompt_ids), params))
        finished = False
        try:
            for index, chunk in enumerate(self.chunks):
                if self.hang_after is not None and index >= self.hang_after:
                    self.hanging.set()
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
                last = index == len(self.chunks) - 1
                finished = last
                top_ids, top_logprobs = fake_top_logprobs(list(chunk), params.sampling.num_logprobs)
                yield _core.RequestOutput(request_id=request_id, new_token_ids=list(chunk),
                                          logprobs=[-0.5] * len(chunk),
                                          finish_reason=self.finish if last else _core.FinishReason.NONE,
                                          num_prompt_tokens=len(prompt_ids), top_token_ids=top_ids,
                                          top_logprobs=top_logprobs, num_top=params.sampling.num_logprobs)
        finally:
            if not finished:
                self.aborted.append(request_id)
                self.aborted_event.set()

    async def get_stats(self, timeout: float = 5.0) -> _core.EngineStats:
        return engine_stats()

    async def wait_ready(self, timeout: float | None = None) -> _core.EngineReady:
        await self._ready.wait()
        return engine_ready()

    def mark_ready(self) -> None:
        self._ready.set()

    def add_failure_listener(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    def fail(self, message: str) -> None:
        self.failure = message
        for callback in self._listeners:
            callback(message)


CONTEXT_LENGTH = 64
MODEL = "tiny"
COMPLETION = "hello 😀 wörld"


def completion_chunks(tokenizer: ModelTokenizer) -> list[list[int]]:
    ids = tokenizer.encode(COMPLETION, add_special_tokens=False)
    return [ids[:2], ids[2:3], ids[3:4], ids[4:]]  # splits the emoji across chunks


class Harness:
    def __init__(self, server: FrontendServer, engine: ScriptedEngine, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.engine = engine
        self.channel = channel
        self.stub = pb_grpc.GenerationStub(channel)


async def start_harness(tokenizer: ModelTokenizer, engine: ScriptedEngine) -> Harness:
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=tokenizer.vocab_size)
    server = build_server(engine, tokenizer, info, host="127.0.0.1", port=0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return Harness(server, engine, channel)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls: the conditions are counters of the engine fake and the servicer, which signal nothing."""
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")
