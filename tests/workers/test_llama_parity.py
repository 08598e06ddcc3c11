"""Our packed, paged llama equals transformers' logits on tiny random checkpoints loaded by our HF loader."""

from __future__ import annotations

import random

import pytest
import torch
from ringserve.workers.loader import load_hf_model, load_model
from ringserve.workers.model.fast_paths import apply_fast_paths
from safetensors.torch import load_file, save_file
from workers_testkit import VARIANTS, bind_cache, forward_packed, hf_logits, save_tiny_hf_model

ATOL = 1e-4
BLOCK = 4  # small blocks so every sequence spans several


@pytest.fixture(params=sorted(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(params=["plain", "fast_paths"])
def models(request, variant, tmp_path):
    """transformers' model and ours: the plain reference, or with the fast paths applied as the runner does."""
    hf = save_tiny_hf_model(variant, tmp_path)
    ours = load_hf_model(tmp_path, torch.float32)
    if request.param == "fast_paths":
        apply_fast_paths(ours)
    return hf, ours


def shuffled_block_tables(lengths: list[int], num_blocks: int, seed: int = 1) -> list[list[int]]:
    """Disjoint, non-contiguous, out-of-order block ids per sequence."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(pool[:need])
        pool = pool[need:]
    return tables


def random_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_packed_prefill_of_several_sequences_matches_transformers(models):
    hf, ours = models
    seqs = [random_tokens(n, seed=n) for n in (5, 17, 1, 33)]
    tables = shuffled_block_tables([len(s) for s in seqs], num_blocks=64)
    bind_cache(ours, num_blocks=64, block_size=BLOCK)
    logits = forward_packed(ours, [(s, 0, t) for s, t in zip(seqs, tables, strict=True)], BLOCK)
    for seq, got in zip(seqs, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, seq), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_through_the_paged_cache_matches_transformers(models):
    hf, ours = models
    a, b, c = random_tokens(23, 7), random_tokens(9, 8), random_tokens(14, 9)
    # Every sequence reserves room for its whole future (prompt + decodes) in shuffled blocks.
    tables = shuffled_block_tables([len(a), len(b), len(c)], num_blocks=40, seed=3)
    bind_cache(ours, num_blocks=40, block_size=BLOCK)
    ref = {name: hf_logits(hf, seq) for name, seq in (("a", a), ("b", b), ("c", c))}

    # Step 1: a's prompt is chunked (first 10 tokens, mid-block), b prefills 7 of its tokens.
    la, lb = forward_packed(ours, [(a[:10], 0, tables[0]), (b[:7], 0, tables[1])], BLOCK)
    torch.testing.assert_close(la, ref["a"][:10], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref["b"][:7], atol=ATOL, rtol=0)

    # Step 2: a's second chunk attends to the first through the cache, b decodes, c prefills whole.
    la, lb, lc = forward_packed(
        ours, [(a[10:21], 10, tables[0]), (b[7:8], 7, tables[1]), (c[:12], 0, tables[2])], BLOCK
    )
    torch.testing.assert_close(la, ref["a"][10:21], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref["b"][7:8], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, ref["c"][:12], atol=ATOL, rtol=0)

    # Step 3: all three decode together (batched decode path, different context lengths).
    la, lb, lc = forward_packed(
        ours, [(a[21:22], 21, tables[0]), (b[8:9], 8, tables[1]), (c[12:13], 12, tables[2])], BLOCK
    )
    torch.testing.assert_close(la, ref["a"][21:22], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref["b"][8:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, ref["c"][12:13], atol=ATOL, rtol=0)

    # Step 4: a smaller decode batch: a and c only, b sits out this step.
    la, lc = forward_packed(ours, [(a[22:23], 22, tables[0]), (c[13:14], 13, tables[2])], BLOCK)
    torch.testing.assert_close(la, ref["a"][22:23], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, ref["c"][13:14], atol=ATOL, rtol=0)


def test_logits_rows_select_only_the_sampled_positions(tmp_path):
    hf = save_tiny_hf_model("llama", tmp_path)
    ours = load_model(tmp_path)
    bind_cache(ours, num_blocks=16, block_size=BLOCK)
    from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope

    s1, s2 = random_tokens(6, 1), random_tokens(3, 2)
    md = AttentionMetadata.build([6, 3], [6, 3], [[3, 1], [0]], BLOCK, logits_indices=[5, 8])
    with torch.inference_mode(), attention_metadata_scope(md):
        logits = ours(torch.tensor(s1 + s2), torch.tensor(list(range(6)) + list(range(3))))
    assert logits.shape == (2, 256)
    torch.testing.assert_close(logits[0], hf_logits(hf, s1)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, s2)[-1], atol=ATOL, rtol=0)


def test_bfloat16_load_stays_close_to_float32(tmp_path):
    hf = save_tiny_hf_model("llama", tmp_path)
    ours = load_hf_model(tmp_path, torch.bfloat16)
    assert ours.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    cache = bind_cache(ours, num_blocks=8, block_size=BLOCK)
    assert cache.k[0].dtype == torch.float32  # the helper allocates float32; the backend casts on write
    seq = random_tokens(12, 5)
    (got,) = forward_packed(ours, [(seq, 0, [4, 2, 7])], BLOCK)
    assert (got - hf_logits(hf, seq)).abs().max() < 0.1


def test_missing_tensor_is_named_in_the_error(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_model(tmp_path, torch.float32)


def test_mismatched_tensor_shape_is_named_in_the_error(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(8, 64\)"):
        load_hf_model(tmp_path, torch.float32)


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    torch.manual_seed(0)
    hf = VARIANTS["llama"]().eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_hf_model(tmp_path, torch.float32)
    bind_cache(ours, num_blocks=8, block_size=BLOCK)
    seq = random_tokens(9, 3)
    (got,) = forward_packed(ours, [(seq, 0, [5, 1, 6])], BLOCK)
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=ATOL, rtol=0)
