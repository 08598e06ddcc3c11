"""TorchServe's gRPC APIs on top of the RingServe frontend, so TorchServe clients work unchanged.

Inference (`org.pytorch.serve.grpc.inference.InferenceAPIsService`): a prediction's `input` map carries a JSON body
under `data` or `body` — TorchServe's LLM handler fields (`prompt`, `max_new_tokens`, `temperature`, `top_p`, `top_k`)
and RingServe's own names (`messages`, `max_tokens`, `min_tokens`, `min_p`, `seed`, the three penalties,
`ignore_eos`, `stop` (a string or a list), `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`priority`, `cache_salt`; `n` only as 1, since a prediction returns one text) — or plain UTF-8 text as the prompt.
Each prediction is translated into a `ringserve.v1.GenerateRequest` and served by the same
`GenerationServicer.Generate` (validation, tracing, metrics and cancellation included); text comes back as UTF-8
bytes.

Management (`org.pytorch.serve.grpc.management.ManagementAPIsService`): ListModels and DescribeModel describe the
model served; run-time registration and scaling are not implemented yet and say so with UNIMPLEMENTED.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from google.rpc import status_pb2
from ringserve.torchserve import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb

INFERENCE_SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name
MANAGEMENT_SERVICE_NAME = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name

# JSON body key -> (GenerateRequest.sampling field, expected Python type). TorchServe LLM handler names first.
_SAMPLING_KEYS: dict[str, tuple[str, type]] = {
    "max_new_tokens": ("max_tokens", int),
    "max_tokens": ("max_tokens", int),
    "min_tokens": ("min_tokens", int),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "seed": ("seed", int),
    "ignore_eos": ("ignore_eos", bool),
    "include_stop_str_in_output": ("include_stop_str_in_output", bool),
}
# JSON body key -> (GenerateRequest field, expected Python type), for request-level options.
_REQUEST_KEYS: dict[str, tuple[str, type]] = {
    "skip_special_tokens": ("skip_special_tokens", bool),
    "priority": ("priority", int),
    "cache_salt": ("cache_salt", str),
}


class PredictionError(Exception):
    """A prediction refused before or during generation, with the gRPC status TorchServe clients should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def generate_request_from_prediction(request: inference_pb2.PredictionsRequest) -> pb.GenerateRequest:
    """Translate TorchServe's input map into a GenerateRequest; bad input is INVALID_ARGUMENT naming the field."""
    key = "data" if "data" in request.input else "body" if "body" in request.input else None
    if key is None:
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              "input: a prediction needs its body under input['data'] or input['body']")
    raw = request.input[key]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT, f"input.{key}: not UTF-8 text ({exc})") from None
    out = pb.GenerateRequest(model=request.model_name)
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = None
    if not isinstance(body, dict):  # plain text (or a JSON string/number): the prompt itself
        out.text = body if isinstance(body, str) else text
        return out
    prompt, messages = body.get("prompt", body.get("text")), body.get("messages")
    if (prompt is None) == (messages is None):
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input.{key}: set exactly one of `prompt` (text) and `messages` (chat)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT, f"input.{key}.prompt: must be a string")
        out.text = prompt
    else:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"input.{key}.messages: must be a list of {{role, content}} strings")
        out.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    for keys, target in ((_SAMPLING_KEYS, out.sampling), (_REQUEST_KEYS, out)):
        for name, (field, kind) in keys.items():
            if name in body:
                _set_field(target, field, body[name], kind, f"input.{key}.{name}")
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input.{key}.stop: expected a string or a list of strings")
    out.sampling.stop.extend(stop)
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input.{key}.n: a TorchServe prediction returns one completion, so n must be 1; "
                              "use ringserve.v1 Generate for n > 1")
    stop_ids = body.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and t >= 0 for t in stop_ids):
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"input.{key}.stop_token_ids: expected a list of non-negative integers")
    out.sampling.stop_token_ids.extend(stop_ids)
    return out


def _set_field(message: Any, field: str, value: Any, kind: type, where: str) -> None:
    """Set a JSON value on a proto field if it has the field's type (no silent conversions from strings/bools)."""
    if kind is bool or kind is str:
        ok = isinstance(value, kind)
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (kind is float or float(value).is_integer()) and math.isfinite(value))
    if not ok:
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: expected {kind.__name__}, got {value!r}")
    try:
        setattr(message, field, kind(value))
    except ValueError as exc:  # out of the proto field's range, e.g. a negative seed
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}") from None


