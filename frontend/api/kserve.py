"""KServe v2 / the Open Inference Protocol over gRPC (`inference.GRPCInferenceService`, Triton's protos), so
tritonclient and the tools built on it talk to RingServe unchanged.

A model takes the tensors Triton's vLLM and TensorRT-LLM backends take: `text_input` (BYTES, the prompt), optional
`stream` (BOOL), `sampling_parameters` (BYTES, a JSON object of ringserve.v1 SamplingParams fields) and
`exclude_input_in_output` (BOOL), and answers `text_output` (BYTES). Each request becomes a
`ringserve.v1.GenerateRequest` served by the same Generate as ringserve.v1 clients get (routing, validation,
tracing, metrics and cancellation included). `ModelStreamInfer` serves the requests of one stream concurrently and
answers, per request, one response per generated piece when `stream` is true (else one), the last one flagged by
the `triton_final_response` parameter; a refused request gets its error in `error_message` and the stream goes on,
as Triton's does. `ModelConfig` describes a model as Triton configures a decoupled LLM model; Triton's other RPCs
(statistics, repository, shared memory, trace and log settings) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import ringserve
from ringserve.frontend.api.validation import RequestError, json_body, json_generate_fields
from ringserve.frontend.catalog import ModelCatalog, ModelError
from ringserve.kserve import grpc_service_pb2 as kpb
from ringserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from ringserve.kserve import model_config_pb2
from ringserve.v1 import generation_pb2 as pb

log = logging.getLogger("ringserve.frontend")

SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_VERSION = "1"  # RingServe keeps one version per model
SERVER_NAME = "ringserve"
FINAL_RESPONSE = "triton_final_response"  # the response parameter that flags a request's last response
# Request parameters RingServe accepts: tritonclient may set this one on a stream; the final flag always comes with a
# response here, so no empty final response is ever needed.
_PARAMETERS = ("triton_enable_empty_final_response",)

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
# Input tensor -> (datatype, required); what ModelMetadata describes and requests are checked against.
INPUTS: dict[str, tuple[str, bool]] = {
    TEXT_INPUT: ("BYTES", True),
    STREAM: ("BOOL", False),
    SAMPLING_PARAMETERS: ("BYTES", False),
    EXCLUDE_INPUT_IN_OUTPUT: ("BOOL", False),
}
_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix in raw tensor contents


class InferError(Exception):
    """A request refused before or during generation, with the gRPC status the protocol answers it with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def invalid(cls, message: str) -> InferError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class InferCall:
    """A ModelInferRequest read: the Generate request it becomes and how to answer it."""

    generate: pb.GenerateRequest
    stream: bool
    prompt: str  # prepended to the output unless exclude_input_in_output (not when streaming)
    exclude_input: bool


