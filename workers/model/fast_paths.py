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
- decode steps in bf16 by the one-call native decoder (workers/model/native_decoder.py) where it applies;
- a mixture of experts' float experts stacked and run as two grouped GEMMs over the tokens sorted by expert
  (`GroupedExpertsMoe`): no host sync, one GEMM per projection instead of one per chosen expert.
Fusion and the one-call decoder are llama's: layers with q/k norms (Qwen3) or experts (Mixtral, Qwen-MoE; their
experts grouped as above) keep their plain forward, and a model with sliding-window layers never takes the one-call
decoder (`fusable`, `NativeDecoder.supports`); the native projections and norms apply to every architecture (Gemma,
workers/model/gemma.py, takes only the native projections: its norms, MLP and model classes are its own).

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
    SparseMoeBlock,
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
        if isinstance(layer.mlp, SparseMoeBlock) and GroupedExpertsMoe.applies(layer.mlp):
            GroupedExpertsMoe.fuse(layer.mlp)
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


class GroupedExpertsMoe(SparseMoeBlock):
    """Every expert's gate|up rows stacked into one [experts, 2 x width, hidden] tensor and its down rows into one
    [experts, hidden, width] (the experts' parameters become views of them); the tokens' (token, expert) pairs sorted
    by expert, then each projection is one grouped GEMM (F.grouped_mm, an offset per expert). Unlike the plain loop
    there is no host sync (its `.unique().tolist()`), so a step with experts can be captured in a CUDA graph."""

    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor

    @staticmethod
    def applies(moe: SparseMoeBlock) -> bool:
        """Float experts without hooks (quantized ones keep the loop), and F.grouped_mm on their device and dtype
        (CUDA takes bf16 from sm90; rows must be 16-byte multiples), tried once on small tensors of their shape."""
        linears = [p for expert in moe.experts for p in (expert.gate_proj, expert.up_proj, expert.down_proj)]
        if any(isinstance(m, quant_ops.QuantizedLinear) or m._forward_hooks or m.bias is not None for m in linears):
            return False
        if len({(m.weight.dtype, m.weight.device) for m in linears}) != 1:
            return False
        weight = moe.experts[0].gate_proj.weight  # [width, hidden]
        ends = torch.tensor([1, 2], dtype=torch.int32, device=weight.device)
        try:  # rows as wide as the hidden size and as the experts' width, on the weights' device and dtype
            for cols in weight.shape:
                F.grouped_mm(weight.new_zeros(2, cols), weight.new_zeros(2, 8, cols).transpose(1, 2), offs=ends)
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    @classmethod
    @torch.no_grad()
    def fuse(cls, moe: SparseMoeBlock) -> GroupedExpertsMoe:
        _become(moe, cls)
        assert isinstance(moe, GroupedExpertsMoe)
        moe.experts_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in moe.experts])
        moe.experts_down = torch.stack([e.down_proj.weight for e in moe.experts])
        width = moe.experts_gate_up.shape[1] // 2
        for j, expert in enumerate(moe.experts):
            expert.gate_proj.weight = nn.Parameter(moe.experts_gate_up[j, :width], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(moe.experts_gate_up[j, width:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(moe.experts_down[j], requires_grad=False)
        return moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.shape[0]:
            return super().forward(x)
        weights, chosen = self.route(x)
        experts = chosen.reshape(-1)  # the T x k (token, expert) pairs, token-major
        order = torch.argsort(experts, stable=True)  # grouped by expert, tokens ascending within each
        rows = order // self.top_k  # each sorted pair's token
        bounds = torch.arange(1, self.experts_gate_up.shape[0] + 1, device=x.device, dtype=experts.dtype)
        ends = torch.searchsorted(experts[order], bounds).to(torch.int32)  # where each expert's pairs end
        gate, up = F.grouped_mm(x[rows], self.experts_gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        down = F.grouped_mm(F.silu(gate) * up, self.experts_down.transpose(1, 2), offs=ends)
        # index_add_ adds each token's experts in ascending expert order, as the plain loop does.
        out = torch.zeros_like(x).index_add_(0, rows, down * weights.reshape(-1)[order, None])
        return self.add_shared_expert(x, out)


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
                                  (layer.mlp, "gate_up_weight"), (layer.mlp, "experts_gate_up"),
                                  (layer.mlp, "experts_down"))
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
