"""The ringserve.v1 Generation service: each model's `GenerationServicer` and the `CatalogServicer` across them.

A token's way out, from the engine client's per-request queue to the gRPC stream, passes one generator per job:
`EngineClient.generate` (the request's events off the ring), `ModelDeployment.generate` (its replica's outstanding
tokens), `GenerationServicer._sample_responses` (detokenize, stop strings, one message per output; `_fan_out`
merges n > 1 of them) and `Generate` (the RPC: status codes, tracing, the waiting queue). `Generate` routes first,
so the catalog's route and a model's own (the Disaggregation service's GenerateFromKv) run the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import grpc
import jinja2
from ringserve.frontend.api.validation import (
    DEFAULT_MAX_TOKENS,
    GENERATE_INPUTS,
    TOKENIZE_INPUTS,
    ModelLimits,
    PromptInput,
    RequestError,
    check_model,
    check_prompt,
    check_prompt_size,
    check_token_ids,
    generation_options,
    prompt_input,
    require_one_sample,
    sample_params,
)
from ringserve.frontend.catalog import ModelCatalog, ModelError
from ringserve.frontend.engine_client import EngineError, GenerationEngine, KvTransfer, SamplingOptions
from ringserve.frontend.observability.timeline import RequestTimeline, trace_headers
from ringserve.frontend.text.detokenizer import CompletionText
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the servicer only calls them; importing them pulls in the OpenTelemetry SDK / prometheus-client
    from ringserve.frontend.observability.metrics import ServingMetrics
    from ringserve.frontend.observability.tracing import RequestTracer

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Requests admitted but not yet scheduled by the engine, per model, before new ones get RESOURCE_EXHAUSTED.
DEFAULT_MAX_WAITING_REQUESTS = 1024
# Prompts longer than this (characters) are tokenized, and id lists longer than this detokenized, in a thread through
# the tokenizer's lock-releasing batch API, so the event loop (every other stream) runs meanwhile.
_THREAD_TOKENIZE_CHARS = 32_768
_THREAD_DETOKENIZE_IDS = 32_768
# At most this many such long tokenizations run at once per model; the rest wait their turn. With the prompt size
# bound (ModelLimits.max_prompt_bytes) this caps the frontend memory and CPU that long prompts take at any time.
_MAX_LONG_TOKENIZATIONS = 2

_FINISH_REASONS = {
    "NONE": pb.FINISH_REASON_UNSPECIFIED,
    "STOP": pb.FINISH_REASON_STOP,
    "LENGTH": pb.FINISH_REASON_LENGTH,
    "ABORT": pb.FINISH_REASON_ABORT,
}
_FINISH_REASON_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                        pb.FINISH_REASON_ABORT: "abort"}


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it always raises; this keeps type checkers honest


async def _refuse(context: grpc.aio.ServicerContext, rejection: RequestError) -> NoReturn:
    """Refuse a request: gRPC answers its status; an HTTP front door's call context (it has `refuse`) takes the
    RequestError whole, so its answer can name the field in its own API's terms."""
    refuse = getattr(context, "refuse", None)
    if refuse is not None:
        await refuse(rejection)
    await _abort(context, rejection.code, rejection.message)


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


@dataclass(eq=False)
class GenerateCall:
    """One admitted Generate RPC: its prompt, its samples and, while observed, its timeline."""

    request_id: str
    prompt_ids: list[int]
    samples: list[_Sample]
    timeline: RequestTimeline | None = field(default=None, repr=False)


