"""The mixture-of-experts block of a tiny Mixtral-shaped layer (8 experts, top-2): the plain per-expert loop of
workers/model/llama.py against the grouped-GEMM fast path (fast_paths.GroupedExpertsMoe), same process, alternating
rounds. Last line: one JSON object.

    python benchmarks/moe_experts.py [--hidden 512] [--width 1792] [--threads 1] [--quick]

- per token count T (1, decode; 8, a small batch; 64 and 512, prompt chunks): `plain_ms` and `grouped_ms`, the
  median milliseconds of one forward of the block; `speedup` = plain_ms / grouped_ms (above 1: the fast path is
  faster); `max_abs_diff` between the two outputs.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from ringserve.workers.model.fast_paths import GroupedExpertsMoe
from ringserve.workers.model.llama import LlamaConfig, SparseMoeBlock


def time_ms(block: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        block(x)
    return (time.perf_counter() - start) * 1000 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=1792, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="small shapes and few rounds (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.width, args.tokens, args.rounds = 128, 256, [1, 8, 64], 3
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(vocab_size=16, hidden_size=args.hidden, intermediate_size=args.width, num_layers=1,
                         num_heads=4, num_kv_heads=4, head_dim=args.hidden // 4, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, moe_intermediate_size=args.width)  # fmt: skip
    torch.manual_seed(0)
    plain = SparseMoeBlock(config).to(dtype).eval()
    if not GroupedExpertsMoe.applies(plain):
        raise SystemExit(f"F.grouped_mm does not run on {args.dtype} here")
    grouped = GroupedExpertsMoe.fuse(copy.deepcopy(plain))
    results = []
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, dtype=dtype)
            diff = float((plain(x) - grouped(x)).abs().max())
            calls = max(3, 2048 // tokens)
            runs: dict[str, list[float]] = {"plain": [], "grouped": []}
            for _ in range(args.rounds):  # alternating, so drifting load hits both alike
                runs["plain"].append(time_ms(plain, x, calls))
                runs["grouped"].append(time_ms(grouped, x, calls))
            plain_ms, grouped_ms = statistics.median(runs["plain"]), statistics.median(runs["grouped"])
            row = {"tokens": tokens, "plain_ms": round(plain_ms, 4), "grouped_ms": round(grouped_ms, 4),
                   "speedup": round(plain_ms / grouped_ms, 3), "max_abs_diff": diff}  # fmt: skip
            print(row, flush=True)
            results.append(row)
    print(json.dumps({"hidden": args.hidden, "width": args.width, "experts": args.experts, "top_k": args.top_k,
                      "dtype": args.dtype, "threads": args.threads, "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
