"""KV connector between real processes: shared-memory and NIXL backends, handshake checks, a dead source."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ringserve.workers.kv_connector import (
    KvConnector,
    KvHandshakeError,
    KvPeerInfo,
    KvRegion,
    KvTransferError,
    check_compatible,
)

SOURCE = Path(__file__).with_name("kv_source.py")
LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None or importlib.util.find_spec("nixl") is not None
BACKENDS = ["shm", pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="nixl is not installed"))]


def nixl_env() -> dict[str, str]:
    env = dict(os.environ)
    if ctypes.util.find_library("ibverbs"):
        env["UCX_MODULES"] = "^ib"  # NIXL processes crash at exit with the ib module loaded and no RDMA device
    return env


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if ctypes.util.find_library("ibverbs"):
        monkeypatch.setenv("UCX_MODULES", "^ib")


class Source:
    def __init__(self, backend: str, num_blocks: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SOURCE), backend, str(num_blocks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=nixl_env(), text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = ""
        while not line.startswith("KVINFO "):
            line = self.proc.stdout.readline()
            assert line, "the KV source exited before publishing its info"
        self.info = bytes.fromhex(line.split()[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def make_source() -> Iterator:
    started: list[Source] = []

    def make(backend: str, num_blocks: int = 12) -> Source:
        s = Source(backend, num_blocks)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def local_connector(backend: str, num_blocks: int = 10, model_id: str = "test-model") -> KvConnector:
    return KvConnector(backend, KvRegion(LAYERS, num_blocks, BLOCK, HEADS, DIM, torch.float32, role="kvtest"),
                       model_id=model_id)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_pull_copies_exactly_the_named_blocks(backend: str, make_source) -> None:
    source = make_source(backend)
    conn = local_connector(backend)
    try:
        remote, local = [7, 0, 11, 3], [2, 9, 4, 5]
        conn.pull(source.info, remote, local)
        for t, tensor in enumerate(conn.region.tensors):
            for r, lo in zip(remote, local, strict=True):
                assert torch.all(tensor[lo] == t * 1000 + r), (t, r, lo)
            untouched = sorted(set(range(10)) - set(local))
            assert torch.all(tensor[untouched] == 0)
        assert conn.bytes_pulled == 2 * LAYERS * len(local) * conn.region.block_bytes
        conn.pull(source.info, [1], [0])  # the peer's connection / descriptors are reused
        assert torch.all(conn.region.tensors[3][0] == 3001)
    finally:
        conn.close()


def test_peer_info_round_trips_and_rejects_garbage() -> None:
    conn = local_connector("shm")
    try:
        assert KvPeerInfo.decode(conn.info.encode()) == conn.info
        with pytest.raises(KvHandshakeError, match=r"truncated|shorter"):
            KvPeerInfo.decode(conn.info.encode()[:-3])
        with pytest.raises(KvHandshakeError, match="magic"):
            KvPeerInfo.decode(b"XXXX" + conn.info.encode()[4:])
    finally:
        conn.close()


def test_handshake_names_what_differs() -> None:
    conn = local_connector("shm")
    try:
        info = conn.info
        check_compatible(info, info)
        with pytest.raises(KvHandshakeError, match="model: source 'other'"):
            check_compatible(info, replace(info, model_id="other"))
        with pytest.raises(KvHandshakeError, match=r"block size.*head dim|head dim"):
            check_compatible(info, replace(info, block_size=16, head_dim=4))
        with pytest.raises(KvHandshakeError, match="KV dtype"):
            check_compatible(info, replace(info, dtype="bfloat16"))
        with pytest.raises(KvHandshakeError, match=r"tensor-parallel sizes differ.*TP=2.*TP=1"):
            check_compatible(info, replace(info, tp_size=2))
        with pytest.raises(KvHandshakeError):
            conn.pull(replace(info, num_layers=3).encode(), [0], [0])
    finally:
        conn.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_source_is_a_transfer_error(backend: str, make_source) -> None:
    source = make_source(backend)
    conn = local_connector(backend)
    try:
        source.proc.kill()
        source.proc.wait()
        if backend == "shm":
            os.unlink(f"/dev/shm/{KvPeerInfo.decode(source.info).shm_name}")  # what reclaim_stale_segments does
        with pytest.raises(KvTransferError):
            conn.pull(source.info, [0, 1], [0, 1], timeout_s=5.0)
    finally:
        conn.close()


def test_region_is_unlinked_on_close() -> None:
    conn = local_connector("shm")
    path = Path("/dev/shm") / conn.region.shm_name
    assert path.exists()
    conn.close()
    assert not path.exists()
