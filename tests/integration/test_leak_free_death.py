"""Whoever dies, nothing is left behind: no shared-memory segment, no KV peer-info folder, no process.

Ring segments lose their names as soon as every peer has attached them, so a serving server has none in /dev/shm;
what must keep a name (a disaggregated worker's KV region, which peers open later) is removed by the surviving
processes when its owner dies."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
import pytest
from ringserve.formats.segments import KV_INFO_DIR_PREFIX
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, start_server

SETTLE_S = 10.0  # how long the survivors get to clean up (it takes well under a second on a quiet machine)


def segments_of(pids: set[int]) -> set[str]:
    """The /dev/shm segments these pids created (every RingServe segment name starts `ringserve-<pid>-`)."""
    found = set()
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if parts[0] == "ringserve" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) in pids:
            found.add(name)
    return found


def kv_info_dirs_of(pid: int) -> list[str]:
    prefix = f"{KV_INFO_DIR_PREFIX}{pid}-"
    return [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(prefix)]


def server_tree(server: RunningServer) -> list[psutil.Process]:
    frontend = psutil.Process(server.proc.pid)
    return [frontend, *frontend.children(recursive=True)]


def victim_of(tree: list[psutil.Process], victim: str) -> psutil.Process:
    if victim == "frontend":
        return tree[0]
    return next(p for p in tree if any(victim in part for part in p.cmdline()))


def eventually(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if not check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} after {SETTLE_S}s: {check()}")


def long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="Once upon a time",
                              sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("victim", ["frontend", "engine_main", "worker_main"])
def test_a_killed_process_leaves_no_segment_and_no_process(model_path: Path, tmp_path: Path, victim: str) -> None:
    with start_server(model_path, tmp_path, "--num-kv-blocks", "256") as server:
        stream = server.stub().Generate(long_request(), timeout=120)
        next(stream)  # mid-stream: the request holds KV blocks and the engine is stepping
        tree = server_tree(server)
        pids = {p.pid for p in tree}
        assert len(tree) == 3
        # Serving, with every ring mapped by both its ends: no ring has a name that could outlive its processes.
        assert segments_of(pids) == set()
        killed = victim_of(tree, victim)
        killed.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The frontend's death takes the engine and its workers down (PR_SET_PDEATHSIG); an engine's takes its
        # workers; a worker's fails its engine, which stops the other ranks and exits.
        doomed = tree if victim == "frontend" else tree[1:]
        _gone, alive = psutil.wait_procs(doomed, timeout=SETTLE_S)
        assert not alive, f"still running after the {victim} died: {alive}"
        # (A frontend that lives on starts a new replica, whose rings it names; those are not leftovers.)
        assert segments_of({p.pid for p in doomed}) == set()


@pytest.mark.parametrize("victim", ["frontend", "worker_main"])
def test_a_killed_prefill_server_process_leaves_no_kv_region_and_no_peer_info_folder(
    model_path: Path, tmp_path: Path, victim: str
) -> None:
    with start_server(model_path, tmp_path, "--role", "prefill", "--kv-transfer", "shm",
                      "--num-kv-blocks", "64") as server:  # fmt: skip
        tree = server_tree(server)
        pids = {p.pid for p in tree}
        worker = victim_of(tree, "worker_main")
        # The KV region keeps its name while serving (a decode server opens it later); the peer infos are a folder.
        assert {name.split("-")[1] for name in segments_of(pids)} == {str(worker.pid)}
        assert len(kv_info_dirs_of(server.proc.pid)) == 1
        victim_of(tree, victim).send_signal(signal.SIGKILL)
        doomed = tree if victim == "frontend" else tree[1:]
        _gone, alive = psutil.wait_procs(doomed, timeout=SETTLE_S)
        assert not alive, f"still running after the {victim} died: {alive}"
        eventually(lambda: segments_of({p.pid for p in doomed}), f"segments left after the {victim} died")
        if victim != "frontend":
            server.stop()  # the frontend outlives its engine; it removes its folder when it stops
        eventually(lambda: kv_info_dirs_of(server.proc.pid), f"KV peer-info folder left after the {victim} died")
