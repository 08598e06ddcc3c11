"""The shape of a speculative draft tree, shared by the launcher (validation), the engine (one lookahead slot per
node) and the workers (drafting and verification); numpy only.

`--spec-tree WxD` with `--num-speculative-tokens K`: the drafter's top-W candidates at each of the first D positions,
then one greedy chain per branch down to depth K. Node 0 is the root (the request's newest token); nodes 1..N are
numbered breadth first, so a parent precedes its children and every prefix of the numbering is itself a tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ringserve._core import MAX_LOOKAHEAD_SLOTS as MAX_TREE_NODES  # kMaxLookaheadSlots (records.h): slots per step


@dataclass(frozen=True)
class DraftTree:
    width: int  # candidates per branching position
    branch_depth: int  # positions that branch
    depth: int  # tokens on a root-to-leaf path (= --num-speculative-tokens)
    parent: np.ndarray  # int64 [N + 1]; parent[0] = -1
    node_depth: np.ndarray  # int64 [N + 1]; node_depth[0] = 0
    rank: np.ndarray  # int64 [N + 1]: which of its parent's candidates the node is (0 = the drafter's best)
    first_child: np.ndarray  # int64 [N + 1]: index of the node's first child (N + 1 when it has none)
    num_children: np.ndarray  # int64 [N + 1]
    ancestor: np.ndarray  # bool [N + 1, N + 1]: ancestor[i, j] = j is i or one of its ancestors

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @classmethod
    def build(cls, width: int, branch_depth: int, depth: int) -> DraftTree:
        if width < 1 or branch_depth < 0 or depth < 1 or branch_depth > depth:
            raise ValueError(f"draft tree {width}x{branch_depth} of depth {depth}: need width >= 1, 0 <= D <= depth")
        parent, node_depth, rank = [-1], [0], [0]
        level = [0]
        for d in range(1, depth + 1):
            fan = width if d <= branch_depth else 1
            next_level = []
            for p in level:
                for r in range(fan):
                    next_level.append(len(parent))
                    parent.append(p)
                    node_depth.append(d)
                    rank.append(r)
            level = next_level
        n = len(parent)
        if n - 1 > MAX_TREE_NODES:
            raise ValueError(
                f"draft tree {width}x{branch_depth} of depth {depth} has {n - 1} nodes; at most {MAX_TREE_NODES}"
            )
        parent_a = np.array(parent, np.int64)
        first_child = np.full(n, n, np.int64)
        num_children = np.zeros(n, np.int64)
        for i in range(n - 1, 0, -1):
            first_child[parent_a[i]] = i
            num_children[parent_a[i]] += 1
        ancestor = np.zeros((n, n), np.bool_)
        for i in range(n):
            j = i
            while j >= 0:
                ancestor[i, j] = True
                j = int(parent_a[j])
        return cls(width, branch_depth, depth, parent_a, np.array(node_depth, np.int64), np.array(rank, np.int64),
                   first_child, num_children, ancestor)  # fmt: skip

    @classmethod
    def parse(cls, spec: str, depth: int) -> DraftTree:
        """`WxD`, e.g. `2x2`: the top 2 candidates at each of the first 2 positions, then greedy chains."""
        try:
            width, branch = (int(part) for part in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"--spec-tree {spec!r}: expected WxD, e.g. 2x2") from None
        return cls.build(width, branch, depth)
