"""The models one frontend serves, by name, and the ringserve.v1 Generation service across them.

A `ServedModel` is one registered model: its servicer (validation, tokenizer, waiting queue), its engine (a
`ModelDeployment` with its data-parallel replicas, or any `GenerationEngine` in tests), its ModelInfo and its state.
The `ModelCatalog` maps names to them and knows the default model (the one requests with an empty `model` go to).
The APIs route each request by its `model` field through `servicer_for`: a model that is not registered gets
NOT_FOUND naming the served ones; one still loading, draining or failed to load gets UNAVAILABLE saying so. The
catalog knows the servicer and the deployment only as the two protocols below, so it imports neither.

`ModelManager` is what TorchServe's management API (RegisterModel, ScaleWorker, UnregisterModel, SetDefault) and
`--models-config` act on: it reserves the name, has the launcher's `ModelLoader` start the engines, and drains and
stops a model before it disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from ringserve.frontend.engine_client import EngineError, GenerationEngine
from ringserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from ringserve.frontend.observability.metrics import ServingMetrics

log = logging.getLogger(__name__)

DEFAULT_DRAIN_S = 30.0
SERVER_DRAINING = "the server is draining (shutting down) and takes no new requests; retry on another replica"


class ModelError(Exception):
    """A catalog or management operation that cannot be done, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ModelServicer(Protocol):
    """What a ready model's servicer offers the APIs that reach it through the catalog (api.generation has it)."""

    @property
    def num_waiting(self) -> int: ...

    def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]: ...

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse: ...

    async def Detokenize(self, request: pb.DetokenizeRequest, context: Any) -> pb.DetokenizeResponse: ...

    async def GetEngineStats(self, request: pb.EngineStatsRequest, context: Any) -> pb.EngineStats: ...


class ModelReplicas(Protocol):
    """What the manager does with a model's engine replicas it started (frontend/deployment.py has them)."""

    async def scale(self, count: int, drain_s: float) -> None: ...

    async def stop(self, drain_s: float) -> None: ...

    def describe_replicas(self) -> list[dict[str, Any]]: ...

    @property
    def restarting(self) -> bool: ...

    @property
    def failure_reason(self) -> str | None: ...


@dataclass(eq=False)
class ServedModel:
    """One registered model; `servicer` and `engine` are set once its first engine replica is ready."""

    name: str
    url: str = ""
    max_num_seqs: int = 0
    servicer: ModelServicer | None = None
    engine: GenerationEngine | None = None
    deployment: ModelReplicas | None = None  # None for a model whose engine the catalog does not own (tests)
    info: pb.ModelInfo | None = None
    ready: bool = False  # the engine answered EngineReady
    draining: bool = False
    load_error: str | None = None
    load_error_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    metrics: ServingMetrics | None = None
    stats_feed: Any = None
    loading: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def state(self) -> int:
        if self.load_error is not None:
            return pb.MODEL_STATE_FAILED
        if self.draining:
            return pb.MODEL_STATE_DRAINING
        if self.servicer is None or self.engine is None or not self.ready:
            return pb.MODEL_STATE_LOADING
        if self.deployment is not None and self.deployment.restarting:  # its engine is starting again
            return pb.MODEL_STATE_RESTARTING
        if self.engine.failure is not None:
            return pb.MODEL_STATE_FAILED
        return pb.MODEL_STATE_READY

    @property
    def serving(self) -> bool:
        return self.state == pb.MODEL_STATE_READY

    def describe(self) -> pb.ModelInfo:
        info = pb.ModelInfo()
        if self.info is not None:
            info.CopyFrom(self.info)
        info.model = self.name
        info.state = self.state  # type: ignore[assignment]
        return info

    def status_text(self) -> str:
        """LOADING, READY, DRAINING, FAILED or RESTARTING (a dead engine is being started again)."""
        return pb.ModelState.Name(self.state).removeprefix("MODEL_STATE_")  # type: ignore[arg-type]

    @property
    def error(self) -> str | None:
        """Why the model failed to load or, once its engines spent their restart budget, why it is FAILED."""
        if self.load_error is not None:
            return self.load_error
        if self.deployment is not None and self.deployment.failure_reason is not None:
            return self.deployment.failure_reason
        if self.state == pb.MODEL_STATE_FAILED and self.engine is not None:
            return self.engine.failure
        return None


