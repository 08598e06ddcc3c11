"""Where Ray put an engine's ranks decides who reads which step ring (backend/ray_executor.py), without Ray: the ranks
on the engine's node read its ring directly and each other node gets a relay, unless that is more readers than a ring
has; then the engine's node is relayed too. More than 8 nodes, or 8 ranks on a node, cannot be served."""

from __future__ import annotations

from ringserve.backend.ray_executor import split_by_reader, step_ring_problem


def test_ranks_on_the_engines_node_read_its_ring_and_other_nodes_get_a_relay() -> None:
    # TP=4 x PP=4 packed on four nodes, the engine on the first: 4 direct readers + 3 relays.
    nodes = [n for n in "ABCD" for _ in range(4)]
    assert step_ring_problem(nodes) is None
    assert split_by_reader(nodes, "A") == ([0, 1, 2, 3], {"B": [4, 5, 6, 7], "C": [8, 9, 10, 11],
                                                          "D": [12, 13, 14, 15]})  # fmt: skip
    assert split_by_reader(nodes, "E") == ([], {n: [r for r in range(16) if nodes[r] == n] for n in "ABCD"})


def test_the_engines_node_is_relayed_when_its_ranks_and_the_relays_would_overflow_the_ring() -> None:
    # TP=8 x PP=2 on two 8-GPU nodes, the engine on the first: 8 ranks + 1 relay would be 9 readers.
    nodes = ["A"] * 8 + ["B"] * 8
    assert step_ring_problem(nodes) is None
    assert split_by_reader(nodes, "A") == ([], {"A": list(range(8)), "B": list(range(8, 16))})
    # Eight nodes of eight: 64 ranks, the engine's ring reads eight relays.
    nodes = [n for n in "ABCDEFGH" for _ in range(8)]
    assert step_ring_problem(nodes) is None
    local, relayed = split_by_reader(nodes, "A")
    assert local == [] and list(relayed) == list("ABCDEFGH") and relayed["H"] == list(range(56, 64))
    # Seven direct readers and one relay: exactly a ring's readers, no relay needed on the engine's node.
    assert split_by_reader(["A"] * 7 + ["B"], "A") == (list(range(7)), {"B": [7]})


def test_placements_no_ring_can_serve_are_named() -> None:
    assert step_ring_problem(["A"] * 9) == ("node A holds 9 ranks; a node's step ring has a reader per rank and at "
                                            "most 8 (docs/distributed.md)")  # fmt: skip
    assert step_ring_problem(list("ABCDEFGHI")) == ("9 nodes hold ranks; the engine's step ring has a reader per node "
                                                    "and at most 8 (docs/distributed.md)")  # fmt: skip
