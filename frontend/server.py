"""The gRPC frontend: `ringserve.v1.Generation` servicer, health and reflection, on one grpc.aio server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import jinja2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from ringserve.frontend.detokenizer import IncrementalDetokenizer
from ringserve.frontend.engine_client import EngineError, GenerationEngine, SamplingOptions
from ringserve.frontend.timeline import RequestTimeline, trace_headers
from ringserve.frontend.tokenizer import ModelTokenizer
from ringserve.frontend.torchserve import (
    INFERENCE_SERVICE_NAME,
    MANAGEMENT_SERVICE_NAME,
    TorchServeInferenceServicer,
    TorchServeManagementServicer,
)
from ringserve.torchserve import inference_pb2_grpc, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the servicer only calls them; importing them pulls in the OpenTelemetry SDK / prometheus-client
    from ringserve.frontend.metrics import ServingMetrics
    from ringserve.frontend.tracing import RequestTracer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_MAX_TOKENS = 256
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (vLLM's default cap)
# Prompts longer than this (characters) are tokenized off the event loop.
_THREAD_TOKENIZE_CHARS = 32_768

_FINISH_REASONS = {
    "NONE": pb.FINISH_REASON_UNSPECIFIED,
    "STOP": pb.FINISH_REASON_STOP,
    "LENGTH": pb.FINISH_REASON_LENGTH,
    "ABORT": pb.FINISH_REASON_ABORT,
}


class _Rejection(Exception):
    """A request the servicer refuses before it reaches the engine."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> _Rejection:
    return _Rejection(grpc.StatusCode.INVALID_ARGUMENT, message)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it always raises; this keeps type checkers honest


