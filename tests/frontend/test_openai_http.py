"""The OpenAI-compatible HTTP API over a scripted engine: bodies, SSE chunks, logprobs, errors and their statuses,
disconnects, the waiting queue, draining, API keys, the body size limit, traceparent and the `api` metrics label."""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trustme
from frontend_testkit import COMPLETION, CONTEXT_LENGTH, MODEL, ScriptedEngine, completion_chunks, until
from observed_engine import TimedEngine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ringserve.frontend.api.security import ServerSecurity, add_server_security_arguments
from ringserve.frontend.api.server import FrontendServer, build_server
from ringserve.frontend.observability.metrics import ServingMetrics
from ringserve.frontend.observability.tracing import RequestTracer, TracingSettings, span_limits
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Http:
    server: FrontendServer
    engine: ScriptedEngine
    client: httpx.AsyncClient
    metrics: ServingMetrics | None = None
    exporter: InMemorySpanExporter | None = None

    async def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return await self.client.post(path, json=body, **kw)

    async def events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """The SSE data of a streamed response, [DONE] as the string."""
        response = await self.post(path, {**body, "stream": True})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in response.text.split("\n\n") if line]
        assert data[-1] == "[DONE]"
        return [json.loads(item) for item in data[:-1]] + ["[DONE]"]


async def start_http(tokenizer: ModelTokenizer, engine: ScriptedEngine, security: ServerSecurity | None = None,
                     max_waiting_requests: int = 1024, observed: bool = False) -> Http:
    """A server with the HTTP API on a free port; `observed`: with metrics and in-memory tracing (the engine must
    then report engine times, as TimedEngine does)."""
    metrics = exporter = tracer = None
    if observed:
        exporter = InMemorySpanExporter()
        settings = TracingSettings(endpoint="memory", replica="test:1")
        provider = TracerProvider(span_limits=span_limits(settings, CONTEXT_LENGTH))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        metrics, tracer = ServingMetrics(MODEL), RequestTracer(provider, settings)
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=tokenizer.vocab_size)
    server = build_server(engine, tokenizer, info, port=0, metrics=metrics, security=security, tracer=tracer,
                          max_waiting_requests=max_waiting_requests)
    port = server.add_http("127.0.0.1", 0, security)
    await server.start()
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
    await until(lambda: server.serving)
    return Http(server, engine, client, metrics, exporter)


@pytest.fixture
async def http(tiny_tokenizer: ModelTokenizer) -> AsyncIterator[Http]:
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)))
    yield served
    await served.client.aclose()
    await served.server.stop(grace=None)


# -- bodies -----------------------------------------------------------------------------------------------------------


async def test_a_chat_completion_has_the_text_its_finish_reason_and_usage(http: Http) -> None:
    response = await http.post("/v1/chat/completions", {**CHAT, "model": MODEL, "max_tokens": 8})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": COMPLETION}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_tokens = len(http.engine.submitted[0][1])
    completion_tokens = sum(len(chunk) for chunk in http.engine.chunks)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + completion_tokens
    assert http.engine.submitted[0][2].max_tokens == 8


async def test_a_streamed_chat_sends_the_role_once_the_deltas_and_done(http: Http) -> None:
    events = await http.events("/v1/chat/completions", CHAT)
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and "usage" not in chunk for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:])
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == COMPLETION
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "length"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])


