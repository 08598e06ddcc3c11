"""Decode inter-token latency while long prompts arrive: colocated vs disaggregated prefill/decode (issue #8).

Real processes on the real model on CPU, driven over gRPC. 8 greedy streams decode while a long prompt (2,048
tokens, 2 output tokens so its KV is transferred) arrives every second. Colocated: one `ringserve serve` on every
core. Disaggregated: a prefill server pinned to core 0 and a decode server pinned to core 1 (`taskset`), with
`ringserve router` in front (on core 0). Both deployments run in the same invocation, one after the other. The KV
transfer time and rate per long prompt come from the decode workers' "KV pull" log lines.

    python benchmarks/disagg.py [--model PATH] [--quick] [--backend shm|nixl] [--long-prompt-tokens N]

--quick is a smoke run that fits a minute on a small CPU (512-token prompts, a 4 s window); the issue's figures come
from the full run. The last line of output is one JSON object (colocated_itl_p50_ms, colocated_itl_p99_ms,
disagg_itl_p50_ms, disagg_itl_p99_ms, kv_transfer_gib_per_s, ...).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from live_server import free_port, running_process
from ringserve.frontend.model_source import embedded_model_path
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc

NUM_STREAMS = 8
LONG_PROMPT_TOKENS = 2048
VOCAB_RANGE = (1000, 40000)  # ordinary word pieces, no special tokens
_PULL_LINE = re.compile(r"KV pull: (\d+) blocks, (\d+) bytes in ([\d.]+) ms")


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_RANGE) for _ in range(n)]


def greedy(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@dataclass
class Stream:
    times: list[float] = field(default_factory=list)
    error: str = ""

    def gaps(self, start: float, end: float) -> list[float]:
        """Inter-token gaps (s) that overlap [start, end]."""
        return [b - a for a, b in itertools.pairwise(self.times) if b > start and a < end]


def pinned(cores: str | None, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *cmd] if cores is not None else cmd


def serve(model: Path, log_dir: Path, cores: str | None, *flags: str) -> tuple[list[str], Path, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model), "--dtype", "float32", "--log-level", "INFO", "--max-num-seqs", "32",
           *flags]  # fmt: skip
    return pinned(cores, cmd), log_dir / f"server-{port}.log", port


def run_stream(stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest, stream: Stream,
               calls: list[grpc.Future], lock: threading.Lock) -> None:  # fmt: skip
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


def measure(address: str, seed: int, window_s: float, long_prompt_tokens: int, drain_s: float) -> dict[str, float]:
    """8 streams decode; a long prompt arrives every second for `window_s`; the streams' ITLs in that window."""
    rng = random.Random(seed)
    streams = [Stream() for _ in range(NUM_STREAMS)]
    calls: list[grpc.Future] = []
    lock = threading.Lock()
    long_errors: list[str] = []
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(stub.Generate(greedy(random_prompt(rng, 16), 4), timeout=300))  # warm-up
        threads = [threading.Thread(target=run_stream, daemon=True,
                                    args=(stub, greedy(random_prompt(rng, 16), 8000), s, calls, lock))
                   for s in streams]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(s.times) for s in streams) < 3:
            if time.monotonic() > deadline or any(s.error for s in streams):
                raise RuntimeError(f"streams did not start: {[s.error for s in streams]}")
            time.sleep(0.01)

        long_calls: list[grpc.Future] = []
        completed = [0]

        def long_prompt(ids: list[int]) -> None:
            call = stub.Generate(greedy(ids, 2), timeout=600)
            with lock:
                long_calls.append(call)
            try:
                list(call)
                completed[0] += 1
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    long_errors.append(f"{e.code().name}: {e.details()}")

        start = time.perf_counter()
        arrivals = []
        for k in range(int(window_s)):
            ids = random_prompt(rng, long_prompt_tokens)  # distinct prompts: no prefix-cache shortcut
            t = threading.Thread(target=long_prompt, args=(ids,), daemon=True)
            t.start()
            arrivals.append(t)
            time.sleep(max(0.0, start + k + 1 - time.perf_counter()))
        end = time.perf_counter()
        with lock:
            for call in calls:
                call.cancel()
        # A deployment that cannot keep up with the arrivals gets a bounded drain; the rest are cancelled (aborted).
        drain_until = time.monotonic() + drain_s
        for t in arrivals:
            t.join(timeout=max(0.0, drain_until - time.monotonic()))
        with lock:
            for call in long_calls:
                call.cancel()
        for t in arrivals:
            t.join(timeout=30)
        for t in threads:
            t.join(timeout=30)
    if long_errors or any(s.error for s in streams):
        raise RuntimeError(f"requests failed: {long_errors + [s.error for s in streams if s.error]}")
    gaps = [g for s in streams for g in s.gaps(start, end)]
    if not gaps:
        raise RuntimeError(f"no token arrived during the {window_s} s window")
    return {"p50": 1000 * float(np.percentile(gaps, 50)), "p99": 1000 * float(np.percentile(gaps, 99)),
            "max": 1000 * float(max(gaps)), "gaps": len(gaps), "long_completed": completed[0],
            "long_submitted": len(arrivals)}  # fmt: skip


