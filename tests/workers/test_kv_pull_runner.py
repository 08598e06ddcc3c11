"""ModelRunner with a KV connector: a decode runner that pulls a prefill runner's blocks (or, when the pull fails,
computes them itself) continues greedily exactly like a runner that did the whole request."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ringserve.workers.kv_connector import KvConnector, KvRegion, pack_peer_infos
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model import KVCache
from ringserve.workers.model_runner import ModelRunner
from workers_testkit import NewRequest, ids, plan, save_tiny_hf_model

BLOCK = 4


@dataclass
class Pull:  # shaped like _core.KvPull
    slot: int
    remote_block_ids: list[int]
    local_block_ids: list[int]
    peer: bytes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_model("llama", folder)
    return folder


def shared_runner(folder, num_blocks: int = 16) -> ModelRunner:
    model = load_hf_model(folder, torch.float32)
    c = model.config
    region = KvRegion(c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim, torch.float32, role="kvtest")
    conn = KvConnector("shm", region, model_id="tiny")
    return ModelRunner(model, block_size=BLOCK, kv_cache=KVCache(k=region.k, v=region.v), kv_connector=conn)


def greedy(runner: ModelRunner, prompt: list[int], blocks: list[int], n: int) -> list[int]:
    out = runner.execute(plan(0, [(0, 0, len(prompt), True)], new_requests=[NewRequest(0, ids(*prompt),
                                                                                       ids(*blocks), temperature=0.0)]))
    tokens = [int(out.token_ids[0])]
    for step in range(1, n):
        out = runner.execute(plan(step, [(0, len(prompt) + step - 1, 1, True)]))
        tokens.append(int(out.token_ids[0]))
    return tokens


@pytest.mark.parametrize("pull_works", [True, False])
def test_decode_from_pulled_kv_matches_colocated(folder, pull_works: bool) -> None:
    prompt = [5, 9, 200, 3, 17, 8, 40, 41, 42, 7]  # 10 tokens: 3 blocks
    n = 6
    colocated = shared_runner(folder)
    prefill = shared_runner(folder)
    decode = shared_runner(folder)
    try:
        expected = greedy(colocated, prompt, [0, 1, 2, 3], n)
        first = greedy(prefill, prompt, [9, 4, 12], 1)[0]  # prefill: the prompt, then one token
        assert first == expected[0]
        peer = prefill.kv_connector.info.encode() if pull_works else b"garbage"
        decode.kv_pulls.append(Pull(3, [9, 4, 12], [1, 2, 5], pack_peer_infos([peer])))
        tokens = [*prompt, first]
        out = decode.execute(plan(
            0, [(3, len(prompt), 1, True)],
            new_requests=[NewRequest(3, ids(*tokens), ids(1, 2, 5, 6), num_computed_tokens=len(prompt),
                                     num_prompt_tokens=len(prompt), temperature=0.0)],
        ))  # fmt: skip
        got = [first, int(out.token_ids[0])]
        for step in range(1, n - 1):
            out = decode.execute(plan(step, [(3, len(prompt) + step, 1, True)]))
            got.append(int(out.token_ids[0]))
        assert got == expected
        pulled = decode.kv_connector.bytes_pulled
        block_bytes = decode.kv_connector.region.block_bytes
        assert pulled == (2 * decode.config.num_layers * 3 * block_bytes if pull_works else 0)
        # The pulled (or recomputed) prompt KV equals the colocated runner's, block for block.
        regions = decode.kv_connector.region, colocated.kv_connector.region
        for t_local, t_ref in zip(regions[0].tensors, regions[1].tensors, strict=True):
            assert torch.allclose(t_local[[1, 2]], t_ref[[0, 1]], atol=1e-5)
            assert torch.allclose(t_local[5, :2], t_ref[2, :2], atol=1e-5)
    finally:
        for r in (colocated, prefill, decode):
            r.kv_connector.close()
