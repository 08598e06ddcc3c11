"""GGUF files of Phi-3 (Phi-4-mini's partial rotary and LongRoPE), Mixtral and Qwen2/Qwen3-MoE, written the way
llama.cpp's converter writes them, give transformers' logits and greedy tokens.

The writer here names tensors with gguf-py's own map from Hugging Face names (what convert_hf_to_gguf.py uses), not
with RingServe's table: fused `attn_qkv` and `ffn_up` (gate and up stacked) for Phi-3, each layer's experts stacked
into 3-D `ffn_{gate,up,down}_exps` with the router as `ffn_gate_inp`, Qwen2-MoE's shared expert as `*_shexp`, Q/K
rows permuted for `llama` (Mixtral) only. The models are tiny random ones built by transformers from a config.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, MODEL_TENSOR, TENSOR_NAMES, quants
from gguf import GGMLQuantizationType as Q
from ringserve.workers.loader import load_model
from ringserve.workers.model_runner import ModelRunner
from workers_testkit import (
    add_decoder_metadata,
    bind_cache,
    finish_gguf,
    forward_packed,
    hf_greedy,
    hf_logits,
    llama_cpp_permute,
    save_tiny_hf_model,
    serve_in_process,
)

BLOCK = 4
PROMPTS = [[5, 9, 200, 3, 17, 8, 44, 61, 90, 12, 7, 33, 150, 2, 99, 64, 31], list(range(30, 52))]
NEW_TOKENS = 32
# testkit variant -> GGUF architecture (Mixtral is llama.cpp's `llama` with experts)
VARIANTS = {"phi4_mini_longrope": "phi3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
            "qwen3_moe_all_sparse": "qwen3moe"}  # fmt: skip
_ARCHS = {"phi3": MODEL_ARCH.PHI3, "llama": MODEL_ARCH.LLAMA, "qwen2moe": MODEL_ARCH.QWEN2MOE,
          "qwen3moe": MODEL_ARCH.QWEN3MOE}  # fmt: skip
_EXPERT_TENSORS = {"gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP, "down": MODEL_TENSOR.FFN_DOWN_EXP}


def gguf_tensors(hf: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, as its converter writes them (float32)."""
    cfg = hf.config
    names = gguf.get_tensor_name_map(_ARCHS[arch], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for key, value in hf.state_dict().items():
        w = value.float().numpy()
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith("mlp.experts.gate_up_proj"):  # transformers' stacked experts: [experts, gate | up, hidden]
            layer = int(key.split(".")[2])
            gate, up = np.split(w, 2, axis=1)
            for kind, stacked in (("gate", gate), ("up", up)):
                out[TENSOR_NAMES[_EXPERT_TENSORS[kind]].format(bid=layer) + ".weight"] = stacked
            continue
        if key.endswith("mlp.experts.down_proj"):
            out[TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN_EXP].format(bid=int(key.split(".")[2])) + ".weight"] = w
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf-py maps no {arch} tensor to {key}"
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        out[name] = w
    return out


