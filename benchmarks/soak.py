"""Soak and chaos run: mixed traffic against a real server for a duration, optionally killing a worker or the engine at
random intervals, then a check that nothing leaked.

It starts `ringserve serve` itself (the embedded model by default, `--worker-threads 1`, float32) and drives
`--concurrency` clients, each sending one request after another drawn from a seeded mix: streams of varied length
with varied sampling settings (greedy, temperature with top-p/top-k/min-p, penalties, seeds, logprobs, stop strings),
chat and token-id prompts, priorities, n > 1, streams this script cancels after a few messages, requests with a
deadline too short to finish, and malformed requests. With `--chaos` a task waits a random while of serving, kills
the engine or one of its workers with SIGKILL, and times how long until health says SERVING again.

Every request ends in an outcome: `completed` (a final message), `cancelled` (by this script), `deadline` (a
deadline this script set on purpose), `refused` (a malformed request answered INVALID_ARGUMENT), or an error. An
UNAVAILABLE error is expected only for a request that overlapped a kill (from the kill until SERVING again); any
other error, and any status other than INVALID_ARGUMENT for a malformed request, is `unexpected`.

    python benchmarks/soak.py --duration 1800 --chaos
    python benchmarks/soak.py --quick --chaos       # two to three minutes, server start included

Ctrl-C (or SIGTERM) stops the traffic early: the requests in flight finish and the report comes as usual, with
"interrupted": true; a second one cancels them. The server is stopped either way.

The last line of output is one JSON object: requests, requests_completed, outcomes, errors_by_status,
unexpected_errors (and a few unexpected_samples), kills, restarts (ringserve_engine_restarts_total),
mean_time_to_serving_s, frontend_rss_mib / engine_rss_mib / workers_rss_mib (at the start of the measured part, after
warm-up, and at the end, with growth_mib_per_1k_requests) and the same for *_anon_mib (anonymous memory only: the
heaps a leak would grow, without the ring pages that RSS gains until each ring has wrapped once), open_fds,
kv_blocks (total, free when idle),
shm_segments (the server's while it serves, and those left after it stopped), processes_left, server_exit_code,
health_latency_max_s and leaked (true when a KV block, a segment or a process outlived its use). The exit status is
1 when an error was unexpected or something leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_server import LiveServer, free_port, live_server
from ringserve.frontend.model_source import embedded_model_path
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

SHM = Path("/dev/shm")
SEGMENT_PREFIX = "ringserve-"  # /dev/shm/ringserve-<creator pid>-<random>-<role> (ringserve/formats/segments.py)
ENGINE_MARK, WORKER_MARK = "ringserve.backend.engine_main", "ringserve.workers.worker_main"
SERVING = health_pb2.HealthCheckResponse.SERVING
PROSE = (
    "The harbour town woke before the sun. Fishing boats slid out past the breakwater one after another, their lamps "
    "swinging, while the bakers on the hill pulled the first loaves from ovens that had been burning since midnight. "
    "By the time the light reached the church tower the market was already loud: crates of mackerel and crab, "
    "baskets of apples from the valley farms, bolts of blue cloth, copper pans hung from poles, and a man who sold "
    "nothing but rope. Children ran between the stalls with errands and without them. An old woman mended nets on "
    "the quay, her fingers finding each broken knot without her eyes, and she hummed a song nobody else remembered."
)
# (kind, weight) of the traffic mix.
MIX = (("stream", 40), ("chat", 10), ("token_ids", 8), ("n", 8), ("cancel", 12), ("deadline", 8), ("bad", 14))


def progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


# -- what a request is -------------------------------------------------------------------------------------------------


def sampling(rng: random.Random, max_tokens: int) -> pb.SamplingParams:
    """Varied but valid sampling settings."""
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    style = rng.choice(("greedy", "temperature", "penalties", "logprobs", "stop"))
    if style == "greedy":
        params.temperature = 0.0
    else:
        params.temperature = rng.choice((0.5, 0.8, 1.0))
        params.top_p = rng.choice((0.9, 1.0))
        params.top_k = rng.choice((0, 20, 50))
        params.min_p = rng.choice((0.0, 0.05))
    if style == "penalties":
        params.repetition_penalty = 1.1
        params.frequency_penalty = rng.uniform(-0.5, 0.5)
        params.presence_penalty = rng.uniform(0.0, 0.5)
    if style == "logprobs":
        params.logprobs = rng.randint(1, 5)
    if style == "stop":
        params.stop.extend(rng.sample((".", ",", " the", "\n"), 2))
        params.include_stop_str_in_output = rng.random() < 0.5
    if rng.random() < 0.5:
        params.seed = rng.getrandbits(63)
    return params


def prose_window(rng: random.Random, chars: int) -> str:
    start = rng.randrange(len(PROSE))
    return (PROSE[start:] + " " + PROSE)[:chars]


def bad_request(rng: random.Random, context_length: int, vocab_size: int) -> pb.GenerateRequest:
    """A request every API must refuse with INVALID_ARGUMENT."""
    text = prose_window(rng, 40)
    choice = rng.randrange(9)
    if choice == 0:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(temperature=-1.0))
    if choice == 1:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=0))
    if choice == 2:
        return pb.GenerateRequest(text="")
    if choice == 3:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, vocab_size + 7]))
    if choice == 4:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(n=100))
    if choice == 5:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(top_p=2.0))
    if choice == 6:
        return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=4, min_tokens=9))
    if choice == 7:  # longer than the context length, as ids
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(100, 1000)] * context_length))
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(stop=["x"] * 40))


@dataclass
class Plan:
    kind: str
    request: pb.GenerateRequest
    timeout_s: float
    cancel_after: int = 0  # messages, for "cancel"


def draw_plan(rng: random.Random, info: pb.ModelInfo) -> Plan:
    kind = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX])[0]
    max_tokens = rng.choice((4, 16, 32, 64, 128))
    priority = rng.choice((0, 0, 0, -1, 1, 5))
    if kind == "bad":
        return Plan(kind, bad_request(rng, info.context_length, info.vocab_size), 60.0)
    if kind == "chat":
        request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[
            pb.ChatMessage(role="system", content="You are brief."),
            pb.ChatMessage(role="user", content=prose_window(rng, rng.randint(20, 300)))]))
    elif kind == "token_ids":
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(100, 20000)
                                                                for _ in range(rng.randint(1, 200))]))
    else:
        request = pb.GenerateRequest(text=prose_window(rng, rng.randint(10, 1200)))
    request.sampling.CopyFrom(sampling(rng, max_tokens))
    request.priority = priority
    if kind == "n":
        request.sampling.n = rng.randint(2, 3)
    if kind == "cancel":
        request.sampling.max_tokens = 128
        return Plan(kind, request, 120.0, cancel_after=rng.randint(1, 6))
    if kind == "deadline":
        request.sampling.max_tokens = 128
        request.sampling.ignore_eos = True
        return Plan(kind, request, rng.uniform(0.2, 1.5))
    return Plan(kind, request, 120.0)


# -- the run's record --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors_by_status: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    kill_windows: list[list[float]] = field(default_factory=list)  # [kill time, SERVING-again time or inf]
    kills: Counter[str] = field(default_factory=Counter)
    times_to_serving: list[float] = field(default_factory=list)
    health_latency_max_s: float = 0.0
    pids: set[int] = field(default_factory=set)  # every process of the server seen
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return sum(self.outcomes.values())

    @property
    def served(self) -> int:
        """Requests a replica answered (every outcome but UNAVAILABLE in a kill): what memory growth is per."""
        return self.finished - self.outcomes["killed"]

    def overlaps_kill(self, start: float, end: float) -> bool:
        return any(start <= serving and end >= killed for killed, serving in self.kill_windows)

    def note(self, plan: Plan, outcome: str, start: float, end: float, error: grpc.aio.AioRpcError | None) -> None:
        if error is None:
            self.outcomes[outcome] += 1
            return
        code = error.code().name
        self.errors_by_status[code] += 1
        if code == "UNAVAILABLE" and self.overlaps_kill(start, end):
            self.outcomes["killed"] += 1
        elif (code, plan.kind) in (("INVALID_ARGUMENT", "bad"), ("DEADLINE_EXCEEDED", "deadline"),
                                   ("CANCELLED", "cancel")):
            self.outcomes[{"bad": "refused", "deadline": "deadline", "cancel": "cancelled"}[plan.kind]] += 1
        else:
            self.outcomes["unexpected"] += 1
            if len(self.unexpected) < 10:
                self.unexpected.append(f"{plan.kind}: {code}: {error.details()}")


# -- traffic -----------------------------------------------------------------------------------------------------------


async def one_request(stub: pb_grpc.GenerationStub, plan: Plan, record: Record) -> None:
    start = time.monotonic()
    call = stub.Generate(plan.request, timeout=plan.timeout_s)
    messages, final = 0, False
    try:
        async for response in call:
            messages += 1
            final = final or response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            if plan.cancel_after and messages >= plan.cancel_after:
                call.cancel()
                break
    except grpc.aio.AioRpcError as error:
        record.note(plan, "", start, time.monotonic(), error)
        return
    end = time.monotonic()
    if plan.cancel_after and not final:
        record.outcomes["cancelled"] += 1
    elif plan.kind == "bad":  # a malformed request that streamed: the server accepted what it must refuse
        record.outcomes["unexpected"] += 1
        record.unexpected.append(f"bad request served: {str(plan.request)[:200]}")
    elif final:
        record.note(plan, "completed", start, end, None)
    else:
        record.outcomes["unexpected"] += 1
        record.unexpected.append(f"{plan.kind}: the stream ended without a final message")


class Deadline:
    """When the traffic stops: after the duration, or at once on the first SIGINT/SIGTERM (in-flight requests finish
    and the report is printed as usual; a second signal cancels everything, the server is stopped all the same)."""

    def __init__(self, duration_s: float) -> None:
        self.at = time.monotonic() + duration_s
        self.stopped = asyncio.Event()

    def passed(self) -> bool:
        return self.stopped.is_set() or time.monotonic() >= self.at

    async def sleep(self, seconds: float) -> None:
        """Sleeps `seconds`, or less when the traffic is stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopped.wait(), seconds)

    def on_signal(self, main: asyncio.Task[Any]) -> None:
        if self.stopped.is_set():
            main.cancel()
            return
        progress("stopping: the requests in flight finish, then the report (signal again to cancel them)")
        self.stopped.set()


