"""The walking skeleton end to end: gRPC frontend -> request ring -> C++ engine -> worker -> back, on the real model."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import grpc
import pytest
import torch
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, start_server

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


def greedy_request(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


def collect(stub, request: pb.GenerateRequest, timeout: float = 300.0) -> tuple[list[int], str, list]:
    responses = list(stub.Generate(request, timeout=timeout))
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text for r in responses), responses


def transformers_greedy(prompt_ids: list[int], n: int, model) -> list[int]:
    """Greedy decoding with transformers' own llama on the same GGUF (full recompute: no cache API to depend on)."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def hf_model(model_path: Path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    return model.eval(), tokenizer


def test_greedy_float32_output_equals_transformers(server: RunningServer, model_path: Path, hf_model) -> None:
    model, tokenizer = hf_model
    stub = server.stub()
    for prompt in PROMPTS:
        ids, text, responses = collect(stub, greedy_request(prompt, 32))
        prompt_ids = tokenizer(prompt).input_ids
        expected = transformers_greedy(prompt_ids, 32, model)
        assert ids == expected, f"prompt {prompt!r}: ringserve {ids} != transformers {expected}"
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(prompt_ids)
        assert last.usage.completion_tokens == 32


def test_sixteen_concurrent_streams_equal_their_solo_runs(server: RunningServer) -> None:
    stub = server.stub()
    requests = [greedy_request(f"{PROMPTS[i % 3]} {'and ' * (i % 5)}", 8 + 3 * i) for i in range(16)]
    solo = [collect(stub, r)[0] for r in requests]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda r: collect(stub, r)[0], requests))
    for i, (alone, batched) in enumerate(zip(solo, together, strict=True)):
        assert len(batched) == 8 + 3 * i
        assert batched == alone, f"stream {i} differs when batched"


def engine_stats(stub) -> pb.EngineStats:
    return stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)


def wait_all_blocks_free(stub, timeout_s: float = 10.0) -> pb.EngineStats:
    deadline = time.monotonic() + timeout_s
    stats = engine_stats(stub)
    while time.monotonic() < deadline:
        stats = engine_stats(stub)
        if stats.free_kv_blocks == stats.total_kv_blocks and stats.num_running == 0 and stats.num_waiting == 0:
            break
        time.sleep(0.05)
    return stats


def test_completed_and_cancelled_requests_leave_every_block_free(server: RunningServer) -> None:
    stub = server.stub()
    cancelled = []
    for i in range(4):
        call = stub.Generate(greedy_request(PROMPTS[i % 3], 400))
        next(call)  # the request is running and holds blocks
        cancelled.append(call)
    mid = engine_stats(stub)
    assert mid.free_kv_blocks < mid.total_kv_blocks
    for call in cancelled:
        call.cancel()
    for i in range(3):
        collect(stub, greedy_request(PROMPTS[i], 10))
    stats = wait_all_blocks_free(stub)
    assert stats.free_kv_blocks == stats.total_kv_blocks, stats
    assert (stats.num_running, stats.num_waiting) == (0, 0), stats


def test_cancelled_stream_frees_its_blocks(server: RunningServer) -> None:
    stub = server.stub()
    call = stub.Generate(greedy_request(PROMPTS[2], 1000))
    for _ in range(3):
        next(call)
    assert engine_stats(stub).free_kv_blocks < engine_stats(stub).total_kv_blocks
    call.cancel()
    stats = wait_all_blocks_free(stub, timeout_s=5.0)
    assert stats.free_kv_blocks == stats.total_kv_blocks


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"sampling": pb.SamplingParams(max_tokens=4)}, "input"),
        ({"text": "hi", "token_ids": pb.TokenIds(ids=[1, 2]), "sampling": pb.SamplingParams(max_tokens=4)}, "input"),
        ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=-1)}, "max_tokens"),
        ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=4, top_p=1.5)}, "top_p"),
        ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=4, top_p=0.0)}, "top_p"),
    ],
    ids=["no-input", "two-inputs", "negative-max-tokens", "top-p-above-one", "top-p-zero"],
)
def test_bad_input_is_invalid_argument_naming_the_field(server: RunningServer, request_kwargs, field: str) -> None:
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, pb.GenerateRequest(**request_kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ids, _, _ = collect(stub, greedy_request("Still serving?", 4))  # the server keeps serving
    assert len(ids) == 4


def test_chat_messages_and_sampling_with_seed_are_reproducible(server: RunningServer) -> None:
    stub = server.stub()
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Why is the sky blue?")])
    params = pb.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=1234)
    first = collect(stub, pb.GenerateRequest(messages=msgs, sampling=params))
    second = collect(stub, pb.GenerateRequest(messages=msgs, sampling=params))
    assert first[0] == second[0] and len(first[0]) > 0
    assert first[2][-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)


def layer_by_layer_greedy(model_path: Path, dtype: torch.dtype, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of the workers' code run in this process (ModelRunner, no engine or rings), every step through
    the layer-by-layer Python path (no one-call native decode)."""
    import numpy as np
    from ringserve.workers.loader import load_model
    from ringserve.workers.model_runner import ModelRunner, NewRequest, StepPlan

    model = load_model(model_path, dtype)
    model.native_decode = False
    runner = ModelRunner(model, block_size=16, num_kv_blocks=16)
    one = np.zeros(1, np.int32)
    prompt = np.asarray(prompt_ids, np.int32)
    request = NewRequest(0, prompt, np.arange(16, dtype=np.int32), num_prompt_tokens=len(prompt), temperature=0.0)
    out = runner.execute(StepPlan(0, new_requests=[request], sched_slots=one, sched_start=one,
                                  sched_len=np.array([len(prompt)], np.int32), sched_sample=np.ones(1, bool)))
    ids = [int(out.token_ids[0])]
    for k in range(1, n):
        out = runner.execute(StepPlan(k, sched_slots=one, sched_start=np.array([len(prompt) + k - 1], np.int32),
                                      sched_len=np.ones(1, np.int32), sched_sample=np.ones(1, bool)))  # fmt: skip
        ids.append(int(out.token_ids[0]))
    return ids


def test_default_dtype_is_bf16_on_avx512_bf16_cpus_and_decodes_as_the_workers_do(
    model_path: Path, hf_model, tmp_path: Path
) -> None:
    from ringserve.backend.engine_process import native_bf16_cpu
    from ringserve.workers.model import cpu_ops

    if cpu_ops.native_decoder_module() is None:
        pytest.skip("this CPU has no AVX-512: the workers' native bf16 kernels do not run here")
    # AVX512-BF16: auto picks bf16. Other AVX-512 CPUs run the same native decoder (FMA projections), asked for.
    dtype = "auto" if native_bf16_cpu() else "bfloat16"
    _, tokenizer = hf_model
    with start_server(model_path, tmp_path, "--dtype", dtype, "--num-kv-blocks", "64") as srv:
        stub = srv.stub()
        assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).dtype == "bfloat16"
        for prompt in PROMPTS[:2]:
            ids, _, _ = collect(stub, greedy_request(prompt, 24))
            # The server's decode steps run through the native one-call decoder in its worker process.
            assert ids == layer_by_layer_greedy(model_path, torch.bfloat16, tokenizer(prompt).input_ids, 24), prompt
        assert srv.stop() == 0
