"""CUDA attention backend in Triton: attends straight over the paged KV cache through the block tables.

Nothing is gathered or copied: every kernel looks up each key's block in the sequence's block table and loads
K/V rows from the cache in place. A step's sequences are split by query length:
- decode rows (one query token): one program per (sequence, KV head, split); the KV head's whole query group
  shares each K/V load (GQA), padded to 16 rows so the scores are one `tl.dot`. Long contexts are split
  ("flash-decoding") so a small batch still fills the GPU; a second kernel merges the splits by their
  log-sum-exp.
- prefill chunks (fresh prompts and chunked prefill): one program per (sequence, tile of queries, head), an
  online-softmax loop over key tiles with the causal mask shifted by the tokens already cached.

The kernels are plain functions compiled lazily, once per mode: `triton.jit` for CUDA tensors, and Triton's
interpreter (numpy, CPU tensors) when TRITON_INTERPRET=1 is set, which is how the tests check them without a
GPU. Importing this module needs neither triton nor CUDA (triton is imported on first use); constructing the
backend does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from ringserve.workers.attention.backend import write_kv
from ringserve.workers.attention.metadata import AttentionMetadata

# Imported on first use (`_import_triton`), not here: a CPU worker choosing its backend should not pay for triton's
# import. The kernels below resolve `tl` from these module globals when they are compiled.
triton: Any = None
tl: Any = None

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
NO_WINDOW = 2**30  # the kernels' window for global attention: longer than any context
_MAX_SPLITS = 32  # flash-decoding splits per context: 8 KV heads x 32 fill twice the SMs of an H200 at batch 1


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _import_triton() -> None:
    global triton, tl
    if triton is None:
        try:
            import triton as triton_module
            import triton.language as language
        except ImportError as exc:
            raise RuntimeError(
                "the triton_paged attention backend needs the `triton` package (pip install triton)"
            ) from exc
        triton, tl = triton_module, language


def interpreter_enabled() -> bool:
    """Triton's own switch (TRITON_INTERPRET=1), read now rather than at import so tests can set it."""
    _import_triton()
    return bool(triton.knobs.runtime.interpret)


# ---- kernels -----------------------------------------------------------------------------------------------
# Pointer arguments are annotated `tl.tensor` only to satisfy the linter: Triton ignores that annotation.
# Every block id is widened to int64 before it scales a stride, so caches past 2**31 elements address correctly.


def _paged_decode_kernel(
    out_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,  # float32 [num_decodes, num_heads, num_splits, HEAD_DIM] (SPLIT_K only)
    part_lse_ptr: tl.tensor,  # float32 [num_decodes, num_heads, num_splits], log2 units
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    seq_ids_ptr: tl.tensor,  # int32 [num_decodes]: which sequence of the step each program row serves
    cu_seqlens_q_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    qk_scale: float,  # softmax scale * log2(e): the kernel works in exp2
    window: int,  # sliding window (keys (pos - window, pos]); NO_WINDOW for global attention
    stride_qt: int,
    stride_qh: int,
    stride_ot: int,
    stride_oh: int,
    stride_kb: int,
    stride_ks: int,
    stride_kh: int,
    stride_vb: int,
    stride_vs: int,
    stride_vh: int,
    stride_bt: int,
    num_splits: int,  # a runtime value: a new split count must not compile a new kernel
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,  # num_splits > 1: write partials for the merge kernel instead of the output
    F32_DOT: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + row)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)  # the oldest key the query (at seq_len - 1) sees
    # Each split owns a whole number of key tiles; a split past the context end leaves an empty partial.
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    in_group = offs_g < GROUP
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=in_group[:, None], other=0.0
    )
    if F32_DOT:
        q = q.to(tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k_rows = k_cache_ptr + block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_rows = v_cache_ptr + block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)  # [N, D]
        if F32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [G, N]
        # Every tile holds at least one valid key, so m_new is finite and exp2 never sees inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)  # [N, D]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    if not SPLIT_K:
        out = acc / l_i[:, None]
        out_rows = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
    else:
        has_keys = l_i > 0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        part = (row.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=in_group)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=in_group[:, None]
        )