async def test_include_usage_adds_a_last_chunk_with_the_usage_and_null_before(http: Http) -> None:
    events = await http.events("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}})
    *chunks, usage_chunk, done = events
    assert all(chunk["usage"] is None for chunk in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == sum(
        len(chunk) for chunk in http.engine.chunks)
    assert done == "[DONE]"


async def test_completions_of_several_prompts_and_n_are_indexed_prompt_major(http: Http) -> None:
    body = {"prompt": ["hello", [104, 101]], "n": 2, "echo": True, "max_tokens": 5}
    response = await http.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    assert [choice["text"] for choice in choices] == ["hello" + COMPLETION] * 2 + ["he" + COMPLETION] * 2
    assert len(http.engine.submitted) == 4
    prompt_lengths = {len(ids) for _, ids, _ in http.engine.submitted}
    assert response.json()["usage"]["prompt_tokens"] == sum(prompt_lengths)  # each prompt once, not once per n
    events = await http.events("/v1/completions", body)
    texts: dict[int, str] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {index: choice["text"] for index, choice in enumerate(choices)}


async def test_chat_logprobs_list_each_token_with_its_top_alternatives(http: Http, tiny_tokenizer) -> None:
    response = await http.post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    ids = [token for chunk in http.engine.chunks for token in chunk]
    assert len(content) == len(ids)
    assert http.engine.submitted[0][2].sampling.num_logprobs == 2
    for entry, token_id in zip(content, ids, strict=True):
        assert entry["logprob"] == -0.5 and len(entry["top_logprobs"]) == 2
        assert bytes(entry["bytes"]) == tiny_tokenizer.decode([token_id], skip_special_tokens=False).encode() or \
            "\ufffd" in entry["token"]  # a token holding part of a character shows U+FFFD, its bytes are its own
    assert b"".join(bytes(entry["bytes"]) for entry in content).decode() == COMPLETION


async def test_completion_logprobs_have_tokens_offsets_and_top_dicts(http: Http) -> None:
    response = await http.post("/v1/completions", {"prompt": "hi", "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    ids = [token for chunk in http.engine.chunks for token in chunk]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(ids)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert all(token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))


async def test_sampling_fields_reach_the_engine(http: Http) -> None:
    body = {**CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3, "min_tokens": 2,
            "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3, "ignore_eos": True,
            "stop_token_ids": [5], "max_completion_tokens": 9, "max_tokens": 4, "user": "u1", "priority": 1}
    response = await http.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    params = http.engine.submitted[0][2]
    assert params.max_tokens == 9  # max_completion_tokens wins
    assert params.sampling.top_k == 7 and params.seed == 3 and params.ignore_eos and params.stop_token_ids == (5,)
    assert params.sampling.min_tokens == 2 and params.priority == 1
    assert params.sampling.temperature == pytest.approx(0.5) and params.sampling.top_p == pytest.approx(0.9)


async def test_stop_strings_end_the_text_with_finish_reason_stop(http: Http) -> None:
    response = await http.post("/v1/completions", {"prompt": "hi", "stop": " w"})
    choice = response.json()["choices"][0]
    assert choice["text"] == COMPLETION[:COMPLETION.index(" w")] and choice["finish_reason"] == "stop"


# -- errors -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "code"), [
    ({**CHAT, "temperature": -1.0}, "temperature", "invalid_value"),
    ({**CHAT, "temperature": "hot"}, "temperature", "invalid_value"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": 10**40}, "max_tokens", "invalid_value"),
    ({**CHAT, "n": 99}, "n", "invalid_value"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools", "unsupported_field"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format", "unsupported_field"),
    ({**CHAT, "temprature": 1.0}, "temprature", "unknown_field"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id",
     "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "unsupported_field"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    ({**CHAT, "stop": [1, 2]}, "stop", "invalid_value"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({}, "messages", "invalid_value"),
])  # fmt: skip
async def test_an_invalid_chat_field_is_a_400_naming_it(http: Http, body: dict, param: str | None,
                                                        code: str) -> None:
    response = await http.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    if param is not None:
        assert error["param"] == param and param in error["message"], error
    assert not http.engine.submitted


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"), ({"prompt": [10**6]}, "prompt[0]"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x" * 200}, "prompt"), ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"), ({"prompt": "hi", "suffix": "end"}, "suffix"),
])  # fmt: skip
async def test_an_invalid_completion_field_is_a_400_naming_it(http: Http, body: dict, param: str) -> None:
    response = await http.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"", b"\xff\xfe", b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}",
                                 b"[" * 100_000])
