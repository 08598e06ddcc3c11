"""Tensor parallelism applied to the decoder from outside (gpt-fast style), so model/llama.py stays single-device.

Each rank builds the model with a *local* config (its share of heads, KV heads, MLP columns and vocab rows), loads
only its slice of every checkpoint tensor (`TensorParallelShard.slice`), then `apply_tensor_parallel` adds the
collectives: an all-reduce after the row-parallel O and down projections, a masked lookup plus all-reduce for the
vocab-parallel embedding, and an all-gather of the vocab-parallel LM head's logits so every rank samples the same
full logits (identical seeds make every rank's sampler draw the same tokens). With pipeline stages
(workers/pipeline.py) these collectives run within the stage's tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this module binds `group.WORLD` as a default argument when it
# is first imported. torch imports it lazily (torch._dynamo does, while a model loads), and imported after
# init_process_group it would hold the group past destroy_process_group: the gloo worker threads then outlive the
# group and can abort the interpreter's shutdown ("terminate called without an active exception" while a thread
# releases a finished collective's tensors).
import torch.distributed.nn.functional
import torch.nn.functional as F
from ringserve.formats.rank_layout import RankLayout
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM
from ringserve.workers.model.cpu_ops import linear
from ringserve.workers.model.llama import SparseMoeBlock
from torch import nn

# Parameter-name suffix -> dim split across ranks (0: output rows, column-parallel; 1: input columns, row-parallel).
_COLUMN = ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_ROW = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TensorParallelShard:
    """What rank `rank` of `world_size` holds of a model with config `full`."""

    rank: int
    world_size: int
    full: LlamaConfig

    def __post_init__(self) -> None:
        c, n = self.full, self.world_size
        if c.num_heads % n:
            raise ValueError(
                f"--tensor-parallel-size {n} does not divide the model's {c.num_heads} attention heads; "
                f"choose a divisor of {c.num_heads}"
            )
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {n} neither divides the model's {c.num_kv_heads} KV heads nor is a multiple "
                f"of them; choose a divisor or a multiple of {c.num_kv_heads}"
            )
        for what, width in (("MLP", c.intermediate_size), ("expert", c.moe_intermediate_size),
                            ("shared expert", c.shared_expert_intermediate_size)):  # fmt: skip
            if width % n:
                raise ValueError(
                    f"--tensor-parallel-size {n} does not divide the {what} width {width}; choose a divisor"
                )

    @property
    def local_kv_heads(self) -> int:
        # Fewer KV heads than ranks: each rank keeps a replica of the one KV head its query heads read.
        return max(1, self.full.num_kv_heads // self.world_size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.full.vocab_size // self.world_size)  # the last shard is zero-padded

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> LlamaConfig:
        c, n = self.full, self.world_size
        return dataclasses.replace(
            c,
            vocab_size=self.vocab_per_rank,
            intermediate_size=c.intermediate_size // n,
            moe_intermediate_size=c.moe_intermediate_size // n,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size // n,
            num_heads=c.num_heads // n,
            num_kv_heads=self.local_kv_heads,
        )

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor `name` (our parameter naming)."""
        if self.world_size == 1:
            return tensor
        if name.endswith(_VOCAB):
            part = tensor[self.vocab_start : self.vocab_start + self.vocab_per_rank]
            if part.shape[0] < self.vocab_per_rank:  # padded rows are never looked up; their logits are cut off
                part = torch.cat([part, part.new_zeros(self.vocab_per_rank - part.shape[0], *part.shape[1:])])
            return part
        if name.endswith(_COLUMN):
            return tensor.chunk(self.world_size, 0)[self.rank]
        if name.endswith(_ROW):
            return tensor.chunk(self.world_size, 1)[self.rank]
        if name.endswith(_KV):
            kv = self.full.num_kv_heads
            if kv % self.world_size == 0:
                return tensor.chunk(self.world_size, 0)[self.rank]
            head = self.rank // (self.world_size // kv)
            return tensor.chunk(kv, 0)[head]
        return tensor  # norms: replicated

    def row_range(self, name: str, rows: int, cols: int | None) -> tuple[slice, slice | None] | None:
        """Index of this rank's part, for reading a memory-mapped tensor lazily; None = needs padding (read whole)."""
        if self.world_size == 1:
            return None
        if name.endswith(_VOCAB):
            end = self.vocab_start + self.vocab_per_rank
            return None if end > rows else (slice(self.vocab_start, end), None)
        if name.endswith(_COLUMN):
            step = rows // self.world_size
            return slice(self.rank * step, (self.rank + 1) * step), None
        if name.endswith(_ROW) and cols is not None:
            step = cols // self.world_size
            return slice(None), slice(self.rank * step, (self.rank + 1) * step)
        if name.endswith(_KV):
            kv = self.full.num_kv_heads
            if kv % self.world_size == 0:
                step = rows // self.world_size
                return slice(self.rank * step, (self.rank + 1) * step), None
            step = rows // kv
            head = self.rank // (self.world_size // kv)
            return slice(head * step, (head + 1) * step), None
        return None


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + local) of the table; ids outside are looked up as zeros and the ranks' parts summed."""

    def __init__(self, weight: nn.Parameter, vocab_start: int) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=_groups.tensor_parallel)
        return out


