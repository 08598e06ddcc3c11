"""GGUF loader: the config from the file's metadata, tensors dequantized to float with the `gguf` package.

Tensor names are llama.cpp's (gguf-py's TENSOR_NAMES); workers/loader/weight_names.py maps them to ours. Mixtures of
experts (Mixtral is written as `llama` with `{arch}.expert_count`; qwen2moe, qwen3moe) store each projection of a
layer's experts as one 3-D tensor, split here into the experts' matrices; Phi-3's fused `attn_qkv` and `ffn_up` (gate
and up) are split by rows, and its `rope.dimension_count` below the head size is the partial rotary width.

llama.cpp's converter permutes the rows of Q and K so its interleaved ("GPT-J") RoPE sees each head's pairs
as (2j, 2j+1). Our model uses HF's rotate_half RoPE (pairs (j, j + head_dim/2)), so Q and K are un-permuted
on load, exactly as transformers does.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from ringserve.formats.gguf_file import GGUFFile
from ringserve.workers.loader.weight_names import expand_names, fused_parts, gguf_fused_name
from ringserve.workers.loader.weight_sink import WeightSink, build_empty_model
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM, quant_ops
from ringserve.workers.model.gemma import GemmaConfig, GemmaForCausalLM
from ringserve.workers.model.registry import Architecture, gguf_architecture
from ringserve.workers.parallel import TensorParallelShard
from ringserve.workers.pipeline import PipelineStage
from tqdm import tqdm

# Storage types gguf's `dequantize` reads: float, the legacy block types and the k-quants.
SUPPORTED_TYPES = tuple(GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))  # fmt: skip
# Consumed apart: RoPE frequency factors (llama3), Phi-3's LongRoPE factor lists (read into the config).
_IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _need(reader: GGUFReader, key: str, path: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata is missing {key!r}")
    return value


def read_gguf_config(reader: GGUFReader, path: str) -> tuple[Architecture, LlamaConfig]:
    """The architecture from `general.architecture` and the config from its metadata; every refusal (architecture,
    experts, partial rotary, RoPE scaling, tensor storage type) is raised here, before any weight is read."""
    entry = gguf_architecture(_field(reader, "general.architecture"), path)
    arch = entry.gguf_name
    tensors = {t.name: t for t in reader.tensors}
    unsupported = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in SUPPORTED_TYPES})
    if unsupported:
        raise ValueError(f"{path}: tensor types {', '.join(unsupported)} are not supported "
                         f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")  # fmt: skip
    hidden = int(_need(reader, f"{arch}.embedding_length", path))
    heads = int(_need(reader, f"{arch}.attention.head_count", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and (entry.gguf_permuted_qk or rope_dim % 2 or not 0 < rope_dim < head_dim):
        raise ValueError(f"{path}: {arch}.rope.dimension_count {rope_dim} of head_dim {head_dim} is not supported "
                         "(supported: the whole head, or an even part of it for architectures without permuted "
                         "Q/K rows)")  # fmt: skip
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling: dict[str, Any] | None = None
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE: both factor lists, as tensors
        rope_scaling = _longrope(reader, tensors, arch, path)
    elif scaling_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(_need(reader, f"{arch}.rope.scaling.factor", path))}
        if scaling_type == "yarn":
            original = _need(reader, f"{arch}.rope.scaling.original_context_length", path)
            rope_scaling["original_max_position_embeddings"] = int(original)
    elif scaling_type not in ("none", None):
        # llama3 files carry their scaling as the `rope_freqs` tensor, with no scaling type.
        raise ValueError(f"{path}: rope scaling {scaling_type!r} is not supported (supported: none, linear, yarn)")
    window = _field(reader, f"{arch}.attention.sliding_window")
    layers = int(_need(reader, f"{arch}.block_count", path))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = LlamaConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # ggml order: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(_need(reader, f"{arch}.feed_forward_length", path)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        partial_rotary_factor=_rotary_factor(rope_dim, head_dim),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        layer_windows=(int(window),) * layers if window else (),
        eos_token_ids=[] if eos is None else [int(eos)],
        **_experts(reader, tensors, entry, layers, path),
    )
    if entry.model_class is GemmaForCausalLM:
        return entry, _gemma_config(reader, config, arch, window)
    return entry, config


def _rotary_factor(rope_dim: int, head_dim: int) -> float:
    """The factor whose int(head_dim * factor) (LlamaConfig.rotary_dim, as transformers computes it) is rope_dim:
    rope_dim / head_dim, one float step up where the product rounds to just under rope_dim (30 / 44 * 44)."""
    factor = rope_dim / head_dim
    return math.nextafter(factor, 1.0) if int(head_dim * factor) < rope_dim else factor


def _longrope(reader: GGUFReader, tensors: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    """llama.cpp's converter writes Phi-3's LongRoPE as two factor tensors, the original context and the cos/sin
    scale it computed (the formula rope.py applies when the file gives none)."""
    if "rope_factors_short.weight" not in tensors:
        raise ValueError(f"{path}: rope_factors_long.weight without rope_factors_short.weight")
    factors = {kind: [float(v) for v in dequantize(tensors[f"rope_factors_{kind}.weight"].data,
                                                    tensors[f"rope_factors_{kind}.weight"].tensor_type).reshape(-1)]
               for kind in ("long", "short")}  # fmt: skip
    scaling: dict[str, Any] = {
        "rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
        "original_max_position_embeddings": int(_need(reader, f"{arch}.rope.scaling.original_context_length", path)),
    }  # fmt: skip
    attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


# Expert-routing metadata llama.cpp defines for other architectures, and the values this decoder implements.
_EXPERT_SUPPORTED = {"expert_gating_func": (1,), "expert_weights_scale": (1.0,), "expert_shared_count": (0, 1),
                     "expert_group_count": (0, 1)}  # fmt: skip
_GATING_NAMES = {1: "softmax", 2: "sigmoid"}


def _experts(
    reader: GGUFReader, tensors: dict[str, Any], entry: Architecture, layers: int, path: str
) -> dict[str, Any]:
    """The mixture-of-experts fields from `{arch}.expert_count` and friends (none for a dense model). A layer is
    sparse where the file has its router (`ffn_gate_inp`); the widths come from the stacked tensors' shapes."""
    arch = entry.gguf_name
    count = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not count:
        return {}
    for key, supported in _EXPERT_SUPPORTED.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and value not in supported:
            named = f" ({_GATING_NAMES.get(value, 'unknown')})" if key == "expert_gating_func" else ""
            listed = ", ".join(f"{v} ({_GATING_NAMES[v]})" if named else str(v) for v in supported)
            raise ValueError(f"{path}: {arch}.{key} = {value}{named} is not supported (supported: {listed})")
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers))
    first = sparse.index(True) if any(sparse) else None
    if first is None:
        raise ValueError(f"{path}: {arch}.expert_count is {count} but no layer has a router (blk.N.ffn_gate_inp)")
    stacked = tensors.get(f"blk.{first}.ffn_gate_exps.weight")
    if stacked is None:
        raise ValueError(f"{path}: the experts of layer {first} are not stacked as blk.{first}.ffn_gate_exps.weight "
                         "(supported: llama.cpp's stacked ffn_{gate,up,down}_exps tensors)")  # fmt: skip
    shared = tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    return dict(
        num_experts=count,
        num_experts_per_tok=int(_need(reader, f"{arch}.expert_used_count", path)),
        moe_intermediate_size=int(stacked.shape[1]),  # ggml order: [cols, rows, experts]
        shared_expert_intermediate_size=0 if shared is None else int(shared.shape[1]),
        norm_topk_prob=entry.gguf_norm_topk_prob if norm is None else bool(norm),
        moe_layers=sparse,
    )


