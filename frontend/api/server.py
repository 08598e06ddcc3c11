"""The gRPC frontend: `ringserve.v1.Generation` servicer, health and reflection, on one grpc.aio server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
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
from ringserve.frontend.api.security import ServerSecurity
from ringserve.frontend.api.torchserve import (
    INFERENCE_SERVICE_NAME,
    MANAGEMENT_SERVICE_NAME,
    TorchServeInferenceServicer,
    TorchServeManagementServicer,
)
from ringserve.frontend.catalog import CatalogServicer, ModelCatalog, ModelManager, ServedModel
from ringserve.frontend.engine_client import EngineError, GenerationEngine, KvTransfer, SamplingOptions
from ringserve.frontend.observability.timeline import RequestTimeline, trace_headers
from ringserve.frontend.text.detokenizer import CompletionText
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.torchserve import inference_pb2_grpc, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the servicer only calls them; importing them pulls in the OpenTelemetry SDK / prometheus-client
    from ringserve.frontend.observability.metrics import ServingMetrics
    from ringserve.frontend.observability.tracing import RequestTracer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_MAX_TOKENS = 256
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (vLLM's default cap)
MAX_N = 16  # completions one Generate request may ask for
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # also bounds the text held back while a stop string may be starting
MAX_CACHE_SALT_CHARS = 1024
# Requests admitted but not yet scheduled by the engine, per model, before new ones get RESOURCE_EXHAUSTED.
DEFAULT_MAX_WAITING_REQUESTS = 1024
# Prompts longer than this (characters) are tokenized, and id lists longer than this detokenized, off the event loop.
_THREAD_TOKENIZE_CHARS = 32_768
_THREAD_DETOKENIZE_IDS = 32_768
_U64 = 1 << 64

_FINISH_REASONS = {
    "NONE": pb.FINISH_REASON_UNSPECIFIED,
    "STOP": pb.FINISH_REASON_STOP,
    "LENGTH": pb.FINISH_REASON_LENGTH,
    "ABORT": pb.FINISH_REASON_ABORT,
}
_FINISH_REASON_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                        pb.FINISH_REASON_ABORT: "abort"}


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


def cache_salt_hash(salt: str) -> int:
    """The engine's u64 prefix-cache salt for a request's `cache_salt`: 0 (none) when empty, else nonzero."""
    if not salt:
        return 0
    digest = hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


@dataclass(eq=False)
class _Sample:
    """One of a Generate request's n completions: its engine request and its streamed text."""

    index: int
    params: SamplingOptions
    text: CompletionText
    engine_request_id: int = 0
    completion_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    waiting: bool = True  # holds a place in the model's waiting queue until its first engine output


