"""Serving load generator in the style of vLLM's benchmark_serving: streams `ringserve.v1` Generate requests at a fixed
concurrency (closed loop) or with Poisson arrivals at a request rate (open loop) for a duration, cancels a share of
the streams at random points, and reports throughput and latency. It starts a server itself (the embedded model by
default) unless `--target host:port` names a running one.

Prompts are windows of a built-in English text, tokenized once by the server and sent as token ids so every prompt
has exactly the length drawn; prompt and output lengths come from a seeded distribution (`--len-dist`), and outputs
ignore EOS so they run to their drawn length. Before the load a few requests run one at a time: that single-stream
baseline, measured in the same run, is what the latencies under load compare against. After the load the script waits
for the engine to go idle and reports any KV block still held as `blocks_leaked`.

    python benchmarks/serve.py --concurrency 64 --duration 60 --cancel-fraction 0.1
    python benchmarks/serve.py --request-rate 4 --duration 30
    python benchmarks/serve.py --quick                      # under a minute, server start included
    python benchmarks/serve.py --target 10.0.0.5:50051 --tls-ca-file ca.pem --api-key KEY
    python benchmarks/serve.py --api ringserve,openai,kserve  # the front doors on the same load, one after the other

`--api` picks the front doors to load, each in its own phase on the same server with the same seeded requests (a
cache salt per phase keeps one phase's prompts out of the next one's prefix cache): `ringserve` streams
ringserve.v1 Generate over gRPC, `openai` streams POST /v1/completions (token-id prompts, SSE) over HTTP/1.1, `kserve`
streams KServe v2 ModelStreamInfer (one stream per request, the same prompt windows as text in text_input, the same
sampling in sampling_parameters).

The last line of output is one JSON object: request_throughput (completed requests/s), output_tok_s (tokens streamed
to clients, cancelled streams included, per second), ttft_ms and itl_ms ({mean, median, p99}; inter-token latency is
the gap between consecutive streamed messages that carry tokens), completed, cancelled (streams this script cancelled
on purpose), errors (anything else that failed) with error_codes, blocks_leaked, and the baseline, all of the first
API's phase; then per API `<api>_output_tok_s`, `<api>_ttft_ms_median` and `<api>_frontend_cpu_us_per_token` (CPU
time of the frontend process per streamed token, when this script started the server), and `apis` with each
phase's full figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
from front_doors import RequestPlan, Streamer, StreamResult, kserve_stream, piece_texts, stream, stream_openai
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.frontend.api.security import ChannelSecurity, add_channel_security_arguments, channel_security_from_args
from ringserve.frontend.api.security import open_aio_channel as open_channel
from ringserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from tqdm import tqdm

# Written for this benchmark; any English prose of a few hundred tokens would do.
PROSE = """\
The harbour town woke before the sun. Fishing boats slid out past the breakwater one after another, their lamps
swinging, while the bakers on the hill pulled the first loaves from ovens that had been burning since midnight. By
the time the light reached the church tower the market was already loud: crates of mackerel and crab, baskets of
apples from the valley farms, bolts of blue cloth, copper pans hung from poles, and a man who sold nothing but
rope and would tell anyone who stopped how each kind was twisted and what it was good for.
Children ran between the stalls with errands and without them. An old woman mended nets on the quay, her fingers
finding each broken knot without her eyes, and she hummed a song nobody else remembered the words to. The
harbourmaster wrote the names of the boats in a ledger as they left and would write them again as they came home,
and on the evenings when a name was missing the whole town knew before the lamps were lit.
In winter the storms came in from the west and the sea climbed the steps of the quay. The boats stayed in, the
market shrank to a few covered stalls, and people gathered in the long room above the inn to repair what the
autumn had broken, to argue about the price of salt, and to listen to the schoolteacher read from the newspaper
that arrived, three days late, with the mail coach. Spring always seemed impossible until, one morning, it was
simply there: the wind turned, the water went green and clear, and the boats went out again as if they had never
stopped.
"""


def progress(message: str) -> None:
    tqdm.write(f"[serve] {message}", file=sys.stderr)


class Workload:
    """Seeded prompts, output lengths and cancellation points; the same --seed gives the same request sequence."""

    def __init__(self, args: argparse.Namespace, corpus: list[int]) -> None:
        self.args = args
        self.corpus = corpus
        self.rng = random.Random(args.seed)

    def length(self, mean: int) -> int:
        dist = self.args.len_dist
        if dist == "fixed":
            return mean
        if dist == "uniform":  # [mean/2, 3*mean/2]
            return self.rng.randint(max(1, mean // 2), max(1, mean + mean // 2))
        # lognormal with this median and sigma: a long tail like real traffic, clipped to 4x the mean
        return max(1, min(4 * mean, round(self.rng.lognormvariate(math.log(mean), self.args.len_sigma))))

    def plans(self) -> Iterator[RequestPlan]:
        index = 0
        while True:
            prompt_len = self.length(self.args.input_len)
            start = self.rng.randrange(len(self.corpus))
            prompt = [self.corpus[(start + i) % len(self.corpus)] for i in range(prompt_len)]
            max_tokens = self.length(self.args.output_len)
            cancel_after = self.rng.randrange(max_tokens) if self.rng.random() < self.args.cancel_fraction else None
            yield RequestPlan(index, prompt, max_tokens, cancel_after, self.rng.uniform(0.0, 0.2))
            index += 1


def summary(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values_s) * 1e3
    return {"mean": round(float(ms.mean()), 3), "median": round(float(np.median(ms)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3)}


APIS = ("ringserve", "openai", "kserve")


class LoadRun:
    """Drives the load and accumulates what the streams saw."""

    def __init__(self, streamer: Streamer, args: argparse.Namespace, workload: Workload) -> None:
        self.streamer = streamer
        self.args = args
        self.plans = workload.plans()
        self.results: list[StreamResult] = []
        self.bar = tqdm(total=None, unit="req", desc="streams done", file=sys.stderr, disable=args.no_progress,
                        dynamic_ncols=True)  # fmt: skip

    async def one(self) -> None:
        result = await self.streamer(next(self.plans))
        self.results.append(result)
        self.bar.update(1)
        if result.outcome == "error" and sum(r.outcome == "error" for r in self.results) <= 5:
            progress(f"unexpected error: {result.error}")

    async def closed_loop(self, deadline: float) -> None:
        async def worker() -> None:
            while time.perf_counter() < deadline:
                await self.one()

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def open_loop(self, deadline: float) -> None:
        """Poisson arrivals; with --concurrency as well, at most that many streams at once (vLLM's max-concurrency)."""
        rng = random.Random(self.args.seed + 1)
        limit = asyncio.Semaphore(self.args.concurrency) if self.args.concurrency else contextlib.nullcontext()
        tasks: set[asyncio.Task[None]] = set()

        async def limited() -> None:
            async with limit:  # type: ignore[attr-defined]
                await self.one()

        next_arrival = time.perf_counter()
        while next_arrival < deadline:
            await asyncio.sleep(max(0.0, next_arrival - time.perf_counter()))
            task = asyncio.create_task(limited())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_arrival += rng.expovariate(self.args.request_rate) if math.isfinite(self.args.request_rate) else 0.0
        if tasks:
            await asyncio.gather(*tasks)


async def engine_idle_stats(stub: pb_grpc.GenerationStub, timeout_s: float) -> tuple[pb.EngineStats, bool]:
    """Stats once nothing runs or waits and every block is free again (cached blocks count as free), or the last
    stats when that does not happen within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and stats.free_kv_blocks == stats.total_kv_blocks:
            return stats, True
        if time.monotonic() > deadline:
            return stats, idle
        await asyncio.sleep(0.2)


# -- the server ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_serving(address: str, security: ChannelSecurity, proc: subprocess.Popen[bytes] | None,
                       timeout_s: float, log_path: Path | None = None) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    async with open_channel(address, security) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = (await asyncio.to_thread(log_path.read_text, errors="replace"))[-3000:] if log_path else ""
                raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{tail}")
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{address} is not SERVING after {timeout_s:.0f} s")


@dataclass(frozen=True)
class Target:
    address: str  # gRPC host:port
    http_url: str  # the OpenAI-compatible API's base URL ("" = not served)
    pid: int | None  # the frontend process, when this script started it


@contextlib.asynccontextmanager
async def server_for(args: argparse.Namespace, security: ChannelSecurity) -> AsyncIterator[Target]:
    """The server to load: --target (and --http-target) as given, or a server this script starts (and stops) on free
    ports, with the HTTP API when an --api needs it."""
    if args.target:
        await wait_serving(args.target, security, None, 30.0)
        scheme = "https" if security.uses_tls else "http"
        yield Target(args.target, f"{scheme}://{args.http_target}" if args.http_target else "", None)
        return
    model = args.model
    if not model:
        from ringserve.frontend.model_source import embedded_model_path

        model = str(embedded_model_path())
    port = free_port()
    max_num_seqs = args.max_num_seqs or max(args.concurrency, 8)
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--dtype", args.dtype, "--max-num-seqs", str(max_num_seqs), *args.server_arg]  # fmt: skip
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    http_url = ""
    if "openai" in args.api:
        http_port = free_port()
        cmd += ["--http-port", str(http_port)]
        http_url = f"http://127.0.0.1:{http_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}  # only the flags configure it
    with tempfile.TemporaryDirectory(prefix="ringserve-serve-bench-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        with log_path.open("wb") as log:
            proc = await asyncio.to_thread(subprocess.Popen, cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        progress(f"starting a server: {' '.join(cmd[3:])}")
        try:
            await wait_serving(f"127.0.0.1:{port}", security, proc, args.server_start_timeout, log_path)
            yield Target(f"127.0.0.1:{port}", http_url, proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.to_thread(proc.wait, 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = await asyncio.to_thread(proc.wait)
            if code != 0:
                log_text = await asyncio.to_thread(log_path.read_text, errors="replace")
                progress(f"the server exited with {code}; its log:\n{log_text[-3000:]}")


def frontend_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) the frontend process has used; None when unknown (a --target server)."""
    if pid is None:
        return None
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@contextlib.asynccontextmanager
async def streamer_for(api: str, target: Target, channel: grpc.aio.Channel, corpus: list[int],
                       args: argparse.Namespace, security: ChannelSecurity) -> AsyncIterator[Streamer]:  # fmt: skip
    """How one request of the plan is streamed through `api`; each phase salts its prompts' prefix-cache blocks."""
    salt = f"bench-{api}"
    stub = pb_grpc.GenerationStub(channel)
    if api == "ringserve":
        yield lambda plan: stream(stub, plan, args.request_timeout, salt)
        return
    if api == "kserve":
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        pieces = await piece_texts(stub, corpus)  # KServe prompts are text: the same windows, token by token
        yield lambda plan: kserve_stream(kserve, plan, "".join(pieces[i] for i in plan.prompt_ids),
                                         args.request_timeout)  # fmt: skip
        return
    if not target.http_url:
        raise SystemExit("--api openai needs the server's HTTP port: --http-target host:port with --target")
    headers = {"authorization": f"Bearer {security.api_key}"} if security.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(args.concurrency, 1) * 2)
    cert = (security.cert_file, security.key_file) if security.cert_file else None
    async with httpx.AsyncClient(base_url=target.http_url, headers=headers, limits=limits, timeout=None,
                                 verify=security.ca_file or True, cert=cert) as client:  # fmt: skip
        yield lambda plan: stream_openai(client, plan, args.request_timeout, salt)


