"""KV peer info: what a worker rank publishes about its KV region, in a defined binary layout (never pickle), and
the handshake that decides whether blocks can be copied between two ranks. Shared by workers/kv_connector.py and the
frontend (which checks KV handles before it submits a request); no torch here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_MAGIC = b"RSKV"
_VERSION = 1
BACKEND_SHM = 1
BACKEND_NIXL = 2
BACKEND_NAMES = {"shm": BACKEND_SHM, "nixl": BACKEND_NIXL}
_FIXED = struct.Struct("<4sHH7IQQQ")  # magic, version, backend, 7 x u32 (see KvPeerInfo), block/region bytes, base


class KvTransferError(RuntimeError):
    """A pull failed (peer gone, transfer error, timeout); the caller falls back to computing the KV itself."""


class KvHandshakeError(ValueError):
    """The two sides' KV layouts differ, so blocks cannot be copied between them."""


@dataclass(frozen=True)
class KvPeerInfo:
    """What one worker rank publishes about its KV region. Encoded as `_FIXED` + five u32-length-prefixed
    fields (model_id, dtype, shm_name, nixl agent name, nixl agent metadata), all little-endian."""

    backend: int
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    num_blocks: int
    block_bytes: int
    region_bytes: int
    base_address: int
    shm_name: str = ""
    agent_name: str = ""
    agent_metadata: bytes = b""

    def encode(self) -> bytes:
        parts = [
            _FIXED.pack(_MAGIC, _VERSION, self.backend, self.block_size, self.num_layers, self.num_kv_heads,
                        self.head_dim, self.tp_rank, self.tp_size, self.num_blocks, self.block_bytes,
                        self.region_bytes, self.base_address)
        ]  # fmt: skip
        for blob in (self.model_id.encode(), self.dtype.encode(), self.shm_name.encode(), self.agent_name.encode(),
                     self.agent_metadata):  # fmt: skip
            parts.append(struct.pack("<I", len(blob)))
            parts.append(blob)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> KvPeerInfo:
        if len(data) < _FIXED.size:
            raise KvHandshakeError(f"KV peer info is {len(data)} bytes, shorter than its {_FIXED.size}-byte header")
        magic, version, backend, *u32s, block_bytes, region_bytes, base = _FIXED.unpack_from(data)
        if magic != _MAGIC or version != _VERSION:
            raise KvHandshakeError(
                f"KV peer info has magic {magic!r} version {version}, expected {_MAGIC!r} {_VERSION}"
            )
        pos = _FIXED.size
        blobs: list[bytes] = []
        for _ in range(5):
            if pos + 4 > len(data):
                raise KvHandshakeError("KV peer info is truncated")
            (n,) = struct.unpack_from("<I", data, pos)
            if pos + 4 + n > len(data):
                raise KvHandshakeError("KV peer info is truncated")
            blobs.append(bytes(data[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        if pos != len(data):
            raise KvHandshakeError(f"KV peer info has {len(data) - pos} trailing bytes")
        block_size, num_layers, kv_heads, head_dim, tp_rank, tp_size, num_blocks = u32s
        return cls(backend, blobs[0].decode(errors="replace"), blobs[1].decode(errors="replace"), block_size,
                   num_layers, kv_heads, head_dim, tp_rank, tp_size, num_blocks, block_bytes, region_bytes, base,
                   blobs[2].decode(errors="replace"), blobs[3].decode(errors="replace"), blobs[4])  # fmt: skip


def check_compatible(local: KvPeerInfo, remote: KvPeerInfo) -> None:
    """Raises KvHandshakeError naming every field that keeps remote blocks from being copied into local ones."""
    if local.tp_size != remote.tp_size:
        raise KvHandshakeError(
            f"tensor-parallel sizes differ: the KV source runs TP={remote.tp_size}, this server TP={local.tp_size}; "
            "run prefill and decode servers with the same --tensor-parallel-size"
        )
    problems = [
        f"{name}: source {a!r}, here {b!r}"
        for name, a, b in (
            ("backend", remote.backend, local.backend),
            ("model", remote.model_id, local.model_id),
            ("KV dtype", remote.dtype, local.dtype),
            ("block size", remote.block_size, local.block_size),
            ("layers", remote.num_layers, local.num_layers),
            ("KV heads per rank", remote.num_kv_heads, local.num_kv_heads),
            ("head dim", remote.head_dim, local.head_dim),
            ("TP rank", remote.tp_rank, local.tp_rank),
            ("block bytes", remote.block_bytes, local.block_bytes),
        )
        if a != b
    ]
    if problems:
        raise KvHandshakeError("incompatible KV layouts: " + "; ".join(problems))


def pack_peer_infos(infos: list[bytes]) -> bytes:
    """Every TP rank's encoded KvPeerInfo, rank order, each as u32 length + bytes: the `peer` of a KV pull."""
    return b"".join(struct.pack("<I", len(i)) + i for i in infos)


def unpack_peer_infos(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise KvHandshakeError("peer info list is truncated")
        (n,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + n > len(data):
            raise KvHandshakeError("peer info list is truncated")
        out.append(bytes(data[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    return out
