"""The decode server's handshake on KV handles and the router's least-outstanding-tokens choice (no processes)."""

from __future__ import annotations

import time
from dataclasses import replace

from ringserve.formats.kv_peer import KvPeerInfo
from ringserve.frontend.routing.disagg import LocalKv, check_handle
from ringserve.frontend.routing.router import (
    Upstream,
    choose_decode,
    choose_prefill,
    estimate_prompt_tokens,
    least_loaded,
    prompt_prefix,
)
from ringserve.internal import disagg_pb2 as dpb
from ringserve.v1 import generation_pb2 as pb

INFO = KvPeerInfo(backend=1, model_id="llama:m.gguf:123:float32", dtype="float32", block_size=16, num_layers=30,
                  num_kv_heads=3, head_dim=64, tp_rank=0, tp_size=1, num_blocks=100, block_bytes=12288,
                  region_bytes=100 * 60 * 12288, base_address=0x1000, shm_name="ringserve-1-ab-kv0")  # fmt: skip
LOCAL = LocalKv("shm", (INFO.encode(),), 16)


def prefill_response(info: KvPeerInfo = INFO, num_tokens: int = 20, **handle: object) -> dpb.PrefillResponse:
    fields = {"engine_id": "e", "request_id": 1, "worker_infos": [info.encode()], "block_ids": [4, 5],
              "num_tokens": num_tokens, "block_size": 16, "tensor_parallel_size": 1, "backend": "shm",
              "expires_at_unix_nano": time.time_ns() + 10**10, **handle}  # fmt: skip
    return dpb.PrefillResponse(handle=dpb.KvHandle(**fields), prompt_token_ids=list(range(num_tokens)))


def test_a_matching_handle_passes() -> None:
    assert check_handle(LOCAL, prefill_response()) is None


def test_mismatches_are_named() -> None:
    problem = check_handle(LOCAL, prefill_response(replace(INFO, model_id="llama:other.gguf:9:float32")))
    assert problem is not None and "model" in problem and "other.gguf" in problem
    problem = check_handle(LOCAL, prefill_response(replace(INFO, dtype="bfloat16")))
    assert problem is not None and "KV dtype" in problem
    problem = check_handle(LOCAL, prefill_response(replace(INFO, num_kv_heads=6, head_dim=32)))
    assert problem is not None and "KV heads" in problem and "head dim" in problem
    problem = check_handle(LOCAL, prefill_response(block_size=32))
    assert problem is not None and "block sizes differ" in problem
    problem = check_handle(LOCAL, prefill_response(backend="nixl"))
    assert problem is not None and "backends differ" in problem


def test_different_tensor_parallel_sizes_are_refused_clearly() -> None:
    two = [replace(INFO, tp_size=2, tp_rank=r).encode() for r in range(2)]
    problem = check_handle(LOCAL, prefill_response(worker_infos=two, tensor_parallel_size=2))
    assert problem is not None and "prefill TP=2, decode TP=1" in problem


def test_inconsistent_or_expired_handles_are_refused() -> None:
    assert "do not match" in (check_handle(LOCAL, prefill_response(num_tokens=40)) or "")
    expired = prefill_response(expires_at_unix_nano=time.time_ns() - 1)
    assert "expired" in (check_handle(LOCAL, expired) or "")


def test_router_picks_the_least_outstanding_tokens() -> None:
    ups = [Upstream(f"h{i}:1", None, None, None, tokens) for i, tokens in enumerate((300, 20, 20))]  # type: ignore[arg-type]
    assert least_loaded(ups).address == "h1:1"  # ties: the first listed
    # A decode server whose last request found it unreachable is passed over while another one is reachable.
    ups[1].unreachable_at = time.monotonic()
    assert choose_decode(ups).address == "h2:1"
    ups[2].unreachable_at = time.monotonic()
    assert choose_decode(ups).address == "h0:1"
    ups[0].unreachable_at = time.monotonic()
    assert choose_decode(ups).address == "h1:1"  # none is reachable: the least loaded still gets the request
    ups[0].unreachable_at = time.monotonic() - 60  # long enough ago to be tried again
    assert choose_decode(ups).address == "h0:1"
    assert estimate_prompt_tokens(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))) == 3
    assert estimate_prompt_tokens(pb.GenerateRequest(text="x" * 400)) == 101


def test_router_sends_requests_that_start_alike_to_the_same_prefill_server() -> None:
    ups = [Upstream(f"h{i}:1", None, None, None, 0) for i in range(4)]  # type: ignore[arg-type]
    system = "You are a careful assistant for the harbour authority. " * 12  # > 512 characters shared
    prefixes = [prompt_prefix(pb.GenerateRequest(text=system + question), 512) for question in ("tides?", "ships?")]
    assert prefixes[0] == prefixes[1]
    chosen = {choose_prefill(ups, p, 8192)[0].address for p in prefixes}
    assert len(chosen) == 1
    # Different prefixes spread over the servers (rendezvous hashing), each one always to the same server.
    picks = [choose_prefill(ups, f"document {i} ".encode() * 40, 8192)[0].address for i in range(40)]
    assert len(set(picks)) == 4
    assert picks == [choose_prefill(ups, f"document {i} ".encode() * 40, 8192)[0].address for i in range(40)]
    # A prefix's server far busier than the least loaded one loses the request to it.
    preferred, reason = choose_prefill(ups, prefixes[0], 8192)
    assert reason == "prefix_affinity"
    preferred.outstanding_tokens = 10_000
    other, reason = choose_prefill(ups, prefixes[0], 8192)
    assert reason == "least_loaded" and other is not preferred and other.outstanding_tokens == 0
    # Token-id prompts and chat messages have prefixes too; an empty prompt has none.
    long_ids, short_ids = (pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(n)))) for n in (300, 200))
    assert prompt_prefix(long_ids, 512) == prompt_prefix(short_ids, 512)  # the first 128 ids
    chats = [pb.GenerateRequest(messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="system", content=system), pb.ChatMessage(role="user", content=q)]))
        for q in ("tides?", "ships?")]  # fmt: skip
    assert prompt_prefix(chats[0], 512) == prompt_prefix(chats[1], 512) != prompt_prefix(chats[0], 2048)
    assert choose_prefill(ups, b"", 8192)[1] == "least_loaded"