def write_gguf(path: Path, hf: torch.nn.Module, arch: str, tensors: dict[str, np.ndarray],
               types: dict[str, Q] | None = None, rope_dims: int | None = None, **extra: object) -> None:  # fmt: skip
    """Metadata as llama.cpp's converter writes it for `arch`; `types`: tensors stored quantized (default F32);
    `rope_dims`: a Phi-3 rope.dimension_count other than the converter's; `extra`: further `{arch}.key` values."""
    cfg, types = hf.config, types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_decoder_metadata(writer, cfg)
    rope = cfg.rope_parameters
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "phi3":  # Phi3MiniModel: int(partial_rotary_factor * hidden) // heads; LongRoPE factors as tensors
        partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0
        converted = int(partial * cfg.hidden_size) // cfg.num_attention_heads
        writer.add_rope_dimension_count(converted if rope_dims is None else rope_dims)
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = (rope.get("original_max_position_embeddings")
                    or getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
            for kind in ("long", "short"):
                writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], np.float32))
    else:
        writer.add_rope_dimension_count(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in extra.items():
        writer.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.get_type(value))
    writer.add_eos_token_id(2)
    for name, w in tensors.items():
        qtype = types.get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(w))
        else:
            writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)
    finish_gguf(writer)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_gguf_gives_transformers_logits_and_greedy_tokens(tmp_path: Path, variant: str) -> None:
    hf = save_tiny_hf_model(variant, tmp_path / "hf")
    arch = VARIANTS[variant]
    tensors = gguf_tensors(hf, arch)
    if arch == "phi3":
        assert "blk.0.attn_qkv.weight" in tensors and "blk.0.ffn_gate.weight" not in tensors
    else:
        assert tensors["blk.1.ffn_gate_exps.weight"].ndim == 3 and "blk.1.ffn_gate_inp.weight" in tensors
    write_gguf(tmp_path / "tiny.gguf", hf, arch, tensors)
    ours = load_model(tmp_path / "tiny.gguf")
    config = ours.config
    if arch == "phi3":
        assert (config.rotary_dim, config.head_dim, config.rope_scaling["rope_type"]) == (12, 16, "longrope")
    else:
        assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
        assert config.norm_topk_prob is (arch != "qwen2moe")  # llama.cpp's choice per architecture
        assert config.shared_expert_intermediate_size == (64 if arch == "qwen2moe" else 0)
    bind_cache(ours, num_blocks=32, block_size=BLOCK)
    for got, prompt in zip(forward_packed(ours, [(p, 0, list(range(8 * i, 8 * i + 8))) for i, p in enumerate(PROMPTS)],
                                          BLOCK), PROMPTS, strict=True):  # fmt: skip
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    assert greedy_served(tmp_path / "tiny.gguf") == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("variant", ["phi4_mini_longrope", "qwen2_moe"])
def test_q8_0_gguf_equals_transformers_on_the_dequantized_weights(tmp_path: Path, variant: str) -> None:
    """The fused and stacked tensors stored as Q8_0 blocks: split and dequantized, they are the weights transformers
    holds after the same quantize/dequantize round trip."""
    hf = save_tiny_hf_model(variant, tmp_path / "hf")
    arch = VARIANTS[variant]
    tensors = gguf_tensors(hf, arch)
    quantized = [n for n in tensors if n.endswith(("attn_qkv.weight", "ffn_up.weight", "_exps.weight",
                                                   "_shexp.weight")) and "gate_inp" not in n]  # fmt: skip
    assert quantized
    write_gguf(tmp_path / "q8.gguf", hf, arch, tensors, types=dict.fromkeys(quantized, Q.Q8_0))
    with torch.no_grad():  # the reference: transformers' model holding the round-tripped weights
        rounded = {n: quants.dequantize(quants.quantize(tensors[n], Q.Q8_0), Q.Q8_0) for n in quantized}
        reference = {**tensors, **rounded}
        for key, value in hf.state_dict().items():
            value.copy_(_hf_value(key, value, reference, hf.config.num_hidden_layers, arch))
    ours = load_model(tmp_path / "q8.gguf")
    bind_cache(ours, num_blocks=32, block_size=BLOCK)
    (got,) = forward_packed(ours, [(PROMPTS[0], 0, [0, 1, 2, 3, 4])], BLOCK)
    torch.testing.assert_close(got, hf_logits(hf, PROMPTS[0]), atol=1e-4, rtol=0)
    assert greedy_served(tmp_path / "q8.gguf", PROMPTS[:1]) == [hf_greedy(hf, PROMPTS[0], NEW_TOKENS)]


def greedy_served(path: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """32 greedy tokens for each prompt through the C++ scheduler (8-token prefill chunks) and the fast paths."""
    runner = ModelRunner(load_model(path), block_size=BLOCK, num_kv_blocks=64)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]
    got, _ = serve_in_process(runner, requests, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=8)
    return [got[i + 1] for i in range(len(prompts))]


def _hf_value(key: str, value: torch.Tensor, reference: dict[str, np.ndarray], layers: int, arch: str) -> torch.Tensor:
    """transformers' tensor `key` rebuilt from GGUF-named arrays (the inverse of gguf_tensors, for unpermuted archs)."""
    names = gguf.get_tensor_name_map(_ARCHS[arch], layers)
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if key.endswith("mlp.experts.gate_up_proj"):
        gate, up = (reference[TENSOR_NAMES[_EXPERT_TENSORS[k]].format(bid=layer) + ".weight"] for k in ("gate", "up"))
        return torch.from_numpy(np.concatenate([gate, up], axis=1))
    if key.endswith("mlp.experts.down_proj"):
        return torch.from_numpy(reference[TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN_EXP].format(bid=layer) + ".weight"])
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    return value if name is None or name not in reference else torch.from_numpy(reference[name]).reshape(value.shape)


def test_unsupported_expert_routing_is_refused_naming_the_field(tmp_path: Path) -> None:
    hf = save_tiny_hf_model("qwen3_moe_all_sparse", tmp_path / "hf")
    tensors = gguf_tensors(hf, "qwen3moe")
    write_gguf(tmp_path / "sigmoid.gguf", hf, "qwen3moe", tensors, expert_gating_func=2)
    with pytest.raises(ValueError, match=r"qwen3moe.expert_gating_func = 2 \(sigmoid\) is not supported "
                                         r"\(supported: 1 \(softmax\)\)"):  # fmt: skip
        load_model(tmp_path / "sigmoid.gguf")
    write_gguf(tmp_path / "scaled.gguf", hf, "qwen3moe", tensors, expert_weights_scale=2.5)
    with pytest.raises(ValueError, match=r"qwen3moe.expert_weights_scale = 2.5 is not supported"):
        load_model(tmp_path / "scaled.gguf")


@pytest.mark.parametrize("dims", [11, 20])
def test_a_rope_dimension_count_that_is_odd_or_wider_than_the_head_is_refused(tmp_path: Path, dims: int) -> None:
    hf = save_tiny_hf_model("phi3", tmp_path / "hf")
    write_gguf(tmp_path / "bad.gguf", hf, "phi3", gguf_tensors(hf, "phi3"), rope_dims=dims)
    with pytest.raises(ValueError, match=rf"phi3.rope.dimension_count {dims} of head_dim 16 is not supported"):
        load_model(tmp_path / "bad.gguf")