class GenerationServicer(pb_grpc.GenerationServicer):
    """Validates, tokenizes, submits to the engine and streams detokenized deltas back."""

    def __init__(self, engine: GenerationEngine, tokenizer: ModelTokenizer, model_info: pb.ModelInfo,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, *, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self._engine = engine
        self._tracer = tracer
        self._metrics = metrics
        self._observed = tracer is not None or metrics is not None
        self._tokenizer = tokenizer
        self._model_info = model_info
        self._default_max_tokens = default_max_tokens
        self._vocab_size = model_info.vocab_size or tokenizer.vocab_size

    # -- RPCs -----------------------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        # Observation costs one None check per output while tracing and metrics are off.
        timeline = self._start_timeline(request, context) if self._observed else None
        try:
            self._check_model(request.model)
            prompt_ids = await self._prompt_ids(request)
            if timeline is not None:
                timeline.tokenize_end_ns = time.time_ns()
                timeline.prompt_tokens = len(prompt_ids)
            params = self._sampling_options(request.sampling, len(prompt_ids), request.priority)
        except _Rejection as rejection:
            if timeline is not None:
                timeline.fail(rejection.code, rejection)
                self._close_timeline(timeline)
            await _abort(context, rejection.code, rejection.message)
        request_id = request.request_id or uuid.uuid4().hex
        if timeline is not None:
            timeline.request_id = request_id
            timeline.params = params
        skip_special = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        detokenizer = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=skip_special)
        engine_request_id = self._engine.allocate_request_id()
        completion_tokens = 0
        try:
            # aclosing: when the client cancels or its deadline passes, this task is cancelled and the engine
            # stream's finally aborts the request in the engine.
            async with contextlib.aclosing(self._engine.generate(engine_request_id, prompt_ids, params)) as outputs:
                async for output in outputs:
                    if timeline is not None:
                        timeline.on_output(output)
                    new_ids = list(output.new_token_ids)
                    completion_tokens += len(new_ids)
                    response = pb.GenerateResponse(request_id=request_id, token_ids=new_ids,
                                                   text=detokenizer.push(new_ids), logprobs=list(output.logprobs))
                    if params.num_logprobs and new_ids:
                        _add_top_logprobs(response, output, len(new_ids), params.num_logprobs)
                    reason = _FINISH_REASONS.get(output.finish_reason.name, pb.FINISH_REASON_ABORT)
                    if reason != pb.FINISH_REASON_UNSPECIFIED:
                        response.text += detokenizer.finish()
                        response.finish_reason = reason
                        response.usage.prompt_tokens = len(prompt_ids)
                        response.usage.completion_tokens = completion_tokens
                        response.usage.cached_tokens = output.num_cached_tokens
                        if timeline is not None:
                            timeline.finish_reason = output.finish_reason.name.lower()
                        yield response
                        if timeline is not None:
                            timeline.mark_sent()
                        return
                    if response.token_ids or response.text:
                        yield response
                        if timeline is not None:
                            timeline.mark_sent()
        except EngineError as error:
            if timeline is not None:
                timeline.fail(error.code, error)
            await _abort(context, error.code, error.message)
        except (asyncio.CancelledError, GeneratorExit) as stopped:  # the client went away or its deadline passed
            if timeline is not None:
                timeline.fail(grpc.StatusCode.CANCELLED, stopped)
            raise
        finally:
            if timeline is not None:
                self._close_timeline(timeline)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self._check_model(request.model)
            which = _which_input(request, ("text", "messages"))
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompt, ids = await self._tokenize_input(request, which, add_special)
        except _Rejection as rejection:
            await _abort(context, rejection.code, rejection.message)
        return pb.TokenizeResponse(token_ids=ids, prompt=prompt)

    async def GetModelInfo(self, request: pb.ModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            self._check_model(request.model)
        except _Rejection as rejection:
            await _abort(context, rejection.code, rejection.message)
        info = pb.ModelInfo()
        info.CopyFrom(self._model_info)
        return info

    async def GetEngineStats(self, request: pb.EngineStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.EngineStats:
        try:
            self._check_model(request.model)
        except _Rejection as rejection:
            await _abort(context, rejection.code, rejection.message)
        try:
            stats = await self._engine.get_stats()
        except EngineError as error:
            await _abort(context, error.code, error.message)
        return pb.EngineStats(num_running=stats.num_running, num_waiting=stats.num_waiting,
                              total_kv_blocks=stats.num_total_blocks, free_kv_blocks=stats.num_free_blocks,
                              block_size=stats.block_size, num_steps=stats.num_steps,
                              num_preemptions=stats.num_preemptions)

    # -- observation ----------------------------------------------------------------------------------------

    def _start_timeline(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestTimeline:
        headers = trace_headers(context.invocation_metadata()) if self._tracer is not None else None
        timeline = RequestTimeline(self._model_info.model, headers)
        timeline.chat = request.HasField("messages")
        return timeline

    def _close_timeline(self, timeline: RequestTimeline) -> None:
        """Spans and samples are made after the RPC's last message is out, off its path."""
        if timeline.end_ns:
            return
        timeline.finish()
        try:
            asyncio.get_running_loop().call_soon(self._record, timeline)
        except RuntimeError:  # a stream finalized outside the loop (interpreter shutdown): record inline
            self._record(timeline)

    def _record(self, timeline: RequestTimeline) -> None:
        try:
            if self._metrics is not None:
                self._metrics.observe_request(timeline)
            if self._tracer is not None:
                self._tracer.record(timeline)
        except Exception:  # observability must never take serving down
            log.exception("recording the trace/metrics of request %s failed", timeline.request_id)

    # -- validation -----------------------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name and name != self._model_info.model:
            raise _Rejection(grpc.StatusCode.NOT_FOUND,
                             f"model {name!r} is not served here; served: {self._model_info.model!r} (or leave empty)")

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        which = _which_input(request, ("text", "messages", "token_ids"))
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise _invalid("token_ids.ids must not be empty")
            self._check_token_ids(ids, "token_ids.ids")
        else:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            _, ids = await self._tokenize_input(request, which, add_special)
            if not ids:
                raise _invalid(f"{which} tokenized to no tokens")
        context_length = self._model_info.context_length
        if context_length and len(ids) >= context_length:
            raise _invalid(f"the prompt has {len(ids)} tokens but the context length is {context_length}; "
                           f"shorten the prompt to at most {context_length - 1} tokens so one can be generated")
        kv_capacity = self._model_info.kv_capacity_tokens
        if kv_capacity and len(ids) + 1 > kv_capacity:
            raise _Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the prompt has {len(ids)} tokens but the KV cache holds at most {kv_capacity} tokens")
        return ids

    async def _tokenize_input(self, request: Any, which: str, add_special_tokens: bool) -> tuple[str, list[int]]:
        """(prompt text, ids) for a `text` or `messages` input."""
        if which == "text":
            if not request.text:
                raise _invalid("text must not be empty")
            return request.text, await self._encode(request.text, add_special_tokens)
        chat = request.messages
        if not chat.messages:
            raise _invalid("messages.messages must not be empty")
        for index, message in enumerate(chat.messages):
            if not message.role:
                raise _invalid(f"messages.messages[{index}].role must not be empty")
        conversation = [{"role": m.role, "content": m.content} for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            prompt = self._tokenizer.render_chat(conversation, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise _invalid(f"messages: the chat template rejected the conversation: {exc}") from exc
        except ValueError as exc:  # no chat template
            raise _invalid(f"messages: {exc}") from exc
        # The template writes its own special tokens.
        return prompt, await self._encode(prompt, add_special_tokens=False)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(self._tokenizer.encode, text, add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens)

    def _check_token_ids(self, ids: Sequence[int], field_name: str) -> None:
        for index, token_id in enumerate(ids):
            if token_id >= self._vocab_size:
                raise _invalid(f"{field_name}[{index}] = {token_id} is out of range: the vocabulary has "
                               f"{self._vocab_size} tokens (ids 0..{self._vocab_size - 1})")

    def _sampling_options(self, sampling: pb.SamplingParams, prompt_len: int, priority: int = 0) -> SamplingOptions:
        room = self._model_info.context_length - prompt_len if self._model_info.context_length else None
        if sampling.HasField("max_tokens"):
            max_tokens = sampling.max_tokens
            if max_tokens <= 0:
                raise _invalid(f"sampling.max_tokens must be > 0, got {max_tokens}")
        else:
            max_tokens = self._default_max_tokens
        if room is not None:
            max_tokens = min(max_tokens, room)  # never past the context length
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0.0):
            raise _invalid(f"sampling.temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
        if not (0.0 < top_p <= 1.0):  # also rejects NaN
            raise _invalid(f"sampling.top_p must be in (0, 1], got {top_p}")
        top_k = sampling.top_k if sampling.HasField("top_k") else 0
        if top_k < 0:
            raise _invalid(f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
        self._check_token_ids(sampling.stop_token_ids, "sampling.stop_token_ids")
        min_tokens = sampling.min_tokens if sampling.HasField("min_tokens") else 0
        if not 0 <= min_tokens <= max_tokens:
            raise _invalid(f"sampling.min_tokens must be in [0, max_tokens = {max_tokens}], got {min_tokens}")
        min_p = _bounded_float(sampling, "min_p", 0.0, 0.0, 1.0)
        repetition_penalty = sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0
        if not (math.isfinite(repetition_penalty) and repetition_penalty > 0.0):
            raise _invalid(f"sampling.repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
        frequency_penalty = _bounded_float(sampling, "frequency_penalty", 0.0, -2.0, 2.0)
        presence_penalty = _bounded_float(sampling, "presence_penalty", 0.0, -2.0, 2.0)
        num_logprobs = sampling.logprobs if sampling.HasField("logprobs") else 0
        if not 0 <= num_logprobs <= MAX_LOGPROBS:
            raise _invalid(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")
        return SamplingOptions(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=sampling.seed if sampling.HasField("seed") else None, ignore_eos=sampling.ignore_eos,
            stop_token_ids=tuple(sampling.stop_token_ids), min_tokens=min_tokens, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, num_logprobs=num_logprobs, priority=priority,
        )


def describe_model(name: str, architecture: str, dtype: str, tensor_parallel_size: int, ready: Any,
                   tokenizer: ModelTokenizer, vocab_size: int = 0) -> pb.ModelInfo:
    """The served model's ModelInfo from the engine's EngineReady (context length, block size, KV blocks)."""
    info = pb.ModelInfo(model=name, architecture=architecture, context_length=ready.max_model_len, dtype=dtype,
                        tensor_parallel_size=tensor_parallel_size, block_size=ready.block_size,
                        kv_capacity_tokens=ready.num_total_blocks * ready.block_size,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=vocab_size or tokenizer.vocab_size)
    if tokenizer.bos_token_id is not None:
        info.bos_token_id = tokenizer.bos_token_id
    return info


@dataclass
class FrontendServer:
    """A built (not yet started) gRPC server and the parts the launcher drives."""

    server: grpc.aio.Server
    port: int  # the bound port (useful with port 0)
    servicer: GenerationServicer
    health: health_aio.HealthServicer
    engine: GenerationEngine
    serving: bool = False  # what health reports for the whole server
    _readiness: asyncio.Task[None] | None = field(default=None, repr=False)
    _health_updates: set[asyncio.Task[None]] = field(default_factory=set, repr=False)

    async def start(self) -> None:
        """Start serving; health turns SERVING once the engine is ready and NOT_SERVING if it fails."""
        await self._set_health(False)  # the health servicer starts out SERVING
        await self.server.start()
        loop = asyncio.get_running_loop()

        def report_failure(_message: str) -> None:
            task = loop.create_task(self._set_health(False))
            self._health_updates.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._health_updates.discard)

        self.engine.add_failure_listener(report_failure)
        self._readiness = loop.create_task(self._serve_when_ready())

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight RPCs finish for up to `grace` seconds."""
        if self._readiness is not None:
            self._readiness.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)

    async def _serve_when_ready(self) -> None:
        try:
            await self.engine.wait_ready(None)
        except EngineError:
            return  # the failure listener already reported NOT_SERVING
        if self.engine.failure is None:
            await self._set_health(True)

    async def _set_health(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)


def build_server(engine: GenerationEngine, tokenizer: ModelTokenizer, model_info: pb.ModelInfo,
                 host: str = "127.0.0.1", port: int = 50051, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_concurrent_rpcs: int | None = None, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None, model_url: str = "",
                 max_num_seqs: int = 0) -> FrontendServer:
    """A grpc.aio server with Generation, grpc.health.v1 (NOT_SERVING until the engine is ready) and reflection.

    Call from inside the running event loop; then `await result.start()`. Raises OSError when the address cannot
    be bound. `model_info.model` is the served name; `context_length`, `kv_capacity_tokens` and `vocab_size`
    (0 = take the tokenizer's) drive validation. TorchServe's inference and management services are served too;
    `model_url` and `max_num_seqs` are what their DescribeModel reports.
    """
    server = grpc.aio.server(maximum_concurrent_rpcs=max_concurrent_rpcs)
    servicer = GenerationServicer(engine, tokenizer, model_info, default_max_tokens, tracer=tracer, metrics=metrics)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    frontend = FrontendServer(server=server, port=0, servicer=servicer, health=health, engine=engine)
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
        TorchServeInferenceServicer(servicer.Generate, lambda: frontend.serving), server)
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(
        TorchServeManagementServicer(model_info, model_url, max_num_seqs, lambda: frontend.serving), server)
    service_names = (SERVICE_NAME, INFERENCE_SERVICE_NAME, MANAGEMENT_SERVICE_NAME,
                     health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}; pick another --host/--port") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}; pick another --host/--port")
    frontend.port = bound
    return frontend


def _bounded_float(sampling: pb.SamplingParams, name: str, default: float, low: float, high: float) -> float:
    """An optional float field of `sampling` that must lie in [low, high]; NaN and infinities are rejected."""
    value = getattr(sampling, name) if sampling.HasField(name) else default
    if not low <= value <= high:  # also false for NaN
        raise _invalid(f"sampling.{name} must be in [{low:g}, {high:g}], got {value}")
    return value


def _add_top_logprobs(response: pb.GenerateResponse, output: Any, num_new: int, num_logprobs: int) -> None:
    """One TopLogprobs per new token from the output's flattened [num_new, num_top] arrays, padding ids (-1) dropped."""
    num_top = getattr(output, "num_top", 0)
    ids = getattr(output, "top_token_ids", ())
    logprobs = getattr(output, "top_logprobs", ())
    width = min(num_top, num_logprobs)
    for row in range(num_new):  # an engine that reported none still gets one (empty) entry per token
        start = row * num_top
        entry = response.top_logprobs.add()
        for token_id, logprob in zip(ids[start:start + width], logprobs[start:start + width], strict=False):
            if token_id >= 0:
                entry.token_ids.append(token_id)
                entry.logprobs.append(logprob)


def _which_input(request: Any, fields: tuple[str, ...]) -> str:
    """The one input field the request sets; zero or several is INVALID_ARGUMENT naming them."""
    present = [name for name in fields if request.HasField(name)]
    allowed = ", ".join(f"`{name}`" for name in fields)
    if not present:
        raise _invalid(f"input is required: set exactly one of {allowed}")
    if len(present) > 1:
        raise _invalid(f"input: set exactly one of {allowed}, not {' and '.join(present)}")
    return present[0]
