"""The one-call native decoder: every layer and the final norm of a CPU step in one native call
(csrc/kernels/cpu_decoder.h), installed by workers/model/fast_paths.py as the model's forward where it applies: bf16
models with dense projections (on CPUs with the AVX-512 projection kernels), and bf16 or float32 models whose
projections are quantized GGUF blocks (`--quantization gguf`, on CPUs with the int8 kernel's AVX2 path).

It runs the same kernels, in the same order and with the same roundings, as the fused layer-by-layer path, so it
gives the same bits without a dozen Python-dispatched operators per layer. Steps it does not take (a prefill chunk
longer than NATIVE_MAX_CHUNK or with a speculative tree, another dtype or device, tensor parallelism, the kernels
missing) run layer by layer.
"""

from __future__ import annotations

from typing import Any

import torch
from ringserve.workers.attention import AttentionBackend, get_attention_metadata
from ringserve.workers.model.cpu_ops import native_chunk_attention, native_decoder_module
from ringserve.workers.model.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM
from ringserve.workers.model.quant_ops import QuantizedLinear, QuantizedWeight
from torch import nn


class NativeDecodingLlama(LlamaForCausalLM):
    """The model once the fast paths are applied: steps the native decoder takes skip the layer-by-layer forward."""

    # A class default: an instance may turn the native decoder off (`model.native_decode = False`) before or after
    # the fast paths are applied.
    native_decode: bool = True
    # None: not built yet; False: it cannot run this model. It borrows the weights' and caches' memory, so binding
    # other caches drops it.
    _decoder: NativeDecoder | bool | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        hidden = self._decode_natively(input_ids, positions) if self.native_decode else None
        if hidden is None:
            return super().forward(input_ids, positions, float_logits)
        return self.logits(hidden, float_logits)

    def bind_kv_cache(self, kv_cache: KVCache, backend: AttentionBackend) -> None:
        super().bind_kv_cache(kv_cache, backend)
        self._decoder = None

    def native_decoder(self) -> NativeDecoder | None:
        """The decoder for the bound KV caches, built on first use; None where it cannot run this model."""
        if self._decoder is None:
            module = native_decoder_module(quantized=NativeDecoder.quantized(self))
            runs = module is not None and NativeDecoder.supports(self)
            self._decoder = NativeDecoder(self, module) if runs else False
        return self._decoder or None

    def _decode_natively(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final-normed hidden states of a step by the native decoder, or None where it does not apply. Its
        attention runs the same paged kernels as the layer-by-layer path."""
        md = get_attention_metadata()
        if not md.query_lens_cpu or sum(md.query_lens_cpu) != input_ids.shape[0] or input_ids.device.type != "cpu":
            return None
        _, long, _ = md.paged_split(native_chunk_attention(self.config.head_dim))
        if long:
            return None
        decoder = self.native_decoder()
        if decoder is None:
            return None
        for index in (md.slot_mapping, md.block_tables, md.seq_lens, md.cu_seqlens_q):
            if index.device.type != "cpu" or not index.is_contiguous():
                return None
        if md.slot_mapping.dtype is not torch.int64 or any(
                t.dtype is not torch.int32 for t in (md.block_tables, md.seq_lens, md.cu_seqlens_q)):  # fmt: skip
            return None
        return decoder.decode(input_ids, positions, md.slot_mapping, md.block_tables, md.seq_lens, md.cu_seqlens_q)


class NativeDecoder:
    """`DecoderBf16` / `DecoderF32` over a fused model's weights and KV caches; holds the tensors whose memory it
    borrows."""

    def __init__(self, model: LlamaForCausalLM, module: Any) -> None:
        cfg = model.config
        layers = model.model.layers
        k0 = layers[0].self_attn.k_cache
        assert k0 is not None
        self.quantized = NativeDecoder.quantized(model)
        self._tensors: list[torch.Tensor] = []
        addresses, kinds, panels = [], [], []
        for layer in layers:
            parts = self._layer_tensors(layer)
            addresses.append([0 if t is None else t.data_ptr() for t in parts])
            self._tensors += [t for t in parts if t is not None]
            projections = self._projections(layer)
            kinds.append([w.kind if isinstance(w, QuantizedWeight) else -1 for w in projections])
            layer_panels = [w.panels if isinstance(w, QuantizedWeight) else None for w in projections]
            panels.append([0 if p is None else p.data_ptr() for p in layer_panels])
            self._tensors += [p for p in layer_panels if p is not None]
        self._tensors.append(model.model.norm.weight)
        native = module.DecoderBf16 if model.model.norm.weight.dtype is torch.bfloat16 else module.DecoderF32
        self._decoder = native(
            hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, num_blocks=k0.shape[0], block_size=k0.shape[1],
            max_position=cfg.max_position, rms_eps=cfg.rms_eps, attention_scale=layers[0].self_attn.scale,
            layers=addresses, final_norm=model.model.norm.weight.data_ptr(), quant_types=kinds, quant_panels=panels,
        )  # fmt: skip
        self._embed = model.model.embed_tokens
        self._rotary = model.model.rotary

    @staticmethod
    def quantized(model: LlamaForCausalLM) -> bool:
        return any(isinstance(m, QuantizedLinear) for m in model.model.layers.modules())

    @staticmethod
    def _projections(layer: LlamaDecoderLayer) -> tuple[torch.Tensor | QuantizedWeight, ...]:
        """qkv, o, gate_up and down weights: dense tensors or quantized blocks."""
        attn, mlp = layer.self_attn, layer.mlp
        o, down = attn.o_proj, mlp.down_proj
        return (attn.qkv_weight, o.qweight if isinstance(o, QuantizedLinear) else o.weight, mlp.gate_up_weight,
                down.qweight if isinstance(down, QuantizedLinear) else down.weight)  # fmt: skip

    @staticmethod
    def _layer_tensors(layer: LlamaDecoderLayer) -> tuple[torch.Tensor | None, ...]:
        """The layer's memory in the order the decoder takes it (qkv_bias None when the model has none; quantized
        projections as their blocks' bytes)."""
        attn = layer.self_attn
        qkv, o, gate_up, down = (w.data if isinstance(w, QuantizedWeight) else w
                                 for w in NativeDecoder._projections(layer))  # fmt: skip
        return (layer.input_layernorm.weight, qkv, getattr(attn, "qkv_bias", None), o,
                layer.post_attention_layernorm.weight, gate_up, down, attn.k_cache, attn.v_cache)  # fmt: skip

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Fused projections, every one dense bf16 or every one quantized (then with float32 or bf16 norms and
        caches), on the CPU; no hooks (tensor parallelism adds collectives as forward hooks), even widths (the native
        bf16 projection's layout for batches of three or more rows)."""
        cfg = model.config
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
            return False
        if type(model.model.embed_tokens) is not nn.Embedding or cfg.hidden_size % 2 or cfg.intermediate_size % 2:
            return False
        if (cfg.num_heads * cfg.head_dim) % 2:
            return False
        if any(cfg.window(i) is not None for i in range(cfg.num_layers)):
            return False  # its paged attention has no sliding window
        if cfg.rotary_dim != cfg.head_dim:
            return False  # its RoPE rotates whole heads
        quantized = NativeDecoder.quantized(model)
        dtype = model.model.norm.weight.dtype
        if dtype not in ((torch.bfloat16, torch.float32) if quantized else (torch.bfloat16,)):
            return False
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if getattr(attn, "qkv_weight", None) is None or getattr(mlp, "gate_up_weight", None) is None:
                return False
            if attn.k_cache is None or attn.v_cache is None:
                return False
            if attn.k_cache.shape != attn.v_cache.shape or attn.k_cache.dim() != 4:
                return False
            projections = NativeDecoder._projections(layer)
            if any(isinstance(w, QuantizedWeight) != quantized for w in projections):
                return False
            blocks = {id(w.data) for w in projections if isinstance(w, QuantizedWeight)}
            for t in NativeDecoder._layer_tensors(layer):
                want = torch.uint8 if id(t) in blocks else dtype
                if t is not None and (t.dtype is not want or t.device.type != "cpu" or not t.is_contiguous()):
                    return False
        norm = model.model.norm.weight
        return norm.device.type == "cpu"

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
