"""Multi-candidate speculation: a static draft tree, its attention mask, tree drafting and tree verification.

The tree (`--spec-tree WxD` with `--num-speculative-tokens K`) holds the drafter's top-W candidates at each of the
first D positions, then one greedy chain per branch down to depth K. Node 0 is the root: the request's newest token,
computed this step. Nodes 1..N are numbered breadth first, so every prefix of that numbering is itself a tree: a
request the scheduler gave only L < N lookahead slots drafts and verifies nodes 1..L.

Layout in the paged KV cache: node i sits in the lookahead slot at position `last + i` (last = the root's position)
with the RoPE position `last + depth(i)`. A node attends to the whole prefix and to its ancestors' slots, nothing
else (`ancestor[i, j]`). After verification the accepted path's KV is moved down to the positions `last + 1 ..
last + a` it belongs at (`compact_accepted_kv`); the rejected branches' slots are simply overwritten later.

Acceptance is lossless for any tree of deterministic drafts: at each node t is drawn from the target's distribution
there (argmax for greedy rows; the sampler's own seeded noise for sampled rows, with the output index of that depth);
when t equals one of the node's children the walk moves to that child, otherwise t is emitted and the walk ends.
Drawing t once and matching it against the children is the same as trying each child in turn with probability
p(child) and renormalizing the rest on rejection (the point-mass case of the rejection-sampling rule), so every
emitted token is distributed as the target's own, and a seeded request gives exactly its non-speculative tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from ringserve.formats.spec_tree import DraftTree
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.sampler import GREEDY_TEMPERATURE, Sampler, SamplingBatch, _select, sampling_distribution

__all__ = ["DraftTree", "chunk_tree_mask", "compact_accepted_kv", "draft_tree", "tree_mask", "verify_tree"]


def tree_mask(tree: DraftTree, nodes: np.ndarray, last: int) -> np.ndarray:
    """bool [len(nodes), last + 1 + max(nodes)]: query node i sees every position <= last and its ancestors' slots."""
    width = last + 1 + int(nodes.max())
    mask = np.zeros((len(nodes), width), np.bool_)
    mask[:, : last + 1] = True
    mask[:, last + 1 :] = tree.ancestor[nodes][:, 1 : width - last]
    return mask


def chunk_tree_mask(tree: DraftTree, start: int, chunk: int, num_nodes: int) -> np.ndarray:
    """The verification mask of one request: its scheduled chunk [start, start + chunk) is causal as usual, then
    nodes 1..num_nodes follow (the chunk's last token is the root)."""
    last = start + chunk - 1
    mask = np.zeros((chunk + num_nodes, last + 1 + num_nodes), np.bool_)
    rows = np.arange(chunk)
    mask[:chunk, : last + 1] = np.arange(last + 1)[None, :] <= (start + rows)[:, None]
    if num_nodes:
        mask[chunk:] = tree_mask(tree, np.arange(1, num_nodes + 1), last)
    return mask


def draft_tree(
    tree: DraftTree,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: InputBatch,
    slots: np.ndarray,
    num_nodes: np.ndarray,
) -> list[np.ndarray]:
    """Drafts nodes 1..num_nodes[i] for each slot, level by level: one drafting forward per tree depth over every
    request's nodes of that depth that have children to fill (top-W candidates on branching levels, else argmax).
    `forward(input_ids, positions) -> logits` runs under the attention metadata this sets."""
    dev = batch.device
    bs = batch.block_size
    n = len(slots)
    last = batch.num_tokens[slots] - 1
    tokens = np.zeros((n, tree.num_nodes + 1), np.int64)
    tokens[:, 0] = batch.token_ids[slots, last]
    for d in range(tree.depth):
        level = np.flatnonzero(tree.node_depth == d)
        ids, poss, flat_slots, q_lens, seq_lens, masks, owners = [], [], [], [], [], [], []
        for i in range(n):
            # Nodes of this depth whose first child is within the request's nodes.
            nodes = level[tree.first_child[level] <= num_nodes[i]]
            if not len(nodes):
                continue
            s = int(slots[i])
            pos = last[i] + nodes
            ids.append(tokens[i, nodes])
            poss.append(np.full(len(nodes), last[i] + d, np.int64))
            flat_slots.append(batch.block_table[s, pos // bs].astype(np.int64) * bs + pos % bs)
            q_lens.append(len(nodes))
            seq_lens.append(int(last[i] + 1 + nodes.max()))
            masks.append(tree_mask(tree, nodes, int(last[i])))
            owners.append((i, nodes))
        if not owners:
            break
        width = -(-max(seq_lens) // bs)
        rows = [int(slots[i]) for i, _ in owners]
        cu = np.zeros(len(q_lens) + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(flat_slots)).to(dev),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :width])).to(dev),
            logits_indices=None,
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
            tree_masks={seq: torch.from_numpy(m).to(dev) for seq, m in enumerate(masks)},
        )
        with torch.inference_mode(), attention_metadata_scope(metadata):
            input_ids = torch.from_numpy(np.concatenate(ids)).to(dev)
            logits = forward(input_ids, torch.from_numpy(np.concatenate(poss)).to(dev))
        fan = tree.width if d < tree.branch_depth else 1
        best = logits.topk(fan, dim=-1).indices.cpu().numpy()  # the drafter's best first
        for (i, nodes), lo in zip(owners, cu[:-1].tolist(), strict=True):
            for j, node in enumerate(nodes.tolist()):
                first = int(tree.first_child[node])
                count = min(int(tree.num_children[node]), int(num_nodes[i]) - first + 1)
                tokens[i, first : first + count] = best[lo + j, :count]
    return [tokens[i, 1 : num_nodes[i] + 1].copy() for i in range(n)]


