"""The worker's persistent batch: per-slot state kept across steps, updated from StepPlan deltas.

A StepPlan (docs/contracts.md) names slots, not requests. New requests arrive once with all their tokens and
blocks; afterwards a plan carries only appended blocks, finished slots and (slot, start, len, sample) per
scheduled request. Every sampled token is appended to the slot's own token list, so a decode step needs
nothing but (slot, start, 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope, get_attention_backend
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM
from ringserve.workers.sampler import Sampler, SamplingBatch

_GIB = 1 << 30


class NewRequestLike(Protocol):
    slot: int
    token_ids: Any  # int32 array-like
    block_ids: Any
    num_computed_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool


class BlockAppendLike(Protocol):
    slot: int
    block_ids: Any


class StepPlanLike(Protocol):
    """What the runner reads from `_core.StepPlan`; plain Python objects of this shape work too."""

    step_id: int
    new_requests: Sequence[NewRequestLike]
    block_appends: Sequence[BlockAppendLike]
    sched_slots: Any
    sched_start: Any
    sched_len: Any
    sched_sample: Any
    finished_slots: Any


@dataclass
class SlotState:
    token_ids: list[int]
    block_ids: list[int]
    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None  # own stream when the request is seeded


@dataclass
class StepOutput:
    """One sampled token per slot that had sched_sample set, in schedule order."""

    step_id: int
    slots: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32


def kv_blocks_for_memory(config: LlamaConfig, block_size: int, dtype: torch.dtype, memory_gib: float) -> int:
    blocks = int(memory_gib * _GIB) // config.kv_bytes_per_block(block_size, dtype)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gib={memory_gib} holds no KV block of {block_size} tokens; raise it")
    return blocks


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float = 1.0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.block_size = block_size
        dtype = next(model.parameters()).dtype
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(self.config, block_size, dtype, kv_cache_memory_gib)
        self.num_kv_blocks = num_kv_blocks
        self.kv_cache = KVCache.allocate(self.config, num_kv_blocks, block_size, dtype, self.device)
        model.bind_kv_cache(self.kv_cache, get_attention_backend(attention_backend, self.device))
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(seed))
        self.slots: dict[int, SlotState] = {}

    # ---- plan deltas -------------------------------------------------------------------------------------------

    def apply_plan_deltas(self, plan: StepPlanLike) -> None:
        # Order matters: a finished slot may be reused by a new request in the same plan.
        for slot in _ints(plan.finished_slots):
            self.slots.pop(slot, None)
        for req in plan.new_requests:
            if req.slot in self.slots:
                raise ValueError(f"new request for slot {req.slot}, which is still occupied (not in finished_slots)")
            blocks = self._checked_blocks(_ints(req.block_ids), req.slot)
            generator = torch.Generator(self.device).manual_seed(int(req.seed)) if req.has_seed else None
            self.slots[req.slot] = SlotState(
                token_ids=_ints(req.token_ids),
                block_ids=blocks,
                temperature=float(req.temperature),
                top_p=float(req.top_p),
                top_k=int(req.top_k),
                generator=generator,
            )
        for append in plan.block_appends:
            state = self.slots.get(append.slot)
            if state is None:
                raise ValueError(f"block append for empty slot {append.slot}")
            state.block_ids.extend(self._checked_blocks(_ints(append.block_ids), append.slot))

    def _checked_blocks(self, blocks: list[int], slot: int) -> list[int]:
        bad = [b for b in blocks if not 0 <= b < self.num_kv_blocks]
        if bad:
            raise ValueError(f"slot {slot}: block ids {bad} out of range [0, {self.num_kv_blocks})")
        return blocks

    # ---- one step ----------------------------------------------------------------------------------------------

    def execute(self, plan: StepPlanLike) -> StepOutput:
        self.apply_plan_deltas(plan)
        slots, starts, lens = _ints(plan.sched_slots), _ints(plan.sched_start), _ints(plan.sched_len)
        sample = [bool(s) for s in np.asarray(plan.sched_sample).tolist()]
        if not slots:
            return StepOutput(plan.step_id, *_empty_result())
        input_ids, positions, metadata, sampled_slots = self._prepare(slots, starts, lens, sample)
        with torch.inference_mode(), attention_metadata_scope(metadata):
            logits = self.model(input_ids, positions)
        if not sampled_slots:
            return StepOutput(plan.step_id, *_empty_result())
        states = [self.slots[s] for s in sampled_slots]
        batch = SamplingBatch.build(
            [st.temperature for st in states],
            [st.top_k for st in states],
            [st.top_p for st in states],
            [st.generator for st in states],
            self.device,
        )
        tokens, logprobs = self.sampler(logits, batch)
        token_list = tokens.tolist()
        for state, token in zip(states, token_list, strict=True):
            state.token_ids.append(token)
        return StepOutput(
            plan.step_id,
            np.asarray(sampled_slots, dtype=np.int32),
            np.asarray(token_list, dtype=np.int32),
            logprobs.cpu().numpy().astype(np.float32),
        )

    def _prepare(
        self, slots: list[int], starts: list[int], lens: list[int], sample: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        token_chunks: list[int] = []
        position_chunks: list[np.ndarray] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled_slots: list[int] = []
        row = 0
        for slot, start, length, do_sample in zip(slots, starts, lens, sample, strict=True):
            state = self.slots.get(slot)
            if state is None:
                raise ValueError(f"scheduled slot {slot} holds no request")
            end = start + length
            if length < 1 or start < 0 or end > len(state.token_ids):
                raise ValueError(f"slot {slot}: tokens [{start}, {end}) scheduled but it holds {len(state.token_ids)}")
            needed = -(-end // self.block_size)
            if needed > len(state.block_ids):
                raise ValueError(f"slot {slot}: {end} tokens need {needed} blocks but it has {len(state.block_ids)}")
            if end > self.config.max_position:
                raise ValueError(f"slot {slot}: position {end - 1} exceeds max_position {self.config.max_position}")
            token_chunks.extend(state.token_ids[start:end])
            position_chunks.append(np.arange(start, end, dtype=np.int64))
            seq_lens.append(end)
            tables.append(state.block_ids[:needed])
            row += length
            if do_sample:
                logits_rows.append(row - 1)
                sampled_slots.append(slot)
        metadata = AttentionMetadata.build(lens, seq_lens, tables, self.block_size, logits_rows, self.device)
        input_ids = torch.tensor(token_chunks, dtype=torch.int64, device=self.device)
        positions = torch.from_numpy(np.concatenate(position_chunks)).to(self.device)
        return input_ids, positions, metadata, sampled_slots


def _ints(values: Any) -> list[int]:
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def _empty_result() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32)
