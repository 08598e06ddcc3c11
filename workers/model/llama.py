"""Llama-family decoder over a packed batch with a paged KV cache, in plain PyTorch.

The forward takes the flat token ids and positions of every sequence in the step (no padding) and reads the
step's layout (slot mapping, block tables, which rows produce logits) from the attention metadata.
Parameter names follow Hugging Face's LlamaForCausalLM so the HF loader maps names one to one.
This file is the reference: the fast paths (fused projections, native CPU kernels, the one-call decoder, huge
pages) are applied to a loaded model from outside by workers/model/fast_paths.py and tested against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from ringserve.workers.attention import AttentionBackend, get_attention_metadata
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} or {"rope_type": "linear", "factor"}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Reads a Hugging Face config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position=_attended_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and does not write the flag.
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def _attended_positions(cfg: dict[str, Any]) -> int:
    """Sliding-window attention is not implemented, so a windowed model is only exact up to its window."""
    limit = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    windowed = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    return min(limit, int(window)) if windowed and window else limit


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] with the checkpoint's scaling applied (float32, as HF computes them)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: none, linear, llama3)")


class RotaryStep(NamedTuple):
    """The step's positions [T] and their cos and sin [T, 1, head_dim], looked up once for every layer."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """HF "rotate_half" RoPE: the two halves of each head are the (real, imaginary) pairs."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.freq_factors: torch.Tensor | None = None  # GGUF `rope_freqs` divides inv_freq (llama3 files)
        self._cos_sin: torch.Tensor | None = None  # built lazily so meta-device construction stays free

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        self.freq_factors = factors.float()
        self._cos_sin = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        """The float32 table [2, max_position, head_dim] of every position's cos and sin."""
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = rope_inv_freq(self.config)
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors.cpu()
            t = torch.arange(self.config.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = torch.stack((emb.cos(), emb.sin())).to(device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        cos_sin = self.cos_sin(positions.device)[:, positions].to(dtype)  # [2, T, head_dim]
        return RotaryStep(positions, cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1))


def rotate(x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
    """RoPE on [T, heads, head_dim]: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * rope.cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * rope.sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as HF does) so bf16 activations do not lose the variance.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention: num_heads query heads share num_kv_heads key/value heads, read through the paged KV
    cache by the attention backend with the step's metadata."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        # Bound by LlamaForCausalLM.bind_kv_cache; plain attributes, not buffers, so state_dict stays weights only.
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
        tokens = x.shape[0]
        q = rotate(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), rope)
        k = rotate(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), rope)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v).reshape(tokens, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes this step's k and v into the cache, then attends causally over each sequence's cached context."""
        if self.k_cache is None or self.v_cache is None or self.backend is None:
            raise RuntimeError("no KV cache bound; call LlamaForCausalLM.bind_kv_cache before the forward pass")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_attention_metadata(), self.scale)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP, each added to the stream it read."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # On the meta device (the loaders build the model there, then load every weight) the embedding's random init is
        # skipped: its normal_ runs a Python meta kernel whose first call imports torch._dynamo, 2 s of every start.
        on_meta = torch.get_default_device().type == "meta"
        table = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states [num_tokens, hidden] of every token."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


@dataclass
class KVCache:
    """One K and one V tensor per layer, each [num_blocks, block_size, kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, config: LlamaConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeroed, not empty: padded gathers read unused blocks and NaN garbage would survive a zero weight.
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
        )

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_cache(self, kv_cache: KVCache, backend: AttentionBackend) -> None:
        for layer, k, v in zip(self.model.layers, kv_cache.k, kv_cache.v, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache, layer.self_attn.backend = k, v, backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        """Packed token ids and positions [num_tokens] -> logits for the metadata's logits rows: float32, or with
        `float_logits=False` in the weights' dtype (what the sampler's greedy pass reads without a float32 copy;
        widening bf16 to float32 later is exact)."""
        return self.logits(self.model(input_ids, positions), float_logits)

    def logits(self, hidden: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        """The LM head over the final-normed hidden states of the metadata's logits rows (all rows when None)."""
        rows = get_attention_metadata().logits_indices
        if rows is not None:
            hidden = hidden[rows]
        logits = self.lm_head(hidden)
        return logits.float() if float_logits else logits