def read_infer_request(request: kpb.ModelInferRequest) -> InferCall:
    """Translate a ModelInferRequest; bad input is INVALID_ARGUMENT naming the tensor, field or parameter."""
    if request.model_version not in ("", MODEL_VERSION):
        raise InferError(grpc.StatusCode.NOT_FOUND,
                         f"model_version {request.model_version!r} of model {request.model_name!r} does not exist; "
                         f"RingServe keeps one version per model ({MODEL_VERSION!r})")  # fmt: skip
    for name in request.parameters:
        if name not in _PARAMETERS:
            raise InferError.invalid(f"parameters.{name}: not a request parameter RingServe reads; put sampling "
                                     f"fields in the {SAMPLING_PARAMETERS} tensor")  # fmt: skip
    for output in request.outputs:
        if output.name != TEXT_OUTPUT:
            raise InferError.invalid(f"outputs: the model has no output {output.name!r}; it has {TEXT_OUTPUT!r}")
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InferError.invalid(f"raw_input_contents: {len(request.raw_input_contents)} entries for "
                                 f"{len(request.inputs)} inputs; give one per input or none")  # fmt: skip
    values: dict[str, bytes | bool] = {}
    for index, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[index] if request.raw_input_contents else None
        if tensor.name in values:
            raise InferError.invalid(f"inputs: tensor {tensor.name!r} appears twice")
        values[tensor.name] = _tensor_value(tensor, raw)
    for name, (_, required) in INPUTS.items():
        if required and name not in values:
            raise InferError.invalid(f"inputs: the required input tensor {name!r} (BYTES, shape [1]) is missing")
    prompt = _utf8(values[TEXT_INPUT], TEXT_INPUT)  # type: ignore[arg-type]
    out = pb.GenerateRequest(model=request.model_name, request_id=request.id, text=prompt)
    if SAMPLING_PARAMETERS in values:
        text = _utf8(values[SAMPLING_PARAMETERS], SAMPLING_PARAMETERS)  # type: ignore[arg-type]
        try:
            body = json_body(text, SAMPLING_PARAMETERS)
            if body is None:
                raise InferError.invalid(f"{SAMPLING_PARAMETERS}: not JSON; expected a JSON object such as "
                                         '{"max_tokens": 16, "temperature": 0}')  # fmt: skip
            json_generate_fields(body, SAMPLING_PARAMETERS, out)
        except RequestError as error:
            raise InferError(error.code, error.message) from None
        if out.sampling.HasField("n") and out.sampling.n != 1:
            raise InferError.invalid(f"{SAMPLING_PARAMETERS}.n: a KServe request answers one text_output, so n "
                                     "must be 1; use ringserve.v1 Generate for n > 1")  # fmt: skip
        if out.sampling.logprobs:
            raise InferError.invalid(f"{SAMPLING_PARAMETERS}.logprobs: text_output carries no log-probabilities; "
                                     "use ringserve.v1 Generate for them")  # fmt: skip
    return InferCall(generate=out, stream=bool(values.get(STREAM, False)), prompt=prompt,
                     exclude_input=bool(values.get(EXCLUDE_INPUT_IN_OUTPUT, False)))


