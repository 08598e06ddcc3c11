"""Process architecture: the processes `ringserve serve` starts and a clean stop (idle cost: test_idle_cpu.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from server_harness import RunningServer, start_server


def ringserve_segments(pids: set[int]) -> list[str]:
    owned = [(n, n.split("-")[1]) for n in os.listdir("/dev/shm") if n.startswith("ringserve-")]
    return [n for n, pid in owned if pid.isdigit() and int(pid) in pids]  # (skips e.g. C++ tests' ringserve-test-*)


def server_tree(server: RunningServer) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root, *root.children(recursive=True)]


def test_serve_runs_frontend_engine_and_worker_processes_and_sigterm_removes_them(
    model_path: Path, tmp_path: Path
) -> None:
    with start_server(model_path, tmp_path, "--num-kv-blocks", "64") as server:
        tree = server_tree(server)
        cmdlines = [" ".join(p.cmdline()) for p in tree]
        assert any("ringserve.backend.engine_main" in c for c in cmdlines), cmdlines
        assert any("ringserve.workers.worker_main" in c for c in cmdlines), cmdlines
        pids = {p.pid for p in tree}
        # Every ring is attached by both its ends, so none keeps a name that could outlive its processes.
        assert ringserve_segments(pids) == [], os.listdir("/dev/shm")

        # (the idle-CPU bound of these processes: test_idle_cpu.py)
        assert server.stop() == 0, server.log()
        _gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"processes left running: {alive}"
        assert ringserve_segments(pids) == [], "shared-memory segments left behind"


def test_generate_command_streams_a_chat_answer(server: RunningServer) -> None:
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "generate", "--host", "127.0.0.1",
           "--port", str(server.port), "--stream", "--max-tokens", "12", "--temperature", "0",
           "Why is the sky blue?"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip()) > 0

    raw = subprocess.run([*cmd[:-1], "--raw", "The capital of France is"], capture_output=True, text=True, timeout=120)
    assert raw.returncode == 0, raw.stderr
    assert "Paris" in raw.stdout


def test_generate_command_reports_an_unreachable_server(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "generate", "--port", "1", "--max-tokens", "2", "hi"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "UNAVAILABLE" in out.stderr


def test_sigkill_of_every_process_at_once_leaves_no_segment_and_the_next_start_serves(
    model_path: Path, tmp_path: Path
) -> None:
    with start_server(model_path, tmp_path, "--num-kv-blocks", "64") as first:
        tree = server_tree(first)
        pids = {p.pid for p in tree}
        for p in tree:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(tree, timeout=10)
    assert ringserve_segments(pids) == [], "the killed server left segments behind"
    with start_server(model_path, tmp_path, "--num-kv-blocks", "64") as second:
        assert second.stop() == 0