class GenerationServicer(pb_grpc.GenerationServicer):
    """Validates, tokenizes, submits to the engine and streams detokenized deltas back."""

    def __init__(self, engine: GenerationEngine, tokenizer: ModelTokenizer, model_info: pb.ModelInfo,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, *, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS) -> None:
        self._engine = engine
        self._tracer = tracer
        self._metrics = metrics
        self._observed = tracer is not None or metrics is not None
        self._tokenizer = tokenizer
        self._model_info = model_info
        self._default_max_tokens = default_max_tokens
        self._vocab_size = model_info.vocab_size or tokenizer.vocab_size
        self._max_waiting = max_waiting_requests  # 0 = unbounded
        self._num_waiting = 0

    @property
    def num_waiting(self) -> int:
        """Engine requests admitted (or reserved for n > 1) that have had no engine output yet."""
        return self._num_waiting

    # -- RPCs -----------------------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async with contextlib.aclosing(self.generate(request, context)) as responses:
            async for response in responses:
                yield response

    async def generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       prompt_ids: list[int] | None = None,
                       kv: KvTransfer | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Generate; disaggregation passes the prompt's ids (already tokenized by the prefill server) and `kv`."""
        # Observation costs one None check per output while tracing and metrics are off.
        timeline = self._start_timeline(request, context) if self._observed else None
        try:
            self._check_model(request.model)
            if prompt_ids is None:
                prompt_ids = await self._prompt_ids(request)
            else:
                self._check_token_ids(prompt_ids, "prompt_token_ids")
            if timeline is not None:
                timeline.tokenize_end_ns = time.time_ns()
                timeline.prompt_tokens = len(prompt_ids)
            sampling = request.sampling
            params = self._sampling_options(sampling, len(prompt_ids), request.priority, request.cache_salt)
            n = _num_samples(sampling)
            stop = _stop_strings(sampling)
            if kv is not None:
                if n != 1:
                    raise _invalid("sampling.n must be 1 for a request continuing from transferred KV")
                params = dataclasses.replace(params, kv=kv)
                if timeline is not None:
                    timeline.rpc_method = "GenerateFromKv"
                    timeline.kv_pull_blocks = len(kv.remote_block_ids)
            self._admit(n)  # last: nothing awaits between the queue check and the submission
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
        samples = [
            _Sample(index, _sample_params(params, index),
                    CompletionText(self._tokenizer, skip_special, stop, sampling.include_stop_str_in_output))
            for index in range(n)
        ]  # fmt: skip
        try:
            if n == 1:
                stream = self._sample_responses(request_id, prompt_ids, samples[0], timeline)
            else:
                stream = self._fan_out(request_id, prompt_ids, samples, timeline)
            # aclosing: when the client cancels or its deadline passes, this task is cancelled and the engine
            # streams' finally blocks abort every request in the engine.
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    yield response
                    if timeline is not None and response.index == 0:
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
            for sample in samples:  # places reserved for samples that were never submitted
                self._scheduled(sample)
            if timeline is not None:
                timeline.completion_tokens += sum(sample.completion_tokens for sample in samples[1:])
                self._close_timeline(timeline)

    async def _sample_responses(self, request_id: str, prompt_ids: list[int], sample: _Sample,
                                timeline: RequestTimeline | None) -> AsyncIterator[pb.GenerateResponse]:
        """One completion's messages, the last with its finish reason and usage."""
        sample.engine_request_id = self._engine.allocate_request_id()
        final: pb.GenerateResponse | None = None
        try:
            async with contextlib.aclosing(
                self._engine.generate(sample.engine_request_id, prompt_ids, sample.params)
            ) as outputs:
                async for output in outputs:
                    self._scheduled(sample)
                    if timeline is not None:
                        timeline.on_output(output)
                    response = self._response(request_id, sample, output, len(prompt_ids))
                    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        final = response
                        break  # leaving the block aborts the engine request that a stop string ended early
                    if response.token_ids or response.text:
                        yield response
        finally:
            self._scheduled(sample)
        if final is not None:
            if timeline is not None:
                timeline.finish_reason = _FINISH_REASON_NAMES.get(final.finish_reason, "abort")
            yield final

    async def _fan_out(self, request_id: str, prompt_ids: list[int], samples: list[_Sample],
                       timeline: RequestTimeline | None) -> AsyncIterator[pb.GenerateResponse]:
        """The messages of n > 1 samples, interleaved as they come.

        Sample 0 is submitted first and the others with its first message, once its prompt is computed: then they
        find every full block of the prompt in the prefix cache instead of computing it again. Closing this stream
        (cancellation, deadline, an error) stops every sample, which aborts it in the engine.
        """
        merged: asyncio.Queue[pb.GenerateResponse | BaseException | None] = asyncio.Queue()

        async def pump(sample: _Sample) -> None:
            stream = self._sample_responses(request_id, prompt_ids, sample, timeline if sample.index == 0 else None)
            try:
                async with contextlib.aclosing(stream) as responses:
                    async for response in responses:
                        merged.put_nowait(response)
            except Exception as error:  # handed to the RPC, which fails with its status
                merged.put_nowait(error)
            else:
                merged.put_nowait(None)

        tasks = [asyncio.create_task(pump(samples[0]))]
        try:
            remaining = len(samples)
            while remaining:
                item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                if len(tasks) < len(samples):  # sample 0's first message: its prompt's blocks are cached now
                    tasks += [asyncio.create_task(pump(sample)) for sample in samples[1:]]
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _response(self, request_id: str, sample: _Sample, output: Any, prompt_tokens: int) -> pb.GenerateResponse:
        """The message for one engine output of a sample; the last one (finish reason set) carries its usage."""
        new_ids = list(output.new_token_ids)
        sample.completion_tokens += len(new_ids)
        sample.spec_proposed_tokens += getattr(output, "num_spec_proposed_tokens", 0)  # layout v3
        sample.spec_accepted_tokens += getattr(output, "num_spec_accepted_tokens", 0)
        text, stopped = sample.text.push(new_ids)
        response = pb.GenerateResponse(request_id=request_id, index=sample.index, token_ids=new_ids, text=text,
                                       logprobs=list(output.logprobs))
        if sample.params.num_logprobs and new_ids:
            _add_top_logprobs(response, output, len(new_ids), sample.params.num_logprobs)
        if stopped:
            reason = pb.FINISH_REASON_STOP
        else:
            reason = _FINISH_REASONS.get(output.finish_reason.name, pb.FINISH_REASON_ABORT)
            if reason == pb.FINISH_REASON_UNSPECIFIED:
                return response
            tail, stopped = sample.text.finish()
            response.text += tail
            if stopped:
                reason = pb.FINISH_REASON_STOP
        response.finish_reason = reason
        response.usage.prompt_tokens = prompt_tokens
        response.usage.completion_tokens = sample.completion_tokens
        response.usage.cached_tokens = output.num_cached_tokens
        response.usage.spec_proposed_tokens = sample.spec_proposed_tokens
        response.usage.spec_accepted_tokens = sample.spec_accepted_tokens
        return response

    # -- the waiting queue ----------------------------------------------------------------------------------

    def _admit(self, n: int) -> None:
        """Reserve places for n engine requests in the model's waiting queue, or refuse with RESOURCE_EXHAUSTED.

        Synchronous, so no other request checks or reserves in between (the event loop is the lock).
        """
        limit = self._max_waiting
        if limit and self._num_waiting + n > limit:
            needs = f"; this request's n = {n} needs {n} places" if n > 1 else ""
            raise _Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the waiting queue of model {self._model_info.model!r} is full: {self._num_waiting} "
                             f"requests wait to be scheduled (the server's --max-waiting-requests is {limit})"
                             f"{needs}; retry later")
        self._num_waiting += n

    def _scheduled(self, sample: _Sample) -> None:
        """Release the sample's place: the engine reported on it (it was scheduled) or it ended."""
        if sample.waiting:
            sample.waiting = False
            self._num_waiting -= 1

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

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            self._check_model(request.model)
            ids = list(request.token_ids)
            self._check_token_ids(ids, "token_ids")
        except _Rejection as rejection:
            await _abort(context, rejection.code, rejection.message)
        skip_special = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if len(ids) > _THREAD_DETOKENIZE_IDS:
            text = await asyncio.to_thread(self._tokenizer.decode, ids, skip_special)
        else:
            text = self._tokenizer.decode(ids, skip_special)
        return pb.DetokenizeResponse(text=text)

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
        if not ids or max(ids) < self._vocab_size:
            return
        for index, token_id in enumerate(ids):
            if token_id >= self._vocab_size:
                raise _invalid(f"{field_name}[{index}] = {token_id} is out of range: the vocabulary has "
                               f"{self._vocab_size} tokens (ids 0..{self._vocab_size - 1})")

    def _sampling_options(self, sampling: pb.SamplingParams, prompt_len: int, priority: int = 0,
                          cache_salt: str = "") -> SamplingOptions:
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
        if len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise _invalid(f"cache_salt has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed")
        return SamplingOptions(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=sampling.seed if sampling.HasField("seed") else None, ignore_eos=sampling.ignore_eos,
            stop_token_ids=tuple(sampling.stop_token_ids), min_tokens=min_tokens, min_p=min_p,
            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, num_logprobs=num_logprobs, priority=priority,
            cache_salt=cache_salt_hash(cache_salt),
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
    """A built (not yet started) gRPC server over a model catalog, and the parts the launcher drives.

    Health: the whole server ("") and each service name report SERVING while the default model does; each model's
    name reports that model's own state. Everything turns NOT_SERVING when the server starts stopping.
    """

    server: grpc.aio.Server
    port: int  # the bound port (useful with port 0)
    health: health_aio.HealthServicer
    manager: ModelManager
    serving: bool = False  # what health reports for the whole server
    services: tuple[str, ...] = ()  # gRPC service names whose health follows the whole server's
    stopping: bool = False
    starting: bool = False  # set while the start-up models load: the server is not ready until all are
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)
    _health_names: set[str] = field(default_factory=set, repr=False)

    @property
    def catalog(self) -> ModelCatalog:
        return self.manager.catalog

    @property
    def servicer(self) -> GenerationServicer:
        """The default model's GenerationServicer."""
        servicer = self.catalog.get("").servicer
        assert servicer is not None, "the default model is still loading"
        return servicer

    @property
    def engine(self) -> GenerationEngine:
        engine = self.catalog.get("").engine
        assert engine is not None, "the default model is still loading"
        return engine

    async def start(self) -> None:
        """Start serving; health follows the models (NOT_SERVING until the default one's engine is ready)."""
        await self._refresh_health()  # the health servicer starts out SERVING
        await self.server.start()
        self.catalog.add_listener(self._health_changed)
        for model in self.catalog.models():
            if model.engine is not None and not model.ready:
                self._spawn(self._mark_ready_when_ready(model))

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight RPCs finish for up to `grace` seconds."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self.server.wait_for_termination(timeout)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def _mark_ready_when_ready(self, model: ServedModel) -> None:
        assert model.engine is not None
        try:
            await model.engine.wait_ready(None)
        except EngineError:
            self.catalog.changed()  # failed while starting
            return
        self.catalog.mark_ready(model)

    def started(self) -> None:
        """The start-up models are loaded: health may turn SERVING."""
        self.starting = False
        self._health_changed()

    def _health_changed(self) -> None:
        if not self.stopping:
            self._spawn(self._refresh_health())

    async def _refresh_health(self) -> None:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        models = {model.name: model.serving for model in self.catalog.models()}
        default = self.catalog.default_name
        self.serving = not (self.stopping or self.starting) and default is not None and models.get(default, False)
        statuses = {name: serving if ok and not self.stopping else not_serving for name, ok in models.items()}
        for name in self._health_names - statuses.keys():  # unregistered models
            statuses[name] = not_serving
        for name in ("", *self.services):
            statuses[name] = serving if self.serving else not_serving
        self._health_names |= statuses.keys()
        for name, status in statuses.items():
            await self.health.set(name, status)


