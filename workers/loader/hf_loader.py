"""Hugging Face folder loader: config.json + model.safetensors (or shards listed in model.safetensors.index.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ringserve.workers.loader.weight_names import expand_names, fused_parts
from ringserve.workers.loader.weight_sink import WeightSink, build_empty_model
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM
from ringserve.workers.model.registry import Architecture, hf_architecture
from ringserve.workers.parallel import TensorParallelShard
from ringserve.workers.pipeline import PipelineStage
from safetensors import safe_open
from tqdm import tqdm

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(folder: Path) -> tuple[Architecture, LlamaConfig]:
    """The architecture entry for the folder's config.json and the model config read from it (refusals name why)."""
    source = f"{folder}/config.json"
    raw = json.loads((folder / "config.json").read_text())
    arch = hf_architecture(raw, source)
    return arch, arch.read_config(raw, source)


def our_name(key: str, arch: Architecture) -> str:
    for theirs, ours in arch.hf_renames:
        key = key.replace(theirs, ours)
    return key


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return found


def load_hf_model(
    folder: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """The model, or with world_size > 1 rank `rank`'s tensor-parallel shard of it (reading only that part)."""
    folder = Path(folder)
    arch, config = read_hf_config(folder)
    shard = TensorParallelShard(rank, world_size, config) if world_size > 1 else None
    model = build_empty_model(config, dtype, device, shard, arch.model_class, stage)
    names = expand_names(config, "hf")
    sink = WeightSink(model, shard, stage, config)
    files = safetensors_files(folder)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]  # memory-mapped
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc=f"Loading {folder.name}", unit="tensor", file=sys.stderr) as bar:
        for handle in handles:
            for key in handle.keys():
                bar.update(1)
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                renamed = our_name(key, arch)
                parts = fused_parts(renamed, config, arch.fused)
                if parts and sink.elsewhere(parts[0][0]):
                    continue
                if parts:
                    full = handle.get_tensor(key)
                    for (ours, _), tensor in zip(parts, full.split([rows for _, rows in parts]), strict=True):
                        sink.assign(ours, tensor, key)
                    continue
                ours = names.get(renamed)
                if ours is None:
                    raise KeyError(f"unexpected tensor {key!r} in {folder}; it maps to no {arch.name} parameter")
                if sink.elsewhere(ours):
                    continue  # another pipeline stage's tensor: never read here
                if not sink.wants(ours) and ours == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied checkpoints sometimes save the head anyway; the embedding wins
                if shard is None:
                    sink.assign(ours, handle.get_tensor(key), key)
                    continue
                lazy = handle.get_slice(key)  # memory-mapped: only this rank's rows/columns are read
                shape = lazy.get_shape()
                index = shard.row_range(ours, shape[0], shape[1] if len(shape) > 1 else None)
                if index is None:
                    sink.assign(ours, handle.get_tensor(key), key)
                elif index[1] is None:
                    sink.assign(ours, lazy[index[0]], key, sliced=True)
                else:
                    sink.assign(ours, lazy[index[0], index[1]], key, sliced=True)
    sink.finish(str(folder), names)
    return model