class VocabParallelHead(nn.Module):
    """Local logits for this rank's vocab rows, all-gathered so every rank holds the full [rows, vocab]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, world_size: int) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.world_size = world_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=_groups.tensor_parallel)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def _all_reduce_output(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output, group=_groups.tensor_parallel)
    return output


def apply_tensor_parallel(model: LlamaForCausalLM, shard: TensorParallelShard) -> LlamaForCausalLM:
    """Adds the collectives to a model built with `shard.local_config()` (weights may still be empty)."""
    if shard.world_size == 1:
        return model
    for layer in model.model.layers:
        # Row-parallel: each rank holds a slice of the input features, so the outputs are partial sums.
        layer.self_attn.o_proj.register_forward_hook(_all_reduce_output)
        # Experts are split like MLPs and the router is replicated, so a rank's mixture is a partial sum of the
        # same weighted experts: one all-reduce of the block's output, not one per expert.
        moe = isinstance(layer.mlp, SparseMoeBlock)
        (layer.mlp if moe else layer.mlp.down_proj).register_forward_hook(_all_reduce_output)
    # A pipeline stage holds the embedding (first) or the head (last) only where it uses them.
    if isinstance(model.model.embed_tokens, nn.Embedding):
        embed = model.model.embed_tokens.weight
        model.model.embed_tokens = VocabParallelEmbedding(embed, shard.vocab_start)  # type: ignore[assignment]
    if isinstance(model.lm_head, nn.Linear):
        head = model.lm_head.weight
        model.lm_head = VocabParallelHead(head, shard.full.vocab_size, shard.world_size)  # type: ignore[assignment]
    return model


@dataclass
class ProcessGroups:
    """This rank's groups; None = the default group (every rank), which is what they are without pipeline stages."""

    tensor_parallel: dist.ProcessGroup | None = None
    pipeline: dist.ProcessGroup | None = None


_groups = ProcessGroups()  # set once by init_distributed; the collectives above read it


def init_distributed(
    rank: int, world_size: int, device: torch.device, timeout_s: float = 600.0, pipeline_parallel_size: int = 1
) -> ProcessGroups:
    """Joins the process group from MASTER_ADDR/MASTER_PORT (set by the engine): NCCL on CUDA, gloo on CPU. With
    pipeline stages, also this rank's tensor-parallel group (its stage) and pipeline group (its TP part across the
    stages), laid out by `RankLayout`."""
    if world_size == 1 or dist.is_initialized():
        return _groups
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"{key} is not set; the engine sets it when it starts tensor-parallel workers")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    if pipeline_parallel_size > 1:
        layout = RankLayout(world_size // pipeline_parallel_size, pipeline_parallel_size)
        tp_rank, pp_rank = layout.coords(rank)
        # Every rank creates every group, in the same order (new_group is collective over the default group).
        for p in range(layout.pipeline_parallel_size):
            group = dist.new_group(layout.tensor_parallel_group(p))
            if p == pp_rank:
                _groups.tensor_parallel = group
        for t in range(layout.tensor_parallel_size):
            group = dist.new_group(layout.pipeline_group(t))
            if t == tp_rank:
                _groups.pipeline = group
    return _groups
