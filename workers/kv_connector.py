"""KV connector: moves computed KV blocks from a prefill worker's cache into a decode worker's cache (DESIGN.md §8).

One interface, two backends:
- `shm`: same host. The KV region lives in a POSIX shared-memory segment; a peer maps it read-only by name and
  copies the blocks it needs (one gather per K/V tensor).
- `nixl`: NIXL over UCX (RDMA / GPUDirect where present, TCP or shared memory elsewhere). The region is registered
  once at start-up, descriptor lists of every block are prepared once per peer, and a pull is one batched READ.

Worker side: `KvRegion` owns the KV memory (every K and V tensor of every layer is a view into it), `KvConnector`
registers it, publishes a `KvPeerInfo` (a defined binary layout, never pickle) and pulls remote blocks.
Region layout: tensor t = 2 * layer + (0 for K, 1 for V) at byte offset t * num_blocks * block_bytes; block j of
tensor t at + j * block_bytes (a block is contiguous: [block_size, kv_heads, head_dim]).

The handshake (`check_compatible`) refuses peers whose model, dtype, block size, layer count, KV heads, head dim or
tensor-parallel layout differ, with a message naming what differs.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from ringserve.formats.kv_peer import (
    BACKEND_NAMES,
    KvHandshakeError,
    KvPeerInfo,
    KvTransferError,
    check_compatible,
    pack_peer_infos,
    unpack_peer_infos,
)

__all__ = [
    "BACKEND_NAMES", "KvConnector", "KvHandshakeError", "KvPeerInfo", "KvRegion", "KvTransferError",
    "check_compatible", "pack_peer_infos", "unpack_peer_infos",
]  # fmt: skip

class KvRegion:
    """The KV cache memory of one worker rank in a shared-memory segment, created zero-filled, unlinked on close."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, role: str = "kv0") -> None:  # fmt: skip
        self.shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_bytes = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.region_bytes = 2 * num_layers * num_blocks * self.block_bytes
        # The naming rule of every RingServe segment, so reclaim_stale_segments() also cleans up after a crash.
        self.shm_name = f"ringserve-{os.getpid()}-{secrets.token_hex(8)}-{role}"
        fd = os.open(f"/dev/shm/{self.shm_name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.region_bytes)
            # MAP_POPULATE: the pages are allocated now, not on first touch. Faulting in fresh zero pages made the
            # first pull into a block about 4x slower than the copy itself (67 ms against 19 ms for 90 MiB here).
            self._mmap = mmap.mmap(fd, self.region_bytes, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                   mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        except BaseException:
            os.unlink(f"/dev/shm/{self.shm_name}")
            raise
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.base_address = self.bytes.data_ptr()
        per_tensor = num_blocks * self.block_bytes
        self.tensors = [
            self.bytes[t * per_tensor : (t + 1) * per_tensor].view(dtype).view(self.shape)
            for t in range(2 * num_layers)
        ]
        # [tensor, block, bytes] view used by the shm backend's gathers
        self.blocks = self.bytes.view(2 * num_layers, num_blocks, self.block_bytes)

    @property
    def k(self) -> list[torch.Tensor]:
        return self.tensors[0::2]

    @property
    def v(self) -> list[torch.Tensor]:
        return self.tensors[1::2]

    def unlink(self) -> None:
        try:
            os.unlink(f"/dev/shm/{self.shm_name}")
        except FileNotFoundError:
            pass


class _Backend(Protocol):
    def info_fields(self) -> dict[str, Any]: ...

    def pull(self, peer: KvPeerInfo, remote_blocks: np.ndarray, local_blocks: np.ndarray, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class _ShmBackend:
    """Maps each peer's segment read-only once and gathers the requested blocks into the local region."""

    def __init__(self, region: KvRegion) -> None:
        self.region = region
        self._peers: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def info_fields(self) -> dict[str, Any]:
        return {"shm_name": self.region.shm_name}

    def _map(self, peer: KvPeerInfo) -> np.ndarray:
        cached = self._peers.get(peer.shm_name)
        if cached is not None:
            return cached[1]
        try:
            fd = os.open(f"/dev/shm/{peer.shm_name}", os.O_RDONLY)
        except OSError as exc:
            raise KvTransferError(f"cannot open the KV segment {peer.shm_name}: {exc}") from exc
        try:
            if os.fstat(fd).st_size != peer.region_bytes:
                raise KvTransferError(f"KV segment {peer.shm_name} is not {peer.region_bytes} bytes")
            mm = mmap.mmap(fd, peer.region_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        view = np.frombuffer(mm, np.uint8).reshape(2 * peer.num_layers, peer.num_blocks, peer.block_bytes)
        self._peers[peer.shm_name] = (mm, view)
        return view

    def pull(self, peer: KvPeerInfo, remote_blocks: np.ndarray, local_blocks: np.ndarray, timeout_s: float) -> None:
        remote = self._map(peer)
        local = self.region.blocks.numpy()
        # A prompt's blocks are mostly consecutive on both sides: copy each run of them as one slice per tensor
        # (a strided memcpy) instead of a fancy-indexed gather, which would build a temporary of the whole pull.
        breaks = np.flatnonzero((np.diff(remote_blocks) != 1) | (np.diff(local_blocks) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(remote_blocks)]))
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            r, lo, n = int(remote_blocks[s]), int(local_blocks[s]), e - s
            local[:, lo : lo + n] = remote[:, r : r + n]

    def close(self) -> None:
        self._peers.clear()  # the mmaps unmap when their views are gone


@dataclass
class _NixlPeer:
    name: str
    remote_dlist: Any


@dataclass
class _NixlBackend:
    """NIXL over UCX: register the region once, prepare local and per-peer block descriptor lists once, then each
    pull is one READ of all (tensor, block) pairs, polled to completion."""

    region: KvRegion
    agent: Any = None
    local_dlist: Any = None
    _peers: dict[str, _NixlPeer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            from nixl_cu12 import _api
        except ImportError:
            try:
                from nixl import _api  # type: ignore[no-redef]
            except ImportError as exc:
                raise RuntimeError("the NIXL KV backend needs the nixl (or nixl-cu12) package") from exc
        self.name = f"ringserve-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = _nixl_agent_with_progress_delay(_api, self.name, _PROGRESS_DELAY_US)
        r = self.region
        self.agent.register_memory([(r.base_address, r.region_bytes, 0, "")], "DRAM")
        self.local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_descs(r.base_address, r), "DRAM")

    def info_fields(self) -> dict[str, Any]:
        return {"agent_name": self.name, "agent_metadata": self.agent.get_agent_metadata()}

    def _peer(self, peer: KvPeerInfo) -> _NixlPeer:
        known = self._peers.get(peer.agent_name)
        if known is not None:
            return known
        try:
            name = self.agent.add_remote_agent(peer.agent_metadata)
            descs = _block_descs(peer.base_address, peer)
            known = _NixlPeer(name, self.agent.prep_xfer_dlist(name, descs, "DRAM"))
        except Exception as exc:
            raise KvTransferError(f"NIXL could not connect to KV source {peer.agent_name}: {exc}") from exc
        self._peers[peer.agent_name] = known
        return known

    def forget(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is not None:
            try:
                self.agent.release_dlist_handle(peer.remote_dlist)
                self.agent.remove_remote_agent(peer.name)
            except Exception:
                pass

    def pull(self, peer: KvPeerInfo, remote_blocks: np.ndarray, local_blocks: np.ndarray, timeout_s: float) -> None:
        p = self._peer(peer)
        tensors = np.arange(2 * self.region.num_layers, dtype=np.int64)[:, None]
        local_idx = (tensors * self.region.num_blocks + local_blocks[None, :]).astype(np.int32).reshape(-1)
        remote_idx = (tensors * peer.num_blocks + remote_blocks[None, :]).astype(np.int32).reshape(-1)
        handle = None
        try:
            handle = self.agent.make_prepped_xfer("READ", self.local_dlist, local_idx, p.remote_dlist, remote_idx)
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KvTransferError(f"NIXL READ from {peer.agent_name} timed out after {timeout_s} s")
                time.sleep(0)  # the UCX progress thread moves the data; yield the core to it
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise KvTransferError(f"NIXL READ from {peer.agent_name} failed ({state})")
        except KvTransferError:
            self.forget(peer.agent_name)
            raise
        except Exception as exc:
            self.forget(peer.agent_name)
            raise KvTransferError(f"NIXL READ from {peer.agent_name} failed: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    pass  # a handle of a failed transfer may refuse release; the agent frees it at exit

    def close(self) -> None:
        for name in list(self._peers):
            self.forget(name)
        if self.local_dlist is not None:
            self.agent.release_dlist_handle(self.local_dlist)
            self.local_dlist = None


# The UCX progress thread must run on both sides (over TCP a READ is served by the source's thread), but the Python
# wrapper starts it with no delay between polls: a spinning core per worker, which on a CPU-only box takes a core
# from the forward pass. Between polls it now sleeps this long (RINGSERVE_NIXL_PROGRESS_DELAY_US overrides; 0 = spin).
_PROGRESS_DELAY_US = int(os.environ.get("RINGSERVE_NIXL_PROGRESS_DELAY_US", "200"))


def _nixl_agent_with_progress_delay(api: Any, name: str, delay_us: int) -> Any:
    """`nixl_agent(name, UCX)`, its progress thread sleeping `delay_us` between polls. The wrapper hard-codes
    pthrDelay = 0, so the config is adjusted on its way into the native agent (only during this construction)."""
    native_agent = api.nixlBind.nixlAgent

    def agent_with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return native_agent(agent_name, config)

    api.nixlBind.nixlAgent = agent_with_delay
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind.nixlAgent = native_agent


def _block_descs(base: int, layout: Any) -> np.ndarray:
    """One (address, bytes, device 0) row per (tensor, block), tensor-major: row t * num_blocks + j."""
    n = 2 * layout.num_layers * layout.num_blocks
    descs = np.zeros((n, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(layout.block_bytes)
    descs[:, 1] = layout.block_bytes
    return descs


class KvConnector:
    """Worker-side connector: owns the rank's KV region, describes it to peers, pulls remote blocks into it."""

    def __init__(self, backend: str, region: KvRegion, *, model_id: str, tp_rank: int = 0, tp_size: int = 1) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown KV transfer backend {backend!r}; choose one of {sorted(BACKEND_NAMES)}")
        self.region = region
        self._backend: _Backend = _ShmBackend(region) if backend == "shm" else _NixlBackend(region)
        self.info = KvPeerInfo(
            backend=BACKEND_NAMES[backend], model_id=model_id, dtype=str(region.dtype).removeprefix("torch."),
            block_size=region.shape[1], num_layers=region.num_layers, num_kv_heads=region.shape[2],
            head_dim=region.shape[3], tp_rank=tp_rank, tp_size=tp_size, num_blocks=region.num_blocks,
            block_bytes=region.block_bytes, region_bytes=region.region_bytes, base_address=region.base_address,
            **self._backend.info_fields(),
        )  # fmt: skip
        self.bytes_pulled = 0
        self.seconds_pulling = 0.0

    def pull(
        self, peer_info: bytes | KvPeerInfo, remote_blocks: Any, local_blocks: Any, timeout_s: float = 10.0
    ) -> None:
        """Copies the remote blocks into the local ones (same order). Raises KvHandshakeError for an incompatible
        peer and KvTransferError when the transfer itself fails."""
        peer = peer_info if isinstance(peer_info, KvPeerInfo) else KvPeerInfo.decode(peer_info)
        check_compatible(self.info, peer)
        remote = np.asarray(remote_blocks, np.int64).reshape(-1)
        local = np.asarray(local_blocks, np.int64).reshape(-1)
        if len(remote) != len(local):
            raise KvTransferError(f"pull of {len(remote)} remote blocks into {len(local)} local blocks")
        if len(remote) == 0:
            return
        in_range = remote.max() < peer.num_blocks and local.max() < self.region.num_blocks
        if min(remote.min(), local.min()) < 0 or not in_range:
            raise KvTransferError("block id out of range in a KV pull")
        start = time.perf_counter()
        self._backend.pull(peer, remote, local, timeout_s)
        self.seconds_pulling += time.perf_counter() - start
        self.bytes_pulled += 2 * self.region.num_layers * len(local) * self.region.block_bytes

    def close(self) -> None:
        self._backend.close()
        self.region.unlink()
