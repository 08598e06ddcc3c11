"""Weights move onto one huge-page mapping when a CPU model is prepared for inference (workers/model/hugepages.py),
keeping values, views and tied parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ringserve.workers.model import LlamaConfig, LlamaForCausalLM
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.model.hugepages import HugePageArena, huge_pages_supported, move_to_huge_pages

pytestmark = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE on this platform")


def tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def mapping_of(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps entry for the mapping holding `address`."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("tied", [False, True])
def test_fused_weights_land_in_one_huge_page_mapping_with_values_views_and_ties_kept(tied: bool) -> None:
    model = tiny(tied)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    apply_fast_paths(model)
    arena = model.weight_arena
    assert isinstance(arena, HugePageArena)
    start = arena.address
    inside = [t for t in model.parameters()] + [layer.self_attn.qkv_weight for layer in model.model.layers]
    assert all(start <= t.data_ptr() < start + len(arena.region) for t in inside)
    assert {name: t for name, t in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.qkv_weight[64, 0] = 123.0  # the fused matrix and the projections are still one memory
    assert attn.k_proj.weight[0, 0] == 123.0
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert "hg" in mapping_of(start)["VmFlags"].split()  # advised MADV_HUGEPAGE


def test_peak_memory_is_one_storage_at_a_time() -> None:
    # Every old storage is rebound (and so freeable) before the next one is copied.
    tensors = [torch.full((1024,), float(i)) for i in range(3)]
    seen: list[int] = []

    def rebind(i: int, new: torch.Tensor) -> None:
        assert seen == list(range(i))  # in order, one storage done before the next starts
        assert torch.equal(new, tensors[i])
        seen.append(i)

    assert move_to_huge_pages(tensors, rebind) is not None
    assert seen == [0, 1, 2]


def test_tensors_off_the_cpu_are_left_alone() -> None:
    assert move_to_huge_pages([torch.empty(4, device="meta")], lambda i, t: None) is None
