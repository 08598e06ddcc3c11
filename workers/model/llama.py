"""Llama-family decoder over a packed batch with a paged KV cache.

The forward takes the flat token ids and positions of every sequence in the step (no padding) and reads the
step's layout (slot mapping, block tables, which rows produce logits) from the attention metadata.
Parameter names follow Hugging Face's LlamaForCausalLM so the HF loader maps names one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from ringserve.workers.attention import AttentionBackend, get_attention_backend, get_attention_metadata
from ringserve.workers.model.cpu_ops import Linear, linear, native_chunk_attention, native_decoder_module
from ringserve.workers.model.cpu_ops import rms_norm as cpu_rms_norm
from ringserve.workers.model.cpu_ops import rope_ as cpu_rope_
from ringserve.workers.model.cpu_ops import silu_mul as cpu_silu_mul
from ringserve.workers.model.hugepages import move_to_huge_pages
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


class RotaryEmbedding(nn.Module):
    """HF "rotate_half" RoPE: the two halves of each head are the (real, imaginary) pairs."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.freq_factors: torch.Tensor | None = None  # GGUF `rope_freqs` divides inv_freq (llama3 files)
        self._cos_sin: torch.Tensor | None = None  # built lazily so meta-device construction stays free
        # Every layer rotates by the same positions: the step's cos/sin are looked up once and reused.
        self._step_key: tuple[torch.Tensor, torch.dtype] | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        self.freq_factors = factors.float()
        self._cos_sin = None
        self._step_key = self._step_cos_sin = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = rope_inv_freq(self.config)
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors.cpu()
            t = torch.arange(self.config.max_position, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = torch.stack((emb.cos(), emb.sin())).to(device)  # [2, max_position, head_dim]
        return self._cos_sin

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] for this step's positions, computed by the first layer that asks."""
        key = self._step_key
        if key is None or key[0] is not positions or key[1] != dtype or self._step_cos_sin is None:
            cos_sin = self.cos_sin(positions.device)[:, positions].to(dtype)  # [2, T, head_dim]
            self._step_cos_sin = (cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1))
            self._step_key = (positions, dtype)
        return self._step_cos_sin

    def end_step(self) -> None:
        self._step_key = self._step_cos_sin = None

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RoPE on [T, heads, head_dim] (queries and keys may be rotated together as one tensor)."""
        cos, sin = self.step_cos_sin(positions, x.dtype)
        return x * cos + _rotate_half(x) * sin

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """`rotate` in place by the native CPU kernel (same roundings); False, changing nothing, where it does not
        apply (another device, dtype or layout)."""
        return x.numel() > 0 and cpu_rope_(x, positions, self.cos_sin(x.device))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() and (native := cpu_rms_norm(x, self.weight, self.eps)) is not None:
            return native
        # Normalise in float32 (as HF does) so bf16 activations do not lose the variance.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        # Set by `fuse_projections`: q/k/v weights concatenated into one matrix (the three parameters become
        # views of it), so a step runs one GEMM instead of three.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # Bound by LlamaForCausalLM.bind_kv_cache; plain attributes, not buffers, so state_dict stays weights only.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        self.qkv_weight = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_bias = _fuse_biases(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output, plus `residual` when given."""
        tokens = x.shape[0]
        if self.qkv_weight is not None:
            heads = self.num_heads + 2 * self.num_kv_heads
            qkv = linear(x, self.qkv_weight, self.qkv_bias).view(tokens, heads, self.head_dim)
            # Queries and keys are rotated as one tensor: in place in one native pass on CPU, else half the RoPE
            # tensor operations of rotating them apart.
            qk = qkv[:, : self.num_heads + self.num_kv_heads]
            if not self.rotary.rotate_(positions, qk):
                qk = self.rotary.rotate(positions, qk)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            v = qkv[:, self.num_heads + self.num_kv_heads :]
        else:
            q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, q, k)
        if self.k_cache is None or self.v_cache is None or self.backend is None:
            raise RuntimeError("no KV cache bound; call LlamaForCausalLM.bind_kv_cache before the forward pass")
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_attention_metadata(), self.scale)
        return _project(self.o_proj, out.reshape(tokens, self.num_heads * self.head_dim), residual)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by `fuse_projections`, like LlamaAttention's

    def fuse_projections(self) -> None:
        self.gate_up_weight = _fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus `residual` when given."""
        if self.gate_up_weight is not None:
            gate_up = linear(x, self.gate_up_weight)
            if gate_up.numel() and (activated := cpu_silu_mul(gate_up)) is not None:
                return _project(self.down_proj, activated, residual)
            gate, up = gate_up.chunk(2, dim=-1)
            return _project(self.down_proj, F.silu(gate) * up, residual)
        return _project(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), residual)


def _project(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(x): the add folded into the projection's kernel unless the module has forward hooks (tensor
    parallelism all-reduces the projection's own output in one; the residual must be added after that)."""
    if residual is None:
        return proj(x)
    if proj._forward_hooks or not isinstance(proj, Linear):
        return residual + proj(x)
    return proj(x, residual)