def _tensor_value(tensor: kpb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> bytes | bool:
    """The one element of a known input tensor, from its raw contents or its typed contents."""
    name = tensor.name
    if name not in INPUTS:
        raise InferError.invalid(f"inputs: the model has no input tensor {name!r}; it takes "
                                 f"{', '.join(INPUTS)}")  # fmt: skip
    datatype = INPUTS[name][0]
    if tensor.datatype != datatype:
        raise InferError.invalid(f"{name}: datatype must be {datatype}, got {tensor.datatype!r}")
    elements = 1
    for dim in tensor.shape:
        elements *= dim if dim >= 0 else 0
    if elements != 1 or len(tensor.shape) > 2:
        raise InferError.invalid(f"{name}: shape must hold one element ([1] or [1, 1]), got {list(tensor.shape)}")
    if datatype == "BYTES":
        items = _raw_bytes_elements(raw, name) if raw is not None else list(tensor.contents.bytes_contents)
        if len(items) != 1:
            raise InferError.invalid(f"{name}: holds {len(items)} elements; shape {list(tensor.shape)} needs one")
        return items[0]
    if raw is not None:
        if len(raw) != 1:
            raise InferError.invalid(f"{name}: raw BOOL contents must be 1 byte, got {len(raw)}")
        return raw != b"\x00"
    if len(tensor.contents.bool_contents) != 1:
        raise InferError.invalid(f"{name}: holds {len(tensor.contents.bool_contents)} elements; shape "
                                 f"{list(tensor.shape)} needs one")  # fmt: skip
    return bool(tensor.contents.bool_contents[0])


def _raw_bytes_elements(raw: bytes, name: str) -> list[bytes]:
    """Split raw BYTES contents: each element is a 4-byte little-endian length, then that many bytes."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + _LENGTH.size > len(raw):
            raise InferError.invalid(f"{name}: raw BYTES contents end inside an element's 4-byte length")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise InferError.invalid(f"{name}: raw BYTES element of {length} bytes runs past the contents")
        items.append(raw[offset:offset + length])
        offset += length
    return items


def _utf8(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InferError.invalid(f"{name}: not UTF-8 text ({exc})") from None


def infer_response(call: InferCall, model: str, text: str, final: bool | None) -> kpb.ModelInferResponse:
    """One response carrying `text` as text_output; `final` sets the triton_final_response parameter (streams)."""
    data = text.encode("utf-8")
    response = kpb.ModelInferResponse(
        model_name=model, model_version=MODEL_VERSION, id=call.generate.request_id,
        outputs=[kpb.ModelInferResponse.InferOutputTensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])],
        raw_output_contents=[_LENGTH.pack(len(data)) + data])  # fmt: skip
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def model_metadata(name: str) -> kpb.ModelMetadataResponse:
    """The tensors a model takes and answers, as Triton's vLLM backend describes them."""
    tensor = kpb.ModelMetadataResponse.TensorMetadata
    return kpb.ModelMetadataResponse(
        name=name, versions=[MODEL_VERSION], platform=SERVER_NAME,
        inputs=[tensor(name=key, datatype=datatype, shape=[1]) for key, (datatype, _) in INPUTS.items()],
        outputs=[tensor(name=TEXT_OUTPUT, datatype="BYTES", shape=[-1])])  # fmt: skip


def model_config(name: str) -> model_config_pb2.ModelConfig:
    """The model as Triton's configuration describes a decoupled LLM model (what perf_analyzer and genai-perf read)."""
    types = {"BYTES": model_config_pb2.TYPE_STRING, "BOOL": model_config_pb2.TYPE_BOOL}
    return model_config_pb2.ModelConfig(
        name=name, backend=SERVER_NAME, max_batch_size=0,
        input=[model_config_pb2.ModelInput(name=key, data_type=types[datatype], dims=[1], optional=not required)
               for key, (datatype, required) in INPUTS.items()],
        output=[model_config_pb2.ModelOutput(name=TEXT_OUTPUT, data_type=model_config_pb2.TYPE_STRING, dims=[-1])],
        model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True))  # fmt: skip