def _gemma_config(reader: GGUFReader, config: LlamaConfig, arch: str, window: Any) -> GemmaConfig:
    """llama.cpp's Gemma metadata: Gemma 2 alternates local (even) and global layers, Gemma 3 makes every sixth layer
    global with RoPE base 10000 on the local ones. The attention scale is not in the file either: llama.cpp uses
    (hidden / heads)^-0.5 for the 27B models (Gemma 2: 46 layers, Gemma 3: 62) and head_dim^-0.5 for the others."""
    pattern = 2 if arch == "gemma2" else 6
    large = config.num_layers == (46 if arch == "gemma2" else 62)
    scalar = config.hidden_size / config.num_heads if large else config.head_dim
    windows = tuple(int(window) if (i + 1) % pattern else None for i in range(config.num_layers)) if window else ()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(LlamaConfig)}
    return GemmaConfig(
        **{**fields, "layer_windows": windows},
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_field(reader, f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=_field(reader, f"{arch}.final_logit_softcapping"),
        rope_local_theta=10000.0 if arch == "gemma3" else None,
    )


def _pieces(
    tensor: Any, names: dict[str, str], config: LlamaConfig, arch: Architecture, path: str
) -> Iterator[tuple[str, np.ndarray, tuple[int, ...]]]:
    """One GGUF tensor -> (our parameter, its raw data, its torch shape) for each parameter it holds: llama.cpp's
    stacked experts (`ffn_gate_exps`: [experts, rows, cols]) one per expert, Phi-3's fused `attn_qkv` and `ffn_up`
    split by rows (quantized blocks run along rows, so the raw rows split as the weights do)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first; torch's is reverse
    fused = gguf_fused_name(tensor.name, arch.fused)
    if fused is not None:
        parts = fused_parts(fused, config, arch.fused)
        need = sum(rows for _, rows in parts)
        if need != shape[0]:
            listed = ", ".join(ours for ours, _ in parts)
            raise ValueError(f"{path}: tensor {tensor.name!r} has {shape[0]} rows, but {listed} need {need}")
        start = 0
        for ours, rows in parts:
            yield ours, tensor.data[start : start + rows], (rows, *shape[1:])
            start += rows
        return
    ours = names.get(tensor.name)
    if ours is None:
        raise KeyError(f"unexpected tensor {tensor.name!r} in {path}; it maps to no {arch.name} parameter")
    if "{j}" in ours:
        if len(shape) != 3 or shape[0] != config.num_experts:
            raise ValueError(f"{path}: tensor {tensor.name!r} has shape {shape}, expected [{config.num_experts}, "
                             "rows, cols] (one matrix per expert)")  # fmt: skip
        for j in range(shape[0]):
            yield ours.format(j=j), tensor.data[j], shape[1:]
        return
    if ours.endswith("shared_expert_gate.weight") and len(shape) == 1:
        shape = (1, shape[0])  # llama.cpp may store the shared expert's gate as a vector
    yield ours, tensor.data, shape


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, pair, 2) back to (head, 2, pair)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    stage: PipelineStage | None = None,
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Quantized blocks span whole rows, so each tensor is dequantized whole and then sliced to this rank's part.

    With `quantization` (--quantization) enabling it, projection weights (and the LM head, also when it is the tied
    token embedding, which then stays dequantized for the lookup) of the types workers/model/quant_ops.py takes stay
    in their blocks and their modules become QuantizedLinear; every other tensor is dequantized as before."""
    path = str(path)
    workers = world_size * (stage.num_stages if stage is not None else 1)
    keep_blocks = quant_ops.quantization_enabled(quantization, device, workers)
    blocks: dict[str, quant_ops.QuantizedWeight] = {}
    reader = GGUFFile(path)
    arch, config = read_gguf_config(reader, path)
    shard = TensorParallelShard(rank, world_size, config) if world_size > 1 else None
    model = build_empty_model(config, dtype, device, shard, arch.model_class, stage)
    names = expand_names(config, "gguf")
    gemma = isinstance(config, GemmaConfig)
    sink = WeightSink(model, shard, stage, config)
    for tensor in tqdm(reader.tensors, desc=f"Loading {Path(path).name}", unit="tensor", file=sys.stderr):
        if tensor.name in _IGNORED_TENSORS:
            if tensor.name == "rope_freqs.weight":
                factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
                model.model.rotary.set_freq_factors(torch.from_numpy(np.ascontiguousarray(factors)))
            continue
        for ours, data, shape in _pieces(tensor, names, config, arch, path):
            if sink.elsewhere(ours):
                continue  # another pipeline stage's tensor: never dequantized here
            linear = ours.endswith("proj.weight") or ours == "lm_head.weight"
            if keep_blocks and len(shape) == 2 and quant_ops.can_quantize(tensor.tensor_type, shape[1]):
                if linear or (ours == "model.embed_tokens.weight" and config.tie_word_embeddings):
                    weight = quant_ops.from_gguf(data, tensor.tensor_type, *shape)
                    if arch.gguf_permuted_qk and ours.endswith(("q_proj.weight", "k_proj.weight")):
                        rows = unpermute_qk(np.arange(shape[0]), shape[0] // config.head_dim)
                        weight = quant_ops.QuantizedWeight(weight.kind, weight.data[torch.from_numpy(rows)],
                                                           weight.cols)  # fmt: skip
                    blocks["lm_head.weight" if not linear else ours] = weight
                    if linear:
                        sink.provided_elsewhere(ours)
                        continue
            # Quantized blocks run along a row, so a rank that needs whole rows (column-parallel, vocab, KV heads)
            # dequantizes only those; row-parallel (column) splits dequantize the whole tensor and slice after.
            index = shard.row_range(ours, shape[0], shape[1] if len(shape) > 1 else None) if shard else None
            rows_only = index is not None and index[1] is None and data.shape[0] == shape[0]
            if rows_only:
                data = data[index[0]]  # type: ignore[index]
                shape = (data.shape[0], *shape[1:])
            try:
                array = dequantize(data, tensor.tensor_type)
            except NotImplementedError as exc:
                kind = tensor.tensor_type.name
                raise ValueError(f"{path}: tensor {tensor.name!r} has unsupported type {kind}") from exc
            array = array.reshape(shape)
            # Un-permuting works head by head, so a slice of whole heads un-permutes with its own head count.
            if arch.gguf_permuted_qk and ours.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                        "k_proj.bias")):  # fmt: skip
                array = unpermute_qk(array, shape[0] // config.head_dim)
            array = np.ascontiguousarray(array, dtype=np.float32)
            if gemma and ours.endswith("norm.weight"):
                array = array - 1.0  # llama.cpp's converter stores Gemma's (1 + w) norm weights as 1 + w
            if not array.flags.writeable:  # F32 tensors are views of the read-only file mapping
                array = array.copy()
            sink.assign(ours, torch.from_numpy(array), tensor.name, sliced=rows_only)
    sink.finish(path, names)
    for name, weight in blocks.items():
        quant_ops.become_quantized(model.get_submodule(name.removesuffix(".weight")), weight)
    return model