class OpenStreams:
    """The Generate streams in progress, for a drain: wait until they finish, then cut the rest with UNAVAILABLE
    and a message saying why (not gRPC's generic 'Cancelling all calls')."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.cut_message: str | None = None  # set when the rest were cut

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self) -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        return task

    def discard(self, task: asyncio.Task[Any] | None) -> None:
        self._tasks.discard(task)  # type: ignore[arg-type]

    async def drain(self, grace_s: float, message: str) -> None:
        """Wait up to `grace_s` for the streams to end, then end the rest with UNAVAILABLE `message`."""
        deadline = time.monotonic() + grace_s
        # A drain happens once per server life: polling costs nothing that matters.
        while self._tasks and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if not self._tasks:
            return
        log.warning("the shutdown grace period ended: cutting %d stream(s)", len(self._tasks))
        self.cut_message = message
        for task in list(self._tasks):
            task.cancel()
        # Each cut stream answers its status, then ends: at once on a served machine, in seconds on a starved one.
        deadline = time.monotonic() + 5.0
        while self._tasks and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


class _GenerateRpc:
    """The Generate RPC: route to the model, admit, stream its responses, answer failures with their status."""

    _open_streams: OpenStreams | None = None  # the catalog's Generate tracks its streams for a drain

    async def _route(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationServicer:
        raise NotImplementedError

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, *,
                       prompt_ids: list[int] | None = None,
                       kv: KvTransfer | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Generate; disaggregation passes the prompt's ids (already tokenized by the prefill server) and `kv`."""
        model = await self._route(request, context)
        call = await model.admit(request, context, prompt_ids, kv)
        timeline = call.timeline  # observation costs one None check per output while tracing and metrics are off
        streams = self._open_streams
        task = streams.add() if streams is not None else None
        try:
            # aclosing: when the client cancels or its deadline passes, this task is cancelled and the engine
            # streams' finally blocks abort every request in the engine.
            async with contextlib.aclosing(model.responses(call)) as responses:
                async for response in responses:
                    yield response
                    if timeline is not None and response.index == 0:
                        timeline.mark_sent()
        except EngineError as error:
            if timeline is not None:
                timeline.fail(error.code, error)
            await _abort(context, error.code, error.message)
        except (asyncio.CancelledError, GeneratorExit) as stopped:  # the client went away or its deadline passed
            if streams is not None and streams.cut_message is not None and isinstance(stopped, asyncio.CancelledError):
                if timeline is not None:  # cut at the end of a drain: say so
                    timeline.fail(grpc.StatusCode.UNAVAILABLE, stopped)
                await _abort(context, grpc.StatusCode.UNAVAILABLE, streams.cut_message)
            if timeline is not None:
                timeline.fail(grpc.StatusCode.CANCELLED, stopped)
            raise
        finally:
            if streams is not None:
                streams.discard(task)
            model.release(call)


