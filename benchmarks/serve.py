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
    python benchmarks/serve.py --api ringserve,kserve       # the same load through each API, one after the other

`--api` picks the front doors: `ringserve` (ringserve.v1 Generate, prompts as token ids) and `kserve` (KServe v2
ModelStreamInfer, one stream per request, the same prompt windows as text and the same sampling as
sampling_parameters). Each API gets the same seeded workload in turn, on the same server.

The last line of output is one JSON object: request_throughput (completed requests/s), output_tok_s (tokens streamed
to clients, cancelled streams included, per second), ttft_ms and itl_ms ({mean, median, p99}; inter-token latency is
the gap between consecutive streamed messages that carry tokens), completed, cancelled (streams this script cancelled
on purpose), errors (anything else that failed) with error_codes, blocks_leaked, and the baseline; these are the
first --api's figures, `apis` has each API's, and `<api>_output_tok_s` and `<api>_ttft_ms_median` name them flat
(e.g. kserve_output_tok_s).
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
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.frontend.api.security import ChannelSecurity, add_channel_security_arguments, channel_security_from_args
from ringserve.frontend.api.security import open_aio_channel as open_channel
from ringserve.kserve import grpc_service_pb2 as kpb
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


@dataclass(frozen=True)
class RequestPlan:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    cancel_after: int | None  # cancel once this many tokens arrived (0 = before the first); None = run to the end
    cancel_delay_s: float  # for cancel_after == 0: how long after sending


@dataclass
class StreamResult:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    outcome: str = "completed"  # completed | cancelled | error
    error: str = ""


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


def generate_request(plan: RequestPlan) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"bench-{plan.index}", token_ids=pb.TokenIds(ids=plan.prompt_ids),
                              sampling=pb.SamplingParams(max_tokens=plan.max_tokens, temperature=1.0, seed=plan.index,
                                                         ignore_eos=True))  # fmt: skip


async def stream(stub: pb_grpc.GenerationStub, plan: RequestPlan, timeout_s: float) -> StreamResult:
    result = StreamResult()
    start = time.perf_counter()
    call = stub.Generate(generate_request(plan), timeout=timeout_s)
    cancelled = False
    try:
        if plan.cancel_after == 0:  # gone before the first token: queued, prefilling, or just admitted
            await asyncio.sleep(plan.cancel_delay_s)
            cancelled = call.cancel()
            if cancelled:
                result.outcome = "cancelled"
                return result
        last = start
        async for response in call:
            now = time.perf_counter()
            if response.token_ids:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.tokens += len(response.token_ids)
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                if response.finish_reason == pb.FINISH_REASON_ABORT:
                    result.outcome, result.error = "error", "finish_reason ABORT"
                return result
            if plan.cancel_after is not None and result.tokens >= plan.cancel_after:
                cancelled = call.cancel()
                result.outcome = "cancelled"
                return result
        result.outcome, result.error = "error", "the stream ended without a finish_reason"
    except grpc.aio.AioRpcError as error:
        if cancelled and error.code() == grpc.StatusCode.CANCELLED:
            result.outcome = "cancelled"
        else:
            result.outcome, result.error = "error", error.code().name
    except asyncio.CancelledError:
        call.cancel()
        raise
    return result


API_CHOICES = ("ringserve", "kserve")


class Front:
    """One API's client for the load: how a plan becomes a stream on the shared channel."""

    def __init__(self, api: str, channel: grpc.aio.Channel, piece_text: dict[int, str]) -> None:
        self.api = api
        self.stub = pb_grpc.GenerationStub(channel)
        self.kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        self.piece_text = piece_text  # token id -> its text, so a KServe prompt is the same window as text

    async def stream(self, plan: RequestPlan, timeout_s: float) -> StreamResult:
        if self.api == "kserve":
            return await kserve_stream(self.kserve, plan, "".join(self.piece_text[i] for i in plan.prompt_ids),
                                       timeout_s)  # fmt: skip
        return await stream(self.stub, plan, timeout_s)


def kserve_request(plan: RequestPlan, prompt: str) -> kpb.ModelInferRequest:
    """The plan as Triton's vLLM-style tensors: text_input, stream, sampling_parameters (the same sampling)."""
    sampling = json.dumps({"max_tokens": plan.max_tokens, "temperature": 1.0, "seed": plan.index, "ignore_eos": True})
    request = kpb.ModelInferRequest(id=f"bench-{plan.index}")
    for name, datatype, raw in (("text_input", "BYTES", prompt.encode()), ("stream", "BOOL", None),
                                ("sampling_parameters", "BYTES", sampling.encode())):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(b"\x01" if raw is None else len(raw).to_bytes(4, "little") + raw)
    return request


