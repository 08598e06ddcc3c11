"""One step with lookahead: draft, verify every draft in one target forward pass, keep the accepted prefix.

The runner hands over a plan whose schedule reserves lookahead slots (StepPlan.sched_lookahead). Rows that the
acceptance rule covers get drafts from the proposer; the others decode one token as usual. Each sampling slot
returns its accepted drafts and then the target's own token (StepOutput.token_counts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ringserve.workers.attention import attention_metadata_scope
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.model import KVCache
from ringserve.workers.sampler import Sampler
from ringserve.workers.speculative.acceptance import verify_drafts
from ringserve.workers.speculative.proposers import Proposer
from ringserve.workers.speculative.tree import DraftTree, chunk_tree_mask, compact_accepted_kv, verify_tree
from ringserve.workers.step_output import StepOutput


def draftable(batch: InputBatch, slots: np.ndarray) -> np.ndarray:
    """Rows the acceptance rule covers as is: no penalties (they depend on the accepted prefix), no pending
    min_tokens suppression, no top logprobs. The others decode one token (lossless, just not faster)."""
    p = batch.params
    outputs = batch.num_tokens[slots] - batch.num_prompt_tokens[slots]
    return (
        (p["repetition_penalty"][slots] == 1.0)
        & (p["frequency_penalty"][slots] == 0.0)
        & (p["presence_penalty"][slots] == 0.0)
        & (p["num_logprobs"][slots] == 0)
        & (outputs >= p["min_tokens"][slots])
    )


class SpeculativeStep:
    """The parts of a runner one speculative step uses; built per step, so a proposer swapped in later is seen."""

    def __init__(self, model: torch.nn.Module, batch: InputBatch, sampler: Sampler, proposer: Proposer,
                 kv_cache: KVCache) -> None:  # fmt: skip
        self.model, self.batch, self.sampler, self.proposer, self.kv_cache = model, batch, sampler, proposer, kv_cache

    def execute(self, plan: Any, slots: np.ndarray, lookahead: np.ndarray) -> StepOutput:
        batch = self.batch
        starts = np.asarray(plan.sched_start, np.int64).reshape(-1)
        lens = np.asarray(plan.sched_len, np.int64).reshape(-1)
        sample = np.asarray(plan.sched_sample, np.bool_).reshape(-1)
        spec = np.flatnonzero((lookahead > 0) & sample)
        spec = spec[draftable(batch, slots[spec])]
        num_drafts = np.zeros(len(slots), np.int64)
        proposals = []
        if len(spec):
            proposals = self.proposer.propose(batch, slots[spec], lookahead[spec], batch.sampling_batch(slots[spec]))
            for entry, proposal in zip(spec.tolist(), proposals, strict=True):
                drafts = np.asarray(proposal.token_ids, np.int64)[: lookahead[entry]]
                num_drafts[entry] = len(drafts)
                # A tree's absent nodes (-1) are computed as token 0 and never accepted (verify_tree sees the -1).
                batch.stage_drafts(int(slots[entry]), np.maximum(drafts, 0))
        step = batch.prepare(slots, starts, lens, sample, num_drafts)
        tree = getattr(self.proposer, "tree", None)
        if tree is not None and len(spec):
            _place_tree_nodes(step, tree, spec, starts, lens, num_drafts)
        with torch.inference_mode(), attention_metadata_scope(step.metadata):
            logits = self.model(step.input_ids, step.positions)
        self.proposer.observe_step(step.input_ids, step.positions, step.metadata)
        sampled = np.flatnonzero(sample)
        if not len(sampled):
            return StepOutput.empty(plan.step_id)
        # Logits rows come per sampled entry in schedule order: 1 + num_drafts each.
        per = 1 + num_drafts[sampled]
        first_row = np.cumsum(per) - per
        plain = num_drafts[sampled] == 0
        tokens: list[np.ndarray] = [np.zeros(0, np.int32)] * len(sampled)
        logprobs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sampled)
        top_ids = top_lps = None
        if plain.any():
            rows = torch.from_numpy(first_row[plain]).to(logits.device)
            out = self.sampler.sample(logits[rows], batch.sampling_batch(slots[sampled[plain]]))
            plain_tokens = out.token_ids.cpu().numpy().astype(np.int32)
            plain_lps = out.logprobs.cpu().numpy().astype(np.float32)
            for j, i in enumerate(np.flatnonzero(plain).tolist()):
                tokens[i], logprobs[i] = plain_tokens[j : j + 1], plain_lps[j : j + 1]
            if out.top_token_ids is not None and out.top_logprobs is not None:
                top_ids, top_lps = out.top_token_ids.cpu().numpy(), out.top_logprobs.float().cpu().numpy()
        verified_rows = np.flatnonzero(~plain)
        if len(verified_rows):
            entries = sampled[verified_rows]
            index = np.concatenate([np.arange(first_row[i], first_row[i] + per[i]) for i in verified_rows.tolist()])
            by_entry = {e: p for e, p in zip(spec.tolist(), proposals, strict=True)}
            if tree is not None:
                nodes = [np.asarray(by_entry[e].token_ids, np.int64)[: num_drafts[e]] for e in entries.tolist()]
                self._verify_tree(tree, logits, index, slots, entries, nodes, num_drafts, verified_rows, tokens,
                                  logprobs)  # fmt: skip
            else:
                self._verify_chain(logits, index, slots, entries, num_drafts, verified_rows, by_entry, tokens, logprobs)
        counts = np.array([len(t) for t in tokens], np.int32)
        proposed = num_drafts[sampled].astype(np.int32)
        if tree is not None:  # a tree proposes one path's worth of tokens: its depth
            proposed = tree.node_depth[proposed].astype(np.int32)
        for i, entry in enumerate(sampled.tolist()):
            batch.append_tokens(int(slots[entry]), tokens[i])
        if top_ids is not None and top_lps is not None:
            # Top-n rows per token; speculating rows never ask for them (see draftable), so theirs are padding.
            n = top_ids.shape[1]
            full_ids = np.full((int(counts.sum()), n), -1, np.int32)
            full_lps = np.zeros((int(counts.sum()), n), np.float32)
            at = np.cumsum(counts) - counts
            full_ids[at[plain]] = top_ids
            full_lps[at[plain]] = top_lps
            top_ids, top_lps = full_ids, full_lps
        return StepOutput(
            plan.step_id,
            slots[sampled].astype(np.int32),
            np.concatenate(tokens).astype(np.int32),
            np.concatenate(logprobs).astype(np.float32),
            top_ids,
            top_lps,
            counts,
            proposed,
        )

    def _verify_chain(
        self,
        logits: torch.Tensor,
        index: np.ndarray,
        slots: np.ndarray,
        entries: np.ndarray,
        num_drafts: np.ndarray,
        verified_rows: np.ndarray,
        by_entry: dict[int, Any],
        tokens: list[np.ndarray],
        logprobs: list[np.ndarray],
    ) -> None:
        batch = self.batch
        result = verify_drafts(
            logits[torch.from_numpy(index).to(logits.device)],
            num_drafts[entries],
            [batch.token_ids[slots[e], batch.num_tokens[slots[e]] :][: num_drafts[e]] for e in entries],
            batch.sampling_batch(slots[entries]),
            self.sampler,
            [by_entry[e].probs for e in entries.tolist()],
        )
        for j, i in enumerate(verified_rows.tolist()):
            tokens[i], logprobs[i] = result.token_ids[j], result.logprobs[j]

    def _verify_tree(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        index: np.ndarray,
        slots: np.ndarray,
        entries: np.ndarray,
        node_tokens: list[np.ndarray],
        num_drafts: np.ndarray,
        verified_rows: np.ndarray,
        tokens: list[np.ndarray],
        logprobs: list[np.ndarray],
    ) -> None:
        entry_slots = slots[entries]
        last = self.batch.num_tokens[entry_slots] - 1
        verdict = verify_tree(
            tree,
            logits[torch.from_numpy(index).to(logits.device)],
            num_drafts[entries],
            node_tokens,
            self.batch.sampling_batch(entry_slots),
            self.sampler,
        )
        caches = [(self.kv_cache.k, self.kv_cache.v)]
        own = getattr(self.proposer, "kv_cache", None)  # a draft model's cache holds tree KV too
        if own is not None:
            caches.append((own.k, own.v))
        compact_accepted_kv(caches, self.batch, entry_slots, last, verdict.path)
        for j, i in enumerate(verified_rows.tolist()):
            tokens[i], logprobs[i] = verdict.token_ids[j], verdict.logprobs[j]


def _place_tree_nodes(step: Any, tree: DraftTree, spec: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                      num_drafts: np.ndarray) -> None:  # fmt: skip
    """Tree nodes sit in consecutive lookahead slots but take their depth's RoPE position and see only the prefix
    and their ancestors."""
    ends = np.cumsum(lens + num_drafts)
    positions = step.positions.cpu().numpy().copy()
    masks = {}
    for entry in spec.tolist():
        n = int(num_drafts[entry])
        last = starts[entry] + lens[entry] - 1
        positions[ends[entry] - n : ends[entry]] = last + tree.node_depth[1 : n + 1]
        masks[entry] = torch.from_numpy(chunk_tree_mask(tree, int(starts[entry]), int(lens[entry]), n))
    step.positions = torch.from_numpy(positions).to(step.positions.device)
    step.metadata.tree_masks = {e: m.to(step.positions.device) for e, m in masks.items()}
