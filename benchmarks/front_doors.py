"""The front doors a benchmark streams through, one request plan at a time: ringserve.v1 Generate (gRPC), the
OpenAI-compatible completions endpoint (HTTP, Server-Sent Events) and KServe v2 ModelStreamInfer (gRPC). Each turns a
RequestPlan into a StreamResult: time to first token, the gaps after it, tokens, and how the stream ended."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import httpx
from ringserve.kserve import grpc_service_pb2 as kpb
from ringserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class RequestPlan:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    cancel_after: int | None  # cancel once this many tokens arrived (0 = before the first); None = run to the end
    cancel_delay_s: float  # for cancel_after == 0: how long after sending


@dataclass
class StreamResult:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    outcome: str = "completed"  # completed | cancelled | error
    error: str = ""
    last_s: float = 0.0  # when the latest piece arrived

    def piece(self, start: float, now: float, tokens: int) -> None:
        """A streamed piece of `tokens` tokens arrived at `now`: the first sets the TTFT, each later one adds a gap."""
        if self.ttft_s is None:
            self.ttft_s = now - start
        else:
            self.gaps_s.append(now - self.last_s)
        self.last_s = now
        self.tokens += tokens


def generate_request(plan: RequestPlan, salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"bench-{plan.index}", token_ids=pb.TokenIds(ids=plan.prompt_ids),
                              sampling=pb.SamplingParams(max_tokens=plan.max_tokens, temperature=1.0, seed=plan.index,
                                                         ignore_eos=True), cache_salt=salt)  # fmt: skip


async def stream(stub: pb_grpc.GenerationStub, plan: RequestPlan, timeout_s: float, salt: str = "") -> StreamResult:
    result = StreamResult()
    start = time.perf_counter()
    call = stub.Generate(generate_request(plan, salt), timeout=timeout_s)
    cancelled = False
    try:
        if plan.cancel_after == 0:  # gone before the first token: queued, prefilling, or just admitted
            await asyncio.sleep(plan.cancel_delay_s)
            cancelled = call.cancel()
            if cancelled:
                result.outcome = "cancelled"
                return result
        async for response in call:
            now = time.perf_counter()
            if response.token_ids:
                result.piece(start, now, len(response.token_ids))
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                if response.finish_reason == pb.FINISH_REASON_ABORT:
                    result.outcome, result.error = "error", "finish_reason ABORT"
                return result
            if plan.cancel_after is not None and result.tokens >= plan.cancel_after:
                cancelled = call.cancel()
                result.outcome = "cancelled"
                return result
        result.outcome, result.error = "error", "the stream ended without a finish_reason"
    except grpc.aio.AioRpcError as error:
        if cancelled and error.code() == grpc.StatusCode.CANCELLED:
            result.outcome = "cancelled"
        else:
            result.outcome, result.error = "error", error.code().name
    except asyncio.CancelledError:
        call.cancel()
        raise
    return result


async def stream_openai(client: httpx.AsyncClient, plan: RequestPlan, timeout_s: float, salt: str) -> StreamResult:
    """The plan as a streamed OpenAI text completion: one SSE chunk per engine output, as Generate's messages."""
    result = StreamResult()
    body = {"prompt": plan.prompt_ids, "max_tokens": plan.max_tokens, "temperature": 1.0, "seed": plan.index,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    start = time.perf_counter()

    async def consume() -> None:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                result.outcome, result.error = "error", f"HTTP {response.status_code}"
                return
            finished = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                if '"finish_reason":null' not in line:  # the last chunk, the usage chunk or an error: parse it
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.outcome, result.error = "error", str(chunk["error"].get("code"))
                        return
                    if chunk.get("usage"):
                        result.tokens = chunk["usage"]["completion_tokens"]
                        continue
                    finished = True
                    if chunk["choices"][0]["finish_reason"] == "abort":
                        result.outcome, result.error = "error", "finish_reason abort"
                now = time.perf_counter()
                result.piece(start, now, 1)  # one token per chunk until the usage chunk says how many there were
                if plan.cancel_after is not None and result.tokens >= plan.cancel_after and not finished:
                    result.outcome = "cancelled"  # leaving the block closes the connection: the server aborts
                    return
            if not finished:
                result.outcome, result.error = "error", "the stream ended without a finish_reason"

    try:
        if plan.cancel_after == 0:  # gone before the first token: queued, prefilling, or just admitted
            await asyncio.wait_for(consume(), plan.cancel_delay_s)
        else:
            await consume()
    except asyncio.TimeoutError:
        result.outcome = "cancelled"
    except httpx.HTTPError as error:
        result.outcome, result.error = "error", type(error).__name__
    return result


def kserve_request(plan: RequestPlan, prompt: str) -> kpb.ModelInferRequest:
    """The plan as Triton's vLLM-style tensors: text_input, stream, sampling_parameters (the same sampling)."""
    sampling = json.dumps({"max_tokens": plan.max_tokens, "temperature": 1.0, "seed": plan.index, "ignore_eos": True})
    request = kpb.ModelInferRequest(id=f"bench-{plan.index}")
    for name, datatype, raw in (("text_input", "BYTES", prompt.encode()), ("stream", "BOOL", None),
                                ("sampling_parameters", "BYTES", sampling.encode())):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(b"\x01" if raw is None else len(raw).to_bytes(4, "little") + raw)
    return request


async def kserve_stream(stub: kpb_grpc.GRPCInferenceServiceStub, plan: RequestPlan, prompt: str,
                        timeout_s: float) -> StreamResult:
    """One KServe ModelStreamInfer stream per request (so it can be cancelled alone). Its responses carry text, not
    token counts: a completed stream counts its max_tokens (ignore_eos runs it that far), a cancelled one a token
    per response."""
    result = StreamResult()
    start = time.perf_counter()
    request = kserve_request(plan, prompt)
    call = stub.ModelStreamInfer(iter([request]), timeout=timeout_s)
    cancelled = False
    try:
        if plan.cancel_after == 0:
            await asyncio.sleep(plan.cancel_delay_s)
            cancelled = call.cancel()
            if cancelled:
                result.outcome = "cancelled"
                return result
        async for response in call:
            now = time.perf_counter()
            if response.error_message:
                result.outcome, result.error = "error", response.error_message.split(":")[0]
                return result
            reply = response.infer_response
            if reply.raw_output_contents and len(reply.raw_output_contents[0]) > 4:
                result.piece(start, now, 1)
            if reply.parameters["triton_final_response"].bool_param:
                result.tokens = plan.max_tokens
                return result
            if plan.cancel_after is not None and result.tokens >= plan.cancel_after:
                cancelled = call.cancel()
                result.outcome = "cancelled"
                return result
        result.outcome, result.error = "error", "the stream ended without a final response"
    except grpc.aio.AioRpcError as error:
        if cancelled and error.code() == grpc.StatusCode.CANCELLED:
            result.outcome = "cancelled"
        else:
            result.outcome, result.error = "error", error.code().name
    except asyncio.CancelledError:
        call.cancel()
        raise
    return result


async def piece_texts(stub: pb_grpc.GenerationStub, ids: list[int]) -> dict[int, str]:
    """Each token's text, so a window of token ids can be sent as text (the corpus is ASCII: pieces concatenate)."""
    unique = sorted(set(ids))
    texts = await asyncio.gather(*(stub.Detokenize(pb.DetokenizeRequest(token_ids=[i]), timeout=30) for i in unique))
    return {i: reply.text for i, reply in zip(unique, texts, strict=True)}


Streamer = Callable[[RequestPlan], Awaitable[StreamResult]]