class ModelCatalog:
    """Served models by name; listeners hear of every change that can move a model's health."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.default_name: str | None = None
        self.draining = False  # the server is shutting down: no new requests for any model
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs after a model is added, becomes ready, fails, drains or is removed."""
        self._listeners.append(callback)

    def changed(self) -> None:
        for callback in self._listeners:
            try:
                callback()
            except Exception:
                log.exception("catalog listener raised")

    def __contains__(self, name: str) -> bool:
        return name in self._models

    def __len__(self) -> int:
        return len(self._models)

    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    def add(self, model: ServedModel) -> ServedModel:
        if model.name in self._models:
            raise ModelError(grpc.StatusCode.ALREADY_EXISTS, f"model {model.name!r} is already registered; "
                                                             "UnregisterModel it first to load it again")  # fmt: skip
        self._models[model.name] = model
        if self.default_name is None:
            self.default_name = model.name
        self.changed()
        return model

    def attach(self, model: ServedModel, servicer: ModelServicer, engine: GenerationEngine,
               info: pb.ModelInfo, *, ready: bool = True) -> None:  # fmt: skip
        """The model's engine is up: from now on requests reach `servicer`."""
        model.servicer, model.engine, model.info, model.ready = servicer, engine, info, ready
        engine.add_failure_listener(lambda _message: self.changed())
        self.changed()

    def mark_ready(self, model: ServedModel) -> None:
        model.ready = True
        self.changed()

    def remove(self, name: str) -> ServedModel:
        model = self.get(name)
        del self._models[model.name]
        if self.default_name == model.name:
            self.default_name = next(iter(self._models), None)
        self.changed()
        return model

    def get(self, name: str) -> ServedModel:
        """The named model ('' = the default); NOT_FOUND naming what is served."""
        key = name or self.default_name or ""
        model = self._models.get(key)
        if model is None:
            served = ", ".join(repr(n) for n in self._models) or "none"
            what = f"model {name!r} is" if name else "no default model is"
            raise ModelError(grpc.StatusCode.NOT_FOUND, f"{what} not served here; served models: {served}")
        return model

    def servicer_for(self, name: str) -> ModelServicer:
        """The servicer requests for `name` go to; UNAVAILABLE while the model cannot take requests."""
        if self.draining:
            raise ModelError(grpc.StatusCode.UNAVAILABLE, SERVER_DRAINING)
        model = self.get(name)
        if model.load_error is not None:
            raise ModelError(grpc.StatusCode.UNAVAILABLE,
                             f"model {model.name!r} failed to load: {model.load_error}; UnregisterModel it and "
                             "register it again")  # fmt: skip
        if model.draining:
            raise ModelError(grpc.StatusCode.UNAVAILABLE,
                             f"model {model.name!r} is draining (being unregistered); it takes no new requests")
        if model.servicer is None:
            raise ModelError(grpc.StatusCode.UNAVAILABLE, f"model {model.name!r} is still loading; retry shortly")
        return model.servicer

    def set_default(self, name: str) -> None:
        self.default_name = self.get(name).name
        self.changed()


# -- run-time registration ----------------------------------------------------------------------------------

