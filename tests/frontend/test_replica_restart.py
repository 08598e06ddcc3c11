"""A replica whose engine dies is released and started again after its backoff; one that keeps failing to start is
FAILED with the reason once its restart budget is spent. The replica's start is scripted (no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from ringserve import _core
from ringserve.formats.engine_args import EngineArgs
from ringserve.frontend.catalog import ModelError
from ringserve.frontend.deployment import EngineReplica, ModelDeployment
from ringserve.frontend.engine_client import EngineUnavailableError, SamplingOptions
from ringserve.frontend.restart_policy import RestartPolicy


class FakeClient:
    num_in_flight = 0

    def __init__(self) -> None:
        self.failure: str | None = None
        self.failure_reason: _core.FailureReason | None = None
        self.closed = False
        self._listeners: list[Any] = []

    def add_failure_listener(self, callback: Any) -> None:
        self._listeners.append(callback)

    def add_stats_listener(self, callback: Any) -> None:
        pass

    def fail(self, message: str, reason: _core.FailureReason = _core.FailureReason.WORKER_DIED) -> None:
        self.failure, self.failure_reason = message, reason
        for callback in self._listeners:
            callback(message)

    async def close(self, reason: str) -> None:
        self.closed = True
        self.failure = self.failure or reason


class ScriptedReplica(EngineReplica):
    """start() succeeds, or raises the next scripted load error."""

    def __init__(self, policy: RestartPolicy, load_errors: list[str]) -> None:
        super().__init__(0, EngineArgs(), policy)
        self.load_errors = load_errors
        self.starts = 0
        self.stops = 0
        self.clients: list[FakeClient] = []

    async def start(self, timeout_s: float) -> Any:
        self.starts += 1
        if self.load_errors:
            assert self.state == "RESTARTING"  # what the deployment shows while it tries again
            raise ModelError(grpc.StatusCode.FAILED_PRECONDITION, self.load_errors.pop(0))
        self.client = FakeClient()  # type: ignore[assignment]
        self.clients.append(self.client)  # type: ignore[arg-type]
        self.state, self.ready = "READY", object()
        return self.ready

    async def stop(self, drain_s: float) -> int | None:
        self.stops += 1
        if self.client is not None:
            await self.client.close("stopped")
        if self.state not in ("FAILED", "RESTARTING"):
            self.state = "STOPPED"
        return None


async def deployment_with(replica: ScriptedReplica, max_restarts: int) -> ModelDeployment:
    deployment = ModelDeployment(name="m", url="", tokenizer=None, engine_args=EngineArgs(),  # type: ignore[arg-type]
                                 max_restarts=max_restarts, restart_window_s=60.0)  # fmt: skip
    await replica.start(1.0)
    deployment._wire(replica)
    deployment.replicas.append(replica)
    return deployment


def fast_policy(max_restarts: int) -> RestartPolicy:
    return RestartPolicy(max_restarts, 60.0, initial_backoff_s=0.01, max_backoff_s=0.04)


async def test_a_dead_replica_is_released_then_started_again_and_serves() -> None:
    replica = ScriptedReplica(fast_policy(3), [])
    deployment = await deployment_with(replica, 3)
    changes: list[str] = []
    reasons: list[str] = []
    deployment.add_state_listener(lambda: changes.append(replica.state))
    deployment.add_restart_listener(reasons.append)
    first = replica.clients[0]
    first.fail("worker 1 (pid 7) died (signal 9)")
    assert deployment.restarting and replica.state == "RESTARTING"
    assert "restarting" in (deployment.failure or "") and "worker 1" in (deployment.failure or "")
    with pytest.raises(EngineUnavailableError, match="restarting"):
        await deployment.generate(1, [1], SamplingOptions(max_tokens=1)).__anext__()
    await asyncio.gather(*deployment._restarts)
    assert first.closed and replica.stops == 1 and replica.starts == 2  # released before the new start
    assert replica.serving and deployment.failure is None and not deployment.restarting
    assert reasons == ["worker_died"] and changes[0] == "RESTARTING" and changes[-1] == "READY"
    assert replica.restarts == 1 and replica.last_failure is None
    # The new engine's death is heard too.
    replica.clients[1].fail("the engine process of replica 0 died (signal 9)", _core.FailureReason.ENGINE_DIED)
    await asyncio.gather(*deployment._restarts)
    assert replica.serving and replica.starts == 3 and reasons == ["worker_died", "engine_died"]
    # The label is the engine's typed reason, whatever its message says.
    replica.clients[2].fail("a worker's step never came", _core.FailureReason.STEP_TIMEOUT)
    await asyncio.gather(*deployment._restarts)
    assert replica.serving and reasons == ["worker_died", "engine_died", "step_timeout"]


async def test_a_replica_that_cannot_start_again_is_failed_with_the_reason() -> None:
    replica = ScriptedReplica(fast_policy(2), [])
    deployment = await deployment_with(replica, 2)
    failures: list[str] = []
    reasons: list[str] = []
    deployment.add_failure_listener(failures.append)
    deployment.add_restart_listener(reasons.append)
    replica.load_errors = ["worker rank 0 failed: the model file is truncated"] * 5
    replica.clients[0].fail("worker 0 (pid 9) died (signal 9)")
    await asyncio.gather(*deployment._restarts)
    assert replica.starts == 3  # the first start and two restarts
    assert reasons == ["worker_died", "load_failed"]
    assert replica.state == "FAILED" and not deployment.restarting
    assert len(failures) == 1 and deployment.failure_reason == failures[0] == deployment.failure
    assert failures[0].startswith("load failed: worker rank 0 failed: the model file is truncated")
    assert "--max-restarts 2" in failures[0]
    assert deployment.describe_replicas()[0]["status"] == "FAILED"


async def test_stopping_the_model_cancels_a_pending_restart() -> None:
    replica = ScriptedReplica(RestartPolicy(3, 60.0, initial_backoff_s=30.0), [])
    deployment = await deployment_with(replica, 3)
    replica.clients[0].fail("worker 0 (pid 9) died (signal 9)")
    await asyncio.sleep(0.05)  # released, now waiting out the 30 s backoff
    await deployment.stop(0.0)
    assert not deployment._restarts and replica.starts == 1


async def test_scaling_counts_a_restarting_replica_and_drops_it_first() -> None:
    serving = ScriptedReplica(fast_policy(3), [])
    deployment = await deployment_with(serving, 3)
    restarting = ScriptedReplica(RestartPolicy(3, 60.0, initial_backoff_s=30.0), [])
    restarting.index = 1
    await restarting.start(1.0)
    deployment._wire(restarting)
    deployment.replicas.append(restarting)

    async def no_new_replica() -> None:
        raise AssertionError("a replica was added although one is restarting")

    deployment.add_replica = no_new_replica  # type: ignore[method-assign,assignment]
    restarting.clients[0].fail("worker 0 (pid 9) died (signal 9)")
    assert restarting.state == "RESTARTING" and restarting.restart_task is not None
    await deployment.scale(2, 0.0)  # the restarting replica counts: nothing to add
    assert deployment.replicas == [serving, restarting] and restarting.state == "RESTARTING"
    await deployment.scale(1, 0.0)  # the one that serves nothing goes, its restart cancelled
    assert deployment.replicas == [serving] and serving.serving
    assert restarting.state == "STOPPED" and restarting.restart_task.done() and restarting.starts == 1
    assert not deployment._restarts
