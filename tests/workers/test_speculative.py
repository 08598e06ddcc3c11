"""Speculative decoding in the workers: proposers, lossless acceptance, and the engine's lookahead contract end to end
(the real C++ scheduler in process, records encoded and decoded as between the engine and a worker)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model_runner import ModelRunner
from ringserve.workers.speculative import DraftTree, LayerDraftProposer, NgramProposer, make_proposer
from workers_testkit import save_tiny_hf_model, serve_in_process

BLOCK = 4


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_spec")
    save_tiny_hf_model("llama", folder)
    # A separate draft checkpoint: same vocabulary, other weights (so its proposals are often wrong).
    save_tiny_hf_model("llama", folder / "draft", seed=1)
    # The target's own weights as a separate checkpoint: every draft is right iff its own KV cache is kept right.
    save_tiny_hf_model("llama", folder / "draft_same", seed=0)
    return folder


def runner_for(folder, draft: str | None, num_blocks: int = 128, tree: DraftTree | None = None) -> ModelRunner:
    model = load_hf_model(folder, torch.float32)
    runner = ModelRunner(model, block_size=BLOCK, num_kv_blocks=num_blocks)
    if draft is not None:
        runner.proposer = make_proposer(
            draft, runner.model, num_blocks, BLOCK, torch.Generator().manual_seed(1),
            load_draft=lambda path: load_hf_model(path, torch.float32), tree=tree,
        )  # fmt: skip
    return runner


def copying_prompts(count: int, rng: np.random.Generator) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-gram lookup finds continuations to propose."""
    prompts = []
    for _ in range(count):
        phrase = rng.integers(3, 250, size=int(rng.integers(4, 9))).tolist()
        prompts.append((phrase * 3)[: int(rng.integers(10, 3 * len(phrase) + 1))])
    return prompts


def test_ngram_lookup_prefers_the_longest_and_latest_match() -> None:
    ngram = NgramProposer(min_n=1, max_n=3)
    assert ngram.lookup(np.array([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]), 3).tolist() == [4, 9, 2]  # "1 2 3" matched
    assert ngram.lookup(np.array([7, 2, 3, 8, 6, 2, 3]), 2).tolist() == [8, 6]  # "2 3": the only earlier match
    assert ngram.lookup(np.array([5, 6, 5, 7, 5]), 2).tolist() == [7, 5]  # the latest "5"
    assert ngram.lookup(np.array([1, 2, 3]), 4).tolist() == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(min_n=3, max_n=2)


@pytest.mark.parametrize("draft", ["ngram", "layers:1", "model"])
def test_greedy_output_equals_plain_decoding_in_mixed_batches_with_preemption(tiny_folder, draft: str) -> None:
    if draft == "model":
        draft = str(tiny_folder / "draft_same")
    rng = np.random.default_rng(0)
    prompts = copying_prompts(6, rng)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": 12 + 3 * i, "temperature": 0.0, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]
    # Request 3 asks for a penalty: the worker never drafts for it, in the same batches as the others.
    requests[2]["repetition_penalty"] = 1.3
    plain, _ = serve_in_process(runner_for(tiny_folder, None), requests, num_blocks=128, block_size=BLOCK)
    spec, stats = serve_in_process(
        runner_for(tiny_folder, draft), requests, num_blocks=128, block_size=BLOCK, num_speculative_tokens=4
    )
    assert spec == plain
    assert stats.spec_accepted_tokens > 0
    if draft.endswith("draft_same"):  # the target's own weights: wrong only where float rounding differs
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens
    # A pool too small for all six: requests get preempted and recomputed mid-run, lookahead shrinks.
    tight, tight_stats = serve_in_process(
        runner_for(tiny_folder, draft, num_blocks=40), requests, num_blocks=40, block_size=BLOCK,
        num_speculative_tokens=4,
    )  # fmt: skip
    assert tight_stats.num_preemptions > 0
    assert tight == plain


def test_draft_tree_shape_is_breadth_first_and_every_prefix_is_a_tree() -> None:
    tree = DraftTree.build(2, 2, 4)  # 2 + 4 branching nodes, then 4 chains of 2
    assert tree.num_nodes == 14
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert tree.node_depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert (tree.parent[1:] < np.arange(1, 15)).all()  # a parent precedes its children: any prefix is a tree
    assert tree.ancestor[11].nonzero()[0].tolist() == [0, 1, 3, 7, 11]
    assert DraftTree.parse("1x0", 5).num_nodes == 5  # a plain chain
    for bad in ("2", "ax2", "2x5"):
        with pytest.raises(ValueError):
            DraftTree.parse(bad, 4)
    with pytest.raises(ValueError, match="at most 64"):
        DraftTree.build(4, 3, 8)


