"""The native decoder (csrc/kernels/cpu_decoder.h) for decode steps and steps with prefill chunks: bit-identical to
the layer-by-layer path, used only where it applies, and refusing bad indices with a ValueError before it writes
anything.

The tiny models' head size (16) is off the chunk kernel's AVX-512 tiles, where chunks normally go to SDPA; these tests
send them to the native kernels anyway (its portable loops: the same kernel on both paths is what bit-identity is
about) and lower NATIVE_MAX_CHUNK to LONGEST so that a chunk past it fits the tiny caches."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope, torch_sdpa
from ringserve.workers.attention import metadata as metadata_module
from ringserve.workers.loader import load_hf_model, load_model
from ringserve.workers.model import KVCache, LlamaForCausalLM, cpu_ops, native_decoder
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.model.native_decoder import NativeDecoder
from ringserve.workers.model_runner import ModelRunner
from ringserve.workers.parallel import TensorParallelShard, apply_tensor_parallel
from workers_testkit import NewRequest, assert_same_bits, forward_packed, ids, plan, save_tiny_hf_model

pytestmark = pytest.mark.skipif(cpu_ops.native_decoder_module() is None,
                                reason="needs the built kernels and AVX-512")  # fmt: skip

BLOCK = 4
LONGEST = 64  # the longest chunk the native kernels take in these tests


@pytest.fixture(autouse=True)
def native_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (native_decoder, torch_sdpa):
        monkeypatch.setattr(module, "native_chunk_attention", lambda head_dim: True)
    monkeypatch.setattr(metadata_module, "NATIVE_MAX_CHUNK", LONGEST)


@pytest.fixture(scope="module", params=["llama", "qwen2_attention_bias", "llama_one_kv_head"])
def folder(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_model(request.param, path)
    return path


def bf16_model(folder: Path, native: bool) -> tuple[LlamaForCausalLM, KVCache]:
    model = apply_fast_paths(load_hf_model(folder, torch.bfloat16))
    model.native_decode = native
    cache = KVCache.allocate(model.config, 40, BLOCK, torch.bfloat16, "cpu")
    model.bind_kv_cache(cache, torch_sdpa.TorchSdpaBackend())
    return model, cache


def count_native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = NativeDecoder.decode

    def counted(self: NativeDecoder, *args: object) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeDecoder, "decode", counted)
    return calls


def test_decode_steps_give_the_same_bits_as_the_layer_by_layer_path(folder, monkeypatch):
    calls = count_native_calls(monkeypatch)
    prompts = [[5, 9, 200, 3, 17, 8], [250, 1, 2], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
    tables = [[3, 4, 5, 6, 7], [10, 11, 12], [20, 21, 22, 23, 24]]
    runs = {}
    for native in (False, True):
        model, cache = bf16_model(folder, native)
        steps = [forward_packed(model, [(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BLOCK)]
        tokens = [[int(rows[-1].argmax())] for rows in steps[0]]
        for k in range(6):  # sequences 1 and 2 cross block boundaries on the way
            chunks = [([tokens[i][-1]], len(p) + k, t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
            logits = forward_packed(model, chunks, BLOCK)
            steps.append(logits)
            for i, rows in enumerate(logits):
                tokens[i].append(int(rows[-1].argmax()))
        runs[native] = (steps, tokens, cache)
    assert calls[0] == 7  # every step: the prompts are short chunks
    assert runs[True][1] == runs[False][1]
    assert_same_bits(runs[False][0], runs[False][2], runs[True][0], runs[True][2])


def test_short_chunks_beside_decodes_give_the_same_bits_as_the_layer_by_layer_path(folder, monkeypatch):
    # A prompt longer than LONGEST (SDPA, layer by layer, either way), then steps mixing decode rows with chunks deep
    # into a cached context, which the native decoder takes whole.
    calls = count_native_calls(monkeypatch)
    long_prompt = [(7 * i) % 250 + 1 for i in range(LONGEST + 3)]
    tables = [list(range(0, 20)), list(range(20, 40))]
    runs = {}
    for native in (False, True):
        model, cache = bf16_model(folder, native)
        steps = [forward_packed(model, [(long_prompt, 0, tables[0])], BLOCK)]
        done = len(long_prompt)
        steps.append(forward_packed(model, [([3], done, tables[0]), ([4, 5, 6], 0, tables[1])], BLOCK))
        steps.append(forward_packed(model, [([9, 8, 7, 6, 5], done + 1, tables[0]), ([2], 3, tables[1])], BLOCK))
        runs[native] = (steps, cache)
    assert calls[0] == 2
    assert_same_bits(*runs[False], *runs[True])


def test_long_chunks_and_float32_models_keep_the_layer_by_layer_path(folder, monkeypatch):
    calls = count_native_calls(monkeypatch)
    model, _ = bf16_model(folder, True)
    longest = LONGEST
    forward_packed(model, [(list(range(1, longest + 2)), 0, list(range(17))), ([4, 4], 0, [18])], BLOCK)
    assert calls[0] == 0
    forward_packed(model, [(list(range(1, longest + 1)), 0, list(range(19, 35)))], BLOCK)  # exactly the limit
    assert calls[0] == 1
    f32 = apply_fast_paths(load_hf_model(folder, torch.float32))
    f32.bind_kv_cache(KVCache.allocate(f32.config, 8, BLOCK, torch.float32, "cpu"), torch_sdpa.TorchSdpaBackend())
    forward_packed(f32, [([5, 9], 0, [1])], BLOCK)
    forward_packed(f32, [([3], 2, [1])], BLOCK)
    assert calls[0] == 1 and f32.native_decoder() is None


def test_tensor_parallel_hooks_keep_the_layer_by_layer_path(folder):
    model, _ = bf16_model(folder, True)
    assert NativeDecoder.supports(model)
    # Rank 0 of two: the row-parallel projections all-reduce their outputs in forward hooks.
    apply_tensor_parallel(model, TensorParallelShard(0, 2, model.config))
    assert not NativeDecoder.supports(model)


def test_an_out_of_range_slot_is_a_value_error_and_nothing_is_written(folder):
    model, cache = bf16_model(folder, True)
    forward_packed(model, [([5, 9, 200], 0, [1])], BLOCK)
    before = [t.clone() for t in cache.k + cache.v]
    metadata = AttentionMetadata.build([1], [4], [[1]], BLOCK, None)
    metadata.slot_mapping = torch.tensor([cache.num_blocks * BLOCK], dtype=torch.int64)
    with attention_metadata_scope(metadata), torch.inference_mode(), pytest.raises(ValueError, match="slot"):
        model(torch.tensor([7]), torch.tensor([3]))
    for a, b in zip(before, cache.k + cache.v, strict=True):
        assert torch.equal(a, b)
    metadata = AttentionMetadata.build([1], [4], [[1]], BLOCK, None)  # the model still decodes afterwards
    with attention_metadata_scope(metadata), torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([7]), torch.tensor([3]))).all()


@pytest.mark.skipif(not os.environ.get("RINGSERVE_TEST_GGUF"), reason="set RINGSERVE_TEST_GGUF to a llama .gguf")
def test_embedded_model_batch_decodes_the_same_tokens_either_way(monkeypatch):
    calls = count_native_calls(monkeypatch)
    path = Path(os.environ["RINGSERVE_TEST_GGUF"])
    prompts = [[1, 504, 3458, 282], [9707, 28, 905], [2, 4, 8, 16, 32, 64, 128]]
    outputs = {}
    for native in (False, True):
        model = load_model(path, torch.bfloat16)
        model.native_decode = native
        runner = ModelRunner(model, block_size=16, num_kv_blocks=16)
        requests = [NewRequest(i, ids(*p), ids(i), temperature=0.0) for i, p in enumerate(prompts)]
        out = runner.execute(plan(0, [(i, 0, len(p), True) for i, p in enumerate(prompts)], new_requests=requests))
        tokens = [[int(t)] for t in out.token_ids]
        for k in range(8):
            out = runner.execute(plan(k + 1, [(i, len(p) + k, 1, True) for i, p in enumerate(prompts)]))
            for i, t in enumerate(out.token_ids):
                tokens[i].append(int(t))
        outputs[native] = (tokens, np.asarray(out.logprobs))
    assert calls[0] == 9  # the prompts (short chunks) and 8 decode steps
    assert outputs[True][0] == outputs[False][0]
    assert np.array_equal(outputs[True][1], outputs[False][1])