async def kserve_stream(stub: kpb_grpc.GRPCInferenceServiceStub, plan: RequestPlan, prompt: str,
                        timeout_s: float) -> StreamResult:
    """One KServe ModelStreamInfer stream per request (so it can be cancelled alone). Its responses carry text, not
    token counts: a completed stream counts its max_tokens (ignore_eos runs it that far), a cancelled one a token
    per response."""
    result = StreamResult()
    start = time.perf_counter()
    request = kserve_request(plan, prompt)
    call = stub.ModelStreamInfer(iter([request]), timeout=timeout_s)
    cancelled = False
    try:
        if plan.cancel_after == 0:
            await asyncio.sleep(plan.cancel_delay_s)
            cancelled = call.cancel()
            if cancelled:
                result.outcome = "cancelled"
                return result
        last = start
        async for response in call:
            now = time.perf_counter()
            if response.error_message:
                result.outcome, result.error = "error", response.error_message.split(":")[0]
                return result
            reply = response.infer_response
            if reply.raw_output_contents and len(reply.raw_output_contents[0]) > 4:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.tokens += 1
            if reply.parameters["triton_final_response"].bool_param:
                result.tokens = plan.max_tokens
                return result
            if plan.cancel_after is not None and result.tokens >= plan.cancel_after:
                cancelled = call.cancel()
                result.outcome = "cancelled"
                return result
        result.outcome, result.error = "error", "the stream ended without a final response"
    except grpc.aio.AioRpcError as error:
        if cancelled and error.code() == grpc.StatusCode.CANCELLED:
            result.outcome = "cancelled"
        else:
            result.outcome, result.error = "error", error.code().name
    except asyncio.CancelledError:
        call.cancel()
        raise
    return result