def test_ngram_tree_lays_the_continuations_of_several_matches_onto_the_tree() -> None:
    ngram = NgramProposer(min_n=1, max_n=2, tree=DraftTree.build(2, 1, 3))  # 2 branches, then chains: 6 nodes
    # "7 8" occurs twice before the end: followed by 1 2 3 (latest) and 4 5 6; "8" alone also by 9 (earliest).
    tokens = np.array([8, 9, 0, 7, 8, 4, 5, 6, 7, 8, 1, 2, 3, 7, 8])
    nodes = ngram.lookup_tree(tokens, ngram.tree, 6)
    # BFS: depth 1 = [1, 4], depth 2 = [2, 5], depth 3 = [3, 6]
    assert nodes.tolist() == [1, 4, 2, 5, 3, 6]
    # One continuation only: the second branch is absent (-1), and the proposal ends after the last present node.
    single = ngram.lookup_tree(np.array([5, 6, 1, 2, 5, 6]), ngram.tree, 6)
    assert single.tolist() == [1, -1, 2, -1, 5]
    # A lookahead of 3 slots takes the tree's first 3 nodes.
    assert ngram.lookup_tree(tokens, ngram.tree, 3).tolist() == [1, 4, 2]


@pytest.mark.parametrize("draft", ["layers:1", "model", "other_model", "ngram"])
def test_tree_verification_keeps_greedy_output_in_mixed_batches_with_preemption(tiny_folder, draft: str) -> None:
    if draft == "model":
        draft = str(tiny_folder / "draft_same")
    elif draft == "other_model":
        draft = str(tiny_folder / "draft")
    tree = DraftTree.build(2, 2, 4)
    rng = np.random.default_rng(3)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": 10 + 3 * i, "temperature": 0.0, "ignore_eos": True}
        for i, p in enumerate(copying_prompts(6, rng))
    ]
    requests[2]["repetition_penalty"] = 1.3  # decodes without drafts, in the same batches
    plain, _ = serve_in_process(runner_for(tiny_folder, None), requests, num_blocks=128, block_size=BLOCK)
    spec, stats = serve_in_process(
        runner_for(tiny_folder, draft, tree=tree), requests, num_blocks=128, block_size=BLOCK,
        num_speculative_tokens=tree.num_nodes, max_num_batched_tokens=64,
    )  # fmt: skip
    assert spec == plain
    assert stats.spec_proposed_tokens > 0
    if not draft.endswith("/draft"):  # another random model rarely agrees with the target at all
        assert stats.spec_accepted_tokens > 0
    if draft.endswith("draft_same"):  # the target's own weights: the best path is nearly always the first
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens
    tight, tight_stats = serve_in_process(
        runner_for(tiny_folder, draft, num_blocks=30, tree=tree), requests, num_blocks=30, block_size=BLOCK,
        num_speculative_tokens=tree.num_nodes, max_num_batched_tokens=64,
    )  # fmt: skip
    assert tight_stats.num_preemptions > 0
    assert tight == plain


def test_seeded_sampling_with_a_tree_gives_the_plain_tokens(tiny_folder) -> None:
    rng = np.random.default_rng(4)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": 16, "temperature": 0.8, "top_k": 30,
         "seed": 50 + i, "has_seed": True, "ignore_eos": True}
        for i, p in enumerate(copying_prompts(4, rng))
    ]  # fmt: skip
    tree = DraftTree.build(2, 2, 3)
    plain, _ = serve_in_process(runner_for(tiny_folder, None), requests, num_blocks=128, block_size=BLOCK)
    spec, stats = serve_in_process(
        runner_for(tiny_folder, str(tiny_folder / "draft_same"), tree=tree), requests, num_blocks=128,
        block_size=BLOCK, num_speculative_tokens=tree.num_nodes,
    )  # fmt: skip
    assert stats.spec_accepted_tokens > 0
    assert spec == plain