# -- main ------------------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One API's share of the run: its baseline, then what its load rounds saw."""

    api: str
    streamer: Streamer
    baseline: list[StreamResult] = field(default_factory=list)
    results: list[StreamResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float | None = 0.0
    stats: pb.EngineStats | None = None
    idle: bool = True


async def run(args: argparse.Namespace) -> dict[str, object]:
    security = channel_security_from_args(args)
    async with server_for(args, security) as target, contextlib.AsyncExitStack() as streamers:
        options = [("grpc.max_receive_message_length", -1)]
        channel = await streamers.enter_async_context(open_channel(target.address, security, options))
        stub = pb_grpc.GenerationStub(channel)
        corpus = list((await stub.Tokenize(pb.TokenizeRequest(text=PROSE, add_special_tokens=False),
                                           timeout=30)).token_ids)  # fmt: skip
        info = await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        phases = [Phase(api, await streamers.enter_async_context(
                      streamer_for(api, target, channel, corpus, args, security))) for api in args.api]
        # Baseline: the same kind of requests, one at a time, on the same server (also warms it up).
        baseline_args = argparse.Namespace(**{**vars(args), "cancel_fraction": 0.0, "len_dist": "fixed"})
        for phase in phases:
            plans = Workload(baseline_args, corpus).plans()
            phase.baseline = [await phase.streamer(next(plans)) for _ in range(args.baseline_requests)]
        # Rounds alternate the APIs' order, so a drift in the machine's speed falls on every API alike.
        for round_index in range(args.rounds):
            for phase in phases if round_index % 2 == 0 else reversed(phases):
                progress(f"round {round_index + 1}/{args.rounds}: {args.duration / args.rounds:.0f} s of "
                         f"{phase.api} load")  # fmt: skip
                round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + round_index})
                await load_round(phase, target, stub, round_args, corpus)
    result: dict[str, object] = {"benchmark": "serve", "model": info.model}
    figures = {phase.api: phase_figures(phase, args) for phase in phases}
    result.update(figures[args.api[0]])
    for api, phase_result in figures.items():
        result[f"{api}_output_tok_s"] = phase_result["output_tok_s"]
        result[f"{api}_ttft_ms_median"] = phase_result["ttft_ms"]["median"]  # type: ignore[index]
        result[f"{api}_frontend_cpu_us_per_token"] = phase_result["frontend_cpu_us_per_token"]
    if "ringserve" in figures:
        base = figures["ringserve"]["output_tok_s"]
        for api in figures.keys() - {"ringserve"}:
            result[f"{api}_vs_ringserve_output_tok_s"] = round(figures[api]["output_tok_s"] / base, 3) if base else None
    result["apis"] = figures
    result["errors"] = sum(phase_result["errors"] for phase_result in figures.values())  # type: ignore[misc]
    result["blocks_leaked"] = max(phase_result["blocks_leaked"] for phase_result in figures.values())  # type: ignore
    return result


