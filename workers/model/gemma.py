"""Gemma 2 and Gemma 3 over the same packed batch and paged KV cache as workers/model/llama.py, in plain PyTorch.

What differs from the llama decoder: RMSNorm scales by (1 + w); each layer has four norms (before and after
attention, before and after the MLP, the "after" ones applied to the branch before the residual add); the MLP is
GELU-tanh gated; the embedding is scaled by sqrt(hidden); attention scales by query_pre_attn_scalar^-0.5 instead of
head_dim^-0.5; Gemma 2 soft-caps the attention logits and the final logits (cap * tanh(x / cap)); Gemma 3 has
per-head q/k norms and its sliding-window layers use their own RoPE base (`rope_local_theta`).
Parameter names follow Hugging Face's Gemma2ForCausalLM / Gemma3ForCausalLM. The fast paths leave these modules
alone (their classes are not llama's), except the native linear projections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ringserve.workers.attention import get_attention_metadata
from ringserve.workers.model.llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RotaryEmbedding,
    RotaryStep,
)
from torch import nn


@dataclass
class GemmaConfig(LlamaConfig):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None  # Gemma 2: 50.0
    final_logit_softcapping: float | None = None  # Gemma 2: 30.0
    rope_local_theta: float | None = None  # Gemma 3: sliding-window layers' RoPE base (plain RoPE); None = rope_theta


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), in float32 then cast back (as HF's Gemma does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(LlamaAttention):
    def __init__(self, config: GemmaConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_eps)  # type: ignore[assignment]
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_eps)  # type: ignore[assignment]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return super().attend(q, k, v)
        if self.k_cache is None or self.v_cache is None or self.backend is None:
            raise RuntimeError("no KV cache bound; call LlamaForCausalLM.bind_kv_cache before the forward pass")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_attention_metadata(), self.scale,
                                    window=self.window, softcap=self.softcap)  # fmt: skip


class GemmaDecoderLayer(LlamaDecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, config: GemmaConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = GemmaAttention(config, layer)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)  # type: ignore[assignment]
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_eps)  # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_eps)  # type: ignore[assignment]
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_eps)
        self.local = config.window(layer) is not None and config.rope_local_theta is not None

    def forward(self, x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    def __init__(self, config: GemmaConfig) -> None:
        nn.Module.__init__(self)
        on_meta = torch.get_default_device().type == "meta"
        table = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.rotary = RotaryEmbedding(config)
        if config.rope_local_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.rotary_local = RotaryEmbedding(local)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))  # type: ignore[assignment]
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_eps)  # type: ignore[assignment]
        self.embed_scale = config.hidden_size**0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as HF does
        rope = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if hasattr(self, "rotary_local") else rope
        for layer in self.layers:
            x = layer(x, local if layer.local else rope)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: GemmaConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaModel(config)  # type: ignore[assignment]
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def logits(self, hidden: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        logits = super().logits(hidden, float_logits)
        cap = self.config.final_logit_softcapping  # type: ignore[attr-defined]
        return logits if cap is None else torch.tanh(logits / cap) * cap


__all__ = ["GemmaConfig", "GemmaForCausalLM"]
