"""Linear layers whose weights stay in GGUF's quantized blocks on the CPU (`--quantization gguf`).

A `QuantizedWeight` holds a weight matrix as rows of 32-value blocks, and `linear` multiplies by it with
`ringserve._kernels.linear_quant` (csrc/kernels/cpu_quant.h): each input row is quantized per 32 values to int8 and
meets the weight blocks in integer dot products (AVX2 where the CPU has it, else portable loops). Q8_0, Q4_0 and Q4_1
keep the file's own bytes; Q4_K and Q6_K super-blocks are repacked once at load, without loss, into 32-value blocks
with float32 scales (`repack`). The GGUF loader builds these instead of dequantizing (`--quantization`), and
`QuantizedLinear` (a cpu_ops.Linear without a float weight) computes with them; fast_paths fuses q/k/v and gate/up
of one block type into one QuantizedWeight as it fuses float weights.

For many input rows (prompt chunks, large decode batches: 32 or more) the kernel reads weight rows in panels of 8 rows
(kernels/cpu_quant.h), laid out once at load (`QuantizedWeight.panels`, beside the blocks, which one to 31 input rows
read: one byte per value and float32 scales, 1-2.2x the blocks' own bytes, for 7-9% off a 64-row step's products).
Every block format takes the int8 kernel at every row count: a float32 GEMM on the natively dequantized weight
(`dequantize`) measured slower for each of them, the 8-bit ones included, at 32-2,048 rows on SmolLM2's shapes
(`benchmarks/quantized.py --routes`, docs/serving.md#quantized-gguf-weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from ringserve.workers.model import cpu_ops
from torch import nn

# The kernel's block formats (kernels/cpu_quant.h QuantType) and the GGUF type each comes from.
Q8_0, Q4_0, Q4_1, Q4_1F, Q8_2F = range(5)
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q4_1F: 24, Q8_2F: 40}
_FROM_GGUF = {GGMLQuantizationType.Q8_0: Q8_0, GGMLQuantizationType.Q4_0: Q4_0, GGMLQuantizationType.Q4_1: Q4_1,
              GGMLQuantizationType.Q4_K: Q4_1F, GGMLQuantizationType.Q6_K: Q8_2F}  # fmt: skip
QUANTIZED_GGUF_TYPES = tuple(_FROM_GGUF)


def available() -> bool:
    """True when the kernel module is built and has its AVX2 path here (the portable loops alone are a reference,
    several times slower than PyTorch's float path)."""
    return cpu_ops._MODULE is not None and bool(cpu_ops._MODULE.has_avx2_quant())


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """`data`: uint8 [rows, blocks * BLOCK_BYTES[kind]], row-major; the matrix is [rows, cols] with cols = 32 blocks.
    `panels`: None, or uint8 [rows // 8, panel bytes] holding each 8 rows as the kernel's panels (`with_panels`)."""

    kind: int
    data: torch.Tensor
    cols: int
    panels: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @staticmethod
    def panel_rows() -> int:
        """Weight rows per panel (kernels/cpu_quant.h kQuantPanelRows; the native kernels must be built)."""
        return int(cpu_ops._MODULE.quant_panel_rows)

    def with_panels(self) -> QuantizedWeight:
        """This weight with its panels laid out (where the AVX2 kernel runs; else as it is)."""
        if self.panels is not None or not available():
            return self
        rows = self.panel_rows()
        per_panel = cpu_ops._MODULE.quant_panel_bytes(self.kind, rows, self.cols)
        panels = torch.empty((self.rows // rows, per_panel), dtype=torch.uint8)
        data = self.data.contiguous()
        cpu_ops._MODULE.pack_quant_panels(self.kind, data.data_ptr(), data.numel(), panels.data_ptr(), panels.numel(),
                                          self.rows, self.cols, threads=torch.get_num_threads())  # fmt: skip
        return QuantizedWeight(self.kind, data, self.cols, panels)

    def slice_rows(self, index: slice) -> QuantizedWeight:
        start, stop, step = index.indices(self.rows)
        part = QuantizedWeight(self.kind, self.data[index].contiguous(), self.cols)
        if self.panels is None:
            return part
        rows = self.panel_rows()
        if step == 1 and start % rows == 0 and (stop % rows == 0 or stop == self.rows):
            # Whole panels (and the unpanelled rows past the last one): a view of these panels.
            return dataclasses.replace(part, panels=self.panels[start // rows : stop // rows])
        return part.with_panels()

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        if len({(p.kind, p.cols) for p in parts}) != 1:
            raise ValueError("only weights of one block type and width can be fused")
        whole = QuantizedWeight(parts[0].kind, torch.cat([p.data for p in parts]).contiguous(), parts[0].cols)
        if all(p.panels is None for p in parts):
            return whole
        if all(p.panels is not None for p in parts) and all(p.rows % whole.panel_rows() == 0 for p in parts[:-1]):
            return dataclasses.replace(whole, panels=torch.cat([p.panels for p in parts]))  # type: ignore[misc]
        return whole.with_panels()


def can_quantize(gguf_type: GGMLQuantizationType, cols: int) -> bool:
    return gguf_type in _FROM_GGUF and cols % 32 == 0


def from_gguf(data: np.ndarray, gguf_type: GGMLQuantizationType, rows: int, cols: int) -> QuantizedWeight:
    """The kernel's blocks for a GGUF tensor's raw bytes `data` [rows, row_bytes] (uint8)."""
    kind = _FROM_GGUF[gguf_type]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if kind == Q4_1F:
        raw = repack_q4_k(raw)
    elif kind == Q8_2F:
        raw = repack_q6_k(raw)
    if raw.shape[1] != cols // 32 * BLOCK_BYTES[kind]:
        raise ValueError(f"{gguf_type.name} tensor of {cols} columns holds {raw.shape[1]} bytes per row")
    return QuantizedWeight(kind, torch.from_numpy(raw.copy() if not raw.flags.writeable else raw), cols)


def _halves(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def repack_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (d, dmin: f16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles) as Q4_1F blocks:
    sub-block j's values are d * sc_j * q - dmin * m_j, with both products exact in float32."""
    rows = raw.shape[0]
    sb = raw.reshape(rows, -1, 144)
    d, dmin = _halves(sb[..., 0:2]), _halves(sb[..., 2:4])  # [rows, supers, 1]
    s = sb[..., 4:16].astype(np.uint8)
    sc = np.empty((*s.shape[:2], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = sb[..., 16:].reshape(rows, -1, 4, 32)  # 64-value chunks: low nibbles first 32 values, high the next 32
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # [rows, supers, sub-block, value]
    packed = q[..., :16] | (q[..., 16:] << 4)
    scale = (d * sc.astype(np.float32)).astype(np.float32)
    offset = (-(dmin * mn.astype(np.float32))).astype(np.float32)
    out = np.concatenate([scale[..., None].view(np.uint8), offset[..., None].view(np.uint8), packed.astype(np.uint8)],
                         axis=-1)  # fmt: skip
    return np.ascontiguousarray(out.reshape(rows, -1))


def repack_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks (128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales, f16 d) as Q8_2F blocks:
    value e is d * sc[e // 16] * (q_e - 32), the two scales of a 32-value block in float32 (exact)."""
    rows = raw.shape[0]
    sb = raw.reshape(rows, -1, 210)
    ql = sb[..., 0:128].reshape(rows, -1, 2, 64)
    qh = sb[..., 128:192].reshape(rows, -1, 2, 32)
    sc = sb[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _halves(sb[..., 208:210])
    low = np.concatenate([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32  # [rows, supers, 2, 128]
    q = q.reshape(rows, -1, 8, 32).astype(np.int8)
    scales = (d * sc).astype(np.float32).reshape(rows, -1, 8, 2)
    out = np.concatenate([scales.view(np.uint8).reshape(rows, -1, 8, 8), q.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.reshape(rows, -1))


def dequantize(
    weight: QuantizedWeight, *, out: torch.Tensor | None = None, force_portable: bool = False
) -> torch.Tensor:
    """The weight's float32 values [rows, cols] (into `out` if given), as gguf.quants.dequantize gives them."""
    if cpu_ops._MODULE is None:
        raise RuntimeError("quantized weights need the native kernels (ringserve._kernels is not built)")
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32)
    elif out.dtype is not torch.float32 or tuple(out.shape) != weight.shape or not out.is_contiguous():
        raise ValueError(f"dequantize: out must be a contiguous float32 tensor of shape {weight.shape}")
    cpu_ops._MODULE.dequantize(weight.kind, weight.data.data_ptr(), weight.data.numel(), out.data_ptr(), weight.rows,
                       weight.cols, force_portable=force_portable, threads=torch.get_num_threads())  # fmt: skip
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    force_portable: bool = False,
    avx2_only: bool = False,
) -> torch.Tensor:
    """cpu_ops.linear for a float weight; for a QuantizedWeight, x @ W^T (+ bias) (+ residual) by the native int8
    kernel (x float32 or bfloat16 on the CPU; the output has x's dtype). force_portable / avx2_only pick the portable
    loops / the AVX2 path where AVX-512 VNNI runs (tests and benchmarks)."""
    if not isinstance(weight, QuantizedWeight):
        return cpu_ops.linear(x, weight, bias, residual)
    if cpu_ops._MODULE is None:
        raise RuntimeError("quantized weights need the native kernels (ringserve._kernels is not built)")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantized linear: input must be float32 or bfloat16 on the CPU (got {x.dtype}, {x.device})")
    if x.shape[-1] != weight.cols:
        raise ValueError(f"quantized linear: input has {x.shape[-1]} features, the weight {weight.cols}")
    n, k = weight.rows, weight.cols
    rows = x.numel() // max(k, 1)
    x2 = x.reshape(rows, k).contiguous()
    extras: dict[str, Any] = {}
    for name, t, shape in (("bias", bias, (n,)), ("residual", residual, (*x.shape[:-1], n))):
        if t is not None:
            if t.dtype is not x.dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"quantized linear: {name} must be {x.dtype} of shape {tuple(shape)}")
            extras[name] = t.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype)
    panels = weight.panels
    if rows:
        cpu_ops._MODULE.linear_quant(
            x.dtype is torch.bfloat16, weight.kind, x2.data_ptr(), weight.data.data_ptr(), weight.data.numel(),
            extras["bias"].data_ptr() if "bias" in extras else 0, out.data_ptr(), rows, n, k,
            force_portable=force_portable, avx2_only=avx2_only, threads=torch.get_num_threads(),
            residual=extras["residual"].data_ptr() if "residual" in extras else 0,
            panels=0 if panels is None else panels.data_ptr(), panel_bytes=0 if panels is None else panels.numel(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


class QuantizedLinear(cpu_ops.Linear):
    """A Linear whose weight is a QuantizedWeight (`qweight`); it has no float `weight` parameter (its bias stays)."""

    qweight: QuantizedWeight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.qweight, self.bias, residual)


def become_quantized(module: nn.Linear, weight: QuantizedWeight) -> None:
    """Turns a loaded nn.Linear into a QuantizedLinear over `weight` (with its panels), dropping its float weight."""
    if type(module) is not nn.Linear or weight.shape != tuple(module.weight.shape):
        raise ValueError(f"cannot quantize {type(module).__name__} of shape {tuple(module.weight.shape)} with blocks "
                         f"of shape {weight.shape}")  # fmt: skip
    del module.weight
    module.__class__ = QuantizedLinear
    module.qweight = weight.with_panels()


def quantization_enabled(setting: str, device: torch.device | str, world_size: int) -> bool:
    """`--quantization` for one model load: gguf keeps blocks (refused where the kernel cannot run), auto does where
    the AVX2 kernel runs on the CPU with one worker (no tensor or pipeline parallelism), none never does."""
    if setting == "none":
        return False
    cpu = torch.device(device).type == "cpu"
    if setting == "gguf":
        if not cpu or world_size > 1 or cpu_ops._MODULE is None:
            raise ValueError("--quantization gguf needs the CPU device, one worker (--tensor-parallel-size and "
                             "--pipeline-parallel-size 1) and the built native kernels")  # fmt: skip
        return True
    if setting != "auto":
        raise ValueError(f"--quantization {setting!r}: expected one of auto, none, gguf")
    return cpu and world_size == 1 and available()