class GenerationServicer(_GenerateRpc, pb_grpc.GenerationServicer):
    """One model's requests: validates, tokenizes, submits to the engine and streams detokenized deltas back."""

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
        self.limits = ModelLimits.of(model_info, tokenizer.vocab_size, default_max_tokens,
                                     tokenizer.max_bytes_per_token)
        self._max_waiting = max_waiting_requests  # 0 = unbounded
        self._num_waiting = 0
        self._long_tokenizations = asyncio.Semaphore(_MAX_LONG_TOKENIZATIONS)

    @property
    def tokenizer(self) -> ModelTokenizer:
        return self._tokenizer

    @property
    def num_waiting(self) -> int:
        """Engine requests admitted (or reserved for n > 1) that have had no engine output yet."""
        return self._num_waiting

    async def _route(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationServicer:
        return self  # the model name is checked (and traced) with the rest of the request

    # -- Generate's parts -----------------------------------------------------------------------------------

    async def admit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                    prompt_ids: list[int] | None = None, kv: KvTransfer | None = None) -> GenerateCall:
        """Validate, tokenize and take places in the waiting queue; a refusal aborts the RPC with its status."""
        timeline = self.start_timeline(request, context) if self._observed else None
        try:
            check_model(request.model, self.limits)
            self._check_room(1)  # a full queue refuses at once, before the prompt costs any work
            if prompt_ids is None:
                prompt_ids = await self.prompt_ids(request)
            else:
                check_token_ids(prompt_ids, "prompt_token_ids", self.limits)
            if timeline is not None:
                timeline.tokenize_end_ns = time.time_ns()
                timeline.prompt_tokens = len(prompt_ids)
            options = generation_options(request, len(prompt_ids), self.limits)
            params = options.params
            if kv is not None:
                require_one_sample(options.n, "a request continuing from transferred KV")
                params = dataclasses.replace(params, kv=kv)
                if timeline is not None:
                    timeline.rpc_method = "GenerateFromKv"
                    timeline.kv_pull_blocks = len(kv.remote_block_ids)
            self._take_places(options.n)  # last: nothing awaits between the queue check and the submission
        except RequestError as rejection:
            if timeline is not None:
                timeline.fail(rejection.code, rejection)
                self.close_timeline(timeline)
            await _refuse(context, rejection)
        request_id = request.request_id or uuid.uuid4().hex
        if timeline is not None:
            timeline.request_id = request_id
            timeline.params = params
        samples = [
            _Sample(index, sample_params(params, index),
                    CompletionText(self._tokenizer, options.skip_special_tokens, options.stop,
                                   options.include_stop_str_in_output))
            for index in range(options.n)
        ]  # fmt: skip
        return GenerateCall(request_id, prompt_ids, samples, timeline)

    def responses(self, call: GenerateCall) -> AsyncIterator[pb.GenerateResponse]:
        if len(call.samples) == 1:
            return self._sample_responses(call.request_id, call.prompt_ids, call.samples[0], call.timeline)
        return self._fan_out(call.request_id, call.prompt_ids, call.samples, call.timeline)

    def release(self, call: GenerateCall) -> None:
        """The RPC ended: free the places of samples that were never scheduled and record the timeline."""
        for sample in call.samples:
            self._scheduled(sample)
        if call.timeline is not None:
            call.timeline.completion_tokens += sum(sample.completion_tokens for sample in call.samples[1:])
            self.close_timeline(call.timeline)

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
        sample.spec_proposed_tokens += output.num_spec_proposed_tokens
        sample.spec_accepted_tokens += output.num_spec_accepted_tokens
        text, stopped = sample.text.push(new_ids)
        response = pb.GenerateResponse(request_id=request_id, index=sample.index, token_ids=new_ids, text=text,
                                       logprobs=list(output.logprobs))
        if sample.params.sampling.num_logprobs and new_ids:
            _add_top_logprobs(response, output, len(new_ids), sample.params.sampling.num_logprobs)
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

    def _take_places(self, n: int) -> None:
        """Reserve places for n engine requests in the model's waiting queue, or refuse with RESOURCE_EXHAUSTED.

        Synchronous, so no other request checks or reserves in between (the event loop is the lock).
        """
        self._check_room(n)
        self._num_waiting += n

    def _check_room(self, n: int) -> None:
        """RESOURCE_EXHAUSTED unless the waiting queue has room for n more engine requests."""
        limit = self._max_waiting
        if limit and self._num_waiting + n > limit:
            needs = f"; this request's n = {n} needs {n} places" if n > 1 else ""
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                               f"the waiting queue of model {self._model_info.model!r} is full: {self._num_waiting} "
                               f"requests wait to be scheduled (the server's --max-waiting-requests is {limit})"
                               f"{needs}; retry later")

    def _scheduled(self, sample: _Sample) -> None:
        """Release the sample's place: the engine reported on it (it was scheduled) or it ended."""
        if sample.waiting:
            sample.waiting = False
            self._num_waiting -= 1

    # -- the unary RPCs -------------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            check_model(request.model, self.limits)
            prompt, ids = await self._tokenize(prompt_input(request, self.limits, TOKENIZE_INPUTS))
        except RequestError as rejection:
            await _refuse(context, rejection)
        return pb.TokenizeResponse(token_ids=ids, prompt=prompt)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            check_model(request.model, self.limits)
            ids = list(request.token_ids)
            check_token_ids(ids, "token_ids", self.limits)
        except RequestError as rejection:
            await _refuse(context, rejection)
        skip_special = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if len(ids) > _THREAD_DETOKENIZE_IDS:
            text = await self._off_loop(self._tokenizer.decode_unlocked, ids, skip_special)
        else:
            text = self._tokenizer.decode(ids, skip_special)
        return pb.DetokenizeResponse(text=text)

    async def GetEngineStats(self, request: pb.EngineStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.EngineStats:
        try:
            check_model(request.model, self.limits)
        except RequestError as rejection:
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

    @property
    def observed(self) -> bool:
        """Tracing or metrics are on: requests get a timeline."""
        return self._observed

    def start_timeline(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestTimeline:
        headers = trace_headers(context.invocation_metadata()) if self._tracer is not None else None
        timeline = RequestTimeline(self._model_info.model, headers)
        timeline.chat = request.HasField("messages")
        timeline.api = getattr(context, "api", "ringserve")  # the front door: an HTTP call context names its API
        return timeline

    def close_timeline(self, timeline: RequestTimeline) -> None:
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

    # -- the prompt -----------------------------------------------------------------------------------------

    async def prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids, checked against the model's context length and KV capacity."""
        prompt = prompt_input(request, self.limits, GENERATE_INPUTS)
        if prompt.kind == "token_ids":
            ids = list(prompt.token_ids)
        else:
            _, ids = await self._tokenize(prompt)
        check_prompt(ids, prompt.kind, self.limits)
        return ids

    async def _tokenize(self, prompt: PromptInput) -> tuple[str, list[int]]:
        """(prompt text, ids) for a `text` or `messages` input."""
        if prompt.kind == "text":
            return prompt.text, await self._encode(prompt.text, prompt.add_special_tokens)
        try:
            text = self._tokenizer.render_chat(list(prompt.conversation),
                                               add_generation_prompt=prompt.add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "messages",
                               f"messages: the chat template rejected the conversation: {exc}") from exc
        except ValueError as exc:  # no chat template
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "messages", f"messages: {exc}") from exc
        check_prompt_size(text, "messages", self.limits)  # the template's own text counts too
        # The template writes its own special tokens.
        return text, await self._encode(text, add_special_tokens=False)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await self._off_loop(self._tokenizer.encode_unlocked, text, add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens)

    async def _off_loop(self, function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)` in a thread, at most _MAX_LONG_TOKENIZATIONS at once. A place is held until the thread
        ends, also when the request is cancelled meanwhile (the thread cannot be stopped)."""
        await self._long_tokenizations.acquire()
        try:
            future = asyncio.get_running_loop().run_in_executor(None, function, *args)
        except BaseException:
            self._long_tokenizations.release()
            raise
        future.add_done_callback(self._tokenization_done)
        return await asyncio.shield(future)

    def _tokenization_done(self, future: asyncio.Future[Any]) -> None:
        self._long_tokenizations.release()
        if not future.cancelled():
            future.exception()  # retrieved: a request cancelled meanwhile never awaits it


class CatalogServicer(_GenerateRpc, pb_grpc.GenerationServicer):
    """ringserve.v1.Generation for every served model: each RPC goes to its model's GenerationServicer."""

    def __init__(self, catalog: ModelCatalog) -> None:
        self._catalog = catalog
        self._open_streams = OpenStreams()

    @property
    def open_streams(self) -> OpenStreams:
        assert self._open_streams is not None
        return self._open_streams

    async def _servicer(self, name: str, context: grpc.aio.ServicerContext) -> GenerationServicer:
        try:
            return cast(GenerationServicer, self._catalog.servicer_for(name))
        except ModelError as error:
            await _abort(context, error.code, error.message)

    async def _route(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationServicer:
        return await self._servicer(request.model, context)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        return await (await self._servicer(request.model, context)).Tokenize(request, context)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        return await (await self._servicer(request.model, context)).Detokenize(request, context)

    async def GetEngineStats(self, request: pb.EngineStatsRequest,
                             context: grpc.aio.ServicerContext) -> pb.EngineStats:
        return await (await self._servicer(request.model, context)).GetEngineStats(request, context)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            return self._catalog.get(request.model).describe()  # also while loading or draining
        except ModelError as error:
            await _abort(context, error.code, error.message)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[m.describe() for m in self._catalog.models()],
                                     default_model=self._catalog.default_name or "")


def _add_top_logprobs(response: pb.GenerateResponse, output: Any, num_new: int, num_logprobs: int) -> None:
    """One TopLogprobs per new token from the output's flattened [num_new, num_top] arrays, padding ids (-1) dropped."""
    num_top = output.num_top
    ids: Sequence[int] = output.top_token_ids
    logprobs: Sequence[float] = output.top_logprobs
    width = min(num_top, num_logprobs)
    for row in range(num_new):  # an engine that reported none still gets one (empty) entry per token
        start = row * num_top
        entry = response.top_logprobs.add()
        for token_id, logprob in zip(ids[start:start + width], logprobs[start:start + width], strict=False):
            if token_id >= 0:
                entry.token_ids.append(token_id)
                entry.logprobs.append(logprob)
