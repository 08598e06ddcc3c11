"""Linear layers that send skinny bfloat16 products on CPU to RingServe's native kernel.

Decoding a few sequences multiplies a handful of rows by every weight matrix, so its speed is how fast the weights
stream from memory. On CPUs with AVX512-BF16, `ringserve._kernels.linear_bf16` reads them at several times the rate
of PyTorch's bf16 path for such shapes (benchmarks/throughput.py measures both), splitting large products over
torch's own OpenMP threads (the kernel module shares torch's libgomp); larger batches are compute-bound and stay with
PyTorch (oneDNN). Everything else (other dtypes, devices, missing CPU features) is plain F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the native kernel wins on this class of CPU (benchmarks/throughput.py, single-stream and
# small-batch decode); RINGSERVE_NATIVE_LINEAR=0 turns the kernel off.
MAX_NATIVE_ROWS = 2


def _load_kernels() -> object | None:
    if os.environ.get("RINGSERVE_NATIVE_LINEAR", "1") == "0":
        return None
    try:
        from ringserve import _kernels
    except ImportError:  # a source checkout without the built extension
        return None
    return _kernels if _kernels.has_avx512_bf16() else None


_KERNELS = _load_kernels()


def native_linear_available() -> bool:
    return _KERNELS is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the native kernel when the shapes and dtypes suit it."""
    kernels = _KERNELS
    if (
        kernels is None
        or x.dtype is not torch.bfloat16
        or weight.dtype is not torch.bfloat16
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return F.linear(x, weight, bias)  # (F.linear reports any shape error)
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= MAX_NATIVE_ROWS:
        return F.linear(x, weight, bias)
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(rows, k).contiguous()
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    kernels.linear_bf16(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                        rows, n, k, threads=torch.get_num_threads())  # fmt: skip
    return out.view(*x.shape[:-1], n)


class Linear(nn.Linear):
    """nn.Linear (same parameters, hooks and state_dict) whose forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