@dataclass
class TreeVerdict:
    token_ids: list[np.ndarray]  # per request: the accepted path's tokens, then the target's token
    logprobs: list[np.ndarray]  # raw-logit logprobs of those tokens
    path: list[np.ndarray]  # per request: the accepted nodes (tree indices, depth 1..a)


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    num_nodes: np.ndarray,
    node_tokens: list[np.ndarray],
    batch: SamplingBatch,
    sampler: Sampler,
) -> TreeVerdict:
    """logits: 1 + num_nodes[i] rows per request i in order (the root's, then each node's, breadth first).
    `batch` has one row per request with output_index = outputs generated so far."""
    rows = len(num_nodes)
    device = logits.device
    per = 1 + num_nodes
    owner = np.repeat(np.arange(rows), per)
    node = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)  # tree index of every logits row
    depth = tree.node_depth[node]
    target = logits.float()
    raw_logprobs = torch.log_softmax(target, dim=-1)
    draws = target.argmax(dim=-1)
    sampled = batch.temperature > GREEDY_TEMPERATURE
    if bool(sampled.any()):
        owner_t = torch.from_numpy(owner).to(device)
        srows = sampled[owner_t].nonzero().squeeze(1)
        expanded = _select(batch, owner_t[srows])
        base = expanded.output_index if expanded.output_index is not None else torch.zeros_like(srows)
        # The seeded noise of a token at depth d is the one plain decoding uses for that output position.
        expanded.output_index = base + torch.from_numpy(depth).to(device)[srows]
        probs = sampling_distribution(target[srows], expanded)
        draws[srows] = (probs / sampler._exponential_noise(probs, expanded)).argmax(dim=-1)
    draws_np = draws.cpu().numpy()
    # Walk down: a node is on the accepted path when its token is the draw at its parent and its parent is too.
    first_row = np.cumsum(per) - per
    tokens = np.full((rows, tree.num_nodes + 1), -1, np.int64)
    drawn = np.full((rows, tree.num_nodes + 1), -1, np.int64)
    for i in range(rows):
        tokens[i, 1 : num_nodes[i] + 1] = node_tokens[i]
        drawn[i, : num_nodes[i] + 1] = draws_np[first_row[i] : first_row[i] + per[i]]
    parent = np.maximum(tree.parent, 0)
    on_path = np.zeros((rows, tree.num_nodes + 1), np.bool_)
    on_path[:, 0] = True
    for d in range(1, tree.depth + 1):
        level = np.flatnonzero(tree.node_depth == d)
        p = parent[level]
        on_path[:, level] = on_path[:, p] & (tokens[:, level] == drawn[:, p])
    deepest = np.where(on_path, tree.node_depth[None, :], -1).argmax(axis=1)  # one path: siblings differ
    out_tokens, out_lps, paths = [], [], []
    gather_rows, gather_ids = [], []
    for i in range(rows):
        path = np.flatnonzero(on_path[i])[1:]
        path = path[np.argsort(tree.node_depth[path])]
        end = int(deepest[i])
        seq = np.concatenate([tokens[i, path], [drawn[i, end]]]).astype(np.int64)
        # Each token's logprob comes from the row of the node it follows (its parent, or the end node).
        from_nodes = np.concatenate([parent[path], [end]])
        gather_rows.append(first_row[i] + from_nodes)
        gather_ids.append(seq)
        out_tokens.append(seq.astype(np.int32))
        paths.append(path)
    all_rows = torch.from_numpy(np.concatenate(gather_rows)).to(device)
    all_ids = torch.from_numpy(np.concatenate(gather_ids)).to(device)
    lps = raw_logprobs[all_rows, all_ids].cpu().numpy().astype(np.float32)
    at = 0
    for seq in out_tokens:
        out_lps.append(lps[at : at + len(seq)])
        at += len(seq)
    return TreeVerdict(out_tokens, out_lps, paths)


def compact_accepted_kv(
    caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    batch: InputBatch,
    slots: np.ndarray,
    last: np.ndarray,
    paths: list[np.ndarray],
) -> None:
    """Moves each accepted node's KV from its tree slot (last + node) to its sequence position (last + depth)."""
    bs = batch.block_size
    src, dst = [], []
    for slot, root, path in zip(slots.tolist(), last.tolist(), paths, strict=True):
        if not len(path):
            continue
        from_pos = root + path
        to_pos = root + np.arange(1, len(path) + 1)
        moved = from_pos != to_pos
        if not moved.any():
            continue
        table = batch.block_table[slot]
        src.append(table[from_pos[moved] // bs].astype(np.int64) * bs + from_pos[moved] % bs)
        dst.append(table[to_pos[moved] // bs].astype(np.int64) * bs + to_pos[moved] % bs)
    if not src:
        return
    device = caches[0][0][0].device
    src_t = torch.from_numpy(np.concatenate(src)).to(device)
    dst_t = torch.from_numpy(np.concatenate(dst)).to(device)
    # Gather every source first, then scatter: a destination may be another node's old slot.
    for ks, vs in caches:
        for cache in (*ks, *vs):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst_t, flat.index_select(0, src_t))
