"""The OpenAI-compatible HTTP API of a real server, through the real `openai` client and raw HTTP: chat and text
completions (streamed and not, n, logprobs), models, errors with their classes and statuses, the KV blocks of a
client that leaves mid-stream, and greedy output equal to ringserve.v1's for the same prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, free_port, start_server

API_KEY = "test-key"
SERVED = "smol"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.timeout(600)


@dataclass
class HttpServer:
    grpc: RunningServer
    url: str

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def post(self, path: str, body: object = None, **kw: object) -> httpx.Response:
        headers = {"authorization": f"Bearer {API_KEY}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60, **kw)  # type: ignore[arg-type]

    def ringserve_text(self, request: pb.GenerateRequest) -> str:
        request.model = SERVED
        return "".join(r.text for r in self.grpc.stub().Generate(request, metadata=AUTH, timeout=60))

    def idle_stats(self, timeout_s: float = 30.0) -> pb.EngineStats:
        """Engine stats once nothing runs or waits (the engine frees an aborted request's blocks on its next step)."""
        stub = self.grpc.stub()
        deadline = time.monotonic() + timeout_s
        while True:
            stats = stub.GetEngineStats(pb.EngineStatsRequest(), metadata=AUTH, timeout=10)
            if stats.num_running == stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
                return stats
            assert time.monotonic() < deadline, f"not idle: {stats}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def http_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    port = free_port()
    srv = start_server(model_path, tmp_path_factory.mktemp("openai"), "--served-model-name", SERVED,
                       "--http-port", str(port), "--api-key", API_KEY, "--max-message-size-mib", "1",
                       "--num-kv-blocks", "128", "--max-num-seqs", "8", "--worker-threads", "1")  # fmt: skip
    with srv:
        yield HttpServer(srv, f"http://127.0.0.1:{port}")
        assert srv.stop() == 0, srv.log()


def test_greedy_chat_equals_ringserve_generate(http_server: HttpServer) -> None:
    reply = http_server.client().chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=16,
                                                         temperature=0)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage is not None
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=16, temperature=0))
    request.messages.messages.add(role="user", content=QUESTION[0]["content"])
    assert choice.message.content == http_server.ringserve_text(request)
    assert reply.usage.completion_tokens <= 16 and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + reply.usage.completion_tokens)


def test_greedy_completion_equals_ringserve_generate_streamed_or_not(http_server: HttpServer) -> None:
    client = http_server.client()
    prompt = "The capital of France is"
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12, temperature=0)
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=12, temperature=0, stream=True) if chunk.choices]
    expected = http_server.ringserve_text(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(
        max_tokens=12, temperature=0)))  # fmt: skip
    assert whole.choices[0].text == "".join(pieces) == expected
    assert whole.usage is not None and whole.usage.completion_tokens <= 12


def test_a_streamed_chat_with_usage_and_n(http_server: HttpServer) -> None:
    stream = http_server.client().chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=8, n=2, seed=7, temperature=0.8, stream=True,
        stream_options={"include_usage": True})  # type: ignore[arg-type]
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert set(finish) == {0, 1} and all(texts.values())
    assert usage is not None and 2 <= usage.completion_tokens <= 16


def test_logprobs_through_the_client(http_server: HttpServer) -> None:
    client = http_server.client()
    reply = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)  # type: ignore[arg-type]
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
    completion = client.completions.create(model=SERVED, prompt="Paris is", max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 4 and len(logprobs.top_logprobs or []) == 4


def test_models_list_names_the_served_model(http_server: HttpServer) -> None:
    assert [model.id for model in http_server.client().models.list()] == [SERVED]


def test_errors_raise_the_clients_error_classes(http_server: HttpServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        http_server.client(api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        http_server.client().chat.completions.create(model="gpt-4", messages=QUESTION)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        http_server.client().chat.completions.create(model=SERVED, messages=QUESTION,  # type: ignore[arg-type]
                                                     temperature=-1)
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        http_server.client().chat.completions.create(model=SERVED, messages=QUESTION,  # type: ignore[arg-type]
                                                     tools=[{"type": "function", "function": {"name": "f"}}])


def test_error_paths_over_raw_http(http_server: HttpServer) -> None:
    too_large = http_server.post("/v1/completions", {"model": SERVED, "prompt": "x" * (2 << 20)})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    malformed = http_server.post("/v1/completions", content=b'{"prompt": ')
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    missing_key = httpx.post(f"{http_server.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert missing_key.status_code == 401
    long_prompt = http_server.post("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1})
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{http_server.url}/health", timeout=10).status_code == 200
    tokens = http_server.post("/tokenize", {"model": SERVED, "prompt": "Hello world"}).json()["tokens"]
    assert http_server.post("/detokenize", {"tokens": tokens}).json()["prompt"].endswith("Hello world")


def test_a_client_leaving_mid_stream_frees_its_kv_blocks(http_server: HttpServer) -> None:
    before = http_server.idle_stats()
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{http_server.url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {API_KEY}"}) as response:  # fmt: skip
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                mid = http_server.grpc.stub().GetEngineStats(pb.EngineStatsRequest(), metadata=AUTH, timeout=10)
                assert mid.free_kv_blocks < mid.total_kv_blocks  # the request holds blocks while it runs
                break
    after = http_server.idle_stats()
    assert after.free_kv_blocks == before.free_kv_blocks
    assert after.num_steps - mid.num_steps < 1500  # it was aborted, not run to its 1500 tokens