def test_seeded_sampling_gives_the_same_tokens_with_and_without_ngram_speculation(tiny_folder) -> None:
    rng = np.random.default_rng(1)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": 20, "temperature": 0.1, "top_p": 0.9,
         "seed": 100 + i, "has_seed": True, "ignore_eos": True}
        for i, p in enumerate(copying_prompts(4, rng))
    ]  # fmt: skip
    plain, _ = serve_in_process(runner_for(tiny_folder, None), requests, num_blocks=128, block_size=BLOCK)
    runner = runner_for(tiny_folder, None)
    runner.proposer = NgramProposer(min_n=1, max_n=3)
    spec, stats = serve_in_process(runner, requests, num_blocks=128, block_size=BLOCK, num_speculative_tokens=4)
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0
    assert spec == plain


def test_self_draft_rejects_a_layer_count_it_cannot_take(tiny_folder) -> None:
    model = load_hf_model(tiny_folder, torch.float32)
    with pytest.raises(ValueError, match="layers:2"):
        LayerDraftProposer(model, 2, torch.Generator())


# chi-square critical values at p = 0.001 for 1..9 degrees of freedom: a correct rule fails about once in 1000 runs
# per check, and the draws below are seeded, so the test is deterministic.
_CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.4, 4, 1.0, 0.0), (1.0, 0, 1.0, 0.15)],
)
@pytest.mark.parametrize("draft_kind", ["sampled", "point_mass"])
def test_rejection_sampling_keeps_the_target_distribution(
    temperature: float, top_k: int, top_p: float, min_p: float, draft_kind: str
) -> None:
    """Every emitted token is distributed as the target's processed p at its position, whatever the draft's q."""
    from ringserve.workers.sampler import Sampler, SamplingBatch, sampling_distribution
    from ringserve.workers.speculative import verify_drafts

    vocab, k, trials = 8, 3, 6000
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(k + 1, vocab, generator=gen) * 1.5  # per position, the same in every trial
    draft = target[:k] + torch.randn(k, vocab, generator=gen)  # deliberately unlike the target
    one = SamplingBatch.build([temperature] * (k + 1), [top_k] * (k + 1), [top_p] * (k + 1))
    one.min_p = torch.full((k + 1,), min_p)
    p = sampling_distribution(target, one)  # [k + 1, vocab]
    q = sampling_distribution(torch.cat([draft, draft[:1]]), one)[:k]
    drafts = torch.multinomial(q.repeat(trials, 1), 1, generator=gen).view(trials, k)
    if draft_kind == "point_mass":
        drafts[:, 0] = int(q[0].argmax())  # a fixed proposal, q = its point mass
    batch = SamplingBatch.build([temperature] * trials, [top_k] * trials, [top_p] * trials)
    batch.min_p = torch.full((trials,), min_p)
    batch.output_index = torch.zeros(trials, dtype=torch.int64)
    result = verify_drafts(
        target.repeat(trials, 1),
        np.full(trials, k),
        [d.numpy() for d in drafts],
        batch,
        Sampler(torch.Generator().manual_seed(11)),
        None if draft_kind == "point_mass" else [q] * trials,
    )
    lengths = np.array([len(t) for t in result.token_ids])
    assert lengths.min() >= 1 and lengths.max() <= k + 1 and (lengths > 1).any()
    for position in range(k + 1):
        emitted = np.array([t[position] for t in result.token_ids if len(t) > position])
        if len(emitted) < 500:
            continue
        stat, dof = _chi_square(np.bincount(emitted, minlength=vocab), p[position].numpy())
        if dof > 0:
            assert stat < _CHI2_999[dof - 1], (position, stat, dof)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 5, 1.0)])
