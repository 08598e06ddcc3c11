"""CUDA graphs of every step, piecewise: the forward cut at each layer's attention, the pieces between replayed.

Why: decode graphs (workers/cuda_graphs.py) replay only steps of one new token per sequence. On an H200 a step that
also prefilled ran eagerly, some 15 ms more than a replay (1B shape), and under steady arrivals nearly every step
prefills. Attention is what cannot be one graph for any mix of prompts and decodes: its kernels are planned on the
host from the step's query lengths. Everything else in a layer works row by row on a [tokens, hidden] tensor, so its
kernels depend on the token count only.

How (vLLM's piecewise scheme, without torch.compile): for each padded token count (`piecewise_token_sizes`, up to
the engine's --max-num-batched-tokens), the plain model's forward runs once under capture with every layer's
attention backend swapped for a cut. A cut ends the graph being captured, keeps the attention call (its q, k, v, the
layer's caches, scale, window), begins the next graph, and returns a static output buffer that the next piece reads.
A model of L layers so gives L + 1 graphs per size: the embedding and layer 0 up to its attention; then from each
attention's output projection, through the MLP and the next layer's norm, projections and RoPE, up to the next
attention; the last piece ends with the final norm. A step of T tokens replays the smallest size P >= T: a piece,
the attention eagerly (the step's own metadata, the T real rows, into the static buffer), the next piece, and so
on. The LM head and the sampler run eagerly on the rows that sample.

Memory: each piece copies what crosses a cut (q, k, v; the final hidden states) into static buffers shared by every
layer and size, so nothing a piece allocates outlives its size's capture, and all sizes share one memory pool
whose peak is the largest size's (what must persist between replays lives outside the pool).

Padding rows (P - T) never reach attention, so they write no KV (no scratch block is needed) and read none; their
token ids and positions are whatever the static buffers hold (zeros or an earlier step's, always valid indices).
Every operation between cuts works row by row, so a padding row cannot change a real one; only a GEMM's kernel choice
for P rows instead of T can change the rounding.

Pieces apply where a layer has nothing data-dependent outside attention: not to a mixture of experts (its routing
picks the experts on the host), tensor parallelism's all-reduce hooks or pipeline stages (ModelRunner decides).
`capture=False` runs the same static buffers, padding and cuts eagerly on any device (what the CPU tests check).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from ringserve.workers.attention.backend import AttentionBackend
from ringserve.workers.attention.metadata import AttentionMetadata, attention_metadata_scope, get_attention_metadata
from tqdm import tqdm

log = logging.getLogger(__name__)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 256, of 64 up to 1,024, of 256 beyond, and max_tokens itself: a step
    pads by at most 15 rows up to 256 tokens, and by under a quarter of its size beyond (36 sizes for 2,048)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    steps = [1, 2, 4, 8, *range(16, 257, 16), *range(320, 1025, 64), *range(1280, max_tokens + 1, 256)]
    sizes = [n for n in steps if n <= max_tokens]
    if sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


@dataclass
class _Cut:
    """One layer's attention call between two pieces: q, k, v are the static buffers the piece before writes, `out`
    the one the piece after reads (views of the step's padded size)."""

    backend: AttentionBackend
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    window: int | None
    softcap: float | None
    out: torch.Tensor

    def attend(self, rows: int, metadata: AttentionMetadata) -> None:
        """Attention over the step's `rows` real rows (the metadata's), written into `out`; padding rows are left."""
        if rows:
            self.out[:rows] = self.backend.forward(self.q[:rows], self.k[:rows], self.v[:rows], self.k_cache,
                                                   self.v_cache, metadata, self.scale, window=self.window,
                                                   softcap=self.softcap)  # fmt: skip


class _CutBackend:
    """Stands in for a layer's attention backend while the pieces' forward runs (`PiecewiseGraphs._forward`)."""

    name = "piecewise_cut"

    def __init__(self, graphs: PiecewiseGraphs, backend: AttentionBackend) -> None:
        self.graphs, self.backend = graphs, backend

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
        q, k, v, out = self.graphs.cross(q, k, v)
        cut = _Cut(self.backend, q, k, v, k_cache, v_cache, scale, window, softcap, out)
        if self.graphs._capturing is not None:
            self.graphs._capturing.cut(cut)
        else:
            cut.attend(self.graphs.rows, metadata)
        return cut.out


class _Capture:
    """The graphs of one size, captured piece by piece as the forward reaches each cut."""

    def __init__(self, pool: tuple[int, int]) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[_Cut] = []
        self.hidden: torch.Tensor | None = None
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def cut(self, cut: _Cut) -> None:
        self.graphs[-1].capture_end()
        self.cuts.append(cut)
        self._begin()

    def end(self, hidden: torch.Tensor) -> None:
        self.graphs[-1].capture_end()
        self.hidden = hidden

    def abandon(self) -> None:
        """Ends the open capture after a failure, so the device is usable for eager steps."""
        with contextlib.suppress(Exception):
            self.graphs[-1].capture_end()


class PiecewiseGraphs:
    """Static token ids, positions and attention output for padded token counts and, on CUDA, the captured pieces
    of the forward for each."""

    def __init__(self, model: torch.nn.Module, *, max_tokens: int, device: torch.device | str, capture: bool) -> None:
        self.model = model
        self.device = torch.device(device)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.capture_graphs = capture
        self.sizes = piecewise_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.attention = [layer.self_attn for layer in model.model.layers]  # type: ignore[union-attr]
        config = model.config
        n, dev, dtype = self.max_tokens, self.device, model.model.embed_tokens.weight.dtype  # type: ignore[union-attr]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        # What crosses a cut, one set for every layer: a piece writes q, k, v, the cut's attention reads them and
        # writes `out`, and the next piece reads `out` before it writes the next layer's q, k, v.
        self._q = torch.zeros((n, config.num_heads, config.head_dim), dtype=dtype, device=dev)
        self._k = torch.zeros((n, config.num_kv_heads, config.head_dim), dtype=dtype, device=dev)
        self._v = torch.zeros_like(self._k)
        self._out = torch.zeros_like(self._q)
        self._hidden = torch.zeros((n, config.hidden_size), dtype=dtype, device=dev)
        self.rows = 0  # the real rows of the step being run
        self._capturing: _Capture | None = None
        self._captured: dict[int, _Capture] = {}

    def padded_size(self, rows: int) -> int:
        return next(n for n in self.sizes if n >= rows)

    def cross(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v copied into the static buffers (the copies end the piece before a cut), and the output buffer."""
        rows = q.shape[0]
        if q.shape[1:] != self._q.shape[1:] or k.shape[1:] != self._k.shape[1:] or q.dtype != self._q.dtype:
            raise ValueError(f"attention inputs q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} do not match "
                             f"the static {tuple(self._q.shape)} {tuple(self._k.shape)} {self._q.dtype}")  # fmt: skip
        static = self._q[:rows], self._k[:rows], self._v[:rows]
        for buffer, tensor in zip(static, (q, k, v), strict=True):
            buffer.copy_(tensor)
        return (*static, self._out[:rows])

    def _forward(self, size: int) -> torch.Tensor:
        """The model's final-normed hidden states for the first `size` rows of the static inputs, with every
        attention backend swapped for a cut."""
        backends = [attn.backend for attn in self.attention]
        for attn, backend in zip(self.attention, backends, strict=True):
            attn.backend = _CutBackend(self, backend)
        try:
            hidden = self.model.model(self.input_ids[:size], self.positions[:size])  # type: ignore[union-attr,operator]
            return self._hidden[:size].copy_(hidden)
        finally:
            for attn, backend in zip(self.attention, backends, strict=True):
                attn.backend = backend

    def capture(self) -> None:
        """Per size, largest first into one shared memory pool: one warm-up forward (kernels compiled, cuBLAS's
        workspace sized), then the captured one. No rows are real, so no cut attends and nothing is written to
        the KV cache."""
        if not self.capture_graphs or self._captured:
            return
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))  # the weights and caches are in place
        self.rows = 0
        placeholder = AttentionMetadata.build([], [], [], 1, None, self.device)  # what attend() reads; unused
        with torch.inference_mode(), attention_metadata_scope(placeholder), torch.cuda.stream(side):
            for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing piecewise CUDA graphs", unit="size"):
                self._forward(size)
                torch.cuda.synchronize(self.device)
                self._capturing = capture = _Capture(pool)
                try:
                    capture.end(self._forward(size))
                except BaseException:
                    capture.abandon()
                    raise
                finally:
                    self._capturing = None
                self._captured[size] = capture
        torch.cuda.synchronize(self.device)
        log.info("captured piecewise CUDA graphs (%d pieces each) for token counts %s",
                 len(self.attention) + 1, self.sizes)  # fmt: skip

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states [T, hidden] of a step of T <= max_tokens tokens, under the step's attention
        metadata (set by the caller). A view of a static buffer: read it before the next step."""
        rows = len(input_ids)
        size = self.padded_size(rows)
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.rows = rows
        if not self.capture_graphs:
            return self._forward(size)[:rows]
        captured, metadata = self._captured[size], get_attention_metadata()
        for graph, cut in zip(captured.graphs, captured.cuts, strict=False):  # one graph more than cuts
            graph.replay()
            cut.attend(rows, metadata)
        captured.graphs[-1].replay()
        assert captured.hidden is not None
        return captured.hidden[:rows]
