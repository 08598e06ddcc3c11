"""The one name-mapping table of the decoder: our parameter name <-> Hugging Face name <-> GGUF name.

Our module tree follows HF's LlamaForCausalLM (and Qwen2MoeForCausalLM for experts), so the HF column is the
identity; it stays explicit so an architecture with other HF names only adds renames (workers/model/registry.py).
`{i}` is the layer index, `{j}` an expert's. GGUF None: that weight has no per-tensor GGUF name we load.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.workers.model import LlamaConfig
from ringserve.workers.model.gemma import GemmaConfig


@dataclass(frozen=True)
class WeightName:
    ours: str
    hf: str
    gguf: str | None


def _same(ours: str, gguf: str | None) -> WeightName:
    return WeightName(ours, ours, gguf)


GLOBAL_NAMES = (
    _same("model.embed_tokens.weight", "token_embd.weight"),
    _same("model.norm.weight", "output_norm.weight"),
    _same("lm_head.weight", "output.weight"),  # absent when tied
)
ATTENTION_NAMES = tuple(
    _same(f"model.layers.{{i}}.{ours}", f"blk.{{i}}.{gguf}")
    for ours, gguf in (
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),  # attention_bias only
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("self_attn.q_norm.weight", "attn_q_norm.weight"),  # qk_norm only
        ("self_attn.k_norm.weight", "attn_k_norm.weight"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
    )
)
MLP_NAMES = tuple(
    _same(f"model.layers.{{i}}.mlp.{ours}", f"blk.{{i}}.{gguf}")
    for ours, gguf in (("gate_proj.weight", "ffn_gate.weight"), ("up_proj.weight", "ffn_up.weight"),
                       ("down_proj.weight", "ffn_down.weight"))
)  # fmt: skip
# Gemma's four norms per layer; GGUF calls the one before its MLP `ffn_norm` (llama's post-attention norm).
GEMMA_NORM_NAMES = tuple(
    _same(f"model.layers.{{i}}.{ours}", f"blk.{{i}}.{gguf}")
    for ours, gguf in (("input_layernorm.weight", "attn_norm.weight"),
                       ("post_attention_layernorm.weight", "post_attention_norm.weight"),
                       ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
                       ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"))
)  # fmt: skip
MOE_NAMES = (
    _same("model.layers.{i}.mlp.gate.weight", None),
    *(_same(f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", None) for p in ("gate", "up", "down")),
    *(_same(f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight", None) for p in ("gate", "up", "down")),
    _same("model.layers.{i}.mlp.shared_expert_gate.weight", None),
)


def expand_names(config: LlamaConfig, source: str) -> dict[str, str]:
    """Every concrete name of `source` ("hf" or "gguf") -> our parameter name, for this config's layers."""
    mapping: dict[str, str] = {}

    def add(entry: WeightName, **index: int) -> None:
        theirs = getattr(entry, source)
        if theirs is not None:
            mapping[theirs.format(**index)] = entry.ours.format(**index)

    for entry in GLOBAL_NAMES:
        add(entry)
    for i in range(config.num_layers):
        gemma = isinstance(config, GemmaConfig)
        for entry in ATTENTION_NAMES:
            if not (gemma and entry.ours.endswith("layernorm.weight")):
                add(entry, i=i)
        for entry in GEMMA_NORM_NAMES if gemma else ():
            add(entry, i=i)
        if not config.is_moe_layer(i):
            for entry in MLP_NAMES:
                add(entry, i=i)
            continue
        for entry in MOE_NAMES:
            for j in range(config.num_experts if "{j}" in entry.ours else 1):
                add(entry, i=i, j=j)
    return mapping
