"""Pipeline parallelism applied to the decoder from outside, as tensor parallelism is (workers/parallel.py).

The model's layers are split into P contiguous stages. Stage 0 holds the embedding, the last stage the final norm and
the LM head; every stage holds only its own layers' weights and KV cache. A stage builds the model with a *local*
config (its layers only), loads only its checkpoint tensors (`PipelineStage.local_name` maps the full model's names to
the stage's), then `apply_pipeline_stage` swaps the ends: the embedding of a stage after the first becomes a receive
of the previous stage's hidden states, the final norm of a stage before the last a send to the next stage. Our
decoder layers carry the residual stream in the hidden states themselves, so one tensor [tokens, hidden] crosses
each boundary. Sampled tokens travel back from the last stage to every stage (a broadcast in the rank's pipeline
group), since each stage's persistent batch appends them.

Where a rank sits is `RankLayout`'s (ringserve/formats/rank_layout.py, shared with the engine); `PipelineStage.of`
turns a rank into its stage.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from ringserve.formats.rank_layout import RankLayout
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM
from torch import nn


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as even as possible; the first `num_layers % num_stages` stages take one layer more."""
    if num_stages > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {num_stages} is larger than the model's {num_layers} layers; "
            f"choose at most {num_layers}"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds = np.cumsum([0] + [base + (s < extra) for s in range(num_stages)])
    return [range(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class PipelineStage:
    """What one rank of stage `index` holds and whom it talks to (global ranks; None at the ends)."""

    index: int
    num_stages: int
    prev_rank: int | None
    next_rank: int | None
    last_rank: int  # the rank of the last stage in this rank's pipeline group: it broadcasts the sampled tokens

    @classmethod
    def of(cls, layout: RankLayout, rank: int) -> PipelineStage:
        """The stage of global rank `rank` in `layout`."""
        tp_rank, pp_rank = layout.coords(rank)
        last = layout.pipeline_parallel_size - 1
        return cls(
            index=pp_rank,
            num_stages=layout.pipeline_parallel_size,
            prev_rank=layout.rank_of(tp_rank, pp_rank - 1) if pp_rank > 0 else None,
            next_rank=layout.rank_of(tp_rank, pp_rank + 1) if pp_rank < last else None,
            last_rank=layout.rank_of(tp_rank, last),
        )

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        return split_layers(num_layers, self.num_stages)[self.index]

    def local_config(self, full: LlamaConfig) -> LlamaConfig:
        """The stage's model: its layers only (their windows and expert flags kept); a head of its own when the
        embedding it would be tied to lives on the first stage."""
        layers = self.layers(full.num_layers)
        return dataclasses.replace(
            full,
            num_layers=len(layers),
            layer_windows=full.layer_windows[layers.start : layers.stop],
            moe_layers=full.moe_layers[layers.start : layers.stop],
            tie_word_embeddings=full.tie_word_embeddings and self.is_first,
        )

    def local_name(self, name: str, full: LlamaConfig) -> str | None:
        """The stage's parameter for the full model's parameter `name`, or None when another stage holds it."""
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            layers = self.layers(full.num_layers)
            return f"model.layers.{int(index) - layers.start}.{rest}" if int(index) in layers else None
        if name.startswith("model.embed_tokens."):
            if self.is_first:
                return name
            # A tied head on a later stage is its own copy of the embedding table.
            return "lm_head.weight" if self.is_last and full.tie_word_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last else None
        return name


class HiddenFromPreviousStage(nn.Module):
    """Stands in for the embedding of a stage after the first: receives the previous stage's hidden states."""

    def __init__(self, hidden_size: int, src: int) -> None:
        super().__init__()
        self.src = src
        # Carries the dtype and device the received hidden states get (converted with the model, never saved).
        self.register_buffer("like", torch.empty(0, hidden_size), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.like.new_empty(input_ids.shape[0], self.like.shape[1])
        dist.recv(hidden, self.src)
        return hidden


class HiddenToNextStage(nn.Module):
    """Stands in for the final norm of a stage before the last: sends the hidden states on."""

    def __init__(self, dst: int) -> None:
        super().__init__()
        self.dst = dst

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dist.send(hidden.contiguous(), self.dst)
        return hidden


class HeadOnLastStage(nn.Module):
    """Stands in for the LM head of a stage before the last, which never computes logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head lives on the last pipeline stage; this stage only passes hidden states on")


def apply_pipeline_stage(model: LlamaForCausalLM, stage: PipelineStage) -> LlamaForCausalLM:
    """Swaps the ends of a model built with `stage.local_config(...)` (call on the meta device, before the weights
    are allocated, so a stage never holds the embedding or head it does not use)."""
    if type(model) is not LlamaForCausalLM:
        raise ValueError(f"--pipeline-parallel-size > 1 supports the llama family; {type(model).__name__} has its "
                         "own forward")  # fmt: skip
    if stage.prev_rank is not None:
        model.model.embed_tokens = HiddenFromPreviousStage(model.config.hidden_size, stage.prev_rank)  # type: ignore[assignment]
    if stage.next_rank is not None:
        model.model.norm = HiddenToNextStage(stage.next_rank)  # type: ignore[assignment]
        model.lm_head = HeadOnLastStage()  # type: ignore[assignment]
    return model


class SampledTokens:
    """The last stage's sampled tokens, sent to every stage of the rank's pipeline group (each stage's batch appends
    them: the first stage embeds them next step)."""

    def __init__(self, stage: PipelineStage, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.stage = stage
        self.group = group
        self.device = device  # NCCL moves device tensors only

    def share(self, tokens: np.ndarray) -> np.ndarray:
        """On the last stage: its sampled tokens, sent; elsewhere: an array of the same length, overwritten with
        what the last stage sent."""
        buf = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(self.device)
        dist.broadcast(buf, self.stage.last_rank, group=self.group)
        return buf.cpu().numpy()


# A micro-batch smaller than this costs about as much as a bigger one (the step reads every weight either way), so
# splitting a step below it would only add stage-to-stage trips.
MICRO_BATCH_MIN_TOKENS = 64


def split_micro_batches(lens: np.ndarray, num_stages: int, min_tokens: int = MICRO_BATCH_MIN_TOKENS) -> list[slice]:
    """A step's chunks (their token counts `lens`, in plan order) cut into at most `num_stages` contiguous groups of
    about equal tokens, `min_tokens` or more per group on average: while the next stage computes one group, this
    stage computes the next. Chunks are never cut."""
    total = int(lens.sum())
    parts = max(1, min(num_stages, len(lens), total // max(1, min_tokens)))
    if parts == 1:
        return [slice(0, len(lens))]
    ends = np.concatenate(([0], np.cumsum(lens)))  # ends[i]: tokens before chunk i
    cuts = set()
    for k in range(1, parts):
        target = total * k / parts
        i = int(np.searchsorted(ends, target))  # ends[i - 1] < target <= ends[i]: cut before chunk i or i - 1
        cuts.add(i if ends[i] - target <= target - ends[i - 1] else i - 1)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(lens)), len(lens)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]
