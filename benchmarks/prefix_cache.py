"""Time to first token of a request whose 1,024-token prefix is in the prefix cache, against the same request uncached.

A real server (frontend, engine, worker) on the real model on CPU, driven over gRPC. Each trial draws a fresh random
1,024-token prefix (a whole number of 16-token KV blocks) and sends, one at a time and greedy with max_tokens 1:
  1. prefix + suffix A under a new cache salt: nothing is cached, the whole prompt is computed (the baseline);
  2. prefix + suffix B (same length, same salt): the prefix's blocks come from the cache, only the suffix is computed.
Both prompts have the same length, so the ratio of their TTFTs is what caching the prefix saves. Medians over the
trials; usage.cached_tokens of every cached request is checked to be the whole prefix. Issue #3's target:
ttft_ratio_cached <= 0.2.

    python benchmarks/prefix_cache.py [--model PATH] [--quick]

The last line of output is one JSON object: ttft_ratio_cached, ttft_uncached_ms, ttft_cached_ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from live_server import live_server
from ringserve.frontend.model_source import embedded_model_path
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc
from tqdm import tqdm

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16
VOCAB_RANGE = (1000, 40000)  # ordinary word pieces, no special tokens


def ttft(stub: generation_pb2_grpc.GenerationStub, ids: list[int], salt: str) -> tuple[float, int]:
    """Seconds from sending the request to its first token, and the prompt tokens the server found cached."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    first = 0.0
    cached = -1
    for response in stub.Generate(request, timeout=600):
        if response.token_ids and not first:
            first = time.perf_counter() - start
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            cached = response.usage.cached_tokens
    if not first:
        raise RuntimeError("the request produced no token")
    return first, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--quick", action="store_true", help="2 trials (< 60 s with the server start)")
    parser.add_argument("--trials", type=int, default=0, help="prefixes measured (default 2 quick, 8 full)")
    args = parser.parse_args()
    model = args.model or embedded_model_path()
    trials = args.trials or (2 if args.quick else 8)
    rng = random.Random(20240611)
    uncached: list[float] = []
    cached: list[float] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ringserve-prefix-") as tmp, \
            tqdm(total=trials + 1, desc="start server", file=sys.stderr) as progress, \
            live_server(model, Path(tmp)) as server:  # fmt: skip
        server.wait_serving(300)
        progress.update()
        with grpc.insecure_channel(server.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            ttft(stub, [rng.randrange(*VOCAB_RANGE) for _ in range(64)], "warm-up")  # first-call costs
            for trial in range(trials):
                progress.set_description(f"trial {trial + 1}/{trials}")
                prefix = [rng.randrange(*VOCAB_RANGE) for _ in range(PREFIX_TOKENS)]
                suffixes = [[rng.randrange(*VOCAB_RANGE) for _ in range(SUFFIX_TOKENS)] for _ in range(2)]
                salt = f"trial-{trial}-{rng.getrandbits(64):x}"  # no earlier request can share its blocks
                t_uncached, hit = ttft(stub, prefix + suffixes[0], salt)
                if hit != 0:
                    raise RuntimeError(f"the first request of a fresh salt found {hit} cached tokens")
                t_cached, hit = ttft(stub, prefix + suffixes[1], salt)
                if hit != PREFIX_TOKENS:
                    raise RuntimeError(f"the prefix was not served from the cache: {hit} of {PREFIX_TOKENS} tokens")
                uncached.append(t_uncached)
                cached.append(t_cached)
                progress.update()
    u = statistics.median(uncached)
    c = statistics.median(cached)
    print(f"TTFT of a {PREFIX_TOKENS + SUFFIX_TOKENS}-token prompt: uncached {1000 * u:.0f} ms, "
          f"with its {PREFIX_TOKENS}-token prefix cached {1000 * c:.0f} ms (medians of {trials})", file=sys.stderr)
    print(json.dumps({
        "benchmark": "prefix_cache",
        "model": str(model),
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "trials": trials,
        "ttft_uncached_ms": round(1000 * u, 1),
        "ttft_cached_ms": round(1000 * c, 1),
        "ttft_ratio_cached": round(c / u, 3),
        "ttft_ratio_paired_median": round(statistics.median(x / y for x, y in zip(cached, uncached, strict=True)), 3),
        "target_ratio_at_most_0_2": c / u <= 0.2,
        "ttft_uncached_ms_all": [round(1000 * t, 1) for t in uncached],
        "ttft_cached_ms_all": [round(1000 * t, 1) for t in cached],
        "wall_s": round(time.monotonic() - started, 1),
    }))


if __name__ == "__main__":
    main()
