"""Every architecture of the registry serves transformers' greedy tokens through the real scheduler and a ModelRunner,
RoPE scalings (and partial rotary widths) equal transformers' tables, and unsupported checkpoints are refused at load
naming what they ask for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model import KVCache
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.model.native_decoder import NativeDecoder
from ringserve.workers.model.registry import ARCHITECTURES, read_decoder_config
from ringserve.workers.model.rope import rope_frequencies
from ringserve.workers.model_runner import ModelRunner
from transformers import LlamaConfig as HfLlamaConfig
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from workers_testkit import hf_greedy, save_tiny_hf_model, serve_in_process

BLOCK = 4
# One variant per kind of difference from llama: dense with RoPE scaling (YaRN, LongRoPE), bias, q/k norm, fused
# checkpoint tensors, partial rotary embeddings (with LongRoPE, as Phi-4-mini), sliding windows (every layer, and
# mixed with global layers), experts with and without a shared one.
ARCHITECTURE_VARIANTS = ("llama_yarn", "qwen2_attention_bias", "qwen3", "phi3", "phi3_longrope", "phi4_mini_longrope",
                         "mistral_sliding_window", "qwen2_sliding_window", "mixtral", "qwen2_moe", "qwen3_moe",
                         "gemma2", "gemma3")  # fmt: skip
# transformers 5.x's generate() with yarn RoPE departs from its own whole-sequence forward (prompt [250, 1, 2], token
# 17: 137 where the forward's argmax is 2, by a logit margin of 0.07); the dense variant is compared with the forward.
WHOLE_FORWARD_REFERENCE = {"llama_yarn"}
PROMPTS = [[5, 9, 200, 3, 17, 8, 44, 61, 90, 12, 7, 33, 150, 2, 99, 64, 31], [250, 1, 2], list(range(30, 52))]
NEW_TOKENS = 32


@pytest.mark.parametrize("variant", ARCHITECTURE_VARIANTS)
def test_chunked_prefill_and_greedy_decode_equal_transformers(tmp_path: Path, variant: str) -> None:
    """Prefill chunks of 8 tokens (the windows are 8 long, so chunks cross window boundaries mid-prompt) batched
    with other requests' decodes, then 32 greedy tokens each, through the C++ scheduler and the fast paths."""
    hf = save_tiny_hf_model(variant, tmp_path)
    runner = ModelRunner(load_hf_model(tmp_path, torch.float32), block_size=BLOCK, num_kv_blocks=64)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        for i, p in enumerate(PROMPTS)
    ]
    got, _ = serve_in_process(runner, requests, num_blocks=64, block_size=BLOCK, max_num_batched_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        expected = hf_greedy(hf, prompt, NEW_TOKENS, use_cache=variant not in WHOLE_FORWARD_REFERENCE)
        assert got[i + 1] == expected, f"{variant}: prompt {i}"


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2,
         "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
    ids=lambda s: s["rope_type"],
)  # fmt: skip
def test_rope_scaling_equals_transformers(scaling: dict) -> None:
    hf = HfLlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=2048,
                       rope_scaling={**scaling, "rope_theta": 500000.0})  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    got, factor = rope_frequencies(64, 500000.0, scaling, 2048)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(want_factor)


def write_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_an_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    save_tiny_hf_model("llama", tmp_path)
    write_config(tmp_path, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM is not supported \(supported: .*Qwen3MoeForCausalLM"):
        load_hf_model(tmp_path, torch.float32)


def test_a_missing_config_field_is_named(tmp_path: Path) -> None:
    save_tiny_hf_model("qwen3", tmp_path)
    write_config(tmp_path, num_attention_heads=None)
    with pytest.raises(ValueError, match=r"config.json is missing 'num_attention_heads'"):
        load_hf_model(tmp_path, torch.float32)


def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path: Path) -> None:
    save_tiny_hf_model("llama", tmp_path)
    write_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"quantization 'gptq' is not supported \(supported: unquantized"):
        load_hf_model(tmp_path, torch.float32)