async def client(stub: pb_grpc.GenerationStub, info: pb.ModelInfo, rng: random.Random, record: Record,
                 deadline: Deadline) -> None:
    while not deadline.passed():
        killed = record.outcomes["killed"]
        await one_request(stub, draw_plan(rng, info), record)
        if record.outcomes["killed"] > killed:  # the model is restarting: a client would back off too
            await asyncio.sleep(0.5)


# -- the server's processes and resources ------------------------------------------------------------------------------


def tree(server: LiveServer) -> list[psutil.Process]:
    try:
        root = psutil.Process(server.proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def role_of(process: psutil.Process) -> str:
    try:
        line = " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    return "engine" if ENGINE_MARK in line else "worker" if WORKER_MARK in line else "frontend"


def anon_mib(pid: int) -> float:
    """Resident anonymous memory (MiB): the heaps, which a leak grows. RSS also counts the pages of the rings (shared
    memory, resident once touched: RSS creeps up until each ring has wrapped once) and of libraries."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise psutil.NoSuchProcess(pid)


def snapshot(server: LiveServer, record: Record) -> dict[str, Any]:
    """RSS and anonymous memory (MiB) and open fds of the frontend, the engine and the workers (summed), with the
    engine's pid."""
    shot: dict[str, Any] = {"t": time.monotonic(), "requests": record.served}
    workers: list[tuple[float, float]] = []
    for process in tree(server):
        try:
            role, rss, fds = role_of(process), process.memory_info().rss / 2**20, process.num_fds()
            anon = anon_mib(process.pid)
        except (psutil.Error, OSError):
            continue
        record.pids.add(process.pid)
        if role == "worker":
            workers.append((rss, anon))
        elif role in ("frontend", "engine"):
            shot.update({f"{role}_rss_mib": rss, f"{role}_anon_mib": anon, f"{role}_fds": fds,
                         f"{role}_pid": process.pid})
    if workers:
        shot["workers_rss_mib"] = sum(rss for rss, _ in workers)
        shot["workers_anon_mib"] = sum(anon for _, anon in workers)
    return shot


def alive_server_process(pid: int) -> bool:
    """A RingServe process with this pid runs (a reused pid of another program does not count)."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and "ringserve" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def server_segments(pids: set[int]) -> list[str]:
    """Names in /dev/shm created by one of `pids`."""
    names = []
    for path in SHM.glob(f"{SEGMENT_PREFIX}*"):
        creator = path.name[len(SEGMENT_PREFIX):].split("-", 1)[0]
        if creator.isdigit() and int(creator) in pids:
            names.append(path.name)
    return names


def restarts_total(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("ringserve_engine_restarts_total{"))


async def health_latency(channel: grpc.aio.Channel) -> tuple[int, float]:
    start = time.monotonic()
    try:
        status = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)).status
    except grpc.aio.AioRpcError:
        status = -1
    return status, time.monotonic() - start


async def watch(server: LiveServer, channel: grpc.aio.Channel, record: Record, deadline: Deadline,
                every_s: float) -> None:
    """Samples the processes every `every_s` and health every second (its latency is part of the report)."""
    next_sample = 0.0
    while not deadline.passed():
        status, latency = await health_latency(channel)
        record.health_latency_max_s = max(record.health_latency_max_s, latency)
        record.pids.update(p.pid for p in await asyncio.to_thread(tree, server))  # whose segments to look for
        if time.monotonic() >= next_sample:
            shot = await asyncio.to_thread(snapshot, server, record)
            shot["serving"] = status == SERVING  # a replica that is loading is not measured
            record.samples.append(shot)
            next_sample = time.monotonic() + every_s
        await deadline.sleep(1.0)


async def chaos(server: LiveServer, channel: grpc.aio.Channel, rng: random.Random, record: Record, deadline: Deadline,
                interval_s: tuple[float, float]) -> None:
    """Kill a worker or the engine after a random while of serving; time the way back to SERVING."""
    while True:
        await deadline.sleep(rng.uniform(*interval_s))
        if deadline.passed():
            return
        victims = [p for p in tree(server) if role_of(p) in ("engine", "worker")]
        role = rng.choice(("engine", "worker"))
        targets = [p for p in victims if role_of(p) == role] or victims
        if not targets:
            continue
        target = rng.choice(targets)
        role = role_of(target)
        record.pids.update(p.pid for p in victims)
        window = [time.monotonic(), float("inf")]
        record.kill_windows.append(window)
        try:
            target.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            record.kill_windows.remove(window)
            continue
        record.kills[role] += 1
        progress(f"killed the {role} (pid {target.pid})")
        # The frontend hears of the death within a fraction of a second: until then health still says SERVING.
        noticed_by = time.monotonic() + 10.0
        while time.monotonic() < noticed_by:
            if (await health_latency(channel))[0] != SERVING:
                break
            await asyncio.sleep(0.02)
        while True:
            status, _ = await health_latency(channel)
            if status == SERVING:
                break
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
            await asyncio.sleep(0.1)
        window[1] = time.monotonic()
        record.pids.update(p.pid for p in tree(server))
        record.times_to_serving.append(window[1] - window[0])
        progress(f"SERVING again after {window[1] - window[0]:.1f} s")


async def idle_kv(stub: pb_grpc.GenerationStub, timeout_s: float) -> pb.EngineStats:
    """Stats once nothing runs or waits and every block is free (cached blocks count as free), or the last ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.GetEngineStats(pb.EngineStatsRequest(), timeout=10)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if (idle and stats.free_kv_blocks == stats.total_kv_blocks) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


# -- the figures -------------------------------------------------------------------------------------------------------


def growth(samples: list[dict[str, Any]], key: str, pid_key: str | None) -> dict[str, Any]:
    """`key` at the start, after warm-up and at the end, and its growth per 1,000 served requests from warm-up to
    the end. Warm-up is the first fifth of the requests (allocator pools, caches, the KV cache's pages touched for
    the first time). Only samples taken while the model served count. For processes that a kill replaces (the engine
    and workers), over the samples of the replica that served the most requests."""
    usable = [s for s in samples if key in s and s.get("serving", True)]
    if pid_key is not None and usable:
        by_pid: dict[int, list[dict[str, Any]]] = {}
        for s in usable:
            by_pid.setdefault(s.get(pid_key, 0), []).append(s)
        usable = max(by_pid.values(), key=lambda run: run[-1]["requests"] - run[0]["requests"])
    if len(usable) < 3:
        return {"start": None, "after_warmup": None, "end": None, "requests_measured": 0,
                "growth_mib_per_1k_requests": None}
    first, end = usable[0], usable[-1]
    warm_at = first["requests"] + (end["requests"] - first["requests"]) / 5
    warm = next(s for s in usable[1:] if s["requests"] >= warm_at)
    served = end["requests"] - warm["requests"]
    per_1k = (end[key] - warm[key]) / served * 1000 if served > 0 else None
    return {"start": round(first[key], 1), "after_warmup": round(warm[key], 1), "end": round(end[key], 1),
            "requests_measured": served, "growth_mib_per_1k_requests": None if per_1k is None else round(per_1k, 3)}


def first_last(samples: list[dict[str, Any]], key: str) -> dict[str, Any]:
    usable = [s[key] for s in samples if key in s]
    return {"start": usable[0], "end": usable[-1]} if usable else {"start": None, "end": None}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    record = Record()
    metrics_port = free_port()
    flags = ["--worker-threads", "1", "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs",
             str(args.max_num_seqs), "--max-num-batched-tokens", "256", "--max-waiting-requests", "256",
             "--metrics-port", str(metrics_port), "--max-restarts", "100000", "--restart-window", "60"]
    with tempfile.TemporaryDirectory(prefix="ringserve-soak-") as log_dir, \
            live_server(Path(args.model), Path(log_dir), *flags) as server:
        await asyncio.to_thread(server.wait_serving, 600)
        record.pids.update(p.pid for p in tree(server))
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            info = await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
            progress(f"serving {info.model}; {args.duration:.0f} s of traffic from {args.concurrency} clients"
                     f"{', with chaos' if args.chaos else ''}")
            started = time.monotonic()
            deadline = Deadline(args.duration)
            main = asyncio.current_task()
            assert main is not None
            for signum in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(signum, deadline.on_signal, main)
            tasks = [asyncio.create_task(client(stub, info, random.Random(rng.getrandbits(64)), record, deadline))
                     for _ in range(args.concurrency)]
            tasks.append(asyncio.create_task(watch(server, channel, record, deadline, args.sample_every)))
            if args.chaos:
                tasks.append(asyncio.create_task(
                    chaos(server, channel, random.Random(rng.getrandbits(64)), record, deadline,
                          (args.kill_after_min, args.kill_after_max))))
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - started
            stats = await idle_kv(stub, 60.0)
            record.samples.append(await asyncio.to_thread(snapshot, server, record))
            restarts = await asyncio.to_thread(restarts_total, metrics_port)
        shm_serving = server_segments(record.pids)
        server.proc.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(server.proc.wait, 60)
        await asyncio.sleep(2.0)  # the engine and workers exit after the frontend
        shm_left = server_segments(record.pids)
        left = [pid for pid in sorted(record.pids) if alive_server_process(pid)]
    unexpected = record.outcomes["unexpected"]
    leaked_blocks = stats.total_kv_blocks - stats.free_kv_blocks
    result: dict[str, Any] = {
        "duration_s": round(elapsed, 1),
        "interrupted": deadline.stopped.is_set(),
        "chaos": args.chaos,
        "concurrency": args.concurrency,
        "requests": record.finished,
        "requests_completed": record.outcomes["completed"],
        "outcomes": dict(record.outcomes),
        "errors_by_status": dict(record.errors_by_status),
        "unexpected_errors": unexpected,
        "unexpected_samples": record.unexpected,
        "kills": dict(record.kills),
        "restarts": restarts,
        "mean_time_to_serving_s": round(statistics.mean(record.times_to_serving), 2) if record.times_to_serving
        else None,
        "times_to_serving_s": [round(t, 2) for t in record.times_to_serving],
        "frontend_rss_mib": growth(record.samples, "frontend_rss_mib", None),
        "engine_rss_mib": growth(record.samples, "engine_rss_mib", "engine_pid"),
        "workers_rss_mib": growth(record.samples, "workers_rss_mib", "engine_pid"),
        "frontend_anon_mib": growth(record.samples, "frontend_anon_mib", None),
        "engine_anon_mib": growth(record.samples, "engine_anon_mib", "engine_pid"),
        "workers_anon_mib": growth(record.samples, "workers_anon_mib", "engine_pid"),
        "open_fds": {"frontend": first_last(record.samples, "frontend_fds"),
                     "engine": first_last(record.samples, "engine_fds")},
        "kv_blocks": {"total": stats.total_kv_blocks, "free_idle": stats.free_kv_blocks},
        "shm_segments": {"serving": len(shm_serving), "after_stop": len(shm_left), "left": shm_left},
        "processes_left": left,
        "server_exit_code": exit_code,
        "health_latency_max_s": round(record.health_latency_max_s, 3),
    }
    result["leaked"] = bool(leaked_blocks or shm_serving or shm_left or left)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default %(default)s)")
    parser.add_argument("--chaos", action="store_true", help="kill a worker or the engine at random intervals")
    parser.add_argument("--quick", action="store_true", help="a short run: 90 s, a kill after 30-40 s of serving")
    parser.add_argument("--model", default="", help="a .gguf file or Hugging Face folder (default: the embedded model)")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending requests (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the server's --max-num-seqs")
    parser.add_argument("--num-kv-blocks", type=int, default=256, help="the server's --num-kv-blocks")
    parser.add_argument("--kill-after-min", type=float, default=20.0, help="least seconds of serving before a kill")
    parser.add_argument("--kill-after-max", type=float, default=90.0, help="most seconds of serving before a kill")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between resource samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.duration = min(args.duration, 90.0)
        args.kill_after_min, args.kill_after_max, args.sample_every = 30.0, 40.0, 3.0
    args.model = args.model or str(embedded_model_path())
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    return 1 if result["unexpected_errors"] or result["leaked"] else 0


if __name__ == "__main__":
    sys.exit(main())
