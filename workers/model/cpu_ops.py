"""Linear layers that send bfloat16 (and some float32) products on CPU to RingServe's native kernel.

On AVX-512 CPUs (with AVX512-BF16 dot products, or without them by widening bf16 in registers),
`ringserve._kernels.linear_bf16` computes every bf16 projection: decoding a few sequences streams the weights from
memory at several times the rate of PyTorch's bf16 path, and batches (many sequences, prefill) run packed weight
panels at about three times its FLOP/s here. On AVX-512 CPUs, float32 products of 4 to 63 rows (batched decoding,
short chunks) run `linear_f32`'s float32 weight panels, whose cost grows with the row count as PyTorch's does not.
Large products split over the kernels' own worker pool (csrc/kernels/worker_pool.cpp). Everything else
(other dtypes and row counts, devices, CPUs without AVX-512) is plain F.linear.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ringserve.workers.attention.metadata import AttentionMetadata

# bf16: up to this many rows the native kernel's dot-product tiles take any K; from three rows on it packs weight
# panels for an outer-product kernel, which needs K even (every llama-family width is) where the CPU has AVX512-BF16,
# and otherwise PyTorch takes the product. RINGSERVE_NATIVE_LINEAR=0 turns the kernel off.
MAX_ANY_K_ROWS = 2
# float32: the native float32 weight panels for this many rows (a range). Measured on SmolLM2's projections with
# cold weights on an AVX-512 CPU without AVX512-BF16: 1.4x-2.4x PyTorch's GEMM from 4 to 24 rows (whose time nearly
# doubles from 8 to 16 rows, then stays flat to 64, so a step's cost would not follow its row count), level at 64.
# PyTorch's GEMV streams one or two rows faster, and from 64 rows its GEMM reaches more FLOP/s than these panels.
F32_NATIVE_ROWS = range(4, 64)


def _load_module() -> Any | None:
    try:
        from ringserve import _kernels
    except ImportError:  # a source checkout without the built extension
        return None
    return _kernels


_MODULE = _load_module()
# AVX512-BF16 dot products where the CPU has them; on other AVX-512 CPUs the kernel widens bf16 to float32 in
# registers and uses FMAs, still 1.6-3.6x PyTorch's bf16 path there for 1-256 rows (which has no native bf16 either).
_KERNELS = _MODULE if _MODULE is not None and (_MODULE.has_avx512_bf16() or _MODULE.has_avx512f_linear()) and (
    os.environ.get("RINGSERVE_NATIVE_LINEAR", "1") != "0") else None  # fmt: skip
# The paged attention, RMSNorm, RoPE and SiLU-and-multiply kernels run on any x86-64 CPU (AVX-512 when present);
# RINGSERVE_NATIVE_ATTENTION=0 turns them all off (PyTorch operations instead).
_ATTENTION = _MODULE if os.environ.get("RINGSERVE_NATIVE_ATTENTION", "1") != "0" else None
_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def native_linear_available() -> bool:
    return _KERNELS is not None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual, shaped like the output), through the native kernel when the shapes and
    dtypes suit it; there the residual is added before the output's one rounding (PyTorch rounds the product, then
    the sum)."""
    kernels = _KERNELS
    dtype = x.dtype
    if (
        kernels is None
        or dtype not in _ATTENTION_DTYPES
        or weight.dtype is not dtype
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return _plain_linear(x, weight, bias, residual)
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not weight.is_contiguous():
        return _plain_linear(x, weight, bias, residual)  # (F.linear reports any shape error)
    rows = x.numel() // max(x.shape[-1], 1)
    n, k = weight.shape
    if dtype is torch.float32:
        if rows not in F32_NATIVE_ROWS:  # (_KERNELS is set only where linear_f32 has its AVX-512 panels)
            return _plain_linear(x, weight, bias, residual)
        native = kernels.linear_f32
    else:
        if rows == 0 or (rows > MAX_ANY_K_ROWS and k % 2 != 0):
            return _plain_linear(x, weight, bias, residual)
        native = kernels.linear_bf16
    if bias is not None and (bias.dtype is not dtype or not bias.is_contiguous()):
        return _plain_linear(x, weight, bias, residual)
    if residual is not None and (residual.dtype is not dtype or residual.device.type != "cpu"
                                 or residual.shape != (*x.shape[:-1], n)):  # fmt: skip
        return _plain_linear(x, weight, bias, residual)
    x2 = x.reshape(rows, k).contiguous()
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty((rows, n), dtype=dtype)
    native(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), rows, n, k,
           threads=torch.get_num_threads(), residual=0 if residual is None else residual.data_ptr())  # fmt: skip
    return out.view(*x.shape[:-1], n)


