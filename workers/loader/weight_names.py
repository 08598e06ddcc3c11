"""The one name-mapping table of the decoder: our parameter name <-> Hugging Face name <-> GGUF name.

Our module tree follows HF's LlamaForCausalLM (and Qwen2MoeForCausalLM for experts), so the HF column is the
identity; it stays explicit so an architecture with other HF names only adds renames (workers/model/registry.py).
`{i}` is the layer index, `{j}` an expert's. llama.cpp stacks a layer's experts into one 3-D tensor per projection
(`ffn_gate_exps` [experts, rows, cols]): its GGUF name has no `{j}`, and the loader splits it into the experts.
Fused checkpoint tensors (Phi-3's qkv and gate/up, in both formats) are split by rows with `fused_parts`.
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
    _same("model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight"),  # the router
    *(_same(f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", f"blk.{{i}}.ffn_{p}_exps.weight")
      for p in ("gate", "up", "down")),
    *(_same(f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight", f"blk.{{i}}.ffn_{p}_shexp.weight")
      for p in ("gate", "up", "down")),
    _same("model.layers.{i}.mlp.shared_expert_gate.weight", "blk.{i}.ffn_gate_inp_shexp.weight"),
)  # fmt: skip
# GGUF's fused tensors, named as the HF ones `fused_parts` splits (for the architectures that fuse them: Phi-3).
GGUF_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def expand_names(config: LlamaConfig, source: str) -> dict[str, str]:
    """Every concrete name of `source` ("hf" or "gguf") -> our parameter name, for this config's layers."""
    mapping: dict[str, str] = {}

    def add(entry: WeightName, **index: int) -> None:
        theirs = getattr(entry, source)
        if theirs is None:
            return
        if "{j}" in entry.ours and "{j}" not in theirs:  # stacked experts: ours keeps `{j}` for the loader's split
            mapping[theirs.format(**index)] = entry.ours.format(i=index["i"], j="{j}")
        else:
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


def fused_parts(name: str, config: LlamaConfig, fused_names: tuple[str, ...]) -> list[tuple[str, int]]:
    """A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) -> (our parameter, rows) in checkpoint order;
    [] for any other name."""
    prefix, _, last = name.rpartition(".")
    prefix, _, fused = prefix.rpartition(".")
    if last != "weight" or fused not in fused_names:
        return []
    if fused == "qkv_proj":
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(f"{prefix}.q_proj.weight", q), (f"{prefix}.k_proj.weight", kv), (f"{prefix}.v_proj.weight", kv)]
    if fused == "gate_up_proj":
        width = config.intermediate_size
        return [(f"{prefix}.gate_proj.weight", width), (f"{prefix}.up_proj.weight", width)]
    return []


def gguf_fused_name(gguf_name: str, fused_names: tuple[str, ...]) -> str | None:
    """`blk.{i}.attn_qkv.weight` (and Phi-3's `ffn_up`, gate and up stacked) -> the HF name `fused_parts` splits,
    where the architecture fuses it; else None."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in GGUF_FUSED_NAMES:
        return None
    hf = GGUF_FUSED_NAMES[parts[2]]
    return f"model.layers.{parts[1]}.{hf}.weight" if hf.rpartition(".")[2] in fused_names else None
