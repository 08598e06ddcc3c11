"""Inter-token latency of running streams while a long prompt is prefilled, with chunked prefill on and off.

Real servers (frontend, engine, worker) on the real model on CPU, driven over gRPC: 8 greedy streams decode, then a
2,048-token prompt arrives. Three servers:

- chunked: --max-num-batched-tokens 256 with the server's defaults, so the decode-latency guard
  (--max-step-slowdown, default 2) also cuts each step's prefill chunk to what keeps the step within 2x a
  decode-only step, by the step costs the engine learns online;
- chunked_no_guard: the same budget with the guard off (--max-step-slowdown 0): every step carries a 248-token chunk,
  which on a small CPU costs several decode steps;
- unchunked: a budget of 4,096 (larger than the prompt) and no guard: one step computes the whole prompt and every
  stream waits for it.

The baseline in the same run is the streams' inter-token latency before the prompt arrived, on each server. Issue
#3's target: with chunking, p99 during the prefill within 3x that p50.

    python benchmarks/chunked_prefill_jitter.py [--model PATH] [--quick] [--long-prompt-tokens N] [--dtype bfloat16]

The servers start together (an idle server uses no CPU) and are measured one after the other, alternating over the
trials. --quick is a smoke run that fits a minute on a small CPU: one trial and a 512-token prompt (the JSON says
which length was used); the issue's figures come from the full run. The last line of output is one JSON object:
itl_p50_before_ms, itl_p99_chunked_ms, itl_p99_unchunked_ms, itl_p99_chunked_no_guard_ms, the per-mode p50s and the
long prompt's prefill time in each mode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from live_server import LiveServer, live_server
from ringserve.formats.engine_args import DEFAULT_MAX_STEP_SLOWDOWN
from ringserve.frontend.model_source import embedded_model_path
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc
from tqdm import tqdm

NUM_STREAMS = 8
LONG_PROMPT_TOKENS = 2048
CHUNKED_BUDGET = 256
UNCHUNKED_BUDGET = 4096
VOCAB_RANGE = (1000, 40000)  # ordinary word pieces, no special tokens


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_RANGE) for _ in range(n)]


def greedy(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@dataclass
class Stream:
    """One decoding stream: the arrival time of every token (a message with k tokens counts k arrivals)."""

    times: list[float] = field(default_factory=list)
    error: str = ""

    def gaps(self, start: float, end: float) -> list[float]:
        """Inter-token gaps (s) that overlap [start, end]."""
        t = self.times
        return [b - a for a, b in itertools.pairwise(t) if b > start and a < end]


def run_stream(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, stream: Stream,
               calls: list[grpc.Future], lock: threading.Lock) -> None:
    call = stub.Generate(request, timeout=600)
    with lock:
        calls.append(call)
    try:
        for response in call:
            now = time.perf_counter()
            stream.times.extend([now] * len(response.token_ids))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            stream.error = f"{e.code().name}: {e.details()}"


def measure(server: LiveServer, seed: int, before_s: float, long_prompt_tokens: int) -> dict[str, float]:
    """Streams decode for `before_s`, then the long prompt arrives; returns the ITLs of both windows in ms."""
    rng = random.Random(seed)
    streams = [Stream() for _ in range(NUM_STREAMS)]
    calls: list[grpc.Future] = []
    lock = threading.Lock()
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(stub.Generate(greedy(random_prompt(rng, 16), 4), timeout=300))  # warm-up: first-call costs
        threads = [threading.Thread(target=run_stream, daemon=True,
                                    args=(stub, greedy(random_prompt(rng, 16), 4000), s, calls, lock))
                   for s in streams]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(s.times) for s in streams) < 3:  # every stream past its prefill
            if time.monotonic() > deadline or any(s.error for s in streams):
                raise RuntimeError(f"streams did not start: {[s.error for s in streams]}")
            time.sleep(0.01)
        before_start = time.perf_counter()
        time.sleep(before_s)
        submitted = time.perf_counter()
        long_request = greedy(random_prompt(rng, long_prompt_tokens), 1)
        responses = list(stub.Generate(long_request, timeout=600))
        prefilled = time.perf_counter()  # its first (and only) token: the prefill is done
        if not responses or responses[-1].usage.prompt_tokens != long_prompt_tokens:
            raise RuntimeError(f"the long prompt was not served whole: {responses[-1:]}")
        time.sleep(0.2)  # the gap that ends after the last prefill step
        with lock:
            for call in calls:
                call.cancel()
        for t in threads:
            t.join(timeout=30)
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"stream failed: {errors[0]}")
    # A message carries one step's token; should a slow reader get several in one message, they count as 0-gaps
    # (their real arrival times), which can only lower the figures.
    before = [g for s in streams for g in s.gaps(before_start, submitted)]
    during = [g for s in streams for g in s.gaps(submitted, prefilled)]
    return {
        "p50_before": 1000 * float(np.percentile(before, 50)),
        "p99_before": 1000 * float(np.percentile(before, 99)),
        "p50_during": 1000 * float(np.percentile(during, 50)),
        "p99_during": 1000 * float(np.percentile(during, 99)),
        "max_during": 1000 * float(max(during)),
        "prefill_s": prefilled - submitted,
        "gaps_before": len(before),
        "gaps_during": len(during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one trial per mode, a 512-token prompt, a short baseline window")
    parser.add_argument("--trials", type=int, default=0, help="long prompts per mode (default 1 quick, 3 full)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the servers' weights (default float32, which any CPU runs at full speed)")
    parser.add_argument("--long-prompt-tokens", type=int, default=0,
                        help=f"length of the arriving prompt (default {LONG_PROMPT_TOKENS}; 512 with --quick)")
    args = parser.parse_args()
    model = args.model or embedded_model_path()
    trials = args.trials or (1 if args.quick else 3)
    long_prompt_tokens = args.long_prompt_tokens or (LONG_PROMPT_TOKENS // 4 if args.quick else LONG_PROMPT_TOKENS)
    before_s = 1.0 if args.quick else 4.0
    modes = {"chunked": CHUNKED_BUDGET, "chunked_no_guard": CHUNKED_BUDGET, "unchunked": UNCHUNKED_BUDGET}
    extra = {"chunked_no_guard": ["--max-step-slowdown", "0"], "unchunked": ["--max-step-slowdown", "0"]}
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ringserve-jitter-") as tmp, ExitStack() as stack:
        progress = stack.enter_context(tqdm(total=1 + len(modes) * trials, desc="start servers", file=sys.stderr))
        servers = {m: stack.enter_context(live_server(model, Path(tmp), "--max-num-batched-tokens", str(budget),
                                                      "--max-num-seqs", "16", "--dtype", args.dtype,
                                                      *extra.get(m, [])))
                   for m, budget in modes.items()}  # fmt: skip
        for server in servers.values():
            server.wait_serving(300)
        progress.update()
        for trial in range(trials):
            for mode, server in servers.items():
                progress.set_description(f"{mode} trial {trial + 1}")
                results[mode].append(measure(server, seed=1000 * trial + len(mode), before_s=before_s,
                                             long_prompt_tokens=long_prompt_tokens))
                progress.update()

    def med(mode: str, key: str) -> float:
        return round(float(np.median([r[key] for r in results[mode]])), 2)

    p50_before = med("chunked", "p50_before")
    ratio = med("chunked", "p99_during") / p50_before
    no_guard_ratio = med("chunked_no_guard", "p99_during") / med("chunked_no_guard", "p50_before")
    for mode in modes:
        print(f"{mode:16s} budget {modes[mode]:5d}: ITL before p50 {med(mode, 'p50_before'):7.1f} ms, p99 "
              f"{med(mode, 'p99_before'):7.1f} ms | during the "
              f"{long_prompt_tokens}-token prefill p50 {med(mode, 'p50_during'):7.1f} ms, p99 "
              f"{med(mode, 'p99_during'):7.1f} ms | prefill {med(mode, 'prefill_s'):.2f} s", file=sys.stderr)
    print(json.dumps({
        "benchmark": "chunked_prefill_jitter",
        "model": str(model),
        "dtype": args.dtype,
        "num_streams": NUM_STREAMS,
        "long_prompt_tokens": long_prompt_tokens,
        "budget_chunked": CHUNKED_BUDGET,
        "budget_unchunked": UNCHUNKED_BUDGET,
        "max_step_slowdown_chunked": DEFAULT_MAX_STEP_SLOWDOWN,
        "trials": trials,
        "itl_p50_before_ms": p50_before,
        # The machine's own tail with no prefill at all: how much of a during-prefill p99 is noise, not the guard.
        "itl_p99_before_ms": med("chunked", "p99_before"),
        "itl_p50_chunked_ms": med("chunked", "p50_during"),
        "itl_p99_chunked_ms": med("chunked", "p99_during"),
        "itl_p50_unchunked_ms": med("unchunked", "p50_during"),
        "itl_p99_unchunked_ms": med("unchunked", "p99_during"),
        "itl_max_unchunked_ms": med("unchunked", "max_during"),
        # Each server against its own streams before the arrival: drift on a shared machine stays out of the ratios.
        "itl_p50_before_no_guard_ms": med("chunked_no_guard", "p50_before"),
        "itl_p50_before_unchunked_ms": med("unchunked", "p50_before"),
        "itl_p50_chunked_no_guard_ms": med("chunked_no_guard", "p50_during"),
        "itl_p99_chunked_no_guard_ms": med("chunked_no_guard", "p99_during"),
        "prefill_s_chunked": med("chunked", "prefill_s"),
        "prefill_s_chunked_no_guard": med("chunked_no_guard", "prefill_s"),
        "prefill_s_unchunked": med("unchunked", "prefill_s"),
        "p99_chunked_over_p50_before": round(ratio, 2),
        "p99_chunked_no_guard_over_p50_before": round(no_guard_ratio, 2),
        "target_p99_within_3x_p50_before": ratio <= 3,
        "wall_s": round(time.monotonic() - started, 1),
    }))


if __name__ == "__main__":
    main()
