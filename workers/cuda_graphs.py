"""CUDA graphs of decode steps: the whole forward (every layer, the final norm, the LM head) replayed as one graph.

Why: on an H200 (benchmarks/gpu.py, 2026-12-04) an eager decode step of a Llama-3.2-1B-shaped model at batch 1 took
8.8 ms, of which the GPU worked ~1.6 ms; the rest was Python dispatching ~20 kernels per layer. A replayed graph
launches them all at once.

How (the scheme vLLM uses): at start, one graph per padded batch size (1, 2, 4, 8, then multiples of 16 up to
`max_batch`), captured largest first into one shared memory pool. A decode step of n sequences replays the smallest
graph of B >= n rows. The graph reads static device buffers: token ids, positions, slot mapping, context lengths, and
block tables of full width (max_position / block_size columns; a step uploads only the columns it needs). The B - n
padding rows point at a scratch KV block that no request owns: each writes its key and value there and attends to
that one slot, and its logits are dropped. The paged decode kernel's split count is fixed per graph for the longest
context the model allows; a split past a shorter context's end is empty and exits at once.

Only plain decode steps take a graph: one new token per sequence, no speculative drafts, the triton_paged backend,
no tensor parallelism (its all-reduce hooks stay eager), and batches up to `max_batch`. Other steps replay piecewise
graphs (workers/piecewise_graphs.py) with --cuda-graphs piecewise (auto on CUDA), else run eagerly.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import torch
from ringserve.formats.engine_args import CUDA_GRAPH_MODES
from ringserve.workers.attention.metadata import AttentionMetadata, attention_metadata_scope
from tqdm import tqdm

log = logging.getLogger(__name__)

# --cuda-graphs (ringserve/formats/engine_args.py): "decode", these graphs; "piecewise", these and
# workers/piecewise_graphs.py for every other step; "auto", piecewise on CUDA; "off", always eager.
GraphMode = Literal["auto", "off", "decode", "piecewise"]
GRAPH_MODES = CUDA_GRAPH_MODES


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, not {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Static decode inputs for padded batch sizes and, on CUDA, a captured graph of the forward for each."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        block_size: int,
        scratch_block: int,
        max_position: int,
        max_batch: int,
        device: torch.device | str,
        capture: bool,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.capture_graphs = capture
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = max(1, -(-max_position // block_size))
        b, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), scratch_block * block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((b, self.width), scratch_block, dtype=torch.int32, device=dev)
        self._table_stage = torch.empty(b * self.width, dtype=torch.int32, device=dev)
        cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        decode_ids = torch.arange(b, dtype=torch.int32, device=dev)
        # Pinned host staging, so the uploads are asynchronous; a step's outputs are read back (a sync) before the
        # next step refills them.
        pin = dev.type == "cuda"
        self._host = torch.zeros((3, b), dtype=torch.int64, pin_memory=pin)  # ids, positions, slots
        self._host_lens = torch.zeros(b, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(b * self.width, dtype=torch.int32, pin_memory=pin)
        # One metadata object per size, reused by every replay: the paged backend caches its layout per object.
        # seq_lens_cpu says "the longest context" so the decode kernel's split count suits any context.
        self._metadata = {n: self._metadata_for(n, cu_seqlens_q, decode_ids) for n in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _metadata_for(self, n: int, cu_seqlens_q: torch.Tensor, decode_ids: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], cu_seqlens_q=cu_seqlens_q[: n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], logits_indices=None, query_lens_cpu=[1] * n,
            seq_lens_cpu=[self.width * self.block_size] * n, block_size=self.block_size, decode_ids=decode_ids[:n],
        )  # fmt: skip

    def padded_size(self, rows: int) -> int:
        return next(b for b in self.sizes if b >= rows)

    def _forward(self, rows: int) -> torch.Tensor:
        with torch.inference_mode(), attention_metadata_scope(self._metadata[rows]):
            return self.model(self.input_ids[:rows], self.positions[:rows], float_logits=False)

    def capture(self) -> None:
        """One warm-up forward (compiles the kernels, sizes cuBLAS's workspace) and one capture per size. The static
        buffers hold padding only, so warm-up and capture write nothing but the scratch block."""
        if not self.capture_graphs or self._graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        for rows in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs", unit="graph"):
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._forward(rows)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[rows] = self._forward(rows)
            self._graphs[rows] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs of decode steps for batch sizes %s", self.sizes)

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Logits [n, vocab] (the weights' dtype) of a decode step of n <= max_batch sequences: row i is sequence i's
        next-token logits. The tensor is the graph's output buffer: read it before the next step."""
        rows = len(input_ids)
        padded = self.padded_size(rows)
        width = block_tables.shape[1]
        if width > self.width:
            raise ValueError(f"block tables of {width} columns exceed the graphs' {self.width}")
        host = self._host.numpy()
        host[:2, rows:padded] = 0
        host[2, rows:padded] = self.scratch_block * self.block_size
        host[0, :rows], host[1, :rows], host[2, :rows] = input_ids, positions, slot_mapping
        lens = self._host_lens.numpy()
        lens[:rows], lens[rows:padded] = seq_lens, 1
        tables = self._host_tables.numpy()[: padded * width].reshape(padded, width)
        tables[:rows] = block_tables
        tables[rows:, 0] = self.scratch_block
        self.input_ids[:padded].copy_(self._host[0, :padded], non_blocking=True)
        self.positions[:padded].copy_(self._host[1, :padded], non_blocking=True)
        self.slot_mapping[:padded].copy_(self._host[2, :padded], non_blocking=True)
        self.seq_lens[:padded].copy_(self._host_lens[:padded], non_blocking=True)
        # The tables go up packed (padded x width) and are spread into their full-width rows on the device.
        stage = self._table_stage[: padded * width]
        stage.copy_(self._host_tables[: padded * width], non_blocking=True)
        self.block_tables[:padded, :width].copy_(stage.view(padded, width))
        if self.capture_graphs:
            self._graphs[padded].replay()
            logits = self._outputs[padded]
        else:
            logits = self._forward(padded)
        return logits[:rows]
