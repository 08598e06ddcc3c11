"""Which model class serves a checkpoint: config.json's `architectures` (or `model_type`) or GGUF's
`general.architecture` -> an `Architecture`, and its config.json read into the model's config.

Every refusal happens here, at load, naming what the checkpoint asked for and what is supported: an architecture
not in the table, a config field the model needs that is missing, a quantization or RoPE scaling not implemented.
A family with its own model file (Gemma) adds an entry with its own `model_class` and `read_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringserve.workers.model.gemma import GemmaConfig, GemmaForCausalLM
from ringserve.workers.model.llama import LlamaConfig, LlamaForCausalLM
from ringserve.workers.model.rope import ROPE_SCALING_TYPES


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_architectures: tuple[str, ...]  # config.json `architectures`
    model_types: tuple[str, ...]  # config.json `model_type` (older files without `architectures`)
    read_config: Callable[[dict[str, Any], str], LlamaConfig]  # (config.json, where it came from) -> config
    model_class: type[LlamaForCausalLM] = LlamaForCausalLM
    gguf_name: str | None = None  # GGUF `general.architecture`; None = not loadable from GGUF
    # Checkpoint name pieces -> ours (Mixtral's `block_sparse_moe.experts.{j}.w1` is our `mlp.experts.{j}.gate_proj`).
    hf_renames: tuple[tuple[str, str], ...] = ()
    # Fused checkpoint tensors split into our parameters by rows (Phi-3's qkv_proj and gate_up_proj).
    fused: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False  # llama.cpp's converter permutes Q/K rows for its interleaved RoPE
    # llama.cpp renormalises the top-k routing weights per architecture, not from the file (Qwen2-MoE: no).
    gguf_norm_topk_prob: bool = True


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise ValueError(f"{source} is missing {key!r}, which the {cfg.get('model_type', 'llama')} model needs")
    return value


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, partial rotary factor) from transformers 4.x `rope_scaling` + `rope_theta` (+ a top-level
    `partial_rotary_factor`) or 5.x `rope_parameters`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported (supported: 0 < factor <= 1)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_SCALING_TYPES:
        supported = ", ".join(ROPE_SCALING_TYPES)
        raise ValueError(f"{source}: rope scaling {kind!r} is not supported (supported: {supported})")
    if kind != "default" and "original_max_position_embeddings" in cfg:  # Phi-3 and others write it at the top
        rope.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    return theta, None if kind == "default" else {**rope, "rope_type": kind}, partial


def _layer_windows(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per layer: its sliding window or None. transformers 5 writes `layer_types`; older Qwen configs window the layers
    from `max_window_layers` on when `use_sliding_window`; Mistral, Mixtral and Phi-3 window every layer."""
    window = cfg.get("sliding_window") or None
    types = cfg.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{source}: layer types {unknown} are not supported (supported: full_attention, "
                             "sliding_attention)")  # fmt: skip
        if "sliding_attention" in types and window is None:
            raise ValueError(f"{source} has sliding_attention layers but no 'sliding_window'")
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if window is None:
        return ()
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return ()
        first = int(cfg.get("max_window_layers", 0))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


