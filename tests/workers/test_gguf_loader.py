"""GGUF loading: config from metadata, Q/K un-permuted from llama.cpp's layout, every listed tensor type.

Synthetic files are written with gguf.GGUFWriter from tiny random HF models, permuting Q/K exactly as
llama.cpp's converter does, so these tests need no real checkpoint. The real SmolLM2 file is compared
against transformers when RINGSERVE_TEST_GGUF names it.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from ringserve.workers.loader import load_gguf_model, load_model
from ringserve.workers.loader.weight_names import expand_names
from ringserve.workers.model import LlamaConfig
from ringserve.workers.model.registry import read_decoder_config
from ringserve.workers.model_runner import ModelRunner
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM as HfLlamaForCausalLM
from workers_testkit import (
    TINY,
    NewRequest,
    add_decoder_metadata,
    bind_cache,
    finish_gguf,
    forward_packed,
    hf_logits,
    ids,
    llama_cpp_permute,
    plan,
)

BLOCK = 4


def k_quant_bytes(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random but finite Q4_K / Q5_K / Q6_K blocks (gguf-py can only dequantize these, not quantize)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin are the first two f16 values
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d is the trailing f16
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    hf: torch.nn.Module,
    types: dict[str, Q] | None = None,
    drop: tuple[str, ...] = (),
    raw: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
) -> None:
    """HF state dict -> GGUF of `arch`. types: gguf name -> storage type (default F32); raw: pre-quantized bytes.
    llama.cpp permutes Q/K rows for llama only (qwen converters keep HF's order)."""
    cfg = hf.config
    types, raw = types or {}, raw or {}
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_metadata(writer, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_eos_token_id(2)
    state = hf.state_dict()
    for name, ours in expand_names(decoder_config(hf), "gguf").items():
        if name in drop or ours not in state or (ours == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name in raw:
            writer.add_tensor(name, raw[name], raw_dtype=types[name])
            continue
        w = state[ours].float().numpy()
        if arch != "llama":
            pass
        elif name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        qtype = types.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(w))
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)
    finish_gguf(writer)


def decoder_config(hf: torch.nn.Module) -> LlamaConfig:
    return read_decoder_config(hf.config.to_dict(), "test", qk_norm=hasattr(hf.model.layers[0].self_attn, "q_norm"))


def tiny_hf(seed: int = 0, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return HfLlamaForCausalLM(HfLlamaConfig(**{**TINY, **overrides})).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_float32_gguf_with_llama_cpp_qk_layout_matches_transformers(tmp_path, tied):
    hf = tiny_hf(tie_word_embeddings=tied)
    write_gguf(tmp_path / "tiny.gguf", hf)
    ours = load_model(tmp_path / "tiny.gguf")
    assert ours.config.tie_word_embeddings is tied
    assert (ours.config.num_heads, ours.config.num_kv_heads, ours.config.head_dim) == (4, 2, 16)
    assert ours.config.eos_token_ids == [2]
    bind_cache(ours, num_blocks=16, block_size=BLOCK)
    seqs = [list(range(3, 40, 2)), [7, 1, 200, 31, 9]]
    logits = forward_packed(ours, [(seqs[0], 0, [9, 2, 4, 11, 0]), (seqs[1], 0, [5, 3])], BLOCK)
    for seq, got in zip(seqs, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, seq), atol=1e-4, rtol=0)


def test_every_listed_tensor_type_dequantizes_to_the_stored_weights(tmp_path):
    # hidden 256 so every matrix row is a whole number of 256-wide K-quant super-blocks.
    hf = tiny_hf(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    types = {
        "token_embd.weight": Q.Q8_0,
        "output.weight": Q.BF16,
        "blk.0.attn_q.weight": Q.Q4_0,
        "blk.0.attn_k.weight": Q.Q4_1,
        "blk.0.attn_v.weight": Q.F16,
        "blk.0.ffn_gate.weight": Q.Q4_K,
        "blk.0.ffn_down.weight": Q.Q6_K,
        "blk.1.ffn_gate.weight": Q.Q5_K,
    }
    raw = {
        "blk.0.ffn_gate.weight": k_quant_bytes(256, 256, Q.Q4_K, seed=1),
        "blk.0.ffn_down.weight": k_quant_bytes(256, 256, Q.Q6_K, seed=2),
        "blk.1.ffn_gate.weight": k_quant_bytes(256, 256, Q.Q5_K, seed=3),
    }
    write_gguf(tmp_path / "mixed.gguf", hf, types=types, raw=raw)
    ours = dict(load_gguf_model(tmp_path / "mixed.gguf", torch.float32).named_parameters())
    state = hf.state_dict()
    names = expand_names(decoder_config(hf), "gguf")
    for gguf_name, qtype in types.items():
        if gguf_name in raw:
            expected = quants.dequantize(raw[gguf_name], qtype)
        elif qtype == Q.F16:
            expected = state[names[gguf_name]].numpy().astype(np.float16).astype(np.float32)
        else:
            # Block quantization runs along rows, so it commutes with the Q/K row permutation.
            expected = quants.dequantize(quants.quantize(state[names[gguf_name]].numpy(), qtype), qtype)
        got = ours[names[gguf_name]].detach().numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"{gguf_name} stored as {qtype.name}")
    assert (
        np.abs(
            ours["model.layers.0.mlp.up_proj.weight"].detach().numpy()
            - state["model.layers.0.mlp.up_proj.weight"].numpy()
        ).max()
        == 0
    )


def test_missing_gguf_tensor_is_named_in_the_error(tmp_path):
    write_gguf(tmp_path / "broken.gguf", tiny_hf(), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf_model(tmp_path / "broken.gguf", torch.float32)


GGUF_ENV = "RINGSERVE_TEST_GGUF"
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


@pytest.mark.skipif(not os.environ.get(GGUF_ENV), reason=f"set {GGUF_ENV} to a llama .gguf file")
def test_real_gguf_greedy_tokens_equal_transformers():
    from transformers import AutoModelForCausalLM

    path = Path(os.environ[GGUF_ENV])
    ours = load_gguf_model(path, torch.float32)
    runner = ModelRunner(ours, block_size=16, num_kv_blocks=4)
    new = NewRequest(slot=0, token_ids=ids(*PROMPT), block_ids=ids(3, 1), temperature=0.0)
    out = runner.execute(plan(0, [(0, 0, len(PROMPT), True)], new_requests=[new]))
    generated = [int(out.token_ids[0])]
    for step in range(1, 16):
        pos = len(PROMPT) + step - 1
        generated.append(int(runner.execute(plan(step, [(0, pos, 1, True)])).token_ids[0]))

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0, len(PROMPT) :].tolist()
    assert generated == ref
    if path.name.startswith("SmolLM2-135M-Instruct"):
        assert generated[:7] == [7042, 30, 198, 198, 504, 2988, 314]


@pytest.mark.skipif(not os.environ.get(GGUF_ENV), reason=f"set {GGUF_ENV} to a llama .gguf file")
def test_fast_reader_reads_what_gguf_reads():
    # GGUFFile (frontend and workers) reads through a plain view of the mapping; every field and tensor must be
    # what gguf's own reader gives, and tensor data must stay read-only views of the file.
    from ringserve.formats.gguf_file import GGUFFile

    path = os.environ[GGUF_ENV]
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types) == (field.offset, field.types), key
        assert mine.contents() == field.contents(), key
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.data_offset, mine.data.shape, mine.data.dtype) == (
            tensor.tensor_type, tensor.data_offset, tensor.data.shape, tensor.data.dtype)  # fmt: skip
        assert not mine.data.flags.writeable
        assert np.shares_memory(mine.data, ours.data)
    assert all(np.array_equal(m.data, t.data) for m, t in zip(ours.tensors[:8], theirs.tensors[:8], strict=True))


