"""Weight loaders (GGUF, Hugging Face safetensors folders) that build a ready LlamaForCausalLM."""

from __future__ import annotations

from pathlib import Path

import torch
from ringserve.workers.loader.gguf_loader import load_gguf_model
from ringserve.workers.loader.hf_loader import load_hf_model
from ringserve.workers.model import LlamaForCausalLM
from ringserve.workers.pipeline import PipelineStage

__all__ = ["load_gguf_model", "load_hf_model", "load_model", "parse_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    stage: PipelineStage | None = None,
) -> LlamaForCausalLM:
    """A .gguf file, a folder holding exactly one .gguf, or a Hugging Face folder with config.json.

    With world_size > 1 the result is rank `rank`'s tensor-parallel shard (collectives need the process group); with
    a pipeline stage, that stage's layers only (workers/pipeline.py).
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_model(path, dtype, device, rank, world_size, stage)
    if path.is_dir():
        if (path / "config.json").exists():
            return load_hf_model(path, dtype, device, rank, world_size, stage)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf_model(ggufs[0], dtype, device, rank, world_size, stage)
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json (or a single .gguf)")