def _merge_splits_kernel(
    out_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,
    part_lse_ptr: tl.tensor,
    seq_ids_ptr: tl.tensor,
    cu_seqlens_q_ptr: tl.tensor,
    stride_ot: int,
    stride_oh: int,
    num_splits: int,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # the most splits there can be, so one compiled kernel serves every split count
) -> None:
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + row)
    q_row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + base, mask=offs_s < num_splits, other=float("-inf"))
    # Split 0 always holds keys (every context has at least one token), so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    acc = tl.load(
        part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_s < num_splits)[:, None], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def _paged_prefill_kernel(
    out_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    seq_ids_ptr: tl.tensor,  # int32 [num_prefills]
    cu_seqlens_q_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    qk_scale: float,
    window: int,
    stride_qt: int,
    stride_qh: int,
    stride_ot: int,
    stride_oh: int,
    stride_kb: int,
    stride_ks: int,
    stride_kh: int,
    stride_vb: int,
    stride_vs: int,
    stride_vh: int,
    stride_bt: int,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + row)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:  # the grid is sized for the longest chunk of the step
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # tokens of this sequence already in the cache before this chunk

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    is_query = offs_m < q_len
    q_pos = cached + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=is_query[:, None], other=0.0
    )
    if F32_DOT:
        q = q.to(tl.float32)
    kv_head = head // GROUP
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: the tile's last query sees keys up to its own position; later keys are never loaded. With a window,
    # keys before the tile's first query's window are never loaded either.
    kv_end = tl.minimum(seq_len, cached + (q_tile + 1) * BLOCK_M)
    kv_start = tl.maximum(cached + q_tile * BLOCK_M - window + 1, 0)
    for tile in range(kv_start, kv_end, BLOCK_N):
        pos = tile + offs_n
        valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k_rows = k_cache_ptr + block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_rows = v_cache_ptr + block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        attend = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(attend, s * qk_scale, float("-inf"))
        # A row may see no key of a tile before its window starts: its max stays -inf, so exp2 gets a finite
        # stand-in (its p and the rescale of its empty accumulator are then 0, not NaN).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=is_query[:, None])


@dataclass(frozen=True)
class _Kernels:
    decode: Any
    merge: Any
    prefill: Any


@functools.cache
def _kernels(interpret: bool) -> _Kernels:
    """The three kernels, compiled by `triton.jit` or wrapped by the interpreter (decided per mode, not at import)."""
    _import_triton()
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    # Triton compiles a variant per integer value 1 and per multiple of 16, and per pointer alignment; these
    # change from step to step (the block table's width, the split count, where the prefill ids start in the
    # step's id tensor), so they must not pick the variant or a step would stall compiling a new one.
    ids = {"do_not_specialize_on_alignment": ("seq_ids_ptr",)}
    return _Kernels(
        wrap(_paged_decode_kernel, do_not_specialize=("stride_bt", "num_splits"), **ids),
        wrap(_merge_splits_kernel, do_not_specialize=("num_splits",), **ids),
        wrap(_paged_prefill_kernel, do_not_specialize=("stride_bt",), **ids),
    )


# ---- host side ---------------------------------------------------------------------------------------------


