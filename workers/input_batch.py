"""The persistent batch: per-slot arrays (tokens, block tables, sampling parameters) kept across steps.

A StepPlan (docs/contracts.md) names slots, not requests. New requests arrive once with all their tokens and
blocks; afterwards a plan carries only appended blocks, finished slots and (slot, start, len, sample) per
scheduled request. Everything a step needs is then gathered from these arrays with vectorized indexing, so the
per-step Python work does not grow with the number of running requests (only new requests and block appends,
the plan's deltas, are visited one by one). Arrays grow by doubling when a slot, a sequence or a block table
outgrows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ringserve.workers.attention import AttentionMetadata
from ringserve.workers.sampler import SamplingBatch, greedy_is_plain


def sampling_fields() -> tuple[tuple[str, type, Any], ...]:
    """Per-slot sampling parameters: (name, dtype, default), one per field of the records' SamplingParams, so a new
    sampling field needs no edit here. Integers are kept as int64 (a u64 seed keeps its bits)."""
    from ringserve import _core  # built from csrc/; imported on use so importing workers/ needs no build

    def dtype(default: Any) -> type:
        return np.bool_ if isinstance(default, bool) else np.int64 if isinstance(default, int) else np.float32

    return tuple((name, dtype(default), default) for name, default in _core.SAMPLING_FIELDS)


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    sampled_slots: np.ndarray  # int64 [rows]: slots that get a token this step, in schedule order


def _grown(array: np.ndarray, shape: tuple[int, ...], fill: Any) -> np.ndarray:
    bigger = np.full(shape, fill, dtype=array.dtype)
    bigger[tuple(slice(0, n) for n in array.shape)] = array
    return bigger


def _capacity(needed: int, current: int) -> int:
    while current < needed:
        current *= 2
    return current


class InputBatch:
    def __init__(self, block_size: int, num_kv_blocks: int, max_position: int, device: torch.device) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_position = max_position
        self.device = device
        slots, tokens, blocks = 8, 64, 8
        self.occupied = np.zeros(slots, np.bool_)
        self.token_ids = np.zeros((slots, tokens), np.int64)
        self.num_tokens = np.zeros(slots, np.int64)
        self.num_prompt_tokens = np.zeros(slots, np.int64)
        self.block_table = np.zeros((slots, blocks), np.int32)
        self.num_blocks = np.zeros(slots, np.int64)
        self.suppress = np.full((slots, 1), -1, np.int64)
        self.params = {name: np.full(slots, default, dtype) for name, dtype, default in sampling_fields()}
        # Per slot: greedy with no penalty and no top logprobs, and the token count from which min_tokens no longer
        # suppresses anything: together they say when the sampler's greedy pass alone gives its token.
        self.greedy_plain = np.zeros(slots, np.bool_)
        self.suppress_until = np.zeros(slots, np.int64)

    # ---- capacity --------------------------------------------------------------------------------------------

    def _ensure(self, slots: int = 0, tokens: int = 0, blocks: int = 0, suppress: int = 0) -> None:
        s = _capacity(slots, len(self.occupied))
        t = _capacity(tokens, self.token_ids.shape[1])
        b = _capacity(blocks, self.block_table.shape[1])
        k = _capacity(suppress, self.suppress.shape[1])
        if s != len(self.occupied):
            self.occupied = _grown(self.occupied, (s,), False)
            self.num_tokens = _grown(self.num_tokens, (s,), 0)
            self.num_prompt_tokens = _grown(self.num_prompt_tokens, (s,), 0)
            self.num_blocks = _grown(self.num_blocks, (s,), 0)
            self.params = {n: _grown(a, (s,), a[0] * 0) for n, a in self.params.items()}
            self.greedy_plain = _grown(self.greedy_plain, (s,), False)
            self.suppress_until = _grown(self.suppress_until, (s,), 0)
        if (s, t) != self.token_ids.shape:
            self.token_ids = _grown(self.token_ids, (s, t), 0)
        if (s, b) != self.block_table.shape:
            self.block_table = _grown(self.block_table, (s, b), 0)
        if (s, k) != self.suppress.shape:
            self.suppress = _grown(self.suppress, (s, k), -1)

    # ---- plan deltas -----------------------------------------------------------------------------------------

    def remove(self, slots: np.ndarray) -> None:
        slots = slots[slots < len(self.occupied)]
        self.occupied[slots] = False

    def add(self, req: Any) -> None:
        slot = int(req.slot)
        if slot < 0:
            raise ValueError(f"new request for negative slot {slot}")
        if slot < len(self.occupied) and self.occupied[slot]:
            raise ValueError(f"new request for slot {slot}, which is still occupied (not in finished_slots)")
        tokens = np.asarray(req.token_ids, np.int64).reshape(-1)
        blocks = self._checked_blocks(np.asarray(req.block_ids, np.int32).reshape(-1), slot)
        suppress = np.asarray(req.suppress_token_ids, np.int64).reshape(-1)
        self._ensure(slots=slot + 1, tokens=len(tokens) + 1, blocks=len(blocks), suppress=len(suppress))
        self.occupied[slot] = True
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_prompt_tokens[slot] = int(req.num_prompt_tokens)
        self.block_table[slot, : len(blocks)] = blocks
        self.num_blocks[slot] = len(blocks)
        self.suppress[slot] = -1
        self.suppress[slot, : len(suppress)] = suppress
        sampling = req.sampling
        for name, values in self.params.items():
            value = getattr(sampling, name)
            if name == "seed" and value >= 1 << 63:  # a u64 seed: keep its bits as int64 (the sampler hashes bits)
                value -= 1 << 64
            values[slot] = value
        p = self.params
        self.greedy_plain[slot] = greedy_is_plain({name: values[slot] for name, values in p.items()})
        self.suppress_until[slot] = self.num_prompt_tokens[slot] + p["min_tokens"][slot]

    def append_blocks(self, slot: int, block_ids: Any) -> None:
        if not (0 <= slot < len(self.occupied) and self.occupied[slot]):
            raise ValueError(f"block append for empty slot {slot}")
        blocks = self._checked_blocks(np.asarray(block_ids, np.int32).reshape(-1), slot)
        start = int(self.num_blocks[slot])
        self._ensure(blocks=start + len(blocks))
        self.block_table[slot, start : start + len(blocks)] = blocks
        self.num_blocks[slot] = start + len(blocks)

    def trim_blocks(self, slots: np.ndarray, num_blocks: np.ndarray) -> None:
        """Block tables shrink to `num_blocks` (lookahead blocks the engine took back after rejected drafts)."""
        for slot, n in zip(slots.tolist(), num_blocks.tolist(), strict=True):
            if not (0 <= slot < len(self.occupied) and self.occupied[slot]) or not 0 <= n <= self.num_blocks[slot]:
                raise ValueError(f"trim of slot {slot} to {n} blocks: not an occupied slot with that many blocks")
            self.num_blocks[slot] = n

    def stage_drafts(self, slot: int, tokens: np.ndarray) -> None:
        """Draft tokens sit after the slot's known tokens (not counted in num_tokens) for one verification pass."""
        start = int(self.num_tokens[slot])
        self._ensure(tokens=start + len(tokens) + 1)
        self.token_ids[slot, start : start + len(tokens)] = tokens

    def append_tokens(self, slot: int, tokens: np.ndarray) -> None:
        start = int(self.num_tokens[slot])
        self._ensure(tokens=start + len(tokens) + 1)
        self.token_ids[slot, start : start + len(tokens)] = tokens
        self.num_tokens[slot] = start + len(tokens)

    def _checked_blocks(self, blocks: np.ndarray, slot: int) -> np.ndarray:
        bad = blocks[(blocks < 0) | (blocks >= self.num_kv_blocks)]
        if len(bad):
            raise ValueError(f"slot {slot}: block ids {bad.tolist()} out of range [0, {self.num_kv_blocks})")
        return blocks

    def tokens_of(self, slot: int) -> list[int]:
        return self.token_ids[slot, : self.num_tokens[slot]].tolist()

    # ---- one step --------------------------------------------------------------------------------------------

    def prepare(
        self,
        slots: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
        sample: np.ndarray,
        num_drafts: np.ndarray | None = None,
    ) -> PreparedStep:
        """Packed inputs and attention metadata for the scheduled (slot, start, len) chunks, all vectorized.

        With num_drafts, each chunk also covers that many staged draft tokens after its last one, and a sampled
        chunk gets 1 + num_drafts logits rows (its last token's and each draft's)."""
        drafts = num_drafts if num_drafts is not None else np.zeros(len(slots), np.int64)
        self._validate(slots, starts, lens, drafts)
        lens = lens + drafts
        bs = self.block_size
        ends = starts + lens
        if num_drafts is None and bool((lens == 1).all()):  # a decode step: one row per chunk, at its start
            cu = np.arange(len(lens) + 1, dtype=np.int64)
            row_slot, positions = slots, starts
        else:
            cu = np.zeros(len(lens) + 1, np.int64)
            np.cumsum(lens, out=cu[1:])
            row_slot = np.repeat(slots, lens)
            positions = np.repeat(starts, lens) + (np.arange(cu[-1]) - np.repeat(cu[:-1], lens))
        input_ids = self.token_ids[row_slot, positions]
        slot_mapping = self._cache_slots(row_slot, positions)
        table_width = self._table_width(ends)
        if num_drafts is None:
            logits_rows = cu[1:][sample] - 1
        else:
            per = np.where(sample, 1 + drafts, 0)
            first = np.repeat(cu[1:] - per, per)
            offset = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
            logits_rows = first + offset
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(self.block_table[slots, :table_width])).to(dev),
            # Rows are strictly increasing, so as many as there are tokens means every row (None: no gather).
            logits_indices=None if len(logits_rows) == cu[-1] else torch.from_numpy(logits_rows).to(dev),
            query_lens_cpu=lens.tolist(),
            seq_lens_cpu=ends.tolist(),
            block_size=bs,
        )
        return PreparedStep(
            torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metadata, slots[sample]
        )

    def decode_arrays(
        self, slots: np.ndarray, starts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What `prepare` builds for a decode step (one token per slot, at `starts`), as host arrays for static
        buffers (workers/cuda_graphs.py): token ids, positions, slot mapping, context lengths, block table rows."""
        ones = np.ones(len(slots), np.int64)
        self._validate(slots, starts, ones, np.zeros(len(slots), np.int64))
        ends = starts + 1
        tables = self.block_table[slots, : self._table_width(ends)]
        return self.token_ids[slots, starts], starts, self._cache_slots(slots, starts), ends, tables

    def _cache_slots(self, row_slot: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The flat KV cache slot (block id x block size + offset) of each row's position, int64."""
        bs = self.block_size
        return self.block_table[row_slot, positions // bs].astype(np.int64) * bs + positions % bs

    def _table_width(self, ends: np.ndarray) -> int:
        """Block table columns that reach the longest context (at least one)."""
        return max(1, int(-(-ends.max() // self.block_size)))

    def _validate(self, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray, drafts: np.ndarray) -> None:
        in_range = (slots >= 0) & (slots < len(self.occupied))
        if not in_range.all() or not self.occupied[slots].all():
            bad = slots[~in_range] if not in_range.all() else slots[~self.occupied[slots]]
            raise ValueError(f"scheduled slot {int(bad[0])} holds no request")
        ends = starts + lens
        held = self.num_tokens[slots]
        # Drafts follow a chunk that ends at the slot's last known token.
        bad = (lens < 1) | (starts < 0) | (ends > held) | ((drafts > 0) & (ends < held))
        ends = ends + drafts
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"slot {slots[i]}: tokens [{starts[i]}, {ends[i]}) scheduled but it holds {self.num_tokens[slots[i]]}"
            )
        needed = -(-ends // self.block_size)
        short = needed > self.num_blocks[slots]
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(
                f"slot {slots[i]}: {ends[i]} tokens need {needed[i]} blocks but it has {self.num_blocks[slots[i]]}"
            )
        if ends.max() > self.max_position:
            i = int(np.argmax(ends))
            raise ValueError(f"slot {slots[i]}: position {ends[i] - 1} exceeds max_position {self.max_position}")

    def plain_greedy(self, slots: np.ndarray) -> bool:
        """True when every slot's next token is the argmax of its logits with nothing to adjust (see
        Sampler.greedy): then no SamplingBatch is needed."""
        unsuppressed = self.num_tokens[slots] >= self.suppress_until[slots]
        return bool(self.greedy_plain[slots].all()) and bool(unsuppressed.all())

    def sampling_batch(self, slots: np.ndarray) -> SamplingBatch:
        """Sampling parameters of `slots` (rows in that order); penalty history only when a row needs it."""
        dev = self.device
        num_tokens, num_prompt = self.num_tokens[slots], self.num_prompt_tokens[slots]

        def history() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            width = int(num_tokens.max())
            token_ids = np.ascontiguousarray(self.token_ids[slots, :width])
            return (torch.from_numpy(token_ids).to(dev), torch.from_numpy(num_tokens).to(dev),
                    torch.from_numpy(num_prompt).to(dev))  # fmt: skip

        batch = SamplingBatch.from_columns(
            {name: values[slots] for name, values in self.params.items()},
            lambda column: torch.from_numpy(column).to(dev),
            output_index=torch.from_numpy(num_tokens - num_prompt).to(dev),
            history=history,
        )
        active = num_tokens < self.suppress_until[slots]  # min_tokens not yet reached (the rule plain_greedy uses)
        if active.any():
            batch.suppress_token_ids = torch.from_numpy(np.ascontiguousarray(self.suppress[slots])).to(dev)
            batch.suppress_active = torch.from_numpy(active).to(dev)
        return batch

    def append_sampled(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Each sampled token joins its slot's tokens (the engine's next plan schedules it as (slot, start, 1))."""
        self._ensure(tokens=int(self.num_tokens[slots].max()) + 1)
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1
