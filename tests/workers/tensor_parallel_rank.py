"""One tensor-parallel rank for tests: `python tensor_parallel_rank.py RANK WORLD OUT_DIR FOLDER...`.

Joins a gloo group (MASTER_ADDR/MASTER_PORT from the environment), loads each folder's shard, runs one packed step
(a fresh prompt, plus a chunk continuing a cached context, plus a decode row) and saves the logits as .npy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.loader import load_model
from ringserve.workers.model import KVCache, LlamaForCausalLM
from ringserve.workers.parallel import init_distributed

PROMPT_A = [5, 9, 200, 3, 17, 8, 77]
PROMPT_B = [250, 1, 2, 40, 41, 42]


def forward_packed(model: LlamaForCausalLM, chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> list:
    """Like workers_testkit.forward_packed, without importing transformers (rank start-up stays fast)."""
    metadata = AttentionMetadata.build(
        [len(c) for c, _, _ in chunks], [s + len(c) for c, s, _ in chunks], [b for _, _, b in chunks], block_size, None
    )
    tokens = torch.tensor([t for c, _, _ in chunks for t in c])
    positions = torch.tensor([p for c, s, _ in chunks for p in range(s, s + len(c))])
    with torch.inference_mode(), attention_metadata_scope(metadata):
        return list(model(tokens, positions).split([len(c) for c, _, _ in chunks]))


def run(folder: Path) -> np.ndarray:
    model = load_model(folder, torch.float32, rank=RANK, world_size=WORLD)
    model.bind_kv_cache(KVCache.allocate(model.config, 16, 4, torch.float32, "cpu"), TorchSdpaBackend())
    forward_packed(model, [(PROMPT_B[:4], 0, [5])], block_size=4)  # B's first chunk goes into the cache
    logits = forward_packed(
        model, [(PROMPT_A, 0, [0, 1]), (PROMPT_B[4:], 4, [5, 6]), ([PROMPT_B[0]], 0, [9])], block_size=4
    )
    return torch.cat(logits).numpy()


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (torch names them pt_gloo_runloop, gloo_tcp_loop)."""
    names = (Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task"))
    return [name for name in names if "gloo" in name]


if __name__ == "__main__":
    RANK, WORLD, OUT = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    init_distributed(RANK, WORLD, torch.device("cpu"), timeout_s=120)
    try:
        for i, name in enumerate(sys.argv[4:]):
            np.save(OUT / f"logits-{i}-rank{RANK}.npy", run(Path(name)))
    finally:
        # As worker_main does: a gloo group left to interpreter shutdown can abort the process from its threads
        # ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
    # destroy_process_group joins the group's threads only when nothing else holds the group (see workers/parallel.py
    # for what once did); left running, they race the interpreter's shutdown.
    if leftover := gloo_threads():
        sys.exit(f"rank {RANK}: gloo threads outlived destroy_process_group: {leftover}")
