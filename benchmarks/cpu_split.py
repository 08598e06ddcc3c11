"""Where a served token's CPU time goes: per process and per thread (frontend, engine, worker main thread, its
OpenMP and native-pool helpers, the benchmark client), at each `--worker-threads` count, in alternating rounds.

    python benchmarks/cpu_split.py [--quick] [--threads 1,2] [--rounds 2] [--model PATH] [--server-arg=--flag=value]

It starts one RingServe server per thread count (and per --variant: the same with more environment variables), all at
once (an idle server uses no CPU), then per round runs the peers workload (benchmarks/peers.py: 64 chat prompts x 64
tokens offline, one 128-token stream, a 1,024-token prompt's first token) on each server in turn, the order rotating.
Around every run it reads each thread's CPU time and run-queue wait (/proc/PID/task/TID/schedstat: time on a CPU,
time runnable but not running) and context switches (/proc/PID/task/TID/status). CPU time and waits per 1,000
generated tokens are robust to other load on the machine; the tokens/s figures are not (compare servers within one
run, and read `loadavg_1m`).

Worker threads are grouped by role: `main` (the thread that runs the model), `pool` (the native kernels' helpers,
named ringserve-pool), `omp` (PyTorch's intra-op OpenMP threads: the worker's other threads named like its main
thread) and `other` (anything else: gloo, Python's). Last line: one JSON object, `by_threads` -> server -> workload
-> the tokens/s (or TTFT) median and per process/role the median CPU ms, run-queue wait ms and context switches per
1,000 tokens (the TTFT run: per prompt), and per server the worker's OpenMP wait settings (`worker_openmp_env`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from peers import RingServe, log, make_workload
from ringserve.frontend.api.security import ChannelSecurity, open_aio_channel
from ringserve.frontend.model_source import embedded_model_path
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from serve import server_for

KINDS = ("offline", "single", "ttft")


def thread_counters(pid: int) -> dict[int, tuple[str, float, float, int, int]]:
    """tid -> (name, CPU s, run-queue wait s, voluntary switches, involuntary switches) of every thread of `pid`."""
    out: dict[int, tuple[str, float, float, int, int]] = {}
    task = Path(f"/proc/{pid}/task")
    for entry in task.iterdir() if task.exists() else []:
        try:
            stat = (entry / "stat").read_text()
            sched = (entry / "schedstat").read_text().split()
            status = (entry / "status").read_text().splitlines()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        switches = {k: int(v) for k, v in (line.split(":\t") for line in status if "ctxt_switches" in line)}
        out[int(entry.name)] = (name, int(sched[0]) / 1e9, int(sched[1]) / 1e9, switches["voluntary_ctxt_switches"],
                                switches["nonvoluntary_ctxt_switches"])  # fmt: skip
    return out


class Processes:
    """The processes of one server (frontend, engine, worker) and this client, by role."""

    def __init__(self, frontend_pid: int) -> None:
        root = psutil.Process(frontend_pid)
        self.pids = {"frontend": frontend_pid, "client": os.getpid()}
        for child in root.children(recursive=True):
            cmdline = " ".join(child.cmdline())
            if "engine_main" in cmdline:
                self.pids["engine"] = child.pid
            elif "worker_main" in cmdline:
                self.pids["worker"] = child.pid

    def worker_openmp_env(self) -> dict[str, str]:
        """The OpenMP wait settings in the worker's environment (what its libgomp read when torch loaded it)."""
        raw = Path(f"/proc/{self.pids['worker']}/environ").read_bytes().split(b"\0")
        pairs = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        return {k: v for k, v in pairs.items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def snapshot(self) -> dict[str, dict[int, tuple[str, float, float, int, int]]]:
        return {role: thread_counters(pid) for role, pid in self.pids.items()}

    def role_of(self, role: str, tid: int, name: str) -> str:
        if role != "worker":
            return role
        pid = self.pids["worker"]
        if tid == pid:
            return "worker.main"
        if name == "ringserve-pool":
            return "worker.pool"
        main_name = thread_counters(pid).get(pid, ("",))[0]
        return "worker.omp" if name == main_name else "worker.other"

    def difference(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[float]]:
        """role -> [CPU s, run-queue wait s, voluntary switches, involuntary switches, threads] between snapshots."""
        totals: dict[str, list[float]] = {}
        for role, threads in after.items():
            for tid, (name, cpu, wait, vol, invol) in threads.items():
                _, cpu0, wait0, vol0, invol0 = before.get(role, {}).get(tid, (name, 0.0, 0.0, 0, 0))
                row = totals.setdefault(self.role_of(role, tid, name), [0.0, 0.0, 0, 0, 0])
                row[0] += cpu - cpu0
                row[1] += wait - wait0
                row[2] += vol - vol0
                row[3] += invol - invol0
                row[4] += 1 if cpu > cpu0 else 0
        return totals


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else embedded_model_path()
    workload = make_workload(model, args)
    load_before = os.getloadavg()[0]
    configs = [(t, env, f"{t}" + "".join(f" {k}={v}" for k, v in env.items()))
               for t in args.threads for env in [{}, *args.variant]]  # fmt: skip
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {label: {k: [] for k in KINDS} for _, _, label in configs}
    worker_env: dict[str, dict[str, str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        servers: dict[str, tuple[RingServe, Processes]] = {}
        for threads, env, label in configs:
            serve_args = argparse.Namespace(
                target="", model=str(model), dtype=args.dtype, max_num_seqs=max(args.num_prompts, 8),
                concurrency=args.num_prompts, num_kv_blocks=0, api=["ringserve"], server_start_timeout=600.0,
                server_arg=["--worker-threads", str(threads), *args.server_arg])  # fmt: skip
            saved = dict(os.environ)
            os.environ.update(env)  # the server's environment is this one's when it starts
            try:
                target = await stack.enter_async_context(server_for(serve_args, ChannelSecurity()))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            channel = await stack.enter_async_context(open_aio_channel(target.address, ChannelSecurity()))
            assert target.pid is not None
            servers[label] = (RingServe(pb_grpc.GenerationStub(channel)), Processes(target.pid))
            worker_env[label] = servers[label][1].worker_openmp_env()
            await servers[label][0].offline(workload.chat[:4], 4, "warmup")  # warm-up, not measured
            await servers[label][0].ttft(workload.long[:64], "warmup")
        labels = list(servers)
        for round_index in range(args.rounds):
            order = labels[round_index % len(labels) :] + labels[: round_index % len(labels)]
            for label in order:
                engine, processes = servers[label]
                log(f"round {round_index + 1}/{args.rounds}: --worker-threads {label}")
                salt = f"split-{label}-{round_index}"
                for kind in KINDS:
                    before = processes.snapshot()
                    start = time.perf_counter()
                    if kind == "offline":
                        result = await engine.offline(workload.chat, workload.output_len, salt)
                    elif kind == "single":
                        result = await engine.single(workload.single, workload.single_len, salt + "-single")
                    else:
                        result = await engine.ttft(workload.long_prompt(round_index), salt + "-1k")
                        result["tokens"] = 1
                    wall = time.perf_counter() - start
                    roles = processes.difference(before, processes.snapshot())
                    samples[label][kind].append({"wall_s": wall, "tokens": result["tokens"], "roles": roles,
                                                 "result": result})  # fmt: skip
    return {"benchmark": "cpu_split", "model": str(model), "dtype": args.dtype, "server_args": args.server_arg,
            "by_threads": {label: {**summarize(runs), "worker_openmp_env": worker_env[label]}
                           for label, runs in samples.items()},
            "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
            "cpu_count": os.cpu_count()}  # fmt: skip


def summarize(kinds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, runs in kinds.items():
        per = 1000.0 if kind != "ttft" else 1.0  # per 1,000 tokens; the TTFT run per prompt
        entry: dict[str, Any] = {}
        if kind == "ttft":
            entry["ttft_ms"] = round(statistics.median(r["result"]["ttft_s"] * 1e3 for r in runs), 1)
        else:
            entry["tok_s"] = round(statistics.median(r["result"]["tokens"] / r["result"]["elapsed_s"] for r in runs), 2)
        entry["wall_ms_per_unit"] = round(statistics.median(r["wall_s"] * 1e3 * per / r["tokens"] for r in runs), 1)
        roles = sorted({role for r in runs for role in r["roles"]})
        table = {}
        for role in roles:
            rows = [(r["roles"].get(role, [0.0, 0.0, 0, 0, 0]), r["tokens"]) for r in runs]
            table[role] = {
                "cpu_ms": round(statistics.median(row[0] * 1e3 * per / t for row, t in rows), 1),
                "runq_wait_ms": round(statistics.median(row[1] * 1e3 * per / t for row, t in rows), 1),
                "vol_switches": round(statistics.median(row[2] * per / t for row, t in rows), 1),
                "invol_switches": round(statistics.median(row[3] * per / t for row, t in rows), 1),
                "threads": max(row[4] for row, _ in rows),
            }
        entry["per_1k_tokens" if kind != "ttft" else "per_prompt"] = table
        out[kind] = entry
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="8 x 16 tokens offline, a 32-token stream, a 256-token "
                        "prompt, one round")  # fmt: skip
    parser.add_argument("--threads", default="1,2", help="--worker-threads counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--ttft-len", type=int, default=1024)
    parser.add_argument("--model", default="", help="the GGUF file or HF folder (default: the embedded model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--server-arg", action="append", default=[], help="a further server flag (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also run a server at each thread count with these environment variables (repeatable)")
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    if not args.threads or min(args.threads) < 1 or args.rounds < 1:
        parser.error("--threads needs counts >= 1 and --rounds >= 1")
    try:
        args.variant = [dict(item.split("=", 1) for item in v.split(",")) for v in args.variant]
    except ValueError:
        parser.error("--variant takes KEY=VALUE pairs, comma-separated")
    if args.quick:
        args.num_prompts, args.output_len = min(args.num_prompts, 8), min(args.output_len, 16)
        args.single_len, args.ttft_len, args.rounds = min(args.single_len, 32), min(args.ttft_len, 256), 1
    return args


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(asyncio.run(run(parse_args(argv)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
