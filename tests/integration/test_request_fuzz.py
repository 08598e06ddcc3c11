"""Property: whatever a client sends as a GenerateRequest, the real server answers with either a complete stream or a
clear refusal (INVALID_ARGUMENT; RESOURCE_EXHAUSTED for prompts or messages too large; NOT_FOUND for another model
name), never INTERNAL or UNKNOWN, never a hang or a crash; afterwards it still serves and every KV block is free.

Hypothesis generates the requests (random field values, NaN/inf/negative/huge numbers, huge and empty strings, any
Unicode, several inputs at once, token ids outside the vocabulary, random priorities and logprobs counts, fields the
proto gains later) and raw request bytes that are not a valid message. Each example is one request; once all are drawn
they are sent with up to WINDOW in flight on one connection, each checked when its answer is in; generated
requests ask for one or two tokens, so the ~2,000 requests cost the engine only some 70 steps. Generation is
derandomized and the example database is off, so every run sends the same requests; a failure lists the requests that
broke the property (they are not shrunk: each is one request, readable as it is).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from server_harness import RunningServer

NUM_EXAMPLES = 2000
WINDOW = 32  # requests in flight at once
REQUEST_TIMEOUT_S = 120.0  # a request still unanswered after this is a hang
ALLOWED_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = (-(2**31), 2**31 - 1)

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Served:
    """What the server under test reports about its model."""

    model: str
    vocab_size: int
    context_length: int
    kv_capacity_tokens: int


@dataclass
class Case:
    """One request to send: a message, or raw bytes (possibly not a valid message)."""

    request: pb.GenerateRequest | None = None
    raw: bytes | None = None
    cancel_after_first: bool = False  # read one response, then cancel (for open-ended generations)

    def describe(self) -> str:
        if self.request is None:
            return f"raw bytes {self.raw[:200]!r}{'...' if len(self.raw or b'') > 200 else ''}"
        text = str(self.request).replace("\n", " ")
        return (text[:600] + "...") if len(text) > 600 else text


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    responses: list[pb.GenerateResponse] = field(default_factory=list)
    cancelled_by_client: bool = False


# -- strategies -----------------------------------------------------------------------------------------------------

SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\ufffd", "\U0010ffff", "😀" * 3, "é́"]
SHORT_TEXTS = ["Hello", "The capital of France is", "1, 2, 3,", "Écris un poème", "日本語で", "def f(x):", "😀"]
HUGE_TEXTS = [" a" * 20_000, "😀" * 30_000, "\u0000" * 50_000, "token " * 12_000]  # all past the context length
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-30, 3e38, math.nan, math.inf, -math.inf, 2.0, 1e6]
REQUEST_FIELDS = ("input", "model", "priority", "request_id")  # request-level things one_bad may spoil


def ints(low: int, high: int, *likely: int) -> st.SearchStrategy[int]:
    """Integers in [low, high], the ends and small values drawn often."""
    return st.one_of(st.sampled_from([v for v in (low, high, 0, 1, -1, *likely) if low <= v <= high]),
                     st.integers(low, high))


class RequestStrategies:
    """Every strategy, built once for the served model: drawing ~2,000 requests is the test's own hot path.

    A request is drawn in one of three modes: `valid` (every field in range, so it is generated), `one_bad` (valid
    but for one field or the input) and `chaos` (every field anything its type allows). A fifth of the examples are
    raw bytes instead (`malformed`).
    """

    def __init__(self, served: Served) -> None:
        self.served = served
        vocab = served.vocab_size
        in_vocab = st.integers(0, vocab - 1)
        any_id = st.one_of(in_vocab, st.sampled_from([vocab, vocab + 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
        chaos_float = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(width=32))
        self.chaos_text = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXTS), st.just(""),
                                    st.lists(st.sampled_from([*SPECIAL_TEXTS, "hello", " world", "\n"]),
                                             max_size=6).map("".join))  # fmt: skip
        self.valid_text = st.one_of(st.sampled_from(SHORT_TEXTS), st.text(min_size=1, max_size=12))
        self.chaos_by_type: dict[int, st.SearchStrategy[Any]] = {
            FieldDescriptor.TYPE_INT32: ints(*INT32, 2, 16), FieldDescriptor.TYPE_SINT32: ints(*INT32, 2, 16),
            FieldDescriptor.TYPE_UINT32: ints(0, 2**32 - 1, 2, 16),
            FieldDescriptor.TYPE_INT64: ints(-(2**63), 2**63 - 1), FieldDescriptor.TYPE_UINT64: ints(0, 2**64 - 1),
            FieldDescriptor.TYPE_FLOAT: chaos_float, FieldDescriptor.TYPE_DOUBLE: chaos_float,
            FieldDescriptor.TYPE_BOOL: st.booleans(),
            FieldDescriptor.TYPE_STRING: st.one_of(self.chaos_text, st.sampled_from(["x" * 300, "y" * 1100])),
        }  # fmt: skip
        floats_in = st.floats  # in range; the float32 field rounds them
        self.valid_sampling: dict[str, st.SearchStrategy[Any]] = {
            # One token is enough to run the whole path (prefill, sample, detokenize, finish); engine steps with
            # these sampling features cost a CPU worker a lot, so budgets stay tiny.
            "max_tokens": st.sampled_from([1, 1, 2]), "min_tokens": st.integers(0, 1), "n": st.sampled_from([1, 1, 2]),
            "temperature": st.one_of(st.sampled_from([0.0, 0.7, 1.0]), floats_in(0.0, 2.0)),
            "top_p": floats_in(0.05, 1.0), "min_p": floats_in(0.0, 1.0), "top_k": st.integers(0, vocab + 5),
            "repetition_penalty": floats_in(0.5, 2.0), "frequency_penalty": floats_in(-2.0, 2.0),
            "presence_penalty": floats_in(-2.0, 2.0), "seed": st.integers(0, 2**64 - 1), "logprobs": st.integers(0, 20),
            "stop_token_ids": st.lists(in_vocab, max_size=3), "stop": st.lists(self.valid_text, max_size=3),
            "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
        }  # fmt: skip
        self.chaos_sampling: dict[str, st.SearchStrategy[Any]] = {
            # Small positive budgets keep a generation short; the rest are refused.
            "max_tokens": st.one_of(st.just(1), st.sampled_from([0, -1, INT32[0]])),
            "top_k": ints(*INT32, 50, vocab, vocab + 1), "seed": ints(0, 2**64 - 1, 42),
            "min_tokens": ints(*INT32, 2, 3), "logprobs": ints(*INT32, 2, 5, 20, 21), "n": ints(*INT32, 2, 17),
            "stop_token_ids": st.lists(any_id, max_size=4),
            "stop": st.lists(st.one_of(self.chaos_text, st.just("z" * 300)), max_size=18),
        }  # fmt: skip
        self.sampling_fields = list(pb.SamplingParams.DESCRIPTOR.fields)  # fields added later are fuzzed too
        self.extra_request_fields = [fd for fd in pb.GenerateRequest.DESCRIPTOR.fields  # e.g. cache_salt
                                     if fd.name not in (*REQUEST_FIELDS, "text", "messages", "token_ids", "sampling",
                                                        "skip_special_tokens", "add_special_tokens")
                                     and fd.type != FieldDescriptor.TYPE_MESSAGE]  # fmt: skip
        short_ids = st.lists(st.one_of(in_vocab, in_vocab, in_vocab, any_id), max_size=24)
        # Long prompts are all past what the KV cache or the context holds, so they are refused, never computed.
        long_lengths = [served.kv_capacity_tokens + 7, served.context_length, served.context_length + 100, 70_000]
        long_ids = st.tuples(st.sampled_from(long_lengths), in_vocab).map(lambda pair: [pair[1]] * pair[0])
        self.chaos_ids = st.one_of(short_ids, short_ids, short_ids, long_ids)
        self.valid_ids = st.lists(in_vocab, min_size=1, max_size=6)
        roles = st.sampled_from(["user", "system", "assistant"])
        self.valid_chat = st.lists(st.tuples(roles, self.valid_text), min_size=1, max_size=1)
        self.chaos_chat = st.lists(st.tuples(st.one_of(roles, st.sampled_from(["tool", ""]), self.chaos_text),
                                             st.one_of(self.chaos_text, st.sampled_from(HUGE_TEXTS[:1]))),
                                   max_size=3)  # fmt: skip
        self.cases = st.one_of(self.requests(), self.requests(), self.requests(), self.requests(), self.malformed())

    def value(self, draw: st.DrawFn, fd: FieldDescriptor, chaos: bool, table: dict[str, Any] | None = None) -> Any:
        """A value for `fd` from `table` (else, when chaos, anything of its type), or None to leave it unset."""
        table = table if table is not None else self.chaos_sampling if chaos else self.valid_sampling
        if fd.name in table:
            strategy = table[fd.name]
        elif chaos and fd.type in self.chaos_by_type:
            strategy = self.chaos_by_type[fd.type]
            if fd.is_repeated:
                strategy = st.lists(strategy, max_size=20)
        else:
            return None
        # Unset half the time when valid; when chaos, mostly set, so a chaos request rarely ends up valid by luck.
        if fd.has_presence and not fd.is_repeated and draw(st.integers(0, 3 if chaos else 1)) == 1:
            return None
        return draw(strategy)

    @staticmethod
    def assign(message: Any, fd: FieldDescriptor, value: Any) -> None:
        if value is None:
            return
        if fd.is_repeated:
            getattr(message, fd.name).extend(value)
        else:
            setattr(message, fd.name, value)

    def requests(self) -> st.SearchStrategy[Case]:
        @st.composite
        def draw_request(draw: st.DrawFn) -> Case:
            # Prompt tokens are what costs time on a CPU, so generated requests are a minority and short.
            mode = draw(st.sampled_from(["valid", "one_bad", "one_bad", *["chaos"] * 5]))
            spoiled = draw(st.sampled_from([*REQUEST_FIELDS, *(fd.name for fd in self.sampling_fields)])) \
                if mode == "one_bad" else None
            chaos = {name: mode == "chaos" or name == spoiled
                     for name in (*REQUEST_FIELDS, *(fd.name for fd in self.sampling_fields))}
            request = pb.GenerateRequest()
            for fd in self.sampling_fields:
                if fd.name == "max_tokens":  # always set: the default (256) would take too long
                    table = self.chaos_sampling if chaos["max_tokens"] else self.valid_sampling
                    request.sampling.max_tokens = draw(table["max_tokens"])
                    continue
                self.assign(request.sampling, fd, self.value(draw, fd, chaos[fd.name]))
            # About 1 in 30: an unbounded budget, cancelled after one answer. (Hypothesis favours the ends of a range.)
            open_ended = draw(st.integers(0, 29)) == 7
            if open_ended:
                request.sampling.max_tokens = draw(st.sampled_from([INT32[1], 100_000]))
                request.sampling.ignore_eos = True
            self.draw_input(draw, request, chaos["input"])
            request.model = draw(st.sampled_from([self.served.model, "", "", "no-such-model"]) if chaos["model"]
                                 else st.sampled_from([self.served.model, ""]))
            request.priority = draw(ints(*INT32, 5, 100) if chaos["priority"] else st.integers(-10, 10))
            request.request_id = draw(st.one_of(self.chaos_text, st.just("r" * 5000)) if chaos["request_id"]
                                      else st.sampled_from(["", "req-1", "a b c"]))
            for name in ("skip_special_tokens", "add_special_tokens"):
                if draw(st.booleans()):
                    setattr(request, name, draw(st.booleans()))
            for fd in self.extra_request_fields:
                self.assign(request, fd, self.value(draw, fd, mode == "chaos", {}))  # valid: left unset
            return Case(request=request, cancel_after_first=open_ended)

        return draw_request()

    def draw_input(self, draw: st.DrawFn, request: pb.GenerateRequest, chaos: bool) -> None:
        inputs = draw(st.sampled_from([("text",), ("token_ids",), ("messages",), ("text",), ("token_ids",), (),
                                       ("text", "token_ids"), ("text", "messages", "token_ids")]) if chaos
                      else st.sampled_from([("text",), ("token_ids",), ("text",), ("token_ids",), ("messages",)]))
        if "text" in inputs:
            request.text = draw(st.one_of(self.chaos_text, self.chaos_text, st.sampled_from(HUGE_TEXTS)) if chaos
                                else self.valid_text)
        if "token_ids" in inputs:
            request.token_ids.ids.extend(draw(self.chaos_ids if chaos else self.valid_ids))
        if "messages" in inputs:
            for role, content in draw(self.chaos_chat if chaos else self.valid_chat):
                request.messages.messages.add(role=role, content=content)
            if draw(st.booleans()):
                request.messages.add_generation_prompt = draw(st.booleans())

    def malformed(self) -> st.SearchStrategy[Case]:
        """Bytes that are (mostly) not a valid GenerateRequest: flipped bits, cuts, invalid UTF-8 in a string."""
        valid = pb.GenerateRequest(text="Hello there", request_id="abc",
                                   sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
        bad_utf8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"])

        @st.composite
        def draw_bytes(draw: st.DrawFn) -> Case:
            how = draw(st.sampled_from(["invalid_utf8", "truncate", "flip", "garbage"]))
            if how == "invalid_utf8":
                raw = valid.replace(b"Hello", draw(bad_utf8).ljust(5, b"x"))  # same length: the prefix still fits
            elif how == "truncate":
                raw = valid[: draw(st.integers(1, len(valid) - 1))]
            elif how == "flip":
                data = bytearray(valid)
                for _ in range(draw(st.integers(1, 4))):
                    data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
                raw = bytes(data)
            else:
                raw = draw(st.binary(min_size=1, max_size=64))
            return Case(raw=raw, cancel_after_first=unbounded(raw))

        return draw_bytes()


def unbounded(raw: bytes) -> bool:
    """Bytes that parse into a request with no small max_tokens would generate up to 256 tokens: read one answer."""
    try:
        request = pb.GenerateRequest.FromString(raw)
    except Exception:
        return False
    return not (0 < request.sampling.max_tokens <= 3 and getattr(request.sampling, "n", 1) <= 3)


def explicit_cases(served: Served) -> list[Case]:
    """Edge cases sent on every run whatever Hypothesis draws."""
    vocab = served.vocab_size

    def req(**sampling: Any) -> pb.GenerateRequest:
        sampling.setdefault("max_tokens", 2)
        return pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(**sampling))

    requests = [
        pb.GenerateRequest(), pb.GenerateRequest(text=""), pb.GenerateRequest(token_ids=pb.TokenIds()),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[vocab])),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1])),
        pb.GenerateRequest(text="a", token_ids=pb.TokenIds(ids=[1]), messages=pb.ChatMessages()),
        pb.GenerateRequest(messages=pb.ChatMessages()),
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="", content="x")])),
        req(temperature=math.nan), req(temperature=math.inf), req(temperature=-math.inf), req(temperature=-1.0),
        req(temperature=1e-45), req(temperature=3e38), req(top_p=0.0), req(top_p=math.nan), req(top_p=1.0000001),
        req(top_k=-1), req(top_k=vocab + 1), req(min_p=2.0), req(min_p=math.nan), req(repetition_penalty=0.0),
        req(repetition_penalty=math.nan), req(repetition_penalty=3e38), req(frequency_penalty=3.0),
        req(presence_penalty=-math.inf), req(logprobs=21), req(logprobs=-1), req(logprobs=20), req(min_tokens=3),
        req(min_tokens=-1), req(max_tokens=0), req(max_tokens=-1), req(stop_token_ids=[vocab]),
        req(seed=2**64 - 1), pb.GenerateRequest(text="Hello", model="no-such-model"),
        pb.GenerateRequest(text="Hello", priority=INT32[0], sampling=pb.SamplingParams(max_tokens=1)),
        pb.GenerateRequest(text="Hello", priority=INT32[1], sampling=pb.SamplingParams(max_tokens=1)),
        pb.GenerateRequest(text=HUGE_TEXTS[0], sampling=pb.SamplingParams(max_tokens=1)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * served.context_length)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (served.kv_capacity_tokens + 1))),
        pb.GenerateRequest(text="x" * (65 << 20), sampling=pb.SamplingParams(max_tokens=1)),  # past 64 MiB
    ]  # fmt: skip
    cases = [Case(request=r) for r in requests]
    if "n" in pb.SamplingParams.DESCRIPTOR.fields_by_name:
        cases += [Case(request=req(n=0)), Case(request=req(n=-1)), Case(request=req(n=INT32[1])),
                  Case(request=req(n=2, seed=2**64 - 1)), Case(request=req(n=16, max_tokens=1))]
    cases += [Case(raw=b"\xff\xff\xff"), Case(raw=pb.GenerateRequest(text="ab").SerializeToString()[:-1]),
              Case(raw=pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe"))]
    open_ended = pb.GenerateRequest(text="Count:", sampling=pb.SamplingParams(max_tokens=INT32[1], ignore_eos=True))
    cases.append(Case(request=open_ended, cancel_after_first=True))
    return cases


# -- sending and checking -------------------------------------------------------------------------------------------


async def send(channel: grpc.aio.Channel, case: Case) -> Outcome:
    serializer = None if case.raw is not None else pb.GenerateRequest.SerializeToString  # raw bytes go as they are
    generate = channel.unary_stream("/ringserve.v1.Generation/Generate", request_serializer=serializer,
                                    response_deserializer=pb.GenerateResponse.FromString)
    call = generate(case.raw if case.raw is not None else case.request, timeout=REQUEST_TIMEOUT_S)
    outcome = Outcome(grpc.StatusCode.OK)
    try:
        async for response in call:
            outcome.responses.append(response)
            if case.cancel_after_first:
                call.cancel()
                outcome.cancelled_by_client = True
                break
    except grpc.aio.AioRpcError as error:
        outcome.code, outcome.details = error.code(), error.details() or ""
    return outcome


def problem_with(case: Case, outcome: Outcome, served: Served) -> str | None:
    """None when the outcome is one the property allows, else what is wrong."""
    if outcome.cancelled_by_client:
        return None if outcome.responses else "cancelled before any response"
    if outcome.code != grpc.StatusCode.OK:
        allowed = set(ALLOWED_REFUSALS)
        model = case.request.model if case.request is not None else None
        if case.raw is not None or model not in ("", served.model):
            allowed.add(grpc.StatusCode.NOT_FOUND)
        if outcome.code not in allowed:
            return f"{outcome.code.name}: {outcome.details}"
        if outcome.code == grpc.StatusCode.INVALID_ARGUMENT and not outcome.details:
            return "INVALID_ARGUMENT without a message"
        return None
    if not outcome.responses:
        return "an OK stream with no message"
    if outcome.responses[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        return "the stream ended without a finish_reason"
    by_index: dict[int, list[pb.GenerateResponse]] = {}
    for response in outcome.responses:
        by_index.setdefault(getattr(response, "index", 0), []).append(response)
        if any(t >= served.vocab_size for t in response.token_ids):
            return f"token id outside the vocabulary: {list(response.token_ids)}"
        if any(math.isnan(lp) or lp > 1e-4 for lp in response.logprobs):
            return f"impossible logprobs {list(response.logprobs)}"
    for index, responses in by_index.items():
        last = responses[-1]
        if last.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return f"completion {index} has no last message with a finish_reason"
        generated = sum(len(r.token_ids) for r in responses)
        if last.usage.completion_tokens != generated:
            return f"completion {index}: usage.completion_tokens {last.usage.completion_tokens} != {generated} sent"
        budget = case.request.sampling.max_tokens if case.request is not None else 0
        if budget > 0 and generated > budget:
            return f"completion {index}: {generated} tokens for max_tokens {budget}"
    return None


class Pipeline:
    """Runs requests on a private event loop thread, at most WINDOW at a time, keeping every outcome."""

    def __init__(self, address: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = self._run(self._open(address, options))
        self._window = threading.Semaphore(WINDOW)
        self.results: list[tuple[Case, Future[Outcome]]] = []

    async def _open(self, address: str, options: list[tuple[str, int]]) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, options=options)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, case: Case) -> None:
        self._window.acquire()
        future = asyncio.run_coroutine_threadsafe(send(self._channel, case), self._loop)
        future.add_done_callback(lambda _: self._window.release())
        self.results.append((case, future))

    def close(self) -> None:
        for _, future in self.results:
            future.exception(timeout=REQUEST_TIMEOUT_S + 30)
        self._run(self._channel.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def wait_until_idle_and_free(stub: pb_grpc.GenerationStub, timeout_s: float = 60.0) -> pb.EngineStats:
    """Engine stats once nothing runs or waits; every block is free again by then (cached blocks count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if (idle and stats.free_kv_blocks == stats.total_kv_blocks) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_random_and_malformed_generate_requests_never_break_the_server(server: RunningServer) -> None:
    stub = server.stub()
    info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    served = Served(info.model, info.vocab_size, info.context_length, info.kv_capacity_tokens)
    cases = explicit_cases(served)

    @settings(max_examples=NUM_EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(RequestStrategies(served).cases)
    def draw_case(case: Case) -> None:
        cases.append(case)  # sent and judged below, each request on its own

    draw_case()  # all drawn first: drawing while sending would slow the client's event loop thread (the GIL)
    pipeline = Pipeline(server.address)
    try:
        for case in cases:
            pipeline.submit(case)
    finally:
        pipeline.close()

    tally: Counter[str] = Counter()
    failures: list[str] = []
    for case, future in pipeline.results:
        try:
            outcome = future.result()
        except Exception as exc:  # the client itself failed: report it like a broken answer
            failures.append(f"{type(exc).__name__}: {exc} for {case.describe()}")
            continue
        tally["cancelled" if outcome.cancelled_by_client else outcome.code.name] += 1
        problem = problem_with(case, outcome, served)
        if problem is not None:
            failures.append(f"{problem} for {case.describe()}")
    assert not failures, f"{len(failures)} of {len(pipeline.results)} requests broke the property " \
        f"({dict(tally)}):\n" + "\n".join(failures[:25])
    assert len(pipeline.results) >= NUM_EXAMPLES
    assert tally["OK"] >= NUM_EXAMPLES // 10, f"too few requests were valid to exercise generation: {dict(tally)}"
    assert tally["INVALID_ARGUMENT"] >= NUM_EXAMPLES // 10, f"too few malformed requests: {dict(tally)}"

    assert server.proc.poll() is None, f"the server exited\n{server.log()}"
    after = list(stub.Generate(pb.GenerateRequest(text="The capital of France is",
                                                  sampling=pb.SamplingParams(max_tokens=3, temperature=0.0)),
                               timeout=REQUEST_TIMEOUT_S))  # fmt: skip
    assert after[-1].finish_reason == pb.FINISH_REASON_LENGTH
    stats = wait_until_idle_and_free(stub)
    assert (stats.num_running, stats.num_waiting) == (0, 0), stats
    assert stats.free_kv_blocks == stats.total_kv_blocks, f"KV blocks leaked: {stats}"