_SPEC_OPTIONS: dict[str, type] = {
    "tensor_parallel_size": int, "dtype": str, "max_model_len": int, "max_num_seqs": int,
    "kv_cache_memory_gib": float, "num_kv_blocks": int, "data_parallel_size": int,
}  # fmt: skip
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelSpec:
    """What to load: a model file or folder, the engine settings that differ from the server's flags, and a chat
    template file to use instead of the model's."""

    name: str
    path: str
    replicas: int = 1
    tensor_parallel_size: int | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_gib: float | None = None
    num_kv_blocks: int | None = None
    chat_template: str | None = None  # a Jinja file replacing the model's own chat template (or its lack of one)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """INVALID_ARGUMENT naming the setting that cannot work."""
        def bad(message: str) -> ModelError:
            return ModelError(grpc.StatusCode.INVALID_ARGUMENT, message)

        if not self.name or not self.name.strip() or len(self.name) > 256 or "/" in self.name:
            raise bad(f"model_name {self.name!r}: give a non-empty name of at most 256 characters without '/'")
        if not self.path:
            raise bad("url: the path of a .gguf file or a Hugging Face folder on the server is required")
        if not 1 <= self.replicas <= 64:
            raise bad(f"initial_workers: must be in [1, 64] engine replicas (got {self.replicas})")
        for option in ("tensor_parallel_size", "max_model_len", "max_num_seqs", "num_kv_blocks"):
            value = getattr(self, option)
            if value is not None and value < (0 if option in ("max_model_len", "num_kv_blocks") else 1):
                raise bad(f"{option}: must be positive (got {value})")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise bad(f"dtype: must be one of {', '.join(_DTYPES)} (got {self.dtype!r})")
        gib = self.kv_cache_memory_gib
        if gib is not None and not (math.isfinite(gib) and gib > 0):
            raise bad(f"kv_cache_memory_gib: must be > 0 (got {gib})")

    @classmethod
    def from_url(cls, name: str, url: str, replicas: int, max_num_seqs: int = 0) -> ModelSpec:
        """TorchServe's RegisterModel `url`: a local path, optionally with engine settings as a query string.

        e.g. `/models/llama.gguf?tensor_parallel_size=2&dtype=bfloat16&max_model_len=4096`. A `file://` URL is
        accepted too; remote URLs are refused (a server never downloads weights on its own).
        """
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("", "file"):
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"url: {parsed.scheme}:// URLs are not fetched; give a path on the server (optionally "
                             "file://) of a .gguf file or a Hugging Face folder")  # fmt: skip
        path = urllib.parse.unquote(parsed.path if parsed.scheme == "file" else url.split("?", 1)[0])
        options: dict[str, Any] = {}
        for key, value in urllib.parse.parse_qsl(parsed.query, keep_blank_values=True):
            kind = _SPEC_OPTIONS.get(key)
            if kind is None:
                known = ", ".join(_SPEC_OPTIONS)
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"url: unknown setting {key!r}; known: {known}")
            try:
                options[key] = kind(value)
            except ValueError:
                raise ModelError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"url: {key}={value!r} is not a valid {kind.__name__}") from None
        if "data_parallel_size" in options:
            replicas = max(replicas, options.pop("data_parallel_size"))
        if max_num_seqs > 0:
            options.setdefault("max_num_seqs", max_num_seqs)
        return cls(name=name, path=path, replicas=replicas, **options)


# Starts a reserved model's engines, then `catalog.attach`es it; raises ModelError (or anything) on failure.
ModelLoader = Callable[[ModelSpec, ServedModel], Awaitable[None]]