def summary(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values_s) * 1e3
    return {"mean": round(float(ms.mean()), 3), "median": round(float(np.median(ms)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3)}


class LoadRun:
    """Drives the load and accumulates what the streams saw."""

    def __init__(self, front: Front, args: argparse.Namespace, workload: Workload) -> None:
        self.front = front
        self.args = args
        self.plans = workload.plans()
        self.results: list[StreamResult] = []
        self.bar = tqdm(total=None, unit="req", desc="streams done", file=sys.stderr, disable=args.no_progress,
                        dynamic_ncols=True)  # fmt: skip

    async def one(self) -> None:
        result = await self.front.stream(next(self.plans), self.args.request_timeout)
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


@contextlib.asynccontextmanager
async def server_for(args: argparse.Namespace, security: ChannelSecurity) -> AsyncIterator[str]:
    """The address to load: --target as given, or a server this script starts (and stops) on a free port."""
    if args.target:
        await wait_serving(args.target, security, None, 30.0)
        yield args.target
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}  # only the flags configure it
    with tempfile.TemporaryDirectory(prefix="ringserve-serve-bench-") as log_dir:
        log_path = Path(log_dir) / "server.log"
        with log_path.open("wb") as log:
            proc = await asyncio.to_thread(subprocess.Popen, cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        progress(f"starting a server: {' '.join(cmd[3:])}")
        try:
            await wait_serving(f"127.0.0.1:{port}", security, proc, args.server_start_timeout, log_path)
            yield f"127.0.0.1:{port}"
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


# -- main ------------------------------------------------------------------------------------------------------------


async def piece_texts(stub: pb_grpc.GenerationStub, ids: list[int]) -> dict[int, str]:
    """Each token's text, so a window of token ids can be sent as text (the corpus is ASCII: pieces concatenate)."""
    unique = sorted(set(ids))
    texts = await asyncio.gather(*(stub.Detokenize(pb.DetokenizeRequest(token_ids=[i]), timeout=30) for i in unique))
    return {i: reply.text for i, reply in zip(unique, texts, strict=True)}


def api_figures(results: list[StreamResult], elapsed: float) -> dict[str, object]:
    outcomes = Counter(r.outcome for r in results)
    return {
        "request_throughput": round(outcomes["completed"] / elapsed, 3),
        "output_tok_s": round(sum(r.tokens for r in results) / elapsed, 2),
        "ttft_ms": summary([r.ttft_s for r in results if r.ttft_s is not None]),
        "itl_ms": summary([gap for r in results for gap in r.gaps_s]),
        "completed": outcomes["completed"],
        "cancelled": outcomes["cancelled"],
        "errors": outcomes["error"],
        "error_codes": dict(Counter(r.error for r in results if r.outcome == "error")),
        "output_tokens": sum(r.tokens for r in results),
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    security = channel_security_from_args(args)
    loads: dict[str, tuple[list[StreamResult], float]] = {}
    async with server_for(args, security) as address:
        options = [("grpc.max_receive_message_length", -1)]
        async with open_channel(address, security, options) as channel:
            stub = pb_grpc.GenerationStub(channel)
            corpus = list((await stub.Tokenize(pb.TokenizeRequest(text=PROSE, add_special_tokens=False),
                                               timeout=30)).token_ids)  # fmt: skip
            info = await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
            pieces = await piece_texts(stub, corpus) if "kserve" in args.api else {}

            # Baseline: the same kind of requests, one at a time, on the same server (also warms it up).
            baseline_args = argparse.Namespace(**{**vars(args), "cancel_fraction": 0.0, "len_dist": "fixed"})
            baseline_plans = Workload(baseline_args, corpus).plans()
            baseline = [await stream(stub, next(baseline_plans), args.request_timeout)
                        for _ in range(args.baseline_requests)]  # fmt: skip
            progress(f"baseline: {len(baseline)} requests one at a time; now {args.duration:.0f} s of load per API "
                     f"({', '.join(args.api)})")  # fmt: skip

            # One after another, each with the same seeded workload; --rounds alternates them so a machine whose
            # speed drifts (other load on it) favours none.
            for api in [api for _ in range(args.rounds) for api in args.api]:
                load = LoadRun(Front(api, channel, pieces), args, Workload(args, corpus))
                start = time.perf_counter()
                deadline = start + args.duration
                if args.request_rate:
                    await load.open_loop(deadline)
                else:
                    await load.closed_loop(deadline)
                results, elapsed = loads.get(api, ([], 0.0))
                loads[api] = (results + load.results, elapsed + time.perf_counter() - start)
                load.bar.close()
                stats, idle = await engine_idle_stats(stub, args.idle_timeout)
                if stats.total_kv_blocks != stats.free_kv_blocks:
                    break  # a leak: report it at once, under this API's figures

    figures = {api: api_figures(results, elapsed) for api, (results, elapsed) in loads.items()}
    first = figures[args.api[0]]
    base_itl = summary([gap for r in baseline for gap in r.gaps_s])
    itl: dict[str, float | None] = first["itl_ms"]  # type: ignore[assignment]
    per_api: dict[str, object] = {}
    for api, each in figures.items():
        per_api[f"{api}_output_tok_s"] = each["output_tok_s"]
        per_api[f"{api}_ttft_ms_median"] = each["ttft_ms"]["median"]  # type: ignore[index]
    return {
        "benchmark": "serve",
        "model": info.model,
        "mode": f"poisson {args.request_rate}/s" if args.request_rate else f"concurrency {args.concurrency}",
        "duration_s": args.duration * args.rounds,
        "elapsed_s": round(loads[args.api[0]][1], 2),
        **first,
        "blocks_leaked": stats.total_kv_blocks - stats.free_kv_blocks,
        "engine_idle": idle,
        "num_preemptions": stats.num_preemptions,
        "baseline": {"requests": len(baseline), "itl_ms": base_itl,
                     "ttft_ms": summary([r.ttft_s for r in baseline if r.ttft_s is not None])},
        "itl_median_vs_baseline": round(itl["median"] / base_itl["median"], 3)
        if itl["median"] and base_itl["median"] else None,
        "apis": figures,
        **per_api,
        "config": {"api": args.api, "rounds": args.rounds, "concurrency": args.concurrency,
                   "request_rate": args.request_rate, "cancel_fraction": args.cancel_fraction,
                   "input_len": args.input_len, "output_len": args.output_len, "len_dist": args.len_dist,
                   "seed": args.seed},
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
    load.add_argument("--api", nargs="+", default=["ringserve"], metavar="API",
                      help=f"the front doors to load ({', '.join(API_CHOICES)}; several as a comma or space separated "
                           "list), one after another with the same workload: ringserve.v1 Generate, KServe v2 "
                           "ModelStreamInfer; the first one's figures are the top-level keys")
    load.add_argument("--rounds", type=int, default=1,
                      help="run the --api list this many times, alternating; each API's figures cover its rounds")
    load.add_argument("--quick", action="store_true", help="a short run: under a minute with the server start")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    server = parser.add_argument_group("server (ignored with --target)")
    server.add_argument("--target", default="", help="host:port of a running server; default: start one")
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
    if not 0.0 <= args.cancel_fraction <= 1.0:
        parser.error("--cancel-fraction must be in [0, 1]")
    args.api = [api for value in args.api for api in value.split(",") if api]
    if not args.api or not set(args.api) <= set(API_CHOICES) or len(set(args.api)) != len(args.api):
        parser.error(f"--api takes distinct names among {', '.join(API_CHOICES)}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if min(args.input_len, args.output_len) < 1 or args.duration <= 0:
        parser.error("--input-len and --output-len must be >= 1 and --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    errors = sum(each["errors"] for each in result["apis"].values())  # type: ignore[attr-defined]
    return 1 if errors or result["blocks_leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
