"""The grouped-GEMM mixture of experts (fast_paths.GroupedExpertsMoe) equals the plain per-expert loop of
workers/model/llama.py, and leaves the experts' parameters (views of its stacked weights) where loading put them."""

from __future__ import annotations

import copy

import pytest
import torch
from ringserve.workers.model.fast_paths import GroupedExpertsMoe
from ringserve.workers.model.llama import LlamaConfig, SparseMoeBlock


def moe_block(top_k: int, shared: int, norm: bool, seed: int = 0) -> SparseMoeBlock:
    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                         num_kv_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=top_k,
                         moe_intermediate_size=32, shared_expert_intermediate_size=shared,
                         norm_topk_prob=norm)  # fmt: skip
    torch.manual_seed(seed)
    block = SparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)  # decisive routing: no near-tie
    return block


@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize(("top_k", "shared", "norm"), [(1, 0, True), (2, 0, True), (2, 48, False), (4, 48, True)])
def test_grouped_experts_equal_the_plain_loop(tokens: int, top_k: int, shared: int, norm: bool) -> None:
    plain = moe_block(top_k, shared, norm)
    assert GroupedExpertsMoe.applies(plain)
    grouped = GroupedExpertsMoe.fuse(copy.deepcopy(plain))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        want, got = plain(x), grouped(x)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_some_experts_chosen_by_no_token_contribute_nothing() -> None:
    # One token, top-1: seven of eight experts have an empty group.
    plain = moe_block(1, 0, True, seed=3)
    grouped = GroupedExpertsMoe.fuse(copy.deepcopy(plain))
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(grouped(x), plain(x), atol=2e-6, rtol=1e-5)
        assert torch.unique(grouped.route(x)[1]).numel() == 1


def test_expert_parameters_become_views_of_the_stacked_weights() -> None:
    block = moe_block(2, 48, True)
    before = {name: p.detach().clone() for name, p in block.state_dict().items()}
    GroupedExpertsMoe.fuse(block)
    after = block.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], value) for name, value in before.items())
    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    assert storage(block.experts[5].up_proj.weight) == storage(block.experts_gate_up)
    assert storage(block.experts[5].down_proj.weight) == storage(block.experts_down)
    with torch.no_grad():  # a write through the stacked tensor is what the expert's parameter holds
        block.experts_gate_up[5, 32:] += 1.0
    assert torch.equal(block.experts[5].up_proj.weight, before["experts.5.up_proj.weight"] + 1.0)