def test_fast_reader_reads_metadata_arrays_of_every_kind_as_gguf_does(tmp_path):
    # Arrays are read in bulk (one view per number array, one loop over a string array's lengths): empty, non-ASCII
    # and long strings, every number type and a nested array (gguf's own walk) must all read the same.
    from ringserve.formats.gguf_file import GGUFFile

    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    strings = ["", "a", "\u2581hello", "\u00e9t\u00e9 \u65e5\u672c", "x" * 300, "<0x0A>"]
    writer.add_array("test.strings", strings)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.scalar", 7)
    for name in ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64", "FLOAT32", "FLOAT64"):
        writer.add_key_value(f"test.{name.lower()}", list(range(5)), gguf.GGUFValueType.ARRAY,
                             gguf.GGUFValueType[name])  # fmt: skip
    writer.add_array("test.bools", [True, False, True])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert (ours.fields[key].offset, ours.fields[key].types) == (field.offset, field.types), key
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.fields["test.strings"].contents() == strings
    assert ours.fields["test.float64"].contents() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert ours.data_offset == theirs.data_offset
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


K_QUANTS = {"ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "attn_v": Q.Q8_0}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_k_quant_gguf_of_each_architecture_matches_transformers_on_the_dequantized_weights(tmp_path, arch):
    """Q4_K, Q5_K, Q6_K and Q8_0 tensors (the architecture from `general.architecture`): our logits equal
    transformers' with the same dequantized weights put into the HF model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**TINY, "hidden_size": 256, "intermediate_size": 256}
    torch.manual_seed(0)
    if arch == "qwen3":
        hf = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=64)).eval()
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        hf = tiny_hf(**shape)
    names = expand_names(decoder_config(hf), "gguf")
    types, raw = {}, {}
    for i in range(2):
        for kind, qtype in K_QUANTS.items():
            name = f"blk.{i}.{kind}.weight"
            rows, cols = hf.state_dict()[names[name]].shape
            types[name] = qtype
            if qtype == Q.Q8_0:
                raw[name] = quants.quantize(hf.state_dict()[names[name]].numpy(), qtype)
            else:
                raw[name] = k_quant_bytes(rows, cols, qtype, seed=10 * i + len(kind))
    write_gguf(tmp_path / f"{arch}.gguf", hf, types=types, raw=raw, arch=arch)
    ours = load_model(tmp_path / f"{arch}.gguf")
    assert ours.config.qk_norm is (arch == "qwen3")
    with torch.no_grad():  # the reference: the same dequantized weights in transformers' model
        for name, data in raw.items():
            hf.state_dict()[names[name]].copy_(torch.from_numpy(quants.dequantize(data, types[name])))
    bind_cache(ours, num_blocks=16, block_size=BLOCK)
    seq = [7, 1, 200, 31, 9, 44, 3, 120, 18]
    (got,) = forward_packed(ours, [(seq, 0, [9, 2, 4])], BLOCK)
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=1e-3, rtol=0)


def test_unsupported_gguf_tensor_type_and_architecture_are_refused_at_load(tmp_path):
    hf = tiny_hf()
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    iq = np.zeros((64, 64 // block_elems * block_bytes), np.uint8)
    write_gguf(tmp_path / "iq.gguf", hf, types={"blk.0.attn_q.weight": Q.IQ4_NL}, raw={"blk.0.attn_q.weight": iq})
    with pytest.raises(ValueError, match=r"tensor types IQ4_NL are not supported \(supported: F32, .*Q4_K, Q5_K, Q6_K"):
        load_gguf_model(tmp_path / "iq.gguf", torch.float32)
    write_gguf(tmp_path / "falcon.gguf", hf, arch="falcon")
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported \(supported: llama, qwen2"):
        load_gguf_model(tmp_path / "falcon.gguf", torch.float32)