def _plain_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


def _small_kernel_input(x: torch.Tensor) -> bool:
    """What every kernel but the projections asks of its main tensor: on the CPU, float32 or bf16, no autograd."""
    return x.device.type == "cpu" and x.dtype in _ATTENTION_DTYPES and not (torch.is_grad_enabled() and x.requires_grad)


def native_attention_available() -> bool:
    return _ATTENTION is not None


# The whole decode step's layers as one native call (see csrc/kernels/cpu_decoder.h): it composes the kernels above,
# so it needs both the projection and the attention kernels; RINGSERVE_NATIVE_DECODE=0 keeps the layer-by-layer path.
_NATIVE_DECODE = _ATTENTION is not None and os.environ.get("RINGSERVE_NATIVE_DECODE", "1") != "0"
_DECODER = _KERNELS if _NATIVE_DECODE else None
# With quantized projections (GGUF blocks) it needs the int8 kernel's AVX2 path instead of the dense projections.
_QUANT_DECODER = _ATTENTION if _NATIVE_DECODE and _ATTENTION is not None and _ATTENTION.has_avx2_quant() else None


def native_decoder_module(quantized: bool = False) -> Any | None:
    """The kernels module when it may run whole decode steps (`DecoderBf16`, `DecoderF32`), else None: with dense
    projections where the projection kernels run; with quantized ones (`quantized`) wherever the attention kernels
    and the int8 kernel's AVX2 path do."""
    return _QUANT_DECODER if quantized else _DECODER