class ModelManager:
    """Registers, scales and unregisters models at run time; TorchServe's management API calls it."""

    def __init__(self, catalog: ModelCatalog, loader: ModelLoader | None = None,
                 drain_s: float = DEFAULT_DRAIN_S, *, runtime_changes: bool = True) -> None:  # fmt: skip
        self.catalog = catalog
        self.runtime_changes = runtime_changes and loader is not None
        self._loader = loader
        self.drain_s = drain_s
        self._lock = asyncio.Lock()  # one scale or unregister at a time

    def check_runtime_changes(self) -> None:
        """PERMISSION_DENIED when clients may not change the served models."""
        if not self.runtime_changes:
            raise ModelError(grpc.StatusCode.PERMISSION_DENIED,
                             "this server does not allow changing its models at run time (it was started with "
                             "--no-model-management, or it manages no engines)")

    async def register(self, spec: ModelSpec, *, synchronous: bool = True) -> ServedModel:
        """Reserve the name, then load it (and wait when synchronous); a failed load is reported as FAILED."""
        if self._loader is None:
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                             "this server was built without run-time model registration")
        model = self.catalog.add(ServedModel(name=spec.name, url=spec.path, max_num_seqs=spec.max_num_seqs or 0))
        model.loading = asyncio.get_running_loop().create_task(self._load(spec, model))
        if synchronous:
            await asyncio.shield(model.loading)
            if model.load_error is not None:
                # A synchronous caller gets the error and the name back; an asynchronous one sees FAILED.
                self.catalog.remove(model.name)
                raise ModelError(model.load_error_code, f"model {spec.name!r} could not be loaded: {model.load_error}")
        return model

    async def _load(self, spec: ModelSpec, model: ServedModel) -> None:
        assert self._loader is not None
        try:
            await self._loader(spec, model)
        except asyncio.CancelledError:
            model.load_error = "registration was cancelled"
            raise
        except ModelError as error:
            model.load_error, model.load_error_code = error.message, error.code
        except EngineError as error:  # the engine or a worker refused the settings or died while loading
            model.load_error, model.load_error_code = error.message, grpc.StatusCode.FAILED_PRECONDITION
        except Exception as error:  # a failed load must not take the server down
            log.exception("loading model %s failed", spec.name)
            model.load_error = str(error) or type(error).__name__
        finally:
            if model.load_error is not None:
                log.error("model %s failed to load: %s", spec.name, model.load_error)
            self.catalog.changed()

    def _owned(self, name: str) -> ServedModel:
        model = self.catalog.get(name)
        if model.deployment is None and model.load_error is None:
            if model.loading is not None and not model.loading.done():
                raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"model {model.name!r} is still loading; retry when DescribeModel shows READY")
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {model.name!r} is served by an engine this server does not manage")
        return model

    async def scale(self, name: str, replicas: int, *, synchronous: bool = True) -> ServedModel:
        if not 1 <= replicas <= 64:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"min_worker: must be in [1, 64] engine replicas (got {replicas}); use UnregisterModel "
                             "to remove a model")  # fmt: skip
        model = self._owned(name)
        if model.load_error is not None or model.deployment is None:
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {model.name!r} failed to load ({model.load_error}); register it again")
        deployment = model.deployment

        async def rescale() -> None:
            async with self._lock:
                await deployment.scale(replicas, self.drain_s)
            self.catalog.changed()

        task = asyncio.get_running_loop().create_task(rescale())
        if synchronous:
            try:
                await asyncio.shield(task)
            except Exception as error:
                raise ModelError(grpc.StatusCode.INTERNAL, f"scaling model {model.name!r} failed: {error}") from error
        else:
            task.add_done_callback(_log_failure(f"scaling model {model.name!r}"))
        return model

    async def unregister(self, name: str) -> None:
        """Refuse new requests, let in-flight ones finish (up to the drain time), stop the engines, forget it."""
        model = self.catalog.get(name)
        if model.deployment is None and model.load_error is None and model.loading is None:
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"model {model.name!r} is served by an engine this server does not manage")
        if model.draining:
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION, f"model {model.name!r} is already being removed")
        model.draining = True
        self.catalog.changed()
        if model.loading is not None and not model.loading.done():
            model.loading.cancel()
            with contextlib.suppress(BaseException):
                await model.loading
        async with self._lock:
            await self.stop_model(model, self.drain_s)
        self.catalog.remove(model.name)

    async def stop_model(self, model: ServedModel, drain_s: float) -> None:
        """Drain and stop one model's engines and its observability feeds (it stays in the catalog)."""
        if model.deployment is not None:
            await model.deployment.stop(drain_s)
        if model.stats_feed is not None:
            await model.stats_feed.stop()
        if model.metrics is not None:
            model.metrics.remove()

    async def stop_all(self, drain_s: float) -> None:
        models = self.catalog.models()
        for model in models:
            if model.loading is not None and not model.loading.done():
                model.loading.cancel()
        await asyncio.gather(*(m.loading for m in models if m.loading is not None), return_exceptions=True)
        await asyncio.gather(*(self.stop_model(m, drain_s) for m in models), return_exceptions=True)

    def set_default(self, name: str) -> None:
        self.catalog.set_default(name)


def _log_failure(what: str) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %s", what, task.exception())

    return done