class _ContextWithoutAbort:
    """Wraps a servicer context so an abort in the wrapped Generate becomes a PredictionError the caller handles."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        raise PredictionError(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


GenerateFn = Callable[[pb.GenerateRequest, Any], AsyncIterator[pb.GenerateResponse]]


class TorchServeInferenceServicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
    def __init__(self, generate: GenerateFn, is_serving: Callable[[], bool]) -> None:
        self._generate = generate
        self._is_serving = is_serving

    async def _stream(self, request: inference_pb2.PredictionsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[str]:
        generate_request = generate_request_from_prediction(request)
        async for response in self._generate(generate_request, _ContextWithoutAbort(context)):
            if response.text:
                yield response.text

    async def Ping(self, request: Any, context: grpc.aio.ServicerContext) -> inference_pb2.TorchServeHealthResponse:
        status = "Healthy" if self._is_serving() else "Unhealthy"
        return inference_pb2.TorchServeHealthResponse(health=json.dumps({"status": status}))

    async def Predictions(self, request: inference_pb2.PredictionsRequest,
                          context: grpc.aio.ServicerContext) -> inference_pb2.PredictionResponse:
        try:
            text = "".join([chunk async for chunk in self._stream(request, context)])
        except PredictionError as error:
            await context.abort(error.code, error.message)
        return inference_pb2.PredictionResponse(prediction=text.encode("utf-8"))

    async def StreamPredictions(self, request: inference_pb2.PredictionsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PredictionResponse]:
        try:
            async for chunk in self._stream(request, context):
                yield inference_pb2.PredictionResponse(prediction=chunk.encode("utf-8"))
        except PredictionError as error:
            await context.abort(error.code, error.message)

    async def StreamPredictions2(self, request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
                                 context: grpc.aio.ServicerContext,
                                 ) -> AsyncIterator[inference_pb2.PredictionResponse]:
        # One stream, many predictions in order; a failed prediction reports its status and the stream goes on.
        async for request in request_iterator:
            sequence = {"sequenceId": request.sequenceId} if request.HasField("sequenceId") else {}
            try:
                async for chunk in self._stream(request, context):
                    yield inference_pb2.PredictionResponse(prediction=chunk.encode("utf-8"), **sequence)
            except PredictionError as error:
                status = status_pb2.Status(code=error.code.value[0], message=error.message)
                yield inference_pb2.PredictionResponse(status=status, **sequence)


class TorchServeManagementServicer(management_pb2_grpc.ManagementAPIsServiceServicer):
    """Reports the served model the way TorchServe's management API does (JSON text in `msg`)."""

    def __init__(self, model_info: pb.ModelInfo, model_url: str, max_num_seqs: int,
                 is_serving: Callable[[], bool]) -> None:  # fmt: skip
        self._info = model_info
        self._url = model_url
        self._max_num_seqs = max_num_seqs
        self._is_serving = is_serving

    async def _check_model(self, name: str, context: grpc.aio.ServicerContext) -> None:
        if name != self._info.model:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model_name {name!r} is not registered; registered: {self._info.model!r}")

    async def ListModels(self, request: management_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        if request.limit < 0 or request.limit > 1000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must be between 1 and 1000 (0 = 100)")
        models = [{"modelName": self._info.model, "modelUrl": self._url}]
        return management_pb2.ManagementResponse(msg=json.dumps({"models": models}, indent=2))

    async def DescribeModel(self, request: management_pb2.DescribeModelRequest,
                            context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        await self._check_model(request.model_name, context)
        info = self._info
        description = [{
            "modelName": info.model, "modelVersion": "1.0", "modelUrl": self._url, "runtime": "ringserve",
            "minWorkers": 1, "maxWorkers": 1, "batchSize": self._max_num_seqs, "maxBatchDelay": 0,
            "loadedAtStartup": True,
            "workers": [{"id": "engine-0", "status": "READY" if self._is_serving() else "UNLOADING",
                         "gpu": False}],
            "ringserve": {"architecture": info.architecture, "contextLength": info.context_length,
                          "dtype": info.dtype, "tensorParallelSize": info.tensor_parallel_size,
                          "blockSize": info.block_size, "kvCapacityTokens": info.kv_capacity_tokens},
        }]  # fmt: skip
        return management_pb2.ManagementResponse(msg=json.dumps(description, indent=2))

    async def _not_yet(self, context: grpc.aio.ServicerContext, what: str) -> NoReturn:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{what}: RingServe serves the model given to `ringserve serve --model`; run-time "
                            "model registration and scaling are not implemented yet")
        raise AssertionError("context.abort returned")

    async def RegisterModel(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await self._not_yet(context, "RegisterModel")

    async def ScaleWorker(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await self._not_yet(context, "ScaleWorker")

    async def SetDefault(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await self._not_yet(context, "SetDefault")

    async def UnregisterModel(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await self._not_yet(context, "UnregisterModel")
