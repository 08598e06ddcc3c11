"""A KV source process for the connector tests: fills a region with a known pattern, prints its peer info (hex),
then serves until stdin closes. Usage: python kv_source.py BACKEND NUM_BLOCKS"""

from __future__ import annotations

import sys

import torch
from ringserve.workers.kv_connector import KvConnector, KvRegion

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8


def pattern(tensor: int, block: int) -> float:
    return float(tensor * 1000 + block)


def main() -> int:
    backend, num_blocks = sys.argv[1], int(sys.argv[2])
    region = KvRegion(LAYERS, num_blocks, BLOCK, HEADS, DIM, torch.float32, role="kvtest")
    for t, tensor in enumerate(region.tensors):
        for j in range(num_blocks):
            tensor[j].fill_(pattern(t, j))
    conn = KvConnector(backend, region, model_id="test-model")
    print("KVINFO", conn.info.encode().hex(), flush=True)  # NIXL logs to stdout too
    sys.stdin.read()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