class _ContextWithoutAbort:
    """Wraps a servicer context so an abort in the wrapped Generate raises InferError, which the caller answers."""

    api = "kserve"  # the `api` label of these requests in metrics and traces

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        if details.startswith("sampling."):  # validation names the ringserve.v1 field; here it is a JSON key
            details = f"{SAMPLING_PARAMETERS}.{details.removeprefix('sampling.')}"
        raise InferError(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


GenerateFn = Callable[[pb.GenerateRequest, Any], AsyncIterator[pb.GenerateResponse]]


class KServeInferenceServicer(kpb_grpc.GRPCInferenceServiceServicer):
    """The protocol's health, metadata and inference RPCs over the model catalog; `generate` is the catalog's
    Generate, `is_serving` what grpc.health.v1 reports for the whole server."""

    def __init__(self, catalog: ModelCatalog, generate: GenerateFn, is_serving: Callable[[], bool]) -> None:
        self._catalog = catalog
        self._generate = generate
        self._is_serving = is_serving

    async def ServerLive(self, request: kpb.ServerLiveRequest,
                         context: grpc.aio.ServicerContext) -> kpb.ServerLiveResponse:
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: kpb.ServerReadyRequest,
                          context: grpc.aio.ServicerContext) -> kpb.ServerReadyResponse:
        return kpb.ServerReadyResponse(ready=self._is_serving())

    async def ModelReady(self, request: kpb.ModelReadyRequest,
                         context: grpc.aio.ServicerContext) -> kpb.ModelReadyResponse:
        try:
            model = self._catalog.get(request.name)
        except ModelError:
            return kpb.ModelReadyResponse(ready=False)  # as Triton answers for a model it does not know
        ready = model.serving and not self._catalog.draining and request.version in ("", MODEL_VERSION)
        return kpb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: kpb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> kpb.ServerMetadataResponse:
        return kpb.ServerMetadataResponse(name=SERVER_NAME, version=ringserve.__version__)

    async def ModelMetadata(self, request: kpb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> kpb.ModelMetadataResponse:
        return model_metadata(await self._model_name(request.name, request.version, context))

    async def ModelConfig(self, request: kpb.ModelConfigRequest,
                          context: grpc.aio.ServicerContext) -> kpb.ModelConfigResponse:
        return kpb.ModelConfigResponse(config=model_config(
            await self._model_name(request.name, request.version, context)))

    async def _model_name(self, name: str, version: str, context: grpc.aio.ServicerContext) -> str:
        """The served name of the model asked for ('' = the default); NOT_FOUND for another model or version."""
        try:
            model = self._catalog.get(name)
        except ModelError as error:
            await context.abort(error.code, error.message)
        if version not in ("", MODEL_VERSION):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"version {version!r} of model {model.name!r} does not "
                                f"exist; RingServe keeps one version per model ({MODEL_VERSION!r})")
        return model.name

    async def ModelInfer(self, request: kpb.ModelInferRequest,
                         context: grpc.aio.ServicerContext) -> kpb.ModelInferResponse:
        try:
            call = read_infer_request(request)
            if call.stream:
                raise InferError.invalid(f"{STREAM}: ModelInfer answers once; stream with ModelStreamInfer")
            responses = [response async for response in self._responses(call, context)]
        except InferError as error:
            await context.abort(error.code, error.message)
        return responses[0]

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[kpb.ModelInferRequest],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[kpb.ModelStreamInferResponse]:
        """Serve the stream's requests concurrently, merging their responses; when the client goes away, the
        requests in flight are cancelled, which aborts them in the engine."""
        outbox: asyncio.Queue[kpb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        def refuse(request: kpb.ModelInferRequest, code: grpc.StatusCode, message: str) -> None:
            outbox.put_nowait(kpb.ModelStreamInferResponse(
                error_message=f"{code.name}: {message}",
                infer_response=kpb.ModelInferResponse(model_name=request.model_name, id=request.id)))

        async def serve(request: kpb.ModelInferRequest) -> None:
            try:
                call = read_infer_request(request)
                async for response in self._responses(call, context, streaming=True):
                    outbox.put_nowait(kpb.ModelStreamInferResponse(infer_response=response))
            except InferError as error:
                refuse(request, error.code, error.message)
            except Exception as exc:  # a bug: this request fails as INTERNAL, the stream goes on
                request_id = secrets.token_hex(8)
                log.error("internal error in ModelStreamInfer (request id %s)", request_id, exc_info=exc)
                refuse(request, grpc.StatusCode.INTERNAL,
                       f"internal error (request id {request_id}); the server log has the details")

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.get_running_loop().create_task(serve(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:  # the client closed its side: finish what it asked for, then end the stream
                    await asyncio.gather(*tasks)
            finally:
                outbox.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (response := await outbox.get()) is not None:
                yield response
            await reader  # a malformed request message ends the stream with its status (INVALID_ARGUMENT)
        finally:
            for task in (reader, *tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _responses(self, call: InferCall, context: grpc.aio.ServicerContext,
                         streaming: bool = False) -> AsyncIterator[kpb.ModelInferResponse]:
        """The request's responses: with `stream`, one per piece of text, the input never prepended; else one
        with the whole text. On ModelStreamInfer (`streaming`) each carries the final flag."""
        model = call.generate.model or self._catalog.default_name or ""
        pieces: list[str] = [] if call.exclude_input or call.stream else [call.prompt]
        async with contextlib.aclosing(self._generate(call.generate, _ContextWithoutAbort(context))) as stream:
            async for response in stream:
                if not call.stream:
                    pieces.append(response.text)
                    continue
                final = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED  # n = 1: the stream's last message
                if response.text or final:
                    yield infer_response(call, model, response.text, final=final)
        if not call.stream:
            yield infer_response(call, model, "".join(pieces), final=True if streaming else None)
