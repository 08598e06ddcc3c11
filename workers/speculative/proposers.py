"""Draft-token proposers behind one interface: n-gram prompt lookup, a self-draft (the target's first layers) and a
separate draft model.

A proposer sees the persistent batch (every slot's known tokens and block table) and returns, per request, up to
`max_tokens[i]` draft tokens, plus the drafter's sampling distribution for them when it sampled (None = point mass).
Model drafters run `max_tokens` sequential one-token forward passes over the paged KV of the lookahead positions the
engine reserved; the target's verification pass afterwards rewrites those positions with its own KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.attention.selection import get_attention_backend
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.model import KVCache, LlamaForCausalLM
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.sampler import GREEDY_TEMPERATURE, SamplingBatch, _select, sampling_distribution
from ringserve.workers.speculative.tree import DraftTree, draft_tree


@dataclass
class DraftProposal:
    token_ids: np.ndarray  # int64 [n], n <= the request's lookahead
    probs: torch.Tensor | None = None  # [n, vocab] the drafter's distribution (sampled drafts); None = point mass


class Proposer(Protocol):
    name: str

    def propose(
        self, batch: InputBatch, slots: np.ndarray, max_tokens: np.ndarray, sampling: SamplingBatch
    ) -> list[DraftProposal]: ...

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Called with every target forward pass (a drafter with its own KV cache computes the same tokens)."""


class NgramProposer:
    """Prompt lookup: the last n tokens (n from max_n down to min_n) matched earlier in prompt + output; proposes
    what followed the most recent match. No model; a few vectorized numpy comparisons per request.

    With a draft tree (`--spec-tree`) it proposes what followed several earlier matches as a trie laid onto the
    tree: at a branching position the distinct next tokens (longest n-gram first, then the most recent), each
    followed by its own continuation. Tree positions no continuation reaches are absent (-1) and never accepted."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, tree: DraftTree | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tree = tree

    def _hits(self, tokens: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(n, match starts, latest first) for each n from max_n down to min_n that matches."""
        length = len(tokens)
        found = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = tokens[length - n :]
            # Windows that end before the last token, so each has at least one token after it.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                found.append((n, hits[::-1]))
        return found

    def lookup(self, tokens: np.ndarray, k: int) -> np.ndarray:
        found = self._hits(tokens)
        if not found:
            return np.zeros(0, np.int64)
        n, hits = found[0]
        start = int(hits[0]) + n
        return tokens[start : start + k].copy()

    def lookup_tree(self, tokens: np.ndarray, tree: DraftTree, num_nodes: int) -> np.ndarray:
        """Node tokens 1..num_nodes (-1 = absent), trimmed after the last present node."""
        continuations: list[np.ndarray] = []
        seen: set[int] = set()
        limit = 4 * max(tree.width, 1) * (tree.branch_depth + 1)
        for n, hits in self._hits(tokens):
            for h in hits.tolist():
                start = h + n
                if start not in seen:
                    seen.add(start)
                    continuations.append(tokens[start : start + tree.depth])
            if len(continuations) >= limit:
                break
        nodes = np.full(tree.num_nodes + 1, -1, np.int64)

        def place(node: int, conts: list[np.ndarray]) -> None:
            groups: dict[int, list[np.ndarray]] = {}
            for c in conts:
                if len(c):
                    groups.setdefault(int(c[0]), []).append(c[1:])
            first = int(tree.first_child[node])
            for rank, (token, rest) in enumerate(list(groups.items())[: int(tree.num_children[node])]):
                if first + rank <= num_nodes:
                    nodes[first + rank] = token
                    place(first + rank, rest)

        place(0, continuations)
        present = np.flatnonzero(nodes[1 : num_nodes + 1] >= 0)
        return nodes[1 : int(present[-1]) + 2] if len(present) else np.zeros(0, np.int64)

    def propose(
        self, batch: InputBatch, slots: np.ndarray, max_tokens: np.ndarray, sampling: SamplingBatch
    ) -> list[DraftProposal]:
        if self.tree is not None:
            tree = self.tree
            return [
                DraftProposal(
                    self.lookup_tree(batch.token_ids[slot, : batch.num_tokens[slot]], tree, min(k, tree.num_nodes))
                )
                for slot, k in zip(slots.tolist(), max_tokens.tolist(), strict=True)
            ]
        return [
            DraftProposal(self.lookup(batch.token_ids[slot, : batch.num_tokens[slot]], int(k)))
            for slot, k in zip(slots.tolist(), max_tokens.tolist(), strict=True)
        ]

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass


class _ModelDrafter:
    """k sequential one-token passes of a drafting forward; greedy rows draft by argmax, sampled rows draw from the
    drafter's distribution after the request's own temperature / min-p / top-k / top-p (the q of rejection sampling)."""

    name = "draft"

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.tree: DraftTree | None = None  # set for multi-candidate drafting (--spec-tree)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def propose(
        self, batch: InputBatch, slots: np.ndarray, max_tokens: np.ndarray, sampling: SamplingBatch
    ) -> list[DraftProposal]:
        if self.tree is not None:  # breadth-first node tokens; a prefix of the tree when lookahead is short
            nodes = np.minimum(max_tokens, self.tree.num_nodes)
            return [DraftProposal(t) for t in draft_tree(self.tree, self._forward, batch, slots, nodes)]
        n = len(slots)
        steps = int(max_tokens.max()) if n else 0
        dev = batch.device
        bs = batch.block_size
        last = batch.num_tokens[slots] - 1  # the position of each request's newest token (computed this step)
        tokens = torch.from_numpy(batch.token_ids[slots, last]).to(dev)
        drafted = torch.zeros(n, steps, dtype=torch.int64, device=dev)
        sampled = sampling.temperature > GREEDY_TEMPERATURE
        probs: torch.Tensor | None = None
        for j in range(steps):
            # Only rows still drafting: a row's KV slots exist (reserved by the engine) up to its own lookahead.
            active = np.flatnonzero(max_tokens > j)
            rows_t = torch.from_numpy(active).to(dev)
            act_slots = slots[active]
            pos = last[active] + j
            width = int(-(-(pos.max() + 1) // bs))
            slot_mapping = batch.block_table[act_slots, pos // bs].astype(np.int64) * bs + pos % bs
            metadata = AttentionMetadata(
                slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                cu_seqlens_q=torch.arange(len(active) + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.from_numpy((pos + 1).astype(np.int32)).to(dev),
                block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_table[act_slots, :width])).to(dev),
                logits_indices=None,
                query_lens_cpu=[1] * len(active),
                seq_lens_cpu=(pos + 1).tolist(),
                block_size=bs,
            )
            with torch.inference_mode(), attention_metadata_scope(metadata):
                logits = self._forward(tokens[rows_t], torch.from_numpy(pos).to(dev))
            nxt = logits.argmax(dim=-1)
            act_sampled = sampled[rows_t]
            if bool(act_sampled.any()):
                local = act_sampled.nonzero().squeeze(1)
                rows = rows_t[local]
                q = sampling_distribution(logits[local], _select(sampling, rows))
                nxt[local] = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
                if probs is None:
                    probs = torch.zeros(n, steps, logits.shape[-1], device=dev)
                probs[rows, j] = q
            drafted[rows_t, j] = nxt
            tokens = tokens.clone()
            tokens[rows_t] = nxt
        out = drafted.cpu().numpy()
        proposals = []
        for i, k in enumerate(max_tokens.tolist()):
            q_i = probs[i, :k] if probs is not None and bool(sampled[i]) else None
            proposals.append(DraftProposal(out[i, :k], q_i))
        return proposals

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass


class LayerDraftProposer(_ModelDrafter):
    """Self-draft: the target's first `num_layers` layers, its final norm and LM head. Those layers' KV of every
    computed token is the target's own, so it drafts from the target's KV cache with no cache of its own."""

    name = "layers"

    def __init__(self, target: LlamaForCausalLM, num_layers: int, generator: torch.Generator) -> None:
        super().__init__(generator)
        if not 1 <= num_layers < target.config.num_layers:
            raise ValueError(f"--draft layers:{num_layers}: needs 1 <= N < the target's {target.config.num_layers}")
        self.target, self.num_layers = target, num_layers

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return first_layers_logits(self.target, input_ids, positions, self.num_layers)


class DraftModelProposer(_ModelDrafter):
    """A separate llama-family checkpoint with the target's vocabulary and its own paged KV cache (same block size
    and block ids as the target's), fed every token the target computes so its cache stays complete."""

    name = "draft_model"

    def __init__(
        self, model: LlamaForCausalLM, target_vocab: int, num_blocks: int, block_size: int, generator: torch.Generator
    ) -> None:
        super().__init__(generator)
        if model.config.vocab_size != target_vocab:
            raise ValueError(f"draft vocabulary {model.config.vocab_size} differs from the target's {target_vocab}")
        apply_fast_paths(model)
        self.model = model
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.kv_cache = KVCache.allocate(model.config, num_blocks, block_size, dtype, device)
        model.bind_kv_cache(self.kv_cache, get_attention_backend("auto", device))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return first_layers_logits(self.model, input_ids, positions, self.model.config.num_layers)

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        with torch.inference_mode(), attention_metadata_scope(metadata):
            self.model.model(input_ids, positions)  # KV only: no LM head


def first_layers_logits(
    model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """Float32 logits of every row from the model's first `num_layers` layers, its final norm and LM head: a
    self-draft, or with every layer a draft model's forward (no logits-row selection, no one-call decoder)."""
    m = model.model
    x = m.embed_tokens(input_ids)
    rope = m.rotary(positions, x.dtype)
    for layer in m.layers[:num_layers]:
        x = layer(x, rope)
    return model.lm_head(m.norm(x)).float()


def make_proposer(
    spec: str,
    target: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    generator: torch.Generator,
    ngram_min: int = 2,
    ngram_max: int = 4,
    load_draft: object = None,
    tree: DraftTree | None = None,
) -> Proposer:
    """`ngram`, `layers:N` or a draft checkpoint path (`load_draft(path) -> LlamaForCausalLM`); `tree` makes a
    model drafter propose a multi-candidate tree instead of a chain."""
    drafter: _ModelDrafter
    if spec == "ngram":
        return NgramProposer(ngram_min, ngram_max, tree)
    if spec.startswith("layers:"):
        drafter = LayerDraftProposer(target, int(spec.split(":", 1)[1]), generator)
    elif load_draft is None or not callable(load_draft):
        raise ValueError(f"--draft {spec!r}: expected ngram, layers:N or a model path")
    else:
        drafter = DraftModelProposer(load_draft(spec), target.config.vocab_size, num_blocks, block_size, generator)
    drafter.tree = tree
    return drafter
