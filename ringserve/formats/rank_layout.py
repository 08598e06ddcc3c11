"""Where each worker rank of an engine sits: tensor-parallel part and pipeline stage.

Rank r is tensor-parallel rank r % TP of pipeline stage r // TP, so a stage's TP ranks are consecutive (and share a
node when ranks are packed node by node). The engine, the local and Ray executors and the workers all number ranks
with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """TP x PP ranks: rank r is tensor-parallel rank r % TP of pipeline stage r // TP."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of global rank `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return rank % self.tensor_parallel_size, rank // self.tensor_parallel_size

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tensor_parallel_size + tp_rank

    @property
    def result_rank(self) -> int:
        """The one rank that writes step results: tensor-parallel rank 0 of the last stage (it samples)."""
        return self.rank_of(0, self.pipeline_parallel_size - 1)

    def tensor_parallel_group(self, pp_rank: int) -> list[int]:
        """The ranks of stage `pp_rank` (they all-reduce within it)."""
        return [self.rank_of(t, pp_rank) for t in range(self.tensor_parallel_size)]

    def pipeline_group(self, tp_rank: int) -> list[int]:
        """The ranks that hold tensor-parallel part `tp_rank` in every stage (they pass activations along)."""
        return [self.rank_of(tp_rank, p) for p in range(self.pipeline_parallel_size)]