def kv_pulls(log_path: Path) -> list[tuple[int, int, float]]:
    """(blocks, bytes, ms) of every KV pull the decode workers logged."""
    text = log_path.read_text(errors="replace")
    return [(int(b), int(n), float(ms)) for b, n, ms in _PULL_LINE.findall(text)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 512-token prompts, a 4 s window")
    parser.add_argument("--backend", choices=("shm", "nixl"), default="shm", help="KV transfer backend")
    parser.add_argument("--long-prompt-tokens", type=int, default=0,
                        help=f"arriving prompts' length (default {LONG_PROMPT_TOKENS}; 512 with --quick)")
    parser.add_argument("--window-s", type=float, default=0, help="seconds of arrivals (default 10; 4 with --quick)")
    args = parser.parse_args()
    model = args.model or embedded_model_path()
    long_tokens = args.long_prompt_tokens or (512 if args.quick else LONG_PROMPT_TOKENS)
    window_s = args.window_s or (4.0 if args.quick else 10.0)
    drain_s = 3.0 if args.quick else 60.0
    cores = sorted(os.sched_getaffinity(0))
    can_pin = shutil.which("taskset") is not None and len(cores) >= 2
    prefill_cores, decode_cores = (str(cores[0]), str(cores[1])) if can_pin else (None, None)
    all_cores = ",".join(map(str, cores[:2])) if can_pin else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ringserve-disagg-") as tmp, ExitStack() as stack:
        log_dir = Path(tmp)
        # All three servers load at once (an idle server uses no CPU), then the deployments run one at a time.
        colocated = stack.enter_context(running_process(*serve(model, log_dir, all_cores)))
        kv = ("--kv-transfer", args.backend)
        prefill = stack.enter_context(running_process(*serve(model, log_dir, prefill_cores, "--role", "prefill", *kv)))
        decode_cmd, decode_log, decode_port = serve(model, log_dir, decode_cores, "--role", "decode", *kv)
        decode = stack.enter_context(running_process(decode_cmd, decode_log, decode_port))
        for server in (colocated, prefill, decode):
            server.wait_serving(300)
        router_port = free_port()
        router_cmd = pinned(prefill_cores, [sys.executable, "-m", "ringserve.frontend.cli", "router", "--port",
                                            str(router_port), "--prefill", prefill.address, "--decode",
                                            decode.address, "--log-level", "WARNING"])  # fmt: skip
        router = stack.enter_context(running_process(router_cmd, log_dir / "router.log", router_port))
        router.wait_serving(60)
        print(f"servers up after {time.monotonic() - started:.1f} s", file=sys.stderr)
        results = {
            "colocated": measure(colocated.address, 1, window_s, long_tokens, drain_s),
            "disagg": measure(router.address, 2, window_s, long_tokens, drain_s),
        }
        pulls = kv_pulls(decode_log)
    # The long prompts' pulls (the streams' short prompts are pulled too, one block each).
    long_blocks = -(-long_tokens // 16)
    pulls = [p for p in pulls if p[0] == long_blocks]
    if not pulls:
        raise RuntimeError(f"the decode server logged no KV pull of {long_blocks} blocks")
    gib_per_s = [n / (ms / 1e3) / (1 << 30) for _, n, ms in pulls]
    for mode, r in results.items():
        print(f"{mode:10s}: ITL p50 {r['p50']:7.1f} ms, p99 {r['p99']:7.1f} ms, max {r['max']:7.1f} ms "
              f"({r['gaps']} gaps); long prompts completed {r['long_completed']}/{r['long_submitted']}",
              file=sys.stderr)  # fmt: skip
    print(f"KV pulls: {len(pulls)}, median {np.median([ms for *_, ms in pulls]):.1f} ms, "
          f"{np.median(gib_per_s):.2f} GiB/s, {pulls[0][1] / (1 << 20):.1f} MiB each", file=sys.stderr)
    c, d = results["colocated"], results["disagg"]
    print(json.dumps({
        "benchmark": "disagg",
        "model": str(model),
        "backend": args.backend,
        "num_streams": NUM_STREAMS,
        "long_prompt_tokens": long_tokens,
        "long_prompts_per_s": 1,
        "window_s": window_s,
        "pinning": (f"colocated cores {all_cores}; prefill core {prefill_cores} (+router), decode core {decode_cores}"
                    if can_pin else "none (fewer than 2 cores or no taskset)"),
        "colocated_itl_p50_ms": round(c["p50"], 2),
        "colocated_itl_p99_ms": round(c["p99"], 2),
        "disagg_itl_p50_ms": round(d["p50"], 2),
        "disagg_itl_p99_ms": round(d["p99"], 2),
        "kv_transfer_gib_per_s": round(float(np.median(gib_per_s)), 3),
        "kv_transfer_ms_p50": round(float(np.median([ms for *_, ms in pulls])), 2),
        "kv_transfer_bytes_per_request": pulls[0][1],
        "num_kv_pulls": len(pulls),
        "colocated_long_prompts_completed": results["colocated"]["long_completed"],
        "disagg_long_prompts_completed": results["disagg"]["long_completed"],
        "disagg_p99_over_p50": round(d["p99"] / d["p50"], 2),
        "colocated_p99_over_disagg_p99": round(c["p99"] / d["p99"], 2),
        "target_disagg_p99_within_1_5x_p50": d["p99"] <= 1.5 * d["p50"],
        "target_3x_lower_p99_than_colocated": c["p99"] >= 3 * d["p99"],
        "wall_s": round(time.monotonic() - started, 1),
    }))


if __name__ == "__main__":
    main()
