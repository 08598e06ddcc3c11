"""The decoder of the llama family over a packed batch with a paged KV cache, in plain PyTorch.

One config-driven model serves every architecture that is a llama with flags (workers/model/registry.py lists them):
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, Phi-3, Qwen where configured),
RoPE scaling (workers/model/rope.py), partial rotary embeddings (Phi-4-mini), and a mixture of experts in place of
the MLP (Mixtral, Qwen2/3-MoE).
The forward takes the flat token ids and positions of every sequence in the step (no padding) and reads the
step's layout (slot mapping, block tables, which rows produce logits) from the attention metadata.
Parameter names follow Hugging Face's LlamaForCausalLM / Qwen2MoeForCausalLM, so the loaders map names by table.
This file is the reference: the fast paths (fused projections, native CPU kernels, the one-call decoder, huge
pages) are applied to a loaded model from outside by workers/model/fast_paths.py and tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from ringserve.workers.attention import AttentionBackend, get_attention_metadata
from ringserve.workers.model.rope import rope_frequencies
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
    # HF-style dict with "rope_type" (workers/model/rope.py: linear, dynamic, llama3, yarn) and its parameters;
    # None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    # The share of each head that RoPE rotates (Phi-4-mini: 0.75): its first `rotary_dim` dims; the rest pass through.
    partial_rotary_factor: float = 1.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    # One entry per layer: its sliding window, or None for global attention; empty = every layer global.
    layer_windows: tuple[int | None, ...] = ()
    # Mixture of experts (SparseMoeBlock): num_experts = 0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen-MoE's always-on expert; 0 = none
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # which layers are sparse; empty = all of them
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        partial = self.partial_rotary_factor != 1.0  # a full rotation's width is the head's, whatever it is
        if partial and (not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2):
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} rotates {self.rotary_dim} of "
                             f"head_dim {self.head_dim}: need an even number of dims in (0, head_dim]")  # fmt: skip

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates at the start of each q and k head (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query sees the last `window` positions, itself included), or None."""
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


class RotaryStep(NamedTuple):
    """The step's positions [T] and their cos and sin [T, 1, rotary_dim], looked up once for every layer."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """HF "rotate_half" RoPE: the two halves of each head's first rotary_dim dims are the (real, imaginary) pairs."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.freq_factors: torch.Tensor | None = None  # GGUF `rope_freqs` divides inv_freq (llama3 files)
        self._cos_sin: torch.Tensor | None = None  # built lazily so meta-device construction stays free

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        self.freq_factors = factors.float()
        self._cos_sin = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        """The float32 table [2, max_position, rotary_dim] of every position's cos and sin."""
        if self._cos_sin is None or self._cos_sin.device != device:
            cfg = self.config
            # Partial rotary: the frequencies are those of a head rotary_dim wide, as transformers computes them.
            inv_freq, attention_factor = rope_frequencies(
                cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position
            )
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors.cpu()
            t = torch.arange(self.config.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = (torch.stack((emb.cos(), emb.sin())) * attention_factor).to(device)
        return self._cos_sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        cos_sin = self.cos_sin(positions.device)[:, positions].to(dtype)  # [2, T, head_dim]
        return RotaryStep(positions, cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1))


def rotate(x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
    """RoPE on [T, heads, head_dim]: x * cos + rotate_half(x) * sin over the first rotary_dim dims (the width of
    the step's cos/sin), the rest of each head passed through unchanged."""
    dim = rope.cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :dim], rope), x[..., dim:]), dim=-1)
    half = dim // 2
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

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.window = config.window(layer)
        if config.qk_norm:  # one weight over head_dim, shared by every head
            self.q_norm = RMSNorm(self.head_dim, config.rms_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_eps)
        # Bound by LlamaForCausalLM.bind_kv_cache; plain attributes, not buffers, so state_dict stays weights only.
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, rope), rotate(k, rope)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v).reshape(tokens, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes this step's k and v into the cache, then attends causally over each sequence's cached context."""
        if self.k_cache is None or self.v_cache is None or self.backend is None:
            raise RuntimeError("no KV cache bound; call LlamaForCausalLM.bind_kv_cache before the forward pass")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_attention_metadata(), self.scale,
                                    window=self.window)  # fmt: skip


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Mixture of SwiGLU experts (Mixtral, Qwen2/3-MoE): each token goes to its top-k experts by router softmax,
    their outputs weighted by those probabilities (renormalised to sum to 1 with norm_topk_prob); Qwen2-MoE adds an
    always-on shared expert scaled by a sigmoid gate."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            LlamaMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (in x's dtype)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def add_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        # One small matmul per chosen expert, and a host sync to list them: the readable reference. The fast path
        # (workers/model/fast_paths.py, GroupedExpertsMoe) runs every expert in two grouped GEMMs without a sync.
        for e in chosen.unique().tolist():  # only the experts some token chose
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return self.add_shared_expert(x, out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP (or mixture of experts), each added to the stream it read."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        dense = not config.is_moe_layer(layer)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size) if dense else SparseMoeBlock(config)
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
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
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