def build_server(engine: GenerationEngine, tokenizer: ModelTokenizer, model_info: pb.ModelInfo,
                 host: str = "127.0.0.1", port: int = 50051, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_concurrent_rpcs: int | None = None, tracer: RequestTracer | None = None,
                 metrics: ServingMetrics | None = None, model_url: str = "",
                 max_num_seqs: int = 0, security: ServerSecurity | None = None,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS) -> FrontendServer:
    """A server for one model whose engine the caller runs (tests, embedding); see `build_catalog_server`.

    `model_info.model` is the served name; `context_length`, `kv_capacity_tokens` and `vocab_size` (0 = take the
    tokenizer's) drive validation; `model_url` and `max_num_seqs` are what TorchServe's DescribeModel reports.
    Health is NOT_SERVING until the engine is ready. `max_waiting_requests` bounds the requests admitted but not yet
    scheduled by the engine (0 = unbounded).
    """
    catalog = ModelCatalog()
    servicer = GenerationServicer(engine, tokenizer, model_info, default_max_tokens, tracer=tracer, metrics=metrics,
                                  max_waiting_requests=max_waiting_requests)
    model = catalog.add(ServedModel(name=model_info.model, url=model_url, max_num_seqs=max_num_seqs))
    catalog.attach(model, servicer, engine, model_info, ready=False)
    return build_catalog_server(ModelManager(catalog), host, port, max_concurrent_rpcs=max_concurrent_rpcs,
                                security=security)


