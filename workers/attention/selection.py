"""Which attention backend a worker runs: chosen by name (`--attention-backend`), or `auto` by device."""

from __future__ import annotations

import torch
from ringserve.formats.engine_args import ATTENTION_BACKENDS
from ringserve.workers.attention.backend import AttentionBackend
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.attention.triton_paged import TritonPagedBackend, paged_attention_supported


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """`auto`: the Triton paged kernels on CUDA when triton is installed, else gather + SDPA (CPU, or no triton)."""
    if name == "auto":
        name = TritonPagedBackend.name if paged_attention_supported(device) else TorchSdpaBackend.name
    if name == TorchSdpaBackend.name:
        return TorchSdpaBackend()
    if name == TritonPagedBackend.name:
        return TritonPagedBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}")