async def load_round(phase: Phase, target: Target, stub: pb_grpc.GenerationStub, args: argparse.Namespace,
                     corpus: list[int]) -> None:  # fmt: skip
    """--duration / --rounds seconds of this phase's API under the load, then until the engine is idle again."""
    load = LoadRun(phase.streamer, args, Workload(args, corpus))
    cpu_before = frontend_cpu_s(target.pid)
    start = time.perf_counter()
    deadline = start + args.duration / args.rounds
    if args.request_rate:
        await load.open_loop(deadline)
    else:
        await load.closed_loop(deadline)
    phase.elapsed_s += time.perf_counter() - start
    cpu_after = frontend_cpu_s(target.pid)
    phase.cpu_s = None if cpu_before is None or cpu_after is None or phase.cpu_s is None else \
        phase.cpu_s + cpu_after - cpu_before
    load.bar.close()
    phase.results += load.results
    phase.stats, idle = await engine_idle_stats(stub, args.idle_timeout)
    phase.idle = phase.idle and idle


def phase_figures(phase: Phase, args: argparse.Namespace) -> dict[str, object]:
    results, baseline, elapsed, stats = phase.results, phase.baseline, phase.elapsed_s, phase.stats
    assert stats is not None
    outcomes = Counter(r.outcome for r in results)
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    gaps = [gap for r in results for gap in r.gaps_s]
    base_ttft = [r.ttft_s for r in baseline if r.ttft_s is not None]
    base_gaps = [gap for r in baseline for gap in r.gaps_s]
    itl = summary(gaps)
    base_itl = summary(base_gaps)
    cpu_per_token = round(phase.cpu_s / tokens * 1e6, 1) if phase.cpu_s is not None and tokens else None
    return {
        "api": phase.api,
        "mode": f"poisson {args.request_rate}/s" if args.request_rate else f"concurrency {args.concurrency}",
        "duration_s": args.duration,
        "rounds": args.rounds,
        "elapsed_s": round(elapsed, 2),
        "request_throughput": round(outcomes["completed"] / elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 2),
        "ttft_ms": summary(ttfts),
        "itl_ms": itl,
        "completed": outcomes["completed"],
        "cancelled": outcomes["cancelled"],
        "errors": outcomes["error"],
        "error_codes": dict(Counter(r.error for r in results if r.outcome == "error")),
        "output_tokens": tokens,
        "frontend_cpu_us_per_token": cpu_per_token,
        "blocks_leaked": stats.total_kv_blocks - stats.free_kv_blocks,
        "engine_idle": phase.idle,
        "num_preemptions": stats.num_preemptions,
        "baseline": {"requests": len(baseline), "ttft_ms": summary(base_ttft), "itl_ms": base_itl},
        "itl_median_vs_baseline": round(itl["median"] / base_itl["median"], 3)
        if itl["median"] and base_itl["median"] else None,
        "config": {"concurrency": args.concurrency, "request_rate": args.request_rate,
                   "cancel_fraction": args.cancel_fraction, "input_len": args.input_len,
                   "output_len": args.output_len, "len_dist": args.len_dist, "seed": args.seed},
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=16,
                      help="streams in flight (closed loop); with --request-rate, the most in flight at once")
    load.add_argument("--request-rate", type=float, default=0.0,
                      help="Poisson arrivals per second (inf = all at once); 0 = closed loop at --concurrency")
    load.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    load.add_argument("--cancel-fraction", type=float, default=0.0,
                      help="share of streams the client cancels at a random point (before the first token or after "
                           "a random number of tokens)")
    load.add_argument("--input-len", type=int, default=64, help="prompt tokens (median)")
    load.add_argument("--output-len", type=int, default=32, help="tokens to generate (median)")
    load.add_argument("--len-dist", choices=["lognormal", "uniform", "fixed"], default="lognormal",
                      help="distribution of prompt and output lengths around the medians")
    load.add_argument("--len-sigma", type=float, default=0.5, help="sigma of the lognormal lengths")
    load.add_argument("--seed", type=int, default=0, help="seed of the workload (prompts, lengths, cancels)")
    load.add_argument("--baseline-requests", type=int, default=4, help="single-stream baseline requests")
    load.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one stream (s)")
    load.add_argument("--idle-timeout", type=float, default=60.0,
                      help="seconds to wait after the load for the engine to go idle before counting blocks")
    load.add_argument("--api", type=lambda text: [api.strip() for api in text.split(",")], default=["ringserve"],
                      help="front doors to load, comma-separated, each in its own phase: " + ", ".join(APIS))
    load.add_argument("--rounds", type=int, default=1,
                      help="split --duration into this many rounds per API, alternating the APIs' order")
    load.add_argument("--quick", action="store_true", help="a short run: under a minute with the server start")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    server = parser.add_argument_group("server (ignored with --target)")
    server.add_argument("--target", default="", help="host:port of a running server; default: start one")
    server.add_argument("--http-target", default="", help="host:port of --target's HTTP API (for --api openai)")
    server.add_argument("--model", default="", help="model to serve (default: the embedded SmolLM2-135M-Instruct)")
    server.add_argument("--dtype", default="float32")
    server.add_argument("--max-num-seqs", type=int, default=0, help="default: --concurrency (at least 8)")
    server.add_argument("--num-kv-blocks", type=int, default=0, help="default: the server's (from its memory budget)")
    server.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="extra `ringserve serve` argument (repeat), e.g. --server-arg=--block-size=32")
    server.add_argument("--server-start-timeout", type=float, default=600.0)
    add_channel_security_arguments(parser.add_argument_group("connection (TLS, API key)"))  # type: ignore[arg-type]
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 6.0)
        args.concurrency = min(args.concurrency, 4)
        args.input_len, args.output_len = min(args.input_len, 16), min(args.output_len, 8)
        args.len_dist = "fixed"  # no long tail after the window closes
        args.baseline_requests = min(args.baseline_requests, 2)
    if args.request_rate < 0 or args.concurrency < (0 if args.request_rate else 1):
        parser.error("--request-rate must be >= 0 and --concurrency >= 1 (or 0 with a --request-rate: unbounded)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not args.api or set(args.api) - set(APIS) or len(set(args.api)) != len(args.api):
        parser.error(f"--api takes distinct names among {', '.join(APIS)}, comma-separated")
    if not 0.0 <= args.cancel_fraction <= 1.0:
        parser.error("--cancel-fraction must be in [0, 1]")
    if min(args.input_len, args.output_len) < 1 or args.duration <= 0:
        parser.error("--input-len and --output-len must be >= 1 and --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 1 if result["errors"] or result["blocks_leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