def test_tree_acceptance_keeps_the_target_distribution(temperature: float, top_k: int, top_p: float) -> None:
    """The first token is distributed as p at the root; given it is a child c, the next one as p at c."""
    from ringserve.workers.sampler import Sampler, SamplingBatch, sampling_distribution
    from ringserve.workers.speculative.tree import verify_tree

    vocab, trials = 8, 6000
    tree = DraftTree.build(2, 2, 3)  # 10 nodes
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(tree.num_nodes + 1, vocab, generator=gen) * 1.5  # per node, the same in every trial
    params = SamplingBatch.build([temperature] * (tree.num_nodes + 1), [top_k] * (tree.num_nodes + 1),
                                 [top_p] * (tree.num_nodes + 1))  # fmt: skip
    p = sampling_distribution(target, params).numpy()
    # Candidates unlike the target's choice: the root's 2nd and 3rd most likely tokens, elsewhere the most likely.
    nodes = np.zeros(tree.num_nodes + 1, np.int64)
    for i in range(1, tree.num_nodes + 1):
        parent = tree.parent[i]
        nodes[i] = np.argsort(-p[parent])[tree.rank[i] + (1 if tree.node_depth[i] == 1 else 0)]
    batch = SamplingBatch.build([temperature] * trials, [top_k] * trials, [top_p] * trials)
    batch.output_index = torch.zeros(trials, dtype=torch.int64)
    verdict = verify_tree(
        tree, target.repeat(trials, 1), np.full(trials, tree.num_nodes), [nodes[1:]] * trials, batch,
        Sampler(torch.Generator().manual_seed(11)),
    )  # fmt: skip
    first = np.array([t[0] for t in verdict.token_ids])
    stat, dof = _chi_square(np.bincount(first, minlength=vocab), p[0])
    assert stat < _CHI2_999[dof - 1], ("root", stat, dof)
    assert max(len(t) for t in verdict.token_ids) > 2  # some walks went below the second level
    for child in (1, 2):
        after = np.array([t[1] for t in verdict.token_ids if t[0] == nodes[child] and len(t) > 1])
        if len(after) >= 300:
            stat, dof = _chi_square(np.bincount(after, minlength=vocab), p[child])
            assert stat < _CHI2_999[dof - 1], (child, stat, dof)
        else:  # the root's least likely tokens: rare, but when picked the walk continues under that child
            assert len(after) == int((first == nodes[child]).sum())
    for t, path in zip(verdict.token_ids, verdict.path, strict=True):
        assert t[: len(path)].tolist() == nodes[path].tolist()  # the accepted tokens are the path's


def test_sampled_drafts_from_a_draft_model_are_reproducible_for_seeded_requests(tiny_folder) -> None:
    rng = np.random.default_rng(2)
    requests = [
        {"request_id": i + 1, "prompt_token_ids": p, "max_tokens": 12, "temperature": 0.9, "top_k": 20,
         "seed": 7 + i, "has_seed": True, "ignore_eos": True}
        for i, p in enumerate(copying_prompts(3, rng))
    ]  # fmt: skip
    folder, draft = tiny_folder, str(tiny_folder / "draft")
    runs = [
        serve_in_process(runner_for(folder, draft), requests, num_blocks=64, block_size=4, num_speculative_tokens=3)
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0]
    assert all(len(t) == 12 for t in runs[0][0].values())
    assert runs[0][1].spec_proposed_tokens > 0


@pytest.mark.skipif(not os.environ.get("RINGSERVE_TEST_GGUF"), reason="set RINGSERVE_TEST_GGUF to a llama .gguf file")
def test_embedded_model_greedy_output_is_unchanged_by_speculation() -> None:
    from ringserve.workers.loader import load_model

    model = load_model(os.environ["RINGSERVE_TEST_GGUF"], torch.float32, "cpu")
    # Copying prompts (a phrase of real ids, repeated) and a fresh one; 6 blocks of 16 for 3 requests of up to 52
    # tokens, so requests are preempted and recomputed mid-run.
    phrase = [504, 3575, 282, 4649, 314, 7042, 30, 216]
    requests = [
        {"request_id": 1, "prompt_token_ids": phrase * 3, "max_tokens": 28, "temperature": 0.0},
        {"request_id": 2, "prompt_token_ids": phrase[::-1] * 2 + phrase[:3], "max_tokens": 28, "temperature": 0.0},
        {"request_id": 3, "prompt_token_ids": [504, 3575, 282, 4649, 314], "max_tokens": 28, "temperature": 0.0},
    ]
    outputs = {}
    tree = DraftTree.build(2, 2, 3)
    for draft in (None, "ngram", "layers:8", "tree"):
        runner = ModelRunner(model, block_size=16, num_kv_blocks=6)  # a fresh KV cache and batch on the same weights
        if draft is not None:
            runner.proposer = make_proposer(
                "layers:8" if draft == "tree" else draft, runner.model, 6, 16, torch.Generator(),
                tree=tree if draft == "tree" else None,
            )  # fmt: skip
        slots = {None: 0, "tree": tree.num_nodes}.get(draft, 4)
        outputs[draft], stats = serve_in_process(
            runner, requests, num_blocks=6, block_size=16, num_speculative_tokens=slots
        )
        assert stats.num_preemptions > 0
        if draft is not None:
            assert stats.spec_accepted_tokens > 0
            assert outputs[draft] == outputs[None], draft
