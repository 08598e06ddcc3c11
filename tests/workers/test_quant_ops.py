"""Quantized GGUF weights on the CPU (workers/model/quant_ops.py): the native int8 kernel against gguf's own
dequantization for every block type, tail and thread split; the loader and fast paths around it; and, when
RINGSERVE_TEST_GGUF names the embedded model, greedy tokens and perplexity against the float32 dequantized path."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from ringserve.formats.engine_args import EngineArgs
from ringserve.workers.loader import load_model
from ringserve.workers.model import cpu_ops, quant_ops
from ringserve.workers.model.fast_paths import FusedAttention, apply_fast_paths
from test_gguf_loader import k_quant_bytes, tiny_hf, write_gguf
from workers_testkit import bind_cache, forward_packed

pytestmark = pytest.mark.skipif(cpu_ops._MODULE is None, reason="the native kernels are not built")
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
BLOCK = 4


def random_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q6_K):  # gguf-py cannot quantize k-quants: random blocks with finite scales
        return k_quant_bytes(rows, cols, qtype, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quants.quantize(w, qtype)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quantized_inputs(x: np.ndarray) -> np.ndarray:
    """The kernel's int8 inputs, dequantized: per 32 values, scale = amax / 127 and q = rint(x / scale) in float32."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0).astype(np.float32)
    return (np.rint(blocks * inverse) * d.astype(np.float64)).reshape(x.shape)


def check_product(qtype: Q, m: int, n: int, k: int, threads: int = 1, dtype: torch.dtype = torch.float32,
                  portable: bool = False) -> None:  # fmt: skip
    """The int8 kernel's product against float64 references."""
    raw = random_blocks(n, k, qtype, seed=m * 31 + n + k)
    weight = quant_ops.from_gguf(raw, qtype, n, k)
    w = quants.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    residual = torch.randn(m, n, generator=gen).to(dtype)
    with torch_threads(threads):
        y = quant_ops.linear(x, weight, bias, residual, force_portable=portable).double().numpy()
    xd = x.double().numpy()
    extra = bias.double().numpy() + residual.double().numpy()
    magnitude = np.abs(xd) @ np.abs(w).T + np.abs(extra)
    rel = 2e-5 if dtype is torch.float32 else 8e-3
    # Tight: the same int8 inputs in float64, so only float32 sums (and bf16 outputs) differ.
    exact = quantized_inputs(xd) @ w.T + extra
    np.testing.assert_array_less(np.abs(y - exact), rel * magnitude + 1e-6)
    # Against the float inputs: within half an int8 step of each block's scale times the weights' magnitudes.
    amax = np.abs(xd).reshape(m, -1, 32).max(-1)
    bound = (amax / 127 * 0.5) @ np.abs(w).reshape(n, -1, 32).sum(-1).T
    np.testing.assert_array_less(np.abs(y - (xd @ w.T + extra)), 1.001 * bound + rel * magnitude + 1e-6)


@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_block_type_matches_gguf_dequantize_and_matmul(qtype, portable):
    if not portable and not quant_ops.available():
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    k = 256 if qtype in (Q.Q4_K, Q.Q6_K) else 96  # 96: not a multiple of 256, where the block type allows
    for m in (1, 2, 3, 5, 64):
        check_product(qtype, m, 37, k, portable=portable)
    check_product(qtype, 3, 19, 2 * k, dtype=torch.bfloat16, portable=portable)
    for threads in (2, 3, 4):
        check_product(qtype, 5, 61, k, threads=threads, portable=portable)


