"""A scripted engine whose outputs carry engine timestamps, prefill chunk reports and emit/receive times, as the
real EngineClient's do (a `TimedOutput` around a real `_core.RequestOutput`), for the tracing and metrics tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from frontend_testkit import ScriptedEngine
from ringserve import _core
from ringserve.frontend.engine_client import SamplingOptions, TimedOutput

STEP_NS = 1_000_000  # engine steps 1 ms apart


class TimedEngine(ScriptedEngine):
    """Prefills the prompt in `chunk`-token pieces (one output each, no tokens), then streams `chunks` of tokens.

    Engine times are in the past of the frontend's receive time by `lag_ns`, like a real engine's.
    """

    def __init__(self, chunks: list[list[int]], finish: str = "LENGTH", chunk: int = 4, cached: int = 0,
                 preemptions: int = 0, lag_ns: int = 100_000,
                 spec: tuple[int, int] | None = None) -> None:  # fmt: skip
        super().__init__(chunks, finish)
        self.spec = spec  # (proposed, accepted) reported on every decode output after the first
        self.chunk = chunk
        self.cached = cached
        self.preemptions = preemptions
        self.lag_ns = lag_ns

    async def generate(self, request_id: int, prompt_ids: Sequence[int],
                       params: SamplingOptions) -> AsyncIterator[TimedOutput]:  # fmt: skip
        self.submitted.append((request_id, list(prompt_ids), params))
        arrival = time.time_ns()
        scheduled = arrival + STEP_NS
        emit = scheduled
        computed = self.cached
        first_token = 0

        def output(ids: list[int], reason: _core.FinishReason, scheduled_tokens: int) -> TimedOutput:
            record = _core.RequestOutput(
                request_id=request_id, new_token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=reason,
                num_prompt_tokens=len(prompt_ids), num_cached_tokens=self.cached, arrival_time_ns=arrival,
                first_scheduled_time_ns=scheduled, first_token_time_ns=first_token,
                num_scheduled_tokens=scheduled_tokens, num_computed_tokens=computed,
                num_preemptions=self.preemptions)
            return TimedOutput(record, emit, emit + self.lag_ns)

        while True:
            step = min(self.chunk, len(prompt_ids) - computed)
            computed += step
            emit += STEP_NS
            await self._wait_until(emit + self.lag_ns)
            if computed == len(prompt_ids):
                break
            yield output([], _core.FinishReason.NONE, step)
        first_token = emit
        for index, ids in enumerate(self.chunks):
            last = index == len(self.chunks) - 1
            if index:
                emit += STEP_NS
                await self._wait_until(emit + self.lag_ns)
            out = output(list(ids), self.finish if last else _core.FinishReason.NONE, step if index == 0 else 1)
            if self.spec is not None and index:
                out.output.num_spec_proposed_tokens, out.output.num_spec_accepted_tokens = self.spec
            yield out

    @staticmethod
    async def _wait_until(ns: int) -> None:
        await asyncio.sleep(max(ns - time.time_ns(), 0) / 1e9)