def build_catalog_server(manager: ModelManager, host: str = "127.0.0.1", port: int = 50051, *,
                         max_concurrent_rpcs: int | None = None,
                         security: ServerSecurity | None = None) -> FrontendServer:  # fmt: skip
    """A grpc.aio server with ringserve.v1 Generation over every model of `manager.catalog`, TorchServe's inference
    and management services, grpc.health.v1 (per model and overall) and reflection.

    Call from inside the running event loop; then `await result.start()`. Raises OSError when the address cannot
    be bound. `security` sets TLS, API keys and message size limits (default: plaintext, no keys, 64 MiB).
    """
    security = security or ServerSecurity()
    server = grpc.aio.server(maximum_concurrent_rpcs=max_concurrent_rpcs, interceptors=security.interceptors(),
                             options=security.options())
    generation = CatalogServicer(manager.catalog)
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    frontend = FrontendServer(server=server, port=0, health=health, manager=manager,
                              services=(SERVICE_NAME, INFERENCE_SERVICE_NAME, MANAGEMENT_SERVICE_NAME))
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
        TorchServeInferenceServicer(generation.Generate, lambda: frontend.serving), server)
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(TorchServeManagementServicer(manager), server)
    service_names = (SERVICE_NAME, INFERENCE_SERVICE_NAME, MANAGEMENT_SERVICE_NAME,
                     health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = security.add_port(server, address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}; pick another --host/--port") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}; pick another --host/--port")
    frontend.port = bound
    return frontend


def _num_samples(sampling: pb.SamplingParams) -> int:
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise _invalid(f"sampling.n must be in [1, {MAX_N}], got {n}")
    return n


def _stop_strings(sampling: pb.SamplingParams) -> list[str]:
    stop = list(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid(f"sampling.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for index, text in enumerate(stop):
        if not text:
            raise _invalid(f"sampling.stop[{index}] must not be empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise _invalid(f"sampling.stop[{index}] has {len(text)} characters; at most {MAX_STOP_STRING_CHARS} "
                           "are allowed")
    return stop


def _sample_params(params: SamplingOptions, index: int) -> SamplingOptions:
    """Sample `index` of n: with a seed, seed + index (documented in SamplingParams.n)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % _U64)


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
