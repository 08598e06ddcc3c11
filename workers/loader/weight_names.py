"""The one name-mapping table for the llama family: our parameter name <-> Hugging Face name <-> GGUF name.

Our module tree follows HF's LlamaForCausalLM, so the HF column is the identity; it stays explicit so another
architecture with different HF names only adds a table. `{i}` is the layer index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightName:
    ours: str
    hf: str
    gguf: str


LLAMA_WEIGHT_NAMES: tuple[WeightName, ...] = (
    WeightName("model.embed_tokens.weight", "model.embed_tokens.weight", "token_embd.weight"),
    WeightName("model.norm.weight", "model.norm.weight", "output_norm.weight"),
    WeightName("lm_head.weight", "lm_head.weight", "output.weight"),  # absent when tied
    *(
        WeightName(f"model.layers.{{i}}.{ours}", f"model.layers.{{i}}.{ours}", f"blk.{{i}}.{gguf}")
        for ours, gguf in (
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("self_attn.q_proj.bias", "attn_q.bias"),  # Qwen2-style attention_bias only
            ("self_attn.k_proj.bias", "attn_k.bias"),
            ("self_attn.v_proj.bias", "attn_v.bias"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"),
            ("mlp.up_proj.weight", "ffn_up.weight"),
            ("mlp.down_proj.weight", "ffn_down.weight"),
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
        )
    ),
)


def expand_names(num_layers: int, source: str) -> dict[str, str]:
    """Every concrete name of `source` ("hf" or "gguf") -> our parameter name."""
    mapping: dict[str, str] = {}
    for entry in LLAMA_WEIGHT_NAMES:
        layers = range(num_layers) if "{i}" in entry.ours else range(1)
        for i in layers:
            mapping[getattr(entry, source).format(i=i)] = entry.ours.format(i=i)
    return mapping