async def test_a_body_that_is_not_a_json_object_is_a_400(http: Http, raw: bytes) -> None:
    response = await http.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_an_unknown_model_is_a_404(http: Http) -> None:
    response = await http.post("/v1/chat/completions", {**CHAT, "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found" and response.json()["error"]["param"] == "model"
    assert (await http.client.get("/v1/models/gpt-9")).status_code == 404
    assert (await http.client.get("/v1/nothing")).json()["error"]["code"] == "not_found"


async def test_models_lists_the_served_model(http: Http) -> None:
    body = (await http.client.get("/v1/models")).json()
    assert body["object"] == "list" and [card["id"] for card in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == CONTEXT_LENGTH
    assert (await http.client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL


async def test_tokenize_and_detokenize_round_trip(http: Http, tiny_tokenizer: ModelTokenizer) -> None:
    tokens = (await http.post("/tokenize", {"prompt": "hello", "add_special_tokens": False})).json()
    assert tokens["tokens"] == tiny_tokenizer.encode("hello", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CONTEXT_LENGTH
    assert (await http.post("/detokenize", {"tokens": tokens["tokens"]})).json() == {"prompt": "hello"}
    chat = (await http.post("/tokenize", CHAT)).json()
    assert chat["tokens"] == tiny_tokenizer.encode_chat(CHAT["messages"])
    bad = await http.post("/detokenize", {"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


# -- the server's state -------------------------------------------------------------------------------------------


async def test_a_client_that_disconnects_mid_stream_aborts_its_request(tiny_tokenizer: ModelTokenizer) -> None:
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=2))
    try:
        async with served.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # the first chunk came; the engine now hangs: leave
        await asyncio.wait_for(served.engine.aborted_event.wait(), 10)
        assert served.engine.aborted == [served.engine.submitted[0][0]]
    finally:
        await served.client.aclose()
        await served.server.stop(grace=None)


async def test_a_non_streamed_request_is_aborted_when_its_client_leaves(tiny_tokenizer: ModelTokenizer) -> None:
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=1))
    try:
        pending = asyncio.create_task(served.post("/v1/completions", {"prompt": "hi"}))
        await asyncio.wait_for(served.engine.hanging.wait(), 10)
        pending.cancel()  # closes the connection
        await asyncio.wait_for(served.engine.aborted_event.wait(), 10)
    finally:
        await served.client.aclose()
        await served.server.stop(grace=None)


async def test_a_full_waiting_queue_is_a_429_and_draining_a_503(tiny_tokenizer: ModelTokenizer) -> None:
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=0),
                              max_waiting_requests=1)
    try:
        waiting = asyncio.create_task(served.post("/v1/completions", {"prompt": "hi"}))
        await asyncio.wait_for(served.engine.hanging.wait(), 10)
        refused = await served.post("/v1/completions", {"prompt": "hi"})
        assert refused.status_code == 429 and "waiting queue" in refused.json()["error"]["message"]
        stopping = asyncio.create_task(served.server.stop(grace=5.0))
        await until(lambda: served.server.stopping)
        draining = await served.post("/v1/chat/completions", CHAT)
        assert draining.status_code == 503 and "draining" in draining.json()["error"]["message"]
        assert (await served.client.get("/health")).status_code == 503
        cut = await waiting  # the grace period ends: the waiting request is cut with 503 saying why
        assert cut.status_code == 503 and "draining" in cut.json()["error"]["message"]
        await stopping
    finally:
        await served.client.aclose()
        await served.server.stop(grace=None)


async def test_api_keys_and_the_body_limit_apply(tiny_tokenizer: ModelTokenizer) -> None:
    security = ServerSecurity(api_keys=("k1",), max_message_bytes=4096)
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)), security)
    try:
        missing = await served.post("/v1/chat/completions", CHAT)
        assert missing.status_code == 401 and "Authorization" in missing.json()["error"]["message"]
        wrong = await served.client.get("/v1/models", headers={"authorization": "Bearer k2"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "invalid API key"
        ok = {"authorization": "Bearer k1"}
        assert (await served.post("/v1/chat/completions", CHAT, headers=ok)).status_code == 200
        assert (await served.client.get("/health")).status_code == 200  # open, like gRPC health
        huge = {"prompt": "x" * 5000}
        too_large = await served.post("/v1/completions", huge, headers=ok)
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    finally:
        await served.client.aclose()
        await served.server.stop(grace=None)


async def test_traceparent_joins_the_trace_and_metrics_count_the_api(tiny_tokenizer: ModelTokenizer) -> None:
    http = await start_http(tiny_tokenizer, TimedEngine(completion_chunks(tiny_tokenizer)), observed=True)
    assert http.metrics is not None and http.exporter is not None
    try:
        headers = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"}
        assert (await http.post("/v1/chat/completions", CHAT, headers=headers)).status_code == 200
        assert (await http.post("/v1/chat/completions", {**CHAT, "temperature": -1.0})).status_code == 400
        await asyncio.sleep(0.05)  # samples and spans are recorded on the loop just after the request
        spans = [s for s in http.exporter.get_finished_spans() if s.attributes.get("ringserve.api") == "openai"]
        assert len(spans) == 2
        joined = [s for s in spans if s.parent is not None and f"{s.parent.span_id:016x}" == "b7ad6b7169203331"]
        assert len(joined) == 1 and f"{joined[0].context.trace_id:032x}" == TRACE_ID
        registry = http.metrics.registry
        labels = {"model_name": MODEL, "api": "openai"}
        assert registry.get_sample_value("ringserve_request_success_total",
                                         {**labels, "finished_reason": "length"}) == 1
        assert registry.get_sample_value("ringserve_request_errors_total",
                                         {**labels, "code": "INVALID_ARGUMENT"}) == 1
    finally:
        await http.client.aclose()
        await http.server.stop(grace=None)


async def test_mutual_tls_settings_are_the_grpc_ports(tiny_tokenizer: ModelTokenizer, tmp_path) -> None:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    leaf, client_leaf = server_ca.issue_cert("127.0.0.1"), client_ca.issue_cert("client.example")
    files = {"ca.pem": server_ca.cert_pem.bytes(), "server.pem": leaf.private_key_and_cert_chain_pem.bytes(),
             "client-ca.pem": client_ca.cert_pem.bytes(),
             "client.pem": client_leaf.private_key_and_cert_chain_pem.bytes()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    flags = ["--tls-cert-file", str(tmp_path / "server.pem"), "--tls-key-file", str(tmp_path / "server.pem"),
             "--tls-client-ca-file", str(tmp_path / "client-ca.pem")]
    parser = argparse.ArgumentParser()
    add_server_security_arguments(parser)
    security = ServerSecurity.from_args(parser.parse_args(flags))
    served = await start_http(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)), security)
    url = str(served.client.base_url).replace("http://", "https://")
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        async with httpx.AsyncClient(verify=context, timeout=10) as stranger:
            with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
                await stranger.get(f"{url}/health")
        context.load_cert_chain(str(tmp_path / "client.pem"))
        async with httpx.AsyncClient(verify=context, timeout=10) as client:
            assert (await client.get(f"{url}/health")).status_code == 200
            reply = await client.post(f"{url}/v1/completions", json={"prompt": "hi"})
            assert reply.json()["choices"][0]["text"] == COMPLETION
    finally:
        await served.client.aclose()
        await served.server.stop(grace=None)


def test_the_http_port_flag_reads_its_variable_and_refuses_a_taken_port(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.frontend.launcher import add_serve_arguments, check_serve_arguments

    def parsed(*flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        return parser.parse_args(list(flags))

    assert parsed().http_port == 0  # off by default
    assert check_serve_arguments(parsed("--http-port", "8000")) is None
    assert "--http-port" in (check_serve_arguments(parsed("--http-port", "50051")) or "")  # the gRPC port
    assert "--http-port" in (check_serve_arguments(parsed("--http-port", "70000")) or "")
    monkeypatch.setenv("RINGSERVE_HTTP_PORT", "8001")
    assert parsed().http_port == 8001


async def test_null_fields_mean_their_defaults(http: Http) -> None:
    nulls = {name: None for name in ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                                     "stream_options", "logprobs", "top_logprobs", "user", "tools", "logit_bias",
                                     "response_format")}  # fmt: skip
    response = await http.post("/v1/chat/completions", {**CHAT, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == COMPLETION