def native_chunk_attention(head_dim: int) -> bool:
    """True when prefill chunks of this head size should take the native paged kernel: its AVX-512 or AVX2 tiles
    (head_dim 64 or 128 on an AVX-512F or AVX2+FMA CPU). Its portable loops are correct but slower than SDPA, which
    keeps the rest."""
    return _ATTENTION is not None and bool(_ATTENTION.chunk_attention_vectorized(head_dim))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Writes the causal attention of the step's sequences `ids` (int32: decode rows and chunks, by the step's own
    index) into `out` through the native kernels, reading K/V in place through the block tables. Returns False,
    writing nothing, when they cannot take these tensors (not on CPU, another dtype, a KV cache dtype unlike the
    queries', unusual strides or index layouts); the caller then uses its PyTorch path."""
    kernels = _ATTENTION
    if kernels is None or q.device.type != "cpu" or q.dtype not in _ATTENTION_DTYPES:
        return False
    if k_cache.dtype is not q.dtype or v_cache.dtype is not q.dtype or out.dtype is not q.dtype:
        return False
    tables, seq_lens, cu = metadata.block_tables, metadata.seq_lens, metadata.cu_seqlens_q
    for t in (tables, seq_lens, cu, ids):
        if t.dtype is not torch.int32 or t.device.type != "cpu" or not t.is_contiguous():
            return False
    if tables.dim() != 2 or seq_lens.numel() != tables.shape[0] or cu.numel() != tables.shape[0] + 1:
        return False  # a layout the kernel does not describe: PyTorch's path copes with it
    tokens, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (out.is_contiguous() and k_cache.is_contiguous()
                                                            and v_cache.is_contiguous()):  # fmt: skip
        return False
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    kernels.paged_attention(
        q.dtype is torch.bfloat16, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        seq_lens.data_ptr(), cu.data_ptr(), ids.data_ptr(), out.data_ptr(), tokens, q.stride(0), heads, kv_heads,
        head_dim, num_blocks, block_size, tables.shape[0], tables.shape[1], ids.numel(), scale,
        threads=torch.get_num_threads())  # fmt: skip
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of the rows of `x` through the native kernel (one pass per row instead of eight tensor operations),
    or None when it cannot take these tensors (not on CPU, another dtype, weight dtype unlike x's, autograd)."""
    kernels = _ATTENTION
    if (
        kernels is None
        or not _small_kernel_input(x)
        or weight.dtype is not x.dtype
        or not weight.is_contiguous()
        or (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    dim = x.shape[-1]
    if weight.numel() != dim:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    kernels.rms_norm(x.dtype is torch.bfloat16, x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim,
                     eps, threads=torch.get_num_threads())  # fmt: skip
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Hugging Face "rotate_half" RoPE in place on `x` [tokens, heads, head_dim] (tokens may be strided, as the query
    and key heads inside a fused QKV output are) by the native kernel, with `cos_sin` the float32
    [2, max_position, head_dim] table, rounded like `x * cos + rotate_half(x) * sin` in x's dtype. Returns False,
    changing nothing, when the kernel cannot take these tensors; the caller then uses its PyTorch path."""
    kernels = _ATTENTION
    if (
        kernels is None
        or not _small_kernel_input(x)
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or x.shape[2] % 2
        or cos_sin.dtype is not torch.float32
        or cos_sin.device.type != "cpu"
        or not cos_sin.is_contiguous()
        or cos_sin.dim() != 3
        or cos_sin.shape[2] != x.shape[2]
        or positions.device.type != "cpu"
        or positions.dim() != 1
        or positions.numel() != x.shape[0]
    ):
        return False
    pos = positions if positions.dtype is torch.int64 and positions.is_contiguous() else positions.long().contiguous()
    kernels.rope(x.dtype is torch.bfloat16, x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2],
                 pos.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[1], threads=torch.get_num_threads())  # fmt: skip
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """F.silu(gate) * up for `gate_up` [..., 2 * dim] (gate then up, as the fused projection writes them) by the
    native kernel in one pass (a large batch on torch's threads), or None when it cannot take the tensor."""
    kernels = _ATTENTION
    if (
        kernels is None
        or not _small_kernel_input(gate_up)
        or gate_up.dim() == 0
        or gate_up.shape[-1] % 2
    ):
        return None
    dim = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((*gate_up.shape[:-1], dim), dtype=gate_up.dtype)
    kernels.silu_mul(gate_up.dtype is torch.bfloat16, gate_up.data_ptr(), out.data_ptr(), out.numel() // max(dim, 1),
                     dim, threads=torch.get_num_threads())  # fmt: skip
    return out


def write_kv_(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Copies the step's keys and values [tokens, kv_heads, head_dim] (rows may be strided, as inside a fused QKV
    output) into their flat cache slots by the native kernel, which checks every slot first (ValueError). Returns
    False, writing nothing, when it cannot take these tensors (not on CPU, dtypes differ, inner dims not contiguous);
    the caller then uses index_copy_."""
    kernels = _ATTENTION
    if (
        kernels is None
        or k_cache.device.type != "cpu"
        or k.device.type != "cpu"
        or v.device.type != "cpu"
        or slot_mapping.device.type != "cpu"
        or slot_mapping.dtype is not torch.int64
        or not slot_mapping.is_contiguous()
        or k.dtype is not k_cache.dtype
        or v.dtype is not k_cache.dtype
        or v_cache.dtype is not k_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.shape != v_cache.shape
        or k_cache.dim() != 4
        or k.dim() != 3
        or v.shape != k.shape
        or k.shape[1:] != k_cache.shape[2:]
        or slot_mapping.numel() != k.shape[0]
    ):
        return False
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            return False
    size = k.element_size()
    kernels.write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.numel() * size, k.data_ptr(), v.data_ptr(),
                     slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * size, k.stride(0) * size,
                     v.stride(0) * size)  # fmt: skip
    return True


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax ids int64 [rows], their log-softmax values float32 [rows]) of `logits` [rows, vocab] by the native
    kernel: one call over all rows, no [rows, vocab] float32 copy or log-softmax. None when it cannot take the
    tensor (not on CPU, another dtype, autograd); the caller then uses PyTorch."""
    kernels = _ATTENTION
    if (
        kernels is None
        or not _small_kernel_input(logits)
        or logits.dim() != 2
        or logits.shape[1] == 0
    ):
        return None
    logits = logits.contiguous()
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    kernels.argmax_logprob(logits.dtype is torch.bfloat16, logits.data_ptr(), ids.data_ptr(), logprobs.data_ptr(),
                           rows, vocab, threads=torch.get_num_threads())  # fmt: skip
    return ids, logprobs


class Linear(nn.Linear):
    """nn.Linear (same parameters, hooks and state_dict) whose forward uses `linear`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`, returns residual + the projection (see `linear`)."""
        return linear(x, self.weight, self.bias, residual)