def test_an_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    save_tiny_hf_model("phi3", tmp_path)
    write_config(tmp_path, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    with pytest.raises(ValueError, match=r"rope scaling 'mrope' is not supported \(supported: default, linear"):
        load_hf_model(tmp_path, torch.float32)


@pytest.mark.parametrize("max_position", [4096, 131072])
def test_longrope_takes_the_factor_set_of_the_served_context_as_transformers_does_past_it(max_position: int) -> None:
    # Short factors while the context is the original one; past it the long ones, which transformers takes (for every
    # position) once a sequence is longer than the original context.
    short, long = [1.0 + i / 10 for i in range(32)], [1.0 + i for i in range(32)]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 4096}  # fmt: skip
    hf = Phi3Config(hidden_size=512, num_attention_heads=8, max_position_embeddings=max_position,
                    rope_scaling={**scaling, "rope_theta": 10000.0})  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=max_position)
    got, factor = rope_frequencies(64, 10000.0, scaling, max_position)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(want_factor)
    assert (factor == 1.0) == (max_position == 4096)
    with pytest.raises(ValueError, match="longrope: 32 rescale factors for head_dim 128"):
        rope_frequencies(128, 10000.0, scaling, max_position)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(24)],
                                              "long_factor": [1.0 + i for i in range(24)],
                                              "original_max_position_embeddings": 4096}],
                         ids=["default", "longrope"])  # fmt: skip
def test_partial_rotary_frequencies_are_those_of_the_rotated_width_as_in_transformers(scaling: dict | None) -> None:
    # Phi-4-mini's shape: head_dim 64 here, 0.75 of it (48 dims, 24 frequencies) rotated.
    hf = Phi3Config(hidden_size=512, num_attention_heads=8, max_position_embeddings=131072, partial_rotary_factor=0.75,
                    rope_scaling=None if scaling is None else {**scaling, "rope_theta": 10000.0})  # fmt: skip
    if scaling is None:
        want, want_factor = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:  # the long factors, which transformers takes for a sequence past the original context
        want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=131072)
    config = read_decoder_config(json.loads(hf.to_json_string()), "config.json")
    assert (config.head_dim, config.rotary_dim) == (64, 48)
    got, factor = rope_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_position)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(want_factor)


def test_a_partial_rotary_factor_in_the_transformers_4_layout_is_read(tmp_path: Path) -> None:
    # Phi-4-mini's own config.json: `partial_rotary_factor` at the top level, LongRoPE under `rope_scaling` ("type").
    save_tiny_hf_model("phi4_mini_longrope", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    write_config(tmp_path, rope_parameters=None, partial_rotary_factor=rope.pop("partial_rotary_factor"),
                 rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    config = load_hf_model(tmp_path, torch.float32).config
    assert (config.rotary_dim, config.rope_scaling["rope_type"]) == (12, "longrope")
    write_config(tmp_path, partial_rotary_factor=0.7)  # 11.2 -> 11 dims: not pairs
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.7 rotates 11 of head_dim 16"):
        load_hf_model(tmp_path, torch.float32)


def test_partial_rotary_models_keep_the_native_decoder_off(tmp_path: Path) -> None:
    """The one-call decoder rotates whole heads; a partial-rotary model must decode layer by layer."""
    supports = {}
    for variant in ("phi3", "phi4_mini"):
        save_tiny_hf_model(variant, tmp_path / variant)
        model = apply_fast_paths(load_hf_model(tmp_path / variant, torch.bfloat16))
        model.bind_kv_cache(KVCache.allocate(model.config, 8, BLOCK, torch.bfloat16, "cpu"), TorchSdpaBackend())
        supports[variant] = NativeDecoder.supports(model)
    assert supports == {"phi3": True, "phi4_mini": False}


def test_the_registry_names_each_architecture_once() -> None:
    names = [n for arch in ARCHITECTURES for n in arch.hf_architectures]
    assert len(names) == len(set(names))
    gguf = [arch.gguf_name for arch in ARCHITECTURES if arch.gguf_name]
    assert len(gguf) == len(set(gguf))


def test_an_unsupported_activation_or_mlp_bias_is_refused(tmp_path: Path) -> None:
    save_tiny_hf_model("mistral", tmp_path)
    write_config(tmp_path, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=r"hidden_act 'gelu_pytorch_tanh' is not supported .*\(supported: silu\)"):
        load_hf_model(tmp_path, torch.float32)
    write_config(tmp_path, hidden_act="silu", mlp_bias=True)
    with pytest.raises(ValueError, match=r"mlp_bias is not supported"):
        load_hf_model(tmp_path, torch.float32)


def test_gemma_refuses_an_activation_other_than_gelu_tanh(tmp_path: Path) -> None:
    save_tiny_hf_model("gemma3", tmp_path)
    write_config(tmp_path, hidden_activation="relu", hidden_act=None)
    with pytest.raises(ValueError, match=r"hidden_activation 'relu' is not supported by the Gemma decoder"):
        load_hf_model(tmp_path, torch.float32)