def read_decoder_config(cfg: dict[str, Any], source: str, **family: Any) -> LlamaConfig:
    """config.json -> LlamaConfig; `family` holds the flags an architecture implies but its config does not write."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ValueError(f"{source}: quantization {method!r} is not supported (supported: unquantized safetensors in "
                         "float32/bfloat16/float16, or a GGUF file)")  # fmt: skip
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported by the {cfg.get('model_type')} decoder "
                         "(supported: silu)")  # fmt: skip
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias is not supported (the decoder's MLP projections have no bias)")
    bias_default = family.pop("attention_bias", False)
    norm_topk_default = family.pop("norm_topk_prob", True)
    heads = int(_need(cfg, "num_attention_heads", source))
    hidden = int(_need(cfg, "hidden_size", source))
    num_layers = int(_need(cfg, "num_hidden_layers", source))
    theta, scaling, partial_rotary_factor = _rope(cfg, source)
    eos = cfg.get("eos_token_id")
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    moe: dict[str, Any] = {}
    if experts:
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=int(_need(cfg, "num_experts_per_tok", source)),
            # Mixtral's experts are intermediate_size wide; Qwen-MoE names the expert width apart.
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size", source)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_default)),
            moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        )
    return LlamaConfig(
        vocab_size=int(_need(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_need(cfg, "intermediate_size", source)),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial_rotary_factor,
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", bias_default))),
        layer_windows=_layer_windows(cfg, num_layers, source),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **moe,
        **family,
    )


def _family(**flags: Any) -> Callable[[dict[str, Any], str], LlamaConfig]:
    return lambda cfg, source: read_decoder_config(cfg, source, **dict(flags))


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def read_gemma_config(cfg: dict[str, Any], source: str, version: int) -> GemmaConfig:
    """Gemma 2 / Gemma 3 config.json -> GemmaConfig. transformers 5 writes `layer_types` and per-layer-type
    `rope_parameters`; 4.x writes Gemma 2's alternation implicitly (even layers local), Gemma 3's as
    `sliding_window_pattern`, and the local RoPE base as `rope_local_base_freq`."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"{source}: hidden_activation {act!r} is not supported by the Gemma decoder "
                         f"(supported: {', '.join(_GELU_TANH)})")  # fmt: skip
    layers = int(_need(cfg, "num_hidden_layers", source))
    plain = {k: v for k, v in cfg.items() if k not in ("hidden_act", "hidden_activation", "rope_parameters")}
    rope = cfg.get("rope_parameters") or {}
    local_theta: float | None = None
    if "full_attention" in rope:  # transformers 5: one RoPE per layer type
        plain["rope_parameters"] = rope["full_attention"]
        if "sliding_attention" in rope:
            local = rope["sliding_attention"]
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"{source}: sliding-window layers' rope_type must be default")
            local_theta = float(local.get("rope_theta", 10000.0))
    elif rope:
        plain["rope_parameters"] = rope
    if version == 3 and local_theta is None:
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    if not cfg.get("layer_types") and cfg.get("sliding_window"):
        pattern = int(cfg.get("sliding_window_pattern", 2 if version == 2 else 6))
        # Gemma 2: even layers local; Gemma 3: every pattern-th layer global.
        plain["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    plain.setdefault("tie_word_embeddings", True)
    base = read_decoder_config(plain, source, qk_norm=version == 3)
    return GemmaConfig(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)},
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or base.head_dim),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        rope_local_theta=local_theta,
    )


_MIXTRAL_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                    (".w2.", ".down_proj."))  # fmt: skip

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), _family(), gguf_name="llama", gguf_permuted_qk=True),
    Architecture("mistral", ("MistralForCausalLM",), ("mistral",), _family()),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _family(attention_bias=True), gguf_name="qwen2"),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _family(qk_norm=True), gguf_name="qwen3"),
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), _family(), gguf_name="phi3",
                 fused=("qkv_proj", "gate_up_proj")),
    Architecture("mixtral", ("MixtralForCausalLM",), ("mixtral",), _family(), hf_renames=_MIXTRAL_RENAMES),
    Architecture("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",),
                 _family(attention_bias=True, norm_topk_prob=False), gguf_name="qwen2moe", gguf_norm_topk_prob=False),
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), lambda c, s: read_gemma_config(c, s, 2),
                 GemmaForCausalLM, gguf_name="gemma2"),
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), lambda c, s: read_gemma_config(c, s, 3),
                 GemmaForCausalLM, gguf_name="gemma3"),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _family(qk_norm=True, norm_topk_prob=False),
                 gguf_name="qwen3moe"),
)  # fmt: skip


def _supported_hf() -> str:
    return ", ".join(a for arch in ARCHITECTURES for a in arch.hf_architectures)


def hf_architecture(cfg: dict[str, Any], source: str) -> Architecture:
    """The entry for a config.json: by its `architectures` list, else by `model_type`."""
    names = cfg.get("architectures") or []
    for arch in ARCHITECTURES:
        if any(n in arch.hf_architectures for n in names):
            return arch
    if names:
        raise ValueError(f"{source}: architecture {', '.join(names)} is not supported (supported: {_supported_hf()})")
    model_type = cfg.get("model_type")
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    raise ValueError(f"{source}: model_type {model_type!r} is not supported (supported: {_supported_hf()})")


def gguf_architecture(name: str | None, source: str) -> Architecture:
    for arch in ARCHITECTURES:
        if arch.gguf_name is not None and arch.gguf_name == name:
            return arch
    supported = ", ".join(a.gguf_name for a in ARCHITECTURES if a.gguf_name)
    raise ValueError(f"{source}: GGUF architecture {name!r} is not supported (supported: {supported})")
