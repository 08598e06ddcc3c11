"""TorchServe's gRPC APIs on top of the RingServe frontend, so TorchServe clients work unchanged.

Inference (`org.pytorch.serve.grpc.inference.InferenceAPIsService`): a prediction's `input` map carries a JSON body
under `data` or `body` — TorchServe's LLM handler fields (`prompt`, `max_new_tokens`, `temperature`, `top_p`, `top_k`)
and RingServe's own names (`messages`, `max_tokens`, `min_tokens`, `min_p`, `seed`, the three penalties,
`ignore_eos`, `stop` (a string or a list), `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`priority`, `cache_salt`; `n` only as 1, since a prediction returns one text) — or plain UTF-8 text as the prompt.
Each prediction is translated into a `ringserve.v1.GenerateRequest` and served by the same
Generate as ringserve.v1 clients get (validation, tracing, metrics and cancellation included); text comes back as UTF-8
bytes.

Management (`org.pytorch.serve.grpc.management.ManagementAPIsService`): register, scale, describe, list, set the
default and unregister models at run time (see TorchServeManagementServicer).
"""

from __future__ import annotations

import json
import math
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import PurePosixPath
from typing import Any, NoReturn

import grpc
from google.rpc import status_pb2
from ringserve.frontend.api.validation import RequestError, json_body
from ringserve.frontend.catalog import ModelError, ModelManager, ModelSpec
from ringserve.torchserve import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from ringserve.v1 import generation_pb2 as pb

INFERENCE_SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name
MANAGEMENT_SERVICE_NAME = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"].full_name
MODEL_VERSION = "1.0"  # RingServe keeps one version per model

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
        body = json_body(text, f"input.{key}")
    except RequestError as error:
        raise PredictionError(error.code, error.message) from None
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
    elif isinstance(value, bool) or not isinstance(value, int | float):
        ok = False
    else:  # an integer of any size (the field's range is checked below), or a finite float that fits the kind
        ok = isinstance(value, int) or (math.isfinite(value) and (kind is float or value.is_integer()))
    if not ok:
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{where}: expected {kind.__name__}, got {_shown(value)}")
    try:
        setattr(message, field, kind(value))
    except (ValueError, OverflowError) as exc:  # out of the proto field's range, e.g. a negative or huge seed
        raise PredictionError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{where}: {_shown(value)} is out of range ({exc})") from None


