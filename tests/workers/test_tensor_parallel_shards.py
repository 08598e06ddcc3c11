"""Tensor parallelism: sharded loading and collectives give the single-process logits; bad splits are refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ringserve.workers.model import LlamaConfig
from ringserve.workers.parallel import TensorParallelShard
from tensor_parallel_rank import PROMPT_A, PROMPT_B
from workers_testkit import hf_logits, save_tiny_hf_model

RANK_SCRIPT = Path(__file__).with_name("tensor_parallel_rank.py")
# llama_one_kv_head: 2 ranks > 1 KV head (each rank holds a replica) and vocab 255 (the last shard is padded).
# The other families: q/k norms, fused checkpoint tensors, sliding windows, experts (one with a shared expert).
VARIANTS = ("llama", "llama_tied", "qwen2_attention_bias", "mistral", "llama_one_kv_head", "qwen3", "phi3",
            "mistral_sliding_window", "mixtral", "qwen2_moe", "gemma2", "gemma3")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, folders: list[Path], out: Path) -> list[list[np.ndarray]]:
    """Starts `world` real rank processes over gloo; returns logits[folder][rank]."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(RANK_SCRIPT.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(r), str(world), str(out), *map(str, folders)], env=env)
        for r in range(world)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes}"
    return [[np.load(out / f"logits-{i}-rank{r}.npy") for r in range(world)] for i in range(len(folders))]


def reference_logits(hf: torch.nn.Module) -> np.ndarray:
    """What the rank script's packed step must produce, from transformers on the whole sequences."""
    a, b, single = hf_logits(hf, PROMPT_A), hf_logits(hf, PROMPT_B), hf_logits(hf, PROMPT_B[:1])
    return torch.cat([a, b[4:], single]).numpy()


@pytest.fixture(scope="module")
def sharded_folders(tmp_path_factory) -> tuple[list[Path], list[np.ndarray]]:
    """Each variant saved by transformers as several safetensors shards (with the index)."""
    folders, references = [], []
    for variant in VARIANTS:
        folder = tmp_path_factory.mktemp(variant)
        hf = save_tiny_hf_model(variant, folder, max_shard_size="100KB")
        assert (folder / "model.safetensors.index.json").exists()
        folders.append(folder)
        references.append(reference_logits(hf))
    return folders, references


def test_two_ranks_give_the_transformers_logits_for_sharded_folders_of_every_family(sharded_folders, tmp_path):
    folders, references = sharded_folders
    results = run_ranks(2, folders, tmp_path)
    for variant, per_rank, expected in zip(VARIANTS, results, references, strict=True):
        np.testing.assert_allclose(per_rank[0], expected, atol=1e-4, err_msg=variant)
        # Every rank holds the gathered logits and must hold exactly the same ones (they sample identically).
        np.testing.assert_array_equal(per_rank[0], per_rank[1], err_msg=variant)


def config(heads: int, kv_heads: int, vocab: int = 100, intermediate: int = 96) -> LlamaConfig:
    return LlamaConfig(vocab, 48, intermediate, 1, heads, kv_heads, 48 // heads)


def test_heads_not_divisible_by_the_world_size_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads; choose a divisor of 9"):
        TensorParallelShard(0, 2, config(9, 3))
    with pytest.raises(ValueError, match="neither divides the model's 4 KV heads nor is a multiple"):
        TensorParallelShard(0, 6, config(12, 4))


def test_shard_shapes_split_heads_mlp_and_pad_the_vocab():
    shard = TensorParallelShard(2, 3, config(9, 3, vocab=100))
    local = shard.local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (3, 1, 32, 34)
    table = torch.arange(100 * 2.0).view(100, 2)
    part = shard.slice("model.embed_tokens.weight", table)
    assert part.shape == (34, 2) and torch.equal(part[:32], table[68:]) and not part[32:].any()
    replicated = TensorParallelShard(3, 4, config(8, 2))  # ranks 2 and 3 hold KV head 1
    k = torch.arange(2 * 6 * 48.0).view(12, 48)
    assert torch.equal(replicated.slice("model.layers.0.self_attn.k_proj.weight", k), k[6:])
    assert replicated.row_range("model.layers.0.self_attn.k_proj.weight", 12, 48) == (slice(6, 12), None)