@dataclass
class _StepLayout:
    """Which sequences of a step take which kernel; built once per step and shared by every layer."""

    decode_ids: torch.Tensor  # int32 [num_decodes] on the device
    prefill_ids: torch.Tensor  # int32 [num_prefills]
    block_tables: torch.Tensor  # the metadata's, with unit stride along a row (the kernels assume it)
    max_decode_len: int
    max_prefill_query: int


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_num_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, target_programs: int, min_split_tokens: int
) -> int:
    """Splits per context so the decode grid reaches about `target_programs`, each split `min_split_tokens`+ long."""
    if num_decodes == 0:
        return 1
    wanted = -(-target_programs // (num_decodes * num_kv_heads))
    longest = -(-max_seq_len // min_split_tokens)
    return max(1, min(wanted, longest, _MAX_SPLITS))


class TritonPagedBackend:
    """Paged attention in Triton (CUDA; CPU tensors only under Triton's interpreter)."""

    name = "triton_paged"

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        interpret: bool | None = None,
        block_m: int = 64,
        block_n: int = 64,
        decode_block_n: int = 64,
        num_splits: int | None = None,
        min_split_tokens: int = 256,
        num_warps: int = 4,
        num_stages: int = 2,
    ) -> None:
        _import_triton()
        self.interpret = interpreter_enabled() if interpret is None else interpret
        device = torch.device(device)
        if device.type != "cuda" and not self.interpret:
            raise ValueError(
                f"the triton_paged attention backend runs on CUDA, not {device}; use --attention-backend torch_sdpa "
                "(or set TRITON_INTERPRET=1 to run its kernels in Triton's slow CPU interpreter)"
            )
        for what, n in (("block_m", block_m), ("block_n", block_n), ("decode_block_n", decode_block_n)):
            if n < _MIN_DOT or n & (n - 1):
                raise ValueError(f"{what}={n}: must be a power of two >= {_MIN_DOT}")
        self.block_m, self.block_n, self.decode_block_n = block_m, block_n, decode_block_n
        self.num_splits = num_splits
        self.min_split_tokens = min_split_tokens
        self.num_warps, self.num_stages = num_warps, num_stages
        self._kernels = _kernels(self.interpret)
        if device.type == "cuda":
            # Two programs per SM keep every SM busy while the other program waits on memory.
            self.target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        else:  # Triton's interpreter: a few splits, so long test contexts take the merge path too
            self.target_programs = 8
        self._layout_of: AttentionMetadata | None = None
        self._layout: _StepLayout | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if metadata.tree_masks or softcap is not None:
            # Speculative trees need an arbitrary mask per query row, and soft-capped scores (Gemma 2) a cap the
            # kernels do not apply; the gather path has both (correct, not fused).
            from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend

            return TorchSdpaBackend().forward(q, k, v, k_cache, v_cache, metadata, scale, window, softcap)
        self._check(q, k_cache, v_cache, metadata)
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        layout = self._step_layout(metadata)
        qk_scale = scale * _LOG2E
        # Triton launches on the current CUDA device; a tensor-parallel rank's tensors may live on another one.
        on_other_gpu = q.is_cuda and q.device.index != torch.cuda.current_device()
        with torch.cuda.device(q.device) if on_other_gpu else contextlib.nullcontext():
            window = NO_WINDOW if window is None else window
            if len(layout.decode_ids):
                self._decode(out, q, k_cache, v_cache, metadata, layout, qk_scale, window)
            if len(layout.prefill_ids):
                self._prefill(out, q, k_cache, v_cache, metadata, layout, qk_scale, window)
        return out

    def _check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata) -> None:
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, cache_dim = k_cache.shape
        if head_dim < _MIN_DOT or head_dim & (head_dim - 1) or cache_dim != head_dim:
            raise ValueError(f"triton_paged: head_dim {head_dim} must be a power of two >= {_MIN_DOT}")
        if block_size & (block_size - 1) or block_size != md.block_size:
            raise ValueError(f"triton_paged: block size {block_size} must be a power of two equal to the metadata's")
        if heads % kv_heads:
            raise ValueError(f"triton_paged: {heads} query heads are not a multiple of {kv_heads} KV heads")
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or v_cache.shape != k_cache.shape:
            raise ValueError("triton_paged: K and V caches must have the same shape and contiguous head_dim")

    def _step_layout(self, md: AttentionMetadata) -> _StepLayout:
        if md is not self._layout_of or self._layout is None:
            decodes = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
            prefills = [i for i, n in enumerate(md.query_lens_cpu) if n > 1]
            if md.decode_ids is not None and not prefills:
                ids = md.decode_ids
            else:
                ids = torch.tensor(decodes + prefills, dtype=torch.int32).to(md.seq_lens.device, non_blocking=True)
            self._layout = _StepLayout(
                decode_ids=ids[: len(decodes)],
                prefill_ids=ids[len(decodes) :],
                block_tables=md.block_tables if md.block_tables.stride(-1) == 1 else md.block_tables.contiguous(),
                max_decode_len=max((md.seq_lens_cpu[i] for i in decodes), default=0),
                max_prefill_query=max((md.query_lens_cpu[i] for i in prefills), default=0),
            )
            self._layout_of = md  # one metadata object per step; every layer of the step reuses this layout
        return self._layout

    def _cache_strides(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
        return (*k_cache.stride()[:3], *v_cache.stride()[:3])

    def _decode(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        layout: _StepLayout,
        qk_scale: float,
        window: int,
    ) -> None:
        _, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        num_decodes = len(layout.decode_ids)
        if self.num_splits:
            splits = min(self.num_splits, _MAX_SPLITS)
        else:
            splits = decode_num_splits(
                num_decodes, kv_heads, min(layout.max_decode_len, window), self.target_programs, self.min_split_tokens
            )
        if splits > 1:
            part_acc = torch.empty((num_decodes, heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_decodes, heads, splits), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_lse = out  # unused: the kernel writes `out` directly
        self._kernels.decode[(num_decodes, kv_heads, splits)](
            out, part_acc, part_lse, q, k_cache, v_cache,
            layout.decode_ids, md.cu_seqlens_q, md.seq_lens, layout.block_tables,
            qk_scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *self._cache_strides(k_cache, v_cache), layout.block_tables.stride(0), splits,
            GROUP=group, BLOCK_G=max(_MIN_DOT, _next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_N=self.decode_block_n, SPLIT_K=splits > 1,
            F32_DOT=self._f32_dot(q), num_warps=self.num_warps, num_stages=self.num_stages,
        )  # fmt: skip
        if splits > 1:
            self._kernels.merge[(num_decodes, heads)](
                out, part_acc, part_lse, layout.decode_ids, md.cu_seqlens_q, out.stride(0), out.stride(1),
                splits, HEAD_DIM=head_dim, BLOCK_S=_MAX_SPLITS, num_warps=4,
            )  # fmt: skip

    def _prefill(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        layout: _StepLayout,
        qk_scale: float,
        window: int,
    ) -> None:
        _, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        block_m, block_n, warps = self.block_m, self.block_n, self.num_warps
        if q.dtype == torch.float32:  # exact float32 products run on CUDA cores: 64x64 tiles spill registers
            block_m, block_n, warps = min(block_m, 32), min(block_n, 32), max(warps, 8)
        grid = (len(layout.prefill_ids), -(-layout.max_prefill_query // block_m), heads)
        self._kernels.prefill[grid](
            out, q, k_cache, v_cache, layout.prefill_ids, md.cu_seqlens_q, md.seq_lens, layout.block_tables,
            qk_scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *self._cache_strides(k_cache, v_cache), layout.block_tables.stride(0),
            GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=self._f32_dot(q), num_warps=warps, num_stages=self.num_stages,
        )  # fmt: skip

    def _f32_dot(self, q: torch.Tensor) -> bool:
        # float32 models get exact (not TF32) products; the interpreter always multiplies in float32 because its
        # numpy matmul cannot read bfloat16 (stored as raw uint16).
        return self.interpret or q.dtype == torch.float32


def paged_attention_supported(device: torch.device | str) -> bool:
    """`auto` picks this backend where it can run natively: a CUDA device with triton installed."""
    return torch.device(device).type == "cuda" and triton_available()