@torch.no_grad()
def _fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight matrix holding every linear's rows in order; each linear's weight becomes a view of its rows,
    so loading, state_dict and tensor-parallel slicing still see the original parameters and no memory is doubled."""
    fused = torch.cat([module.weight for module in linears])
    start = 0
    for module in linears:
        rows = module.weight.shape[0]
        module.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


@torch.no_grad()
def _fuse_biases(*linears: nn.Linear) -> torch.Tensor | None:
    if all(module.bias is None for module in linears):
        return None
    parts = [module.bias if module.bias is not None else module.weight.new_zeros(module.weight.shape[0])
             for module in linears]  # fmt: skip
    fused = torch.cat(parts)
    start = 0
    for module, part in zip(linears, parts, strict=True):
        if module.bias is not None:
            module.bias = nn.Parameter(fused[start : start + part.shape[0]], requires_grad=False)
        start += part.shape[0]
    return fused


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = self.self_attn(positions, self.input_layernorm(x), residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # On the meta device (the loaders build the model there, then load every weight) the embedding's random init is
        # skipped: its normal_ runs a Python meta kernel whose first call imports torch._dynamo, 2 s of every start.
        on_meta = torch.get_default_device().type == "meta"
        table = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        try:
            for layer in self.layers:
                x = layer(positions, x)
        finally:
            self.rotary.end_step()  # the cached cos/sin belong to this step's positions only
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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Decode steps on CPU in bf16 run every layer in one native call (NativeDecoder) unless this is False. The
        # decoder borrows the weights' and caches' memory: it is rebuilt after fuse_projections / bind_kv_cache, and
        # weights must not be replaced in between.
        self.native_decode = True
        self._native_decoder: NativeDecoder | bool | None = None  # None: not built yet; False: cannot be built

    def fuse_projections(self) -> None:
        """Concatenates q/k/v and gate/up weights for inference (call once, after the weights are loaded), then
        places every weight on huge pages when they are on the CPU (workers/model/hugepages.py)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        self._place_weights_on_huge_pages()
        self._native_decoder = None

    @torch.no_grad()
    def _place_weights_on_huge_pages(self) -> None:
        params = list(self.parameters())
        fused = [(module, name) for layer in self.model.layers
                 for module, name in ((layer.self_attn, "qkv_weight"), (layer.self_attn, "qkv_bias"),
                                      (layer.mlp, "gate_up_weight"))
                 if getattr(module, name) is not None]  # fmt: skip

        def rebind(i: int, tensor: torch.Tensor) -> None:
            if i < len(params):
                params[i].data = tensor
            else:
                setattr(*fused[i - len(params)], tensor)

        tensors = [p.data for p in params] + [getattr(module, name) for module, name in fused]
        arena = move_to_huge_pages(tensors, rebind)
        if arena is not None:
            self._weight_arena = arena  # the mapping lives as long as the model

    def bind_kv_cache(self, kv_cache: KVCache, backend: AttentionBackend | None = None) -> None:
        backend = backend or get_attention_backend("auto", kv_cache.k[0].device)
        for layer, k, v in zip(self.model.layers, kv_cache.k, kv_cache.v, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache, layer.self_attn.backend = k, v, backend
        self._native_decoder = None

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Logits of every row from the first `num_layers` layers, the final norm and the LM head (a self-draft)."""
        x = self.model.embed_tokens(input_ids)
        try:
            for layer in self.model.layers[:num_layers]:
                x = layer(positions, x)
        finally:
            self.model.rotary.end_step()
        return self.lm_head(self.model.norm(x)).float()

    def _decode_natively(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of a step by the native decoder, or None where it does not apply (a sequence
        that the layer-by-layer path sends to SDPA: a chunk longer than NATIVE_MAX_CHUNK or with a speculative tree;
        another dtype or device, tensor parallelism, the kernels missing). Its attention runs the same paged kernels
        as the layer-by-layer path."""
        md = get_attention_metadata()
        if not md.query_lens_cpu or sum(md.query_lens_cpu) != input_ids.shape[0] or input_ids.device.type != "cpu":
            return None
        _, long, _ = md.paged_split(native_chunk_attention(self.config.head_dim))
        if long:
            return None
        decoder = self._native_decoder
        if decoder is None:
            module = native_decoder_module()
            decoder = NativeDecoder(self, module) if module is not None and NativeDecoder.supports(self) else False
            self._native_decoder = decoder
        if decoder is False:
            return None
        for index in (md.slot_mapping, md.block_tables, md.seq_lens, md.cu_seqlens_q):
            if index.device.type != "cpu" or not index.is_contiguous():
                return None
        if md.slot_mapping.dtype is not torch.int64 or any(
                t.dtype is not torch.int32 for t in (md.block_tables, md.seq_lens, md.cu_seqlens_q)):  # fmt: skip
            return None
        return decoder.decode(input_ids, positions, md.slot_mapping, md.block_tables, md.seq_lens, md.cu_seqlens_q)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        """Packed token ids and positions [num_tokens] -> logits for the metadata's logits rows: float32, or with
        `float_logits=False` in the weights' dtype (what the sampler's greedy pass reads without a float32 copy;
        widening bf16 to float32 later is exact)."""
        hidden = self._decode_natively(input_ids, positions) if self.native_decode else None
        if hidden is None:
            hidden = self.model(input_ids, positions)
        rows = get_attention_metadata().logits_indices
        if rows is not None:
            hidden = hidden[rows]
        logits = self.lm_head(hidden)
        return logits.float() if float_logits else logits


class NativeDecoder:
    """Every layer and the final norm of a decode step (one new token per sequence) in one call of the native
    decoder (csrc/kernels/cpu_decoder.h): the same kernels, order and roundings as the layer-by-layer path, so the
    same bits, without a dozen Python-dispatched operators per layer. Holds the tensors whose memory it borrows."""

    def __init__(self, model: LlamaForCausalLM, module: Any) -> None:
        cfg = model.config
        layers = model.model.layers
        k0 = layers[0].self_attn.k_cache
        assert k0 is not None
        self._tensors: list[torch.Tensor] = []
        addresses = []
        for layer in layers:
            parts = self._layer_tensors(layer)
            addresses.append([0 if t is None else t.data_ptr() for t in parts])
            self._tensors += [t for t in parts if t is not None]
        self._tensors.append(model.model.norm.weight)
        self._decoder = module.DecoderBf16(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, num_blocks=k0.shape[0], block_size=k0.shape[1],
            max_position=cfg.max_position, rms_eps=cfg.rms_eps, attention_scale=layers[0].self_attn.scale,
            layers=addresses, final_norm=model.model.norm.weight.data_ptr(),
        )  # fmt: skip
        self._embed = model.model.embed_tokens
        self._rotary = model.model.rotary

    @staticmethod
    def _layer_tensors(layer: LlamaDecoderLayer) -> tuple[torch.Tensor | None, ...]:
        """The layer's memory in the order DecoderBf16 takes it (qkv_bias None when the model has none)."""
        attn, mlp = layer.self_attn, layer.mlp
        return (layer.input_layernorm.weight, attn.qkv_weight, attn.qkv_bias, attn.o_proj.weight,
                layer.post_attention_layernorm.weight, mlp.gate_up_weight, mlp.down_proj.weight, attn.k_cache,
                attn.v_cache)  # fmt: skip

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """bf16 weights and caches on the CPU, fused projections, no hooks (tensor parallelism adds collectives as
        forward hooks), even widths (the native projection's layout for batches of three or more rows)."""
        cfg = model.config
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return False
        if type(model.model.embed_tokens) is not nn.Embedding or cfg.hidden_size % 2 or cfg.intermediate_size % 2:
            return False
        if (cfg.num_heads * cfg.head_dim) % 2:
            return False
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_weight is None or mlp.gate_up_weight is None or attn.k_cache is None or attn.v_cache is None:
                return False
            if attn.k_cache.shape != attn.v_cache.shape or attn.k_cache.dim() != 4:
                return False
            for t in NativeDecoder._layer_tensors(layer):
                if t is not None and (t.dtype is not torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous()):
                    return False
        norm = model.model.norm.weight
        return norm.dtype is torch.bfloat16 and norm.device.type == "cpu"

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
               seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The final-normed hidden states [rows, hidden] of a step by its own index: sequence i owns rows
        [cu_seqlens_q[i], cu_seqlens_q[i + 1]), the last of its seq_lens[i] positions, attending causally through
        block table row i (int32 tables, lengths and offsets)."""
        x = self._embed(input_ids).contiguous()
        normed = torch.empty_like(x)
        pos = positions.long().contiguous()  # no copy when it already is
        cos_sin = self._rotary.cos_sin(x.device)
        self._decoder.decode(x.data_ptr(), normed.data_ptr(), pos.data_ptr(), slots.data_ptr(), cos_sin.data_ptr(),
                             tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), x.shape[0],
                             tables.shape[0], tables.shape[1], threads=torch.get_num_threads())  # fmt: skip
        return normed
