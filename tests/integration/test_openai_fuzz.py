"""Property: whatever body a client posts to the OpenAI-compatible endpoints (malformed JSON, wrong types, huge or
non-finite numbers, deep nesting, unknown and unsupported fields), the real server answers 200 or a 4xx with an
OpenAI error body, never a 5xx; afterwards it still serves.

Two runs of the same strategies: one derandomized (the same bodies every run) and one from a fresh seed, printed
with any failure (set RINGSERVE_FUZZ_SEED to replay it), so CI keeps exploring new inputs.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from server_harness import free_port, start_server

FRESH_SEED = int(os.environ.get("RINGSERVE_FUZZ_SEED") or secrets.randbits(32))
SERVED = "served"
ANSWERS = {200, 400, 404, 413, 429}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def client(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    port = free_port()
    srv = start_server(model_path, tmp_path_factory.mktemp("openai-fuzz"), "--served-model-name", SERVED,
                       "--http-port", str(port), "--num-kv-blocks", "128", "--max-num-seqs", "8",
                       "--worker-threads", "1")  # fmt: skip
    with srv, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        yield http
        assert srv.stop() == 0, srv.log()


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**20, max_value=10**400),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))  # fmt: skip
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip
SHARED_KEYS = ["model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
               "frequency_penalty", "stream", "stream_options", "user", "top_k", "min_p", "repetition_penalty",
               "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "priority", "cache_salt",
               "tools", "response_format", "logit_bias", "bogus"]  # fmt: skip
CHAT_KEYS = [*SHARED_KEYS, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt"]
COMPLETION_KEYS = [*SHARED_KEYS, "prompt", "logprobs", "echo", "suffix", "best_of"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.one_of(st.text(max_size=20), json_value)})  # fmt: skip
prompt = st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60_000), max_size=6),
                   st.lists(st.text(max_size=10), max_size=3), json_value)  # fmt: skip


@st.composite
def request_body(draw: st.DrawFn, chat: bool) -> bytes:
    kind = draw(st.sampled_from(["request", "request", "request", "any json", "deep", "long int", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        return (draw(st.sampled_from(["[", '{"a":'])) * draw(st.integers(30, 200_000))).encode()
    if kind == "long int":
        return b'{"prompt": "hi", "messages": [], "seed": ' + b"7" * draw(st.integers(4000, 20_000)) + b"}"
    if kind == "any json":
        return json.dumps(draw(json_value)).encode()
    body: dict[str, Any] = {"max_tokens": 1}
    body.update(draw(st.dictionaries(st.sampled_from(CHAT_KEYS if chat else COMPLETION_KEYS), json_value,
                                     max_size=5)))  # fmt: skip
    if chat and draw(st.booleans()):
        body["messages"] = draw(st.lists(message, max_size=3))
    if not chat and draw(st.booleans()):
        body["prompt"] = draw(prompt)
    for key in ("max_tokens", "max_completion_tokens"):  # a valid request stays short
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], 2)
    return json.dumps(body).encode()


def check(http: httpx.Client, path: str, body: bytes) -> None:
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    where = f"POST {path} {body[:200]!r} -> {response.status_code} {response.text[:300]} (fresh seed {FRESH_SEED})"
    assert response.status_code in ANSWERS, where
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), where
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and "internal error" not in response.text, where


def still_serves(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip
FRESH = settings(FUZZ, max_examples=100, derandomize=False)


def test_chat_bodies_get_a_clear_answer(client: httpx.Client) -> None:
    @FUZZ
    @given(body=request_body(chat=True))
    def run(body: bytes) -> None:
        check(client, "/v1/chat/completions", body)

    run()
    still_serves(client)


def test_completion_bodies_get_a_clear_answer(client: httpx.Client) -> None:
    @FUZZ
    @given(body=request_body(chat=False))
    def run(body: bytes) -> None:
        check(client, "/v1/completions", body)

    run()
    still_serves(client)


def test_bodies_from_a_fresh_seed(client: httpx.Client) -> None:
    @FRESH
    @seed(FRESH_SEED)
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]),
           body=st.one_of(request_body(chat=True), request_body(chat=False)))
    def run(path: str, body: bytes) -> None:
        check(client, path, body)

    run()
    still_serves(client)
