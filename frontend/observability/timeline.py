"""What happened to one Generate RPC, in wall-clock nanoseconds: the record traces and metrics are built from.

The servicer fills it on the hot path with list appends only; spans and histogram samples are made from it after
the RPC has ended, so observing a request never delays its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

_TRACE_HEADERS = frozenset(("traceparent", "tracestate"))


def trace_headers(metadata: Sequence[tuple[str, Any]] | None) -> dict[str, str] | None:
    """The W3C trace context headers among a call's gRPC metadata (keys arrive lower-cased)."""
    if not metadata:
        return None
    found = {key: value for key, value in metadata if key in _TRACE_HEADERS and isinstance(value, str)}
    return found or None


class RequestTimeline:
    """One request's times: frontend times from `time.time_ns()`, engine times from the engine's records.

    Both clocks are CLOCK_REALTIME on the same host, so they can be compared and put on one trace.
    """

    __slots__ = (
        "api", "chat", "completion_tokens", "emit_ns", "end_ns", "engine_arrival_ns", "error_code", "error_message",
        "error_type", "finish_reason", "first_scheduled_ns", "first_token_ns", "kv_pull_blocks", "kv_pulled_ns",
        "model", "num_cached_tokens", "num_preemptions", "params", "parent_headers", "prefill_chunks", "prompt_tokens",
        "receive_ns", "request_id", "rpc_method", "rpc_start_ns", "send_ns", "spec_steps", "token_ids",
        "tokenize_end_ns",
    )  # fmt: skip

    def __init__(self, model: str, parent_headers: dict[str, str] | None = None) -> None:
        self.rpc_start_ns = time.time_ns()
        self.model = model
        self.parent_headers = parent_headers  # W3C traceparent/tracestate from the call's metadata
        self.request_id = ""
        self.api = "ringserve"  # the front door the request came through: ringserve (gRPC), openai (HTTP), ...
        self.rpc_method = "Generate"  # or the disaggregation RPCs: Prefill, GenerateFromKv
        self.kv_pull_blocks = 0  # GenerateFromKv: prompt blocks pulled from the prefill server before the first step
        self.kv_pulled_ns = 0  # engine emit time of the first output after the pull (end of the step that pulled)
        self.chat = False
        self.params: Any = None  # SamplingOptions once validated
        self.tokenize_end_ns = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.engine_arrival_ns = 0
        self.first_scheduled_ns = 0
        self.first_token_ns = 0
        # One entry per output that carried tokens: its tokens, the engine's emit time, when the frontend
        # received it and when its response was handed to gRPC.
        self.token_ids: list[list[int]] = []
        self.emit_ns: list[int] = []
        self.receive_ns: list[int] = []
        self.send_ns: list[int] = []
        # (emit time, tokens computed in the chunk, prompt tokens computed so far, cached tokens) per prefill chunk.
        self.prefill_chunks: list[tuple[int, int, int, int]] = []
        # (emit time, draft tokens verified, accepted) per step that verified drafts for this request.
        self.spec_steps: list[tuple[int, int, int]] = []
        self.finish_reason = ""
        # The failure as text: holding the exception would keep its traceback's frames (and what they reference)
        # alive until the cycle collector runs.
        self.error_code: grpc.StatusCode | None = None
        self.error_type = ""
        self.error_message = ""
        self.end_ns = 0

    def on_output(self, output: Any) -> None:
        """Record one engine output (a `TimedOutput`: a layout-v2 `RequestOutput` with emit/receive times)."""
        emit = output.emit_time_ns
        ids = output.new_token_ids
        if not self.first_token_ns:
            # Still in the prefill: every output up to the first token is one computed chunk.
            scheduled = output.num_scheduled_tokens
            if scheduled:
                self.prefill_chunks.append((emit, scheduled, output.num_computed_tokens, output.num_cached_tokens))
            self.engine_arrival_ns = output.arrival_time_ns
            self.first_scheduled_ns = output.first_scheduled_time_ns
            if ids:  # a fake or older engine may leave the time 0: fall back to the emit time
                self.first_token_ns = output.first_token_time_ns or emit or time.time_ns()
        elif self.kv_pull_blocks and not self.kv_pulled_ns and output.first_scheduled_time_ns:
            # Pulled KV: the first token was the prefill server's (made up front); the engine's first output marks
            # the end of the step that pulled the prompt's blocks.
            self.engine_arrival_ns = output.arrival_time_ns
            self.first_scheduled_ns = output.first_scheduled_time_ns
            self.kv_pulled_ns = emit
        if ids:
            self.token_ids.append(ids)
            self.emit_ns.append(emit)
            self.receive_ns.append(output.receive_time_ns)
            self.send_ns.append(0)
            self.completion_tokens += len(ids)
        self.num_cached_tokens = output.num_cached_tokens
        self.num_preemptions = output.num_preemptions
        proposed = output.num_spec_proposed_tokens
        if proposed:
            self.spec_steps.append((emit, proposed, output.num_spec_accepted_tokens))

    @property
    def spec_proposed_tokens(self) -> int:
        return sum(p for _, p, _ in self.spec_steps)

    @property
    def spec_accepted_tokens(self) -> int:
        return sum(a for _, _, a in self.spec_steps)

    def mark_sent(self) -> None:
        """The response carrying the last recorded output's tokens was handed to gRPC."""
        if self.send_ns and not self.send_ns[-1]:
            self.send_ns[-1] = time.time_ns()

    def fail(self, code: grpc.StatusCode, error: BaseException) -> None:
        if self.error_code is None:
            self.error_code = code
            self.error_type = type(error).__name__
            self.error_message = str(error)

    def finish(self) -> None:
        self.end_ns = time.time_ns()

    @property
    def last_emit_ns(self) -> int:
        return self.emit_ns[-1] if self.emit_ns else 0
