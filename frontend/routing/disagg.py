"""The internal Disaggregation service of a prefill / decode server (DESIGN.md §8, protos/ringserve/internal).

Prefill: run the prompt (chunked, prefix-cached), sample the first token, keep the request's KV blocks pinned and
answer with a KV handle. GenerateFromKv: check the handle against this server's KV layout (the handshake), have the
workers pull the blocks, stream the completion starting with the prefill's token. ReleaseKv: unpin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from ringserve.frontend.api.generation import GenerationServicer
from ringserve.frontend.api.validation import (
    RequestError,
    check_model,
    num_samples,
    require_one_sample,
    sampling_options,
)
from ringserve.frontend.engine_client import EngineClient, EngineError, KvTransfer
from ringserve.frontend.observability.timeline import RequestTimeline
from ringserve.internal import disagg_pb2 as dpb
from ringserve.internal import disagg_pb2_grpc as dpb_grpc
from ringserve.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
_FINISH_BY_NAME = {"NONE": pb.FINISH_REASON_UNSPECIFIED, "STOP": pb.FINISH_REASON_STOP,
                   "LENGTH": pb.FINISH_REASON_LENGTH}  # fmt: skip
_NAME_BY_FINISH = {v: k for k, v in _FINISH_BY_NAME.items()}


@dataclass(frozen=True)
class LocalKv:
    """This server's KV transfer setup: backend and each worker rank's encoded KvPeerInfo."""

    backend: str
    worker_infos: tuple[bytes, ...]
    block_size: int
    pin_timeout_s: float = 30.0


class DisaggregationServicer(dpb_grpc.DisaggregationServicer):
    def __init__(self, generation: GenerationServicer | None, engine: EngineClient | None, role: str,
                 kv: LocalKv | None) -> None:  # fmt: skip
        """`generation` and `engine` may come later through `bind` (the service is added before the model loads)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.engine_id = uuid.uuid4().hex
        self._bound = False
        if generation is not None and engine is not None:
            self.bind(generation, engine, kv)
        else:
            self.kv = kv

    def bind(self, generation: GenerationServicer, engine: EngineClient, kv: LocalKv | None) -> None:
        self._gen = generation
        self._engine = engine
        self._core = engine._core
        self.kv = kv
        self._bound = True

    async def _require(self, context: grpc.aio.ServicerContext, role: str) -> LocalKv:
        if not self._bound:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if self.role not in (role, "both"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this server runs --role {self.role}; it does not serve {role} requests")
        if self.kv is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this server was started without KV transfer (--kv-transfer shm|nixl)")
        assert self.kv is not None
        return self.kv

    async def Prefill(self, request: dpb.PrefillRequest, context: grpc.aio.ServicerContext) -> dpb.PrefillResponse:
        kv = await self._require(context, "prefill")
        gen, req = self._gen, request.request
        # Traced and measured like a Generate: SERVER span "ringserve.prefill" with tokenize, queue and prefill.
        timeline = gen.start_timeline(req, context) if gen.observed else None
        if timeline is not None:
            timeline.rpc_method = "Prefill"
        try:
            check_model(req.model, gen.limits)
            prompt_ids = await gen.prompt_ids(req)
            params = sampling_options(req.sampling, len(prompt_ids), gen.limits, req.priority, req.cache_salt)
            require_one_sample(num_samples(req.sampling), "a disaggregated prefill")
        except RequestError as rejection:
            if timeline is not None:
                timeline.fail(rejection.code, rejection)
                gen.close_timeline(timeline)
            await context.abort(rejection.code, rejection.message)
        try:
            return await self._prefill(kv, req, prompt_ids, params, context, timeline)
        finally:
            if timeline is not None:
                gen.close_timeline(timeline)

    async def _prefill(
        self, kv: LocalKv, req: pb.GenerateRequest, prompt_ids: list[int], params: Any,
        context: grpc.aio.ServicerContext, timeline: RequestTimeline | None,
    ) -> dpb.PrefillResponse:  # fmt: skip
        if timeline is not None:
            timeline.tokenize_end_ns = time.time_ns()
            timeline.prompt_tokens = len(prompt_ids)
            timeline.params = params
        pin_ms = max(1, int(kv.pin_timeout_s * 1000))
        params = dataclasses.replace(params, kv=KvTransfer("prefill", pin_timeout_ms=pin_ms))
        request_id = self._engine.allocate_request_id()
        if timeline is not None:
            timeline.request_id = req.request_id or str(request_id)
        pinned: Any = None
        final: Any = None
        try:
            async with contextlib.aclosing(self._engine.generate(request_id, prompt_ids, params)) as outputs:
                async for item in outputs:
                    if isinstance(item, self._core.KvPinned):
                        pinned = item
                        continue
                    if timeline is not None:
                        timeline.on_output(item)
                    if item.finish_reason.name != "NONE":
                        final = item
                        if timeline is not None and (item.finish_reason.name == "STOP" or params.max_tokens == 1):
                            timeline.finish_reason = "stop" if item.finish_reason.name == "STOP" else "length"
        except EngineError as error:
            if timeline is not None:
                timeline.fail(error.code, error)
            await context.abort(error.code, error.message)
        if final is None or final.finish_reason.name == "ABORT" or pinned is None or not final.new_token_ids:
            if pinned is not None:
                self._engine.release_kv(request_id)
            if timeline is not None:
                timeline.fail(grpc.StatusCode.UNAVAILABLE, RuntimeError("the prefill was aborted by the engine"))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill was aborted by the engine")
        # The engine ends a prefill-only request after one token (LENGTH); the client's request ends there only if
        # that token is a stop token or max_tokens is 1.
        if final.finish_reason.name == "STOP":
            finish = pb.FINISH_REASON_STOP
        elif params.max_tokens == 1:
            finish = pb.FINISH_REASON_LENGTH
        else:
            finish = pb.FINISH_REASON_UNSPECIFIED
        handle = dpb.KvHandle(
            engine_id=self.engine_id, request_id=request_id, worker_infos=list(kv.worker_infos),
            block_ids=list(pinned.block_ids), num_tokens=pinned.num_tokens, block_size=kv.block_size,
            tensor_parallel_size=len(kv.worker_infos), expires_at_unix_nano=pinned.expires_at_ns, backend=kv.backend,
        )  # fmt: skip
        return dpb.PrefillResponse(
            handle=handle, prompt_token_ids=prompt_ids, first_token_id=int(final.new_token_ids[0]),
            first_logprob=float(final.logprobs[0]) if len(final.logprobs) else 0.0, finish_reason=finish,
            num_cached_tokens=final.num_cached_tokens,
        )  # fmt: skip

    async def GenerateFromKv(self, request: dpb.GenerateFromKvRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # fmt: skip
        kv = await self._require(context, "decode")
        pre = request.prefill
        problem = check_handle(kv, pre)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        from ringserve.formats.kv_peer import pack_peer_infos

        transfer = KvTransfer(
            "pull", first_token_id=pre.first_token_id, first_logprob=pre.first_logprob,
            first_finish=_NAME_BY_FINISH.get(pre.finish_reason, "NONE"), remote_block_ids=tuple(pre.handle.block_ids),
            peer=pack_peer_infos(list(pre.handle.worker_infos)),
        )  # fmt: skip
        # The handshake passed: the rest is a Generate whose prompt and first token came from the prefill server.
        stream = self._gen.Generate(request.request, context, prompt_ids=list(pre.prompt_token_ids), kv=transfer)
        async with contextlib.aclosing(stream) as responses:
            async for response in responses:
                yield response

    async def ReleaseKv(self, request: dpb.ReleaseKvRequest,
                        context: grpc.aio.ServicerContext) -> dpb.ReleaseKvResponse:  # fmt: skip
        if request.engine_id != self.engine_id or not self._bound:
            return dpb.ReleaseKvResponse(released=False)  # another instance (this one restarted): nothing pinned
        self._engine.release_kv(request.request_id)
        return dpb.ReleaseKvResponse(released=True)

    async def GetServerRole(self, request: dpb.ServerRoleRequest,
                            context: grpc.aio.ServicerContext) -> dpb.ServerRoleResponse:  # fmt: skip
        return dpb.ServerRoleResponse(role=self.role, engine_id=self.engine_id,
                                      kv_backend=self.kv.backend if self.kv else "")  # fmt: skip


def check_handle(kv: LocalKv, pre: dpb.PrefillResponse) -> str | None:
    """The handshake: why this server cannot use the handle's blocks, or None."""
    from ringserve.formats.kv_peer import KvHandshakeError, KvPeerInfo, check_compatible

    h = pre.handle
    if h.backend != kv.backend:
        return f"KV backends differ: the prefill server uses {h.backend!r}, this decode server {kv.backend!r}"
    if len(h.worker_infos) != len(kv.worker_infos):
        return (f"tensor-parallel sizes differ: prefill TP={len(h.worker_infos)}, decode TP={len(kv.worker_infos)}; "
                "run both with the same --tensor-parallel-size")  # fmt: skip
    if h.block_size != kv.block_size:
        return f"block sizes differ: prefill {h.block_size}, decode {kv.block_size}"
    if h.num_tokens != len(pre.prompt_token_ids) or len(h.block_ids) != -(-h.num_tokens // max(1, h.block_size)):
        return "the KV handle's token and block counts do not match its prompt"
    try:
        for local, remote in zip(kv.worker_infos, h.worker_infos, strict=True):
            check_compatible(KvPeerInfo.decode(local), KvPeerInfo.decode(remote))
    except KvHandshakeError as exc:
        return str(exc)
    if h.expires_at_unix_nano and h.expires_at_unix_nano < time.time_ns():
        return "the KV handle expired before it reached the decode server"
    return None


def read_worker_infos(folder: str, world_size: int) -> tuple[bytes, ...]:
    from pathlib import Path

    return tuple((Path(folder) / f"rank{r}.bin").read_bytes() for r in range(world_size))


def model_identity(path: str, arch: str, dtype: str) -> str:
    """What the handshake compares as 'the same model': architecture, file name, size and dtype."""
    import os

    size = os.path.getsize(path) if os.path.isfile(path) else sum(
        e.stat().st_size for e in os.scandir(path) if e.is_file()
    )  # fmt: skip
    return f"{arch}:{os.path.basename(os.path.normpath(path))}:{size}:{dtype}"


__all__: Sequence[str] = ("ROLES", "DisaggregationServicer", "LocalKv", "check_handle", "model_identity",
                          "read_worker_infos")  # fmt: skip