def _shown(value: Any) -> str:
    """A value as an error message quotes it: at most 60 characters."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."



class _ContextWithoutAbort:
    """Wraps a servicer context so an abort in the wrapped Generate becomes a PredictionError the caller handles."""

    api = "torchserve"  # the `api` label of these requests in metrics and traces

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

    def _generate_for(self, request: inference_pb2.PredictionsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """The Generate stream of a prediction; its failures raise PredictionError in the iterating handler."""
        return self._generate(generate_request_from_prediction(request), _ContextWithoutAbort(context))

    async def Ping(self, request: Any, context: grpc.aio.ServicerContext) -> inference_pb2.TorchServeHealthResponse:
        status = "Healthy" if self._is_serving() else "Unhealthy"
        return inference_pb2.TorchServeHealthResponse(health=json.dumps({"status": status}))

    async def Predictions(self, request: inference_pb2.PredictionsRequest,
                          context: grpc.aio.ServicerContext) -> inference_pb2.PredictionResponse:
        try:
            text = "".join([response.text async for response in self._generate_for(request, context)])
        except PredictionError as error:
            await context.abort(error.code, error.message)
        return inference_pb2.PredictionResponse(prediction=text.encode("utf-8"))

    async def StreamPredictions(self, request: inference_pb2.PredictionsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[inference_pb2.PredictionResponse]:
        try:
            async for response in self._generate_for(request, context):
                if response.text:
                    yield inference_pb2.PredictionResponse(prediction=response.text.encode("utf-8"))
        except PredictionError as error:
            await context.abort(error.code, error.message)

    async def StreamPredictions2(self, request_iterator: AsyncIterator[inference_pb2.PredictionsRequest],
                                 context: grpc.aio.ServicerContext,
                                 ) -> AsyncIterator[inference_pb2.PredictionResponse]:
        # One stream, many predictions in order; a failed prediction reports its status and the stream goes on.
        async for request in request_iterator:
            sequence = {"sequenceId": request.sequenceId} if request.HasField("sequenceId") else {}
            try:
                async for response in self._generate_for(request, context):
                    if response.text:
                        yield inference_pb2.PredictionResponse(prediction=response.text.encode("utf-8"), **sequence)
            except PredictionError as error:
                status = status_pb2.Status(code=error.code.value[0], message=error.message)
                yield inference_pb2.PredictionResponse(status=status, **sequence)


class TorchServeManagementServicer(management_pb2_grpc.ManagementAPIsServiceServicer):
    """TorchServe's management API over the model catalog; answers are JSON text in `msg`, as TorchServe's are.

    RegisterModel's `url` is a local .gguf file or Hugging Face folder, optionally with engine settings as a query
    string (`?tensor_parallel_size=2&dtype=bfloat16&max_model_len=4096&kv_cache_memory_gib=2`); `initial_workers`
    is the number of engine replicas (data parallel) and `batch_size` the most sequences one engine runs at once.
    ScaleWorker sets the replica count to `min_worker` (or `max_worker`). RingServe keeps one version ("1.0") per
    model; SetDefault makes the model the one requests without a model name go to.
    """

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    async def _run(self, context: grpc.aio.ServicerContext, action: Callable[[], Awaitable[str]]) -> Any:
        try:
            status = await action()
        except ModelError as error:
            await context.abort(error.code, error.message)
        return management_pb2.ManagementResponse(msg=json.dumps({"status": status}))

    @staticmethod
    def _check_version(name: str, version: str) -> None:
        if version not in ("", MODEL_VERSION):
            raise ModelError(grpc.StatusCode.NOT_FOUND,
                             f"model_version {version!r} of model {name!r} does not exist; RingServe keeps one "
                             f"version per model ({MODEL_VERSION!r})")  # fmt: skip

    async def ListModels(self, request: management_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        limit = request.limit or 100
        if not 1 <= limit <= 1000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must be between 1 and 1000 (0 = 100)")
        start = request.next_page_token or 0
        if start < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "next_page_token: must be >= 0")
        models = self._manager.catalog.models()
        page: dict[str, Any] = {"models": [{"modelName": m.name, "modelUrl": m.url}
                                           for m in models[start:start + limit]]}  # fmt: skip
        if start + limit < len(models):
            page["nextPageToken"] = str(start + limit)
        return management_pb2.ManagementResponse(msg=json.dumps(page, indent=2))

    async def DescribeModel(self, request: management_pb2.DescribeModelRequest,
                            context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        try:
            self._check_version(request.model_name, request.model_version)
            model = self._manager.catalog.get(request.model_name)
        except ModelError as error:
            await context.abort(error.code, error.message)
        info = model.describe()
        if model.deployment is not None:
            workers = [{**worker, "gpu": False} for worker in model.deployment.describe_replicas()]
        else:
            workers = [{"id": "engine-0", "status": model.status_text(), "gpu": False}]
        description = [{
            "modelName": model.name, "modelVersion": MODEL_VERSION, "modelUrl": model.url, "runtime": "ringserve",
            "minWorkers": len(workers), "maxWorkers": len(workers), "batchSize": model.max_num_seqs,
            "maxBatchDelay": 0, "loadedAtStartup": model.loading is None,
            "isDefault": self._manager.catalog.default_name == model.name,
            "workers": workers,
            "ringserve": {"state": model.status_text(), "error": model.error or "",
                          "architecture": info.architecture, "contextLength": info.context_length,
                          "dtype": info.dtype, "tensorParallelSize": info.tensor_parallel_size,
                          "blockSize": info.block_size, "kvCapacityTokens": info.kv_capacity_tokens},
        }]  # fmt: skip
        return management_pb2.ManagementResponse(msg=json.dumps(description, indent=2))

    async def RegisterModel(self, request: management_pb2.RegisterModelRequest,
                            context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def register() -> str:
            self._manager.check_runtime_changes()
            name = request.model_name or _name_from_url(request.url)
            spec = ModelSpec.from_url(name, request.url, request.initial_workers or 1, request.batch_size)
            await self._manager.register(spec, synchronous=request.synchronous)
            if not request.synchronous:
                return f"Model \"{name}\" Version: {MODEL_VERSION} registration started; DescribeModel shows it READY"
            return f"Model \"{name}\" Version: {MODEL_VERSION} registered with {spec.replicas} initial workers"

        return await self._run(context, register)

    async def ScaleWorker(self, request: management_pb2.ScaleWorkerRequest,
                          context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def scale() -> str:
            self._manager.check_runtime_changes()
            self._check_version(request.model_name, request.model_version)
            replicas = request.min_worker or request.max_worker or 1
            model = await self._manager.scale(request.model_name, replicas, synchronous=request.synchronous)
            if not request.synchronous:
                return "Processing worker updates..."
            return f"Workers scaled to {replicas} for model: {model.name}"

        return await self._run(context, scale)

    async def SetDefault(self, request: management_pb2.SetDefaultRequest,
                         context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def set_default() -> str:
            self._manager.check_runtime_changes()
            self._check_version(request.model_name, request.model_version)
            if not request.model_name:
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, "model_name is required")
            self._manager.set_default(request.model_name)
            return f"Default version successfully updated for model \"{request.model_name}\" to \"{MODEL_VERSION}\""

        return await self._run(context, set_default)

    async def UnregisterModel(self, request: management_pb2.UnregisterModelRequest,
                              context: grpc.aio.ServicerContext) -> management_pb2.ManagementResponse:
        async def unregister() -> str:
            self._manager.check_runtime_changes()
            self._check_version(request.model_name, request.model_version)
            if not request.model_name:
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, "model_name is required")
            await self._manager.unregister(request.model_name)
            return f"Model \"{request.model_name}\" unregistered"

        return await self._run(context, unregister)


def _name_from_url(url: str) -> str:
    """TorchServe names a model after its archive when no name is given: the file or folder name, less suffix."""
    path = urllib.parse.urlsplit(url).path.rstrip("/")
    return PurePosixPath(path).stem if path else ""
