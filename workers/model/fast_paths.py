"""The inference fast paths, applied to a loaded plain model from outside (as workers/parallel.py applies tensor
parallelism), so workers/model/llama.py stays the reference they are tested against.

`apply_fast_paths(model)` rewires the model in place, once its weights are loaded:
- q/k/v and gate/up projections fused: one GEMM each instead of three and two, on every device;
- quantized GGUF weights (workers/model/quant_ops.py, loaded as QuantizedLinear modules) fused the same way when
  the fused projections share one block type, and multiplied by the native int8 kernels;
- on the CPU, projections, RMSNorm, RoPE and SiLU-and-multiply through the native kernels (workers/model/cpu_ops.py;
  each falls back to PyTorch for tensors it does not take), and the residual adds folded into the O and down
  projections' one rounding;
- weights on transparent huge pages (workers/model/hugepages.py);
- decode steps in bf16 by the one-call native decoder (workers/model/native_decoder.py) where it applies.
Fusion and the one-call decoder are llama's: layers with q/k norms (Qwen3) or experts (Mixtral, Qwen-MoE) keep their
plain forward, and a model with sliding-window layers never takes the one-call decoder (`fusable`,
`NativeDecoder.supports`); the native projections and norms apply to every architecture (Gemma, workers/model/gemma.py,
takes only the native projections: its norms, MLP and model classes are its own).

Each fast module is a subclass of the plain one that overrides `forward`; `_become` swaps a module's class in place
(as torch.nn.utils.parametrize does), so its parameters, state_dict names, forward hooks (tensor parallelism's
all-reduce) and KV-cache bindings all stay what they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from ringserve.workers.model import cpu_ops, quant_ops
from ringserve.workers.model.hugepages import move_to_huge_pages
from ringserve.workers.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    RotaryStep,
    rotate,
)
from ringserve.workers.model.native_decoder import NativeDecodingLlama
from torch import nn


def apply_fast_paths(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Prepares `model` for inference in place (call once its weights are loaded; a second call changes nothing)."""
    if isinstance(model, NativeDecodingLlama):
        return model
    for module in list(model.modules()):
        if type(module) is nn.Linear:
            _become(module, cpu_ops.Linear)
        elif type(module) is RMSNorm:
            _become(module, NativeRMSNorm)
    for layer in model.model.layers:
        if not fusable(layer):
            continue
        _become(layer, FusedDecoderLayer)
        layer.self_attn = FusedAttention.fuse(layer.self_attn, model.model.rotary.cos_sin)
        layer.mlp = FusedMLP.fuse(layer.mlp)
    _place_weights_on_huge_pages(model)
    if type(model) is LlamaForCausalLM:  # Gemma's own model class keeps its layer-by-layer forward
        _become(model, NativeDecodingLlama)
    return model


def fusable(layer: LlamaDecoderLayer) -> bool:
    """Fusion and the native decoder take plain llama layers; a layer with q/k norms (Qwen3) or a mixture of experts
    keeps its plain forward (its projections and norms still run on the native kernels)."""
    if type(layer.mlp) is not LlamaMLP or hasattr(layer.self_attn, "q_norm"):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return _one_storage(attn.q_proj, attn.k_proj, attn.v_proj) and _one_storage(mlp.gate_proj, mlp.up_proj)


def _one_storage(*linears: nn.Module) -> bool:
    """Float weights all, or quantized blocks of one type all (what one fused matrix can hold)."""
    kinds = {module.qweight.kind if isinstance(module, quant_ops.QuantizedLinear) else None for module in linears}
    return len(kinds) == 1


def _become(module: nn.Module, cls: type[nn.Module]) -> None:
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} is not a {type(module).__name__}")
    module.__class__ = cls


class NativeRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() and (native := cpu_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return native
        return super().forward(x)


class FusedAttention(LlamaAttention):
    """q/k/v as one matrix (the three parameters become views of it); queries and keys rotated as one tensor."""

    qkv_weight: torch.Tensor | quant_ops.QuantizedWeight
    qkv_bias: torch.Tensor | None
    cos_sin_table: Callable[[torch.device], torch.Tensor]

    @classmethod
    def fuse(cls, attn: LlamaAttention, cos_sin_table: Callable[[torch.device], torch.Tensor]) -> FusedAttention:
        _become(attn, cls)
        assert isinstance(attn, FusedAttention)
        attn.qkv_weight = _fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_bias = _fuse_biases(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.cos_sin_table = cos_sin_table  # the model's RotaryEmbedding.cos_sin, for the native kernel
        return attn

    def forward(self, x: torch.Tensor, rope: RotaryStep, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention block's output, plus `residual` when given."""
        tokens = x.shape[0]
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = quant_ops.linear(x, self.qkv_weight, self.qkv_bias).view(tokens, heads, self.head_dim)
        # In place in one native pass on CPU, else half the RoPE tensor operations of rotating them apart.
        qk = qkv[:, : self.num_heads + self.num_kv_heads]
        if not (qk.numel() and cpu_ops.rope_(qk, rope.positions, self.cos_sin_table(qk.device))):
            qk = rotate(qk, rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        return _project(self.o_proj, self.attend(q, k, v).reshape(tokens, self.num_heads * self.head_dim), residual)


class FusedMLP(LlamaMLP):
    """gate/up as one matrix, then SiLU-and-multiply in one native pass on CPU."""

    gate_up_weight: torch.Tensor | quant_ops.QuantizedWeight

    @classmethod
    def fuse(cls, mlp: LlamaMLP) -> FusedMLP:
        _become(mlp, cls)
        assert isinstance(mlp, FusedMLP)
        mlp.gate_up_weight = _fuse_linears(mlp.gate_proj, mlp.up_proj)
        return mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus `residual` when given."""
        gate_up = quant_ops.linear(x, self.gate_up_weight)
        if gate_up.numel() and (activated := cpu_ops.silu_mul(gate_up)) is not None:
            return _project(self.down_proj, activated, residual)
        gate, up = gate_up.chunk(2, dim=-1)
        return _project(self.down_proj, F.silu(gate) * up, residual)


class FusedDecoderLayer(LlamaDecoderLayer):
    """The residual adds go into the O and down projections (one rounding in the native kernel)."""

    self_attn: FusedAttention
    mlp: FusedMLP

    def forward(self, x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), rope, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


def _project(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + proj(x): the add folded into the projection's kernel unless the module has forward hooks (tensor
    parallelism all-reduces the projection's own output in one; the residual must be added after that)."""
    if residual is None:
        return proj(x)
    if proj._forward_hooks or not isinstance(proj, cpu_ops.Linear):
        return residual + proj(x)
    return proj(x, residual)


@torch.no_grad()
def _fuse_linears(*linears: nn.Linear) -> torch.Tensor | quant_ops.QuantizedWeight:
    """One weight matrix holding every linear's rows in order; each linear's weight becomes a view of its rows,
    so loading, state_dict and tensor-parallel slicing still see the original parameters and no memory is doubled.
    Quantized linears (all of one block type: `fusable`) give one QuantizedWeight the same way."""
    if isinstance(linears[0], quant_ops.QuantizedLinear):
        quantized = [module for module in linears if isinstance(module, quant_ops.QuantizedLinear)]
        blocks = quant_ops.QuantizedWeight.cat([module.qweight for module in quantized])
        start = 0
        for module in quantized:
            rows = module.qweight.rows
            module.qweight = blocks.slice_rows(slice(start, start + rows))
            start += rows
        return blocks
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


@torch.no_grad()
def _place_weights_on_huge_pages(model: LlamaForCausalLM) -> None:
    """Every parameter and fused matrix onto one huge-page mapping when they are on the CPU; the arena is kept on
    the model (`weight_arena`), since the mapping must live as long as the tensors in it."""
    params = list(model.parameters())
    fused = [(module, name) for layer in model.model.layers
             for module, name in ((layer.self_attn, "qkv_weight"), (layer.self_attn, "qkv_bias"),
                                  (layer.mlp, "gate_up_weight"))
             if isinstance(getattr(module, name, None), torch.Tensor)]  # fmt: skip

    def rebind(i: int, tensor: torch.Tensor) -> None:
        if i < len(params):
            params[i].data = tensor
        else:
            setattr(*fused[i - len(params)], tensor)

    tensors = [p.data for p in params] + [getattr(module, name) for module, name in fused]
    arena = move_to_huge_pages(tensors, rebind)
    if arena is not None:
        model.weight_arena = arena