@pytest.mark.parametrize("portable", [False, True], ids=["fastest", "portable"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_gives_gguf_values_bit_for_bit(qtype, portable):
    if not portable and not quant_ops.available():
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    for n, k, threads in ((37, 96, 1), (5, 512, 2), (61, 96, 3)):
        k = max(k, 256) if qtype in (Q.Q4_K, Q.Q6_K) else k
        raw = random_blocks(n, k, qtype, seed=n + k)
        with torch_threads(threads):
            got = quant_ops.dequantize(quant_ops.from_gguf(raw, qtype, n, k), force_portable=portable)
        np.testing.assert_array_equal(got.numpy(), quants.dequantize(raw, qtype).reshape(n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_rows_take_the_int8_panels(qtype):
    k = 256 if qtype in (Q.Q4_K, Q.Q6_K) else 96
    for m in (32, 33, 34, 71):  # 8-row weight panels (from 32 rows), every tail of 4-row input tiles
        check_product(qtype, m, 45, k)
    check_product(qtype, 35, 37, 2 * k, dtype=torch.bfloat16)
    for threads in (2, 3):
        check_product(qtype, 33, 61, k, threads=threads)


@pytest.mark.skipif(not quant_ops.available(), reason="the panels are read by the AVX2 path only")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_panels_laid_out_at_load_give_the_same_bits_and_follow_fusing(qtype):
    k = 256 if qtype in (Q.Q4_K, Q.Q6_K) else 96
    parts = [quant_ops.from_gguf(random_blocks(n, k, qtype, seed=n), qtype, n, k) for n in (16, 24, 13)]
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    for weight in parts:
        packed = weight.with_panels()
        assert weight.panels is None and packed.panels is not None and packed.panels.shape[0] == weight.rows // 8
        assert torch.equal(quant_ops.linear(x, packed), quant_ops.linear(x, weight))
        assert torch.equal(quant_ops.linear(x[:3], packed), quant_ops.linear(x[:3], weight))  # tiles: no panels

    def fresh(weight: quant_ops.QuantizedWeight) -> torch.Tensor:
        return quant_ops.QuantizedWeight(weight.kind, weight.data.clone(), weight.cols).with_panels().panels

    # Fusing whole panels concatenates them; a part that ends in a partial panel makes the whole be laid out again.
    fused = quant_ops.QuantizedWeight.cat([p.with_panels() for p in parts])
    assert torch.equal(fused.panels, fresh(fused))
    odd_first = quant_ops.QuantizedWeight.cat([parts[2].with_panels(), parts[0].with_panels()])
    assert odd_first.rows == 29 and torch.equal(odd_first.panels, fresh(odd_first))
    # Row slices on panel boundaries are views of the panels; others are laid out again.
    for index in (slice(16, 40), slice(40, 53), slice(5, 30), slice(0, 53)):
        part = fused.slice_rows(index)
        assert torch.equal(part.panels, fresh(part))
        if index.start % 8 == 0:
            assert part.panels.untyped_storage().data_ptr() == fused.panels.untyped_storage().data_ptr()
        plain = quant_ops.QuantizedWeight(part.kind, part.data, part.cols)
        assert torch.equal(quant_ops.linear(x, part), quant_ops.linear(x, plain))


def test_a_batch_of_prompt_chunks_with_a_residual_takes_the_int8_kernel():
    raw = random_blocks(40, 128, Q.Q8_0, seed=3)
    weight = quant_ops.from_gguf(raw, Q.Q8_0, 40, 128)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    int8 = quant_ops.linear(x, weight)
    floats = x @ quant_ops.dequantize(weight).T
    assert not torch.equal(int8, floats)  # the inputs' int8 rounding: close, not equal
    torch.testing.assert_close(int8, floats, atol=0.02 * floats.abs().max().item(), rtol=0)
    residual = torch.randn(2, 16, 40)  # two prompt chunks, with a residual shaped like the output
    chunked = quant_ops.linear(x.view(2, 16, 128), weight, residual=residual)
    torch.testing.assert_close(chunked, int8.view(2, 16, 40) + residual)


def test_quantized_linear_refuses_bad_inputs():
    raw = random_blocks(8, 64, Q.Q8_0, seed=1)
    weight = quant_ops.from_gguf(raw, Q.Q8_0, 8, 64)
    with pytest.raises(ValueError, match="input has 32 features, the weight 64"):
        quant_ops.linear(torch.zeros(1, 32), weight)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_ops.linear(torch.zeros(1, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match=r"bias must be torch\.float32 of shape"):
        quant_ops.linear(torch.zeros(1, 64), weight, torch.zeros(7))
    with pytest.raises(ValueError, match="expected one of auto, none, gguf"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="--quantization gguf needs the CPU device"):
        quant_ops.quantization_enabled("gguf", "cpu", world_size=2)
    assert not quant_ops.quantization_enabled("none", "cpu", 1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loader_keeps_blocks_and_fast_paths_fuse_them(tmp_path, tied):
    hf = tiny_hf(tie_word_embeddings=tied)
    types = {f"blk.{i}.{kind}.weight": Q.Q4_1 for i in range(2)
             for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}  # fmt: skip
    types["token_embd.weight"] = Q.Q8_0
    if not tied:
        types["output.weight"] = Q.Q4_0
    write_gguf(tmp_path / "q.gguf", hf, types=types)
    plain = load_model(tmp_path / "q.gguf", quantization="none")
    quantized = load_model(tmp_path / "q.gguf", quantization="gguf")
    linears = [m for m in quantized.modules() if isinstance(m, quant_ops.QuantizedLinear)]
    assert len(linears) == 2 * 7 + 1  # every projection and the LM head
    assert all((m.qweight.panels is not None) == quant_ops.available() for m in linears)
    assert quantized.lm_head.qweight.kind == (quant_ops.Q8_0 if tied else quant_ops.Q4_0)
    assert "lm_head.weight" not in dict(quantized.named_parameters())
    for model in (plain, quantized):
        apply_fast_paths(model)
        bind_cache(model, num_blocks=16, block_size=BLOCK)
    attn = quantized.model.layers[0].self_attn
    assert isinstance(attn, FusedAttention) and isinstance(attn.qkv_weight, quant_ops.QuantizedWeight)
    assert (attn.qkv_weight.panels is not None) == quant_ops.available()
    seq = [7, 1, 200, 31, 9, 44, 3, 120, 18]
    (want,) = forward_packed(plain, [(seq, 0, [9, 2, 4])], BLOCK)
    (got,) = forward_packed(quantized, [(seq, 0, [9, 2, 4])], BLOCK)
    # The only difference is the inputs' int8 rounding: logits agree closely, not exactly.
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


GGUF_ENV = "RINGSERVE_TEST_GGUF"
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system",
           "Once upon a time, there was a", "To make a cup of tea, you first", "The three primary colors are",
           "In computer science, a linked list is", "My favourite season of the year is"]  # fmt: skip
TEXT = ("The river ran quietly past the old mill, where the miller's daughter sat every evening to watch the light "
        "fade over the hills. She had lived in the valley all her life and knew every path through the woods, every "
        "stone in the stream and every family in the village. In the spring the fields were green with young wheat, "
        "and in the autumn the orchards were heavy with apples. Travellers who stopped at the inn often asked her the "
        "way to the city, and she would point them to the road that climbed over the pass, warning them that the "
        "weather in the mountains could change in an hour.")  # fmt: skip


def requantize_to_q8_0(float_model: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Every Q4_1 projection of `quantized` requantized to Q8_0 from its values, and the same Q8_0 values, dequantized,
    as the weights of `float_model` (loaded from the same file, before the fast paths fuse them)."""
    dense = dict(float_model.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, quant_ops.QuantizedLinear) and module.qweight.kind == quant_ops.Q4_1:
            rows, cols = module.qweight.shape
            blocks = quants.quantize(quant_ops.dequantize(module.qweight).numpy(), Q.Q8_0)
            module.qweight = quant_ops.from_gguf(blocks, Q.Q8_0, rows, cols)
            dense[name].weight.data = quant_ops.dequantize(module.qweight)


@pytest.mark.skipif(not os.environ.get(GGUF_ENV), reason=f"set {GGUF_ENV} to the embedded model's .gguf file")
@pytest.mark.parametrize("weights", ["embedded", "q8_0"])
def test_embedded_model_quantized_path_keeps_greedy_tokens_and_perplexity(weights):
    """The embedded model (Q4_1 projections, a Q8_0 LM head), and the same with its projections requantized to Q8_0:
    each against the float32 path on its own dequantized weights."""
    from ringserve.frontend.text.tokenizer import tokenizer_from_gguf

    if not quant_ops.available():
        pytest.skip("this CPU has no AVX2 (the portable kernel would take minutes on a whole model)")
    path = Path(os.environ[GGUF_ENV])
    tokenizer = tokenizer_from_gguf(path)
    models = {setting: load_model(path, torch.float32, quantization=setting) for setting in ("none", "gguf")}
    if weights == "q8_0":
        requantize_to_q8_0(models["none"], models["gguf"])
    for model in models.values():
        apply_fast_paths(model)
        bind_cache(model, num_blocks=64, block_size=16)
    kinds = {m.qweight.kind for m in models["gguf"].modules() if isinstance(m, quant_ops.QuantizedLinear)}
    assert kinds == ({quant_ops.Q4_1, quant_ops.Q8_0} if weights == "embedded" else {quant_ops.Q8_0})

    def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
        (logits,) = forward_packed(model, [(prompt, 0, list(range(8)))], 16)
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):  # one new token a step, the earlier ones read from the KV cache
            (logits,) = forward_packed(model, [(tokens[-1:], len(prompt) + len(tokens) - 1, list(range(8)))], 16)
            tokens.append(int(logits[-1].argmax()))
        return tokens

    agree = total = 0
    for text in PROMPTS:
        prompt = tokenizer.encode(text, add_special_tokens=False)
        want = greedy(models["none"], prompt, 6)
        # The quantized model's greedy choice at each of those positions, given the same text before it (so one
        # differing token is counted once, not again in every token after it).
        (logits,) = forward_packed(models["gguf"], [(prompt + want[:-1], 0, list(range(8)))], 16)
        got = logits[len(prompt) - 1 :].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(want, got, strict=True))
        total += len(want)
    assert total == 48 and agree >= 0.95 * total, f"{agree} of {total} greedy tokens agree"

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert 80 <= len(ids) <= 256

    def perplexity(model: torch.nn.Module) -> float:
        (logits,) = forward_packed(model, [(ids, 0, list(range(16)))], 16)
        logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
        return math.exp(-logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())

    want_ppl, got_ppl = perplexity(models["none"]), perplexity(models["gguf"])
    assert abs(got_ppl / want_ppl - 1) <= 0.01, f"perplexity {got_ppl:.4f} vs float32 {want_ppl:.4f}"
    # The text is one prompt chunk (32 rows or more): every projection took the int8 kernel's weight panels.
    assert len(ids) >= 32
