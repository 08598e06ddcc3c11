"""The one-call native decoder over quantized GGUF projections (`DecoderF32` / `DecoderBf16` with blocks): decode
steps bit-identical to the layer-by-layer path, which it replaces, a few rows or many (the kernel's weight panels).
Runs wherever the int8 kernel has its AVX2 path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from ringserve.workers.attention import torch_sdpa
from ringserve.workers.loader import load_model
from ringserve.workers.model import KVCache, LlamaForCausalLM, cpu_ops, quant_ops
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.model.native_decoder import NativeDecoder
from test_gguf_loader import tiny_hf, write_gguf
from test_native_decoder import count_native_calls
from workers_testkit import assert_same_bits, forward_packed

pytestmark = pytest.mark.skipif(cpu_ops.native_decoder_module(quantized=True) is None,
                                reason="needs the built kernels and the int8 kernel's AVX2 path")  # fmt: skip

BLOCK = 4
PROMPTS = [[5, 9, 200, 3, 17, 8], [250, 1, 2], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
TABLES = [[3, 4, 5, 6, 7], [10, 11, 12], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    """A tiny llama whose projections are Q4_1, Q8_0 and Q4_0 blocks (one fused matrix holds one type)."""
    path = tmp_path_factory.mktemp("quantized") / "q.gguf"
    kinds = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
             "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}  # fmt: skip
    types = {f"blk.{i}.{kind}.weight": t for i in range(2) for kind, t in kinds.items()}
    types["token_embd.weight"] = Q.Q8_0
    write_gguf(path, tiny_hf(tie_word_embeddings=True), types=types)
    return path


def quantized_model(path: Path, dtype: torch.dtype, native: bool, blocks: int = 32) -> tuple[LlamaForCausalLM, KVCache]:
    model = apply_fast_paths(load_model(path, dtype, quantization="gguf"))
    model.native_decode = native
    cache = KVCache.allocate(model.config, blocks, BLOCK, dtype, "cpu")
    model.bind_kv_cache(cache, torch_sdpa.TorchSdpaBackend())
    return model, cache


def decode_run(path: Path, dtype: torch.dtype, native: bool, steps: int) -> tuple[list[list[torch.Tensor]], KVCache]:
    """The prompts as one step, then `steps` decode steps of all three sequences (greedy)."""
    model, cache = quantized_model(path, dtype, native)
    logits = [forward_packed(model, [(p, 0, t) for p, t in zip(PROMPTS, TABLES, strict=True)], BLOCK)]
    tokens = [int(rows[-1].argmax()) for rows in logits[0]]
    for k in range(steps):  # sequences 1 and 2 cross block boundaries on the way
        chunks = [([tokens[i]], len(p) + k, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))]
        rows = forward_packed(model, chunks, BLOCK)
        logits.append(rows)
        tokens = [int(r[-1].argmax()) for r in rows]
    return logits, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_quantized_decode_steps_give_the_same_bits_as_the_layer_by_layer_path(gguf_path, dtype, monkeypatch):
    calls = count_native_calls(monkeypatch)
    plain_logits, plain_cache = decode_run(gguf_path, dtype, native=False, steps=5)
    assert calls[0] == 0
    native_logits, native_cache = decode_run(gguf_path, dtype, native=True, steps=5)
    assert calls[0] == 5  # the decode steps; the prompts' chunks keep SDPA, layer by layer, on both paths
    assert_same_bits(plain_logits, plain_cache, native_logits, native_cache)


def test_steps_of_many_rows_take_the_native_decoder_with_the_same_bits(gguf_path, monkeypatch):
    """40 sequences, one token each, then a decode step of all 40: rows enough for the kernel's weight panels, the
    Q8_0 O projection's among them."""
    calls = count_native_calls(monkeypatch)
    runs = []
    for native in (False, True):
        model, cache = quantized_model(gguf_path, torch.float32, native, blocks=40)
        steps = [forward_packed(model, [([3 + i], 0, [i]) for i in range(40)], BLOCK)]
        tokens = [int(rows[-1].argmax()) for rows in steps[0]]
        steps.append(forward_packed(model, [([t], 1, [i]) for i, t in enumerate(tokens)], BLOCK))
        runs += [steps, cache]
        assert calls[0] == (2 if native else 0)
    assert_same_bits(*runs)


def test_a_model_mixing_dense_and_quantized_projections_keeps_the_layer_by_layer_path(gguf_path):
    model, _ = quantized_model(gguf_path, torch.float32, native=True)
    assert NativeDecoder.supports(model)
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.__class__ = cpu_ops.Linear  # a dense O projection in one layer
    o_proj.weight = torch.nn.Parameter(quant_ops.dequantize(o_proj.qweight), requires_grad=False)
    assert not NativeDecoder.supports(model)
