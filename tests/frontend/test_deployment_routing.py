"""A model's replicas: least-outstanding-tokens routing, failure of one replica, aborts, summed stats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from ringserve import _core
from ringserve.formats.engine_args import EngineArgs
from ringserve.frontend.catalog import ModelCatalog, ModelError, ServedModel
from ringserve.frontend.deployment import EngineReplica, ModelDeployment
from ringserve.frontend.engine_client import EngineUnavailableError, SamplingOptions
from ringserve.frontend.restart_policy import RestartPolicy


class ScriptedClient:
    """One replica's engine: a prefill output, then one token per `release()`, then a LENGTH finish."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failure: str | None = None
        self.submitted: list[int] = []
        self.closed: list[int] = []
        self.tokens = asyncio.Queue[None]()
        self._listeners: list[Any] = []

    num_in_flight = 0

    def add_failure_listener(self, callback: Any) -> None:
        self._listeners.append(callback)

    async def close(self, reason: str) -> None:
        self.failure = self.failure or reason

    def add_stats_listener(self, callback: Any) -> None:
        pass

    def fail(self, message: str) -> None:
        self.failure = message
        for callback in self._listeners:
            callback(message)

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[Any]:  # fmt: skip
        self.submitted.append(request_id)
        try:
            yield _core.RequestOutput(request_id=request_id, num_scheduled_tokens=len(prompt_ids))
            for i in range(params.max_tokens):
                await self.tokens.get()
                last = i == params.max_tokens - 1
                reason = _core.FinishReason.LENGTH if last else _core.FinishReason.NONE
                yield _core.RequestOutput(request_id=request_id, new_token_ids=[7], logprobs=[-0.5],
                                          num_scheduled_tokens=1, finish_reason=reason)  # fmt: skip
        finally:
            self.closed.append(request_id)

    async def get_stats(self, timeout: float = 5.0) -> Any:
        return _core.EngineStats(num_running=1, num_waiting=2, num_total_blocks=10, num_free_blocks=4, num_steps=5,
                                 num_preemptions=0, num_scheduled_tokens=3, prefix_cache_queries=8,
                                 prefix_cache_hits=2, total_prompt_tokens=9, total_generation_tokens=4,
                                 block_size=16, step_time_ns=100, kv_usage=0.6, query_id=1, spec_verify_rows=1,
                                 spec_proposed_tokens=4, spec_accepted_tokens=3)  # fmt: skip


def deployment_with(*names: str, max_restarts: int = 0) -> tuple[ModelDeployment, list[ScriptedClient]]:
    deployment = ModelDeployment(name="m", url="/models/m.gguf", tokenizer=None,  # type: ignore[arg-type]
                                 engine_args=EngineArgs(), max_restarts=max_restarts)  # fmt: skip
    clients = []
    for index, name in enumerate(names):
        replica = EngineReplica(index, deployment.engine_args, RestartPolicy(max_restarts, 60.0))
        client = ScriptedClient(name)
        replica.client = client  # type: ignore[assignment]
        replica.state = "READY"
        client.add_failure_listener(
            lambda message, r=replica: deployment._on_replica_failure(r, message, _core.FailureReason.ENGINE_DIED))
        deployment.replicas.append(replica)
        clients.append(client)
    return deployment, clients


def options(max_tokens: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens)


async def first_output(stream: AsyncIterator[Any]) -> Any:
    return await stream.__anext__()


async def test_each_request_goes_to_the_replica_with_the_fewest_outstanding_tokens() -> None:
    deployment, (a, b) = deployment_with("a", "b")
    long = deployment.generate(1, [1] * 100, options(50))  # 150 outstanding on a
    await first_output(long)
    assert a.submitted == [1]
    # The prompt is prefilled: only the 50 tokens still to generate are outstanding on a.
    assert deployment.replicas[0].outstanding_tokens == 50
    short = deployment.generate(2, [1] * 10, options(5))
    await first_output(short)
    assert b.submitted == [2]  # b had nothing outstanding
    third = deployment.generate(3, [1] * 10, options(5))
    await first_output(third)
    assert b.submitted == [2, 3]  # b: 5 outstanding < a: 50
    for stream in (long, short, third):
        await stream.aclose()
    assert [r.outstanding_tokens for r in deployment.replicas] == [0, 0]
    # Closing a stream early closes the replica's stream (which aborts the request in that engine).
    assert sorted(a.closed + b.closed) == [1, 2, 3]


async def test_outstanding_tokens_fall_as_tokens_arrive_and_return_to_zero_at_the_end() -> None:
    deployment, (a,) = deployment_with("a")
    stream = deployment.generate(1, [1, 2, 3], options(3))
    await first_output(stream)
    assert deployment.replicas[0].outstanding_tokens == 3
    a.tokens.put_nowait(None)
    await stream.__anext__()
    assert deployment.replicas[0].outstanding_tokens == 2
    a.tokens.put_nowait(None)
    a.tokens.put_nowait(None)
    outputs = [o async for o in stream]
    assert outputs[-1].finish_reason == _core.FinishReason.LENGTH
    assert deployment.replicas[0].outstanding_tokens == 0


async def test_a_failed_replica_gets_no_new_requests_and_the_model_fails_only_with_the_last() -> None:
    deployment, (a, b) = deployment_with("a", "b")
    failures: list[str] = []
    deployment.add_failure_listener(failures.append)
    a.fail("engine 0 died")
    assert deployment.failure is None and failures == []
    stream = deployment.generate(1, [1], options(1))
    await first_output(stream)
    assert b.submitted == [1] and a.submitted == []
    await stream.aclose()
    b.fail("engine 1 died")
    await asyncio.gather(*deployment._restarts)  # --max-restarts 0: released, then given up on
    assert len(failures) == 1 and failures[0].startswith("engine 1 died (gave up after 0 restart(s)")
    assert deployment.failure == failures[0] == deployment.failure_reason
    with pytest.raises(EngineUnavailableError):
        await first_output(deployment.generate(2, [1], options(1)))


async def test_stats_are_summed_over_serving_replicas() -> None:
    deployment, _ = deployment_with("a", "b")
    stats = await deployment.get_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_waiting) == (20, 8, 4)
    assert stats.block_size == 16 and stats.kv_usage == pytest.approx(0.6)
    assert (stats.spec_verify_rows, stats.spec_proposed_tokens, stats.spec_accepted_tokens) == (2, 8, 6)


async def test_the_catalog_answers_not_found_naming_the_served_models() -> None:
    catalog = ModelCatalog()
    with pytest.raises(ModelError) as missing:
        catalog.get("llama")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND and "served models: none" in missing.value.message
    deployment, _ = deployment_with("a")
    model = catalog.add(ServedModel(name="m", deployment=deployment))
    assert catalog.get("") is model and catalog.get("m") is model
    with pytest.raises(ModelError, match="'m'"):
        catalog.get("other")
    with pytest.raises(ModelError) as loading:  # registered, but its engine is not attached yet
        catalog.servicer_for("m")
    assert loading.value.code == grpc.StatusCode.UNAVAILABLE and "still loading" in loading.value.message
    with pytest.raises(ModelError) as twice:
        catalog.add(ServedModel(name="m"))
    assert twice.value.code == grpc.StatusCode.ALREADY_EXISTS
