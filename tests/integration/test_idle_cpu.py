"""An idle server costs (almost) nothing: after serving a request, all of its processes together (frontend, engine,
workers) use under 1% of one core over 10 s. Nothing busy-spins or polls fast: waiters sleep on futexes and fds."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
from ringserve.v1 import generation_pb2 as pb
from server_harness import free_port, start_server

IDLE_WINDOW_S = 10.0
MAX_IDLE_CPU_S = 0.01 * IDLE_WINDOW_S  # 1% of one core


def cpu_seconds(procs: list[psutil.Process]) -> dict[str, float]:
    used = {}
    for p in procs:
        times = p.cpu_times()
        used[f"{p.pid} {' '.join(p.cmdline()[1:4])}"] = times.user + times.system
    return used


def test_an_idle_server_uses_under_one_percent_of_a_core(model_path: Path, tmp_path: Path) -> None:
    # Prometheus metrics on: its periodic engine-stats query is the one timer an idle server keeps running.
    with start_server(model_path, tmp_path, "--num-kv-blocks", "64", "--metrics-port", str(free_port())) as server:
        request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))
        assert list(server.stub().Generate(request, timeout=120)), "the warm-up request produced nothing"
        root = psutil.Process(server.proc.pid)
        tree = [root, *root.children(recursive=True)]
        time.sleep(1.0)  # the engine's last stats record and every waiter's spin phase are over well before this
        before = cpu_seconds(tree)
        time.sleep(IDLE_WINDOW_S)
        after = cpu_seconds(tree)
        used = {name: after[name] - before[name] for name in before}
        assert sum(used.values()) < MAX_IDLE_CPU_S, f"idle CPU seconds over {IDLE_WINDOW_S:.0f} s: {used}"
        assert server.stop() == 0, server.log()
