"""Model weights on transparent huge pages (CPU).

Decoding streams every weight from memory once per step. On 4 KiB pages the hardware prefetchers stop at every
page boundary and each page costs a TLB entry; a weight region advised with MADV_HUGEPAGE is backed by 2 MiB pages
where the kernel allows it (`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise` or `always`), which
made single-stream decode of the embedded model ~10-15% faster here. RINGSERVE_WEIGHT_HUGE_PAGES=0 keeps the
weights where the loader put them. Tensors that share storage (the fused q/k/v
and gate/up matrices and the per-projection parameters that are views of them) share it again after the move.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

import torch

_ALIGN = 4096
_HUGE_PAGE = 2 << 20


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_pages_wanted() -> bool:
    return huge_pages_supported() and os.environ.get("RINGSERVE_WEIGHT_HUGE_PAGES", "1") != "0"


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class HugePageArena:
    """One anonymous mapping advised for huge pages, filled by copying storages into it in turn."""

    def __init__(self, nbytes: int) -> None:
        self.region = mmap.mmap(-1, -(-max(nbytes, 1) // _HUGE_PAGE) * _HUGE_PAGE,
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fmt: skip
        self.region.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self.region, dtype=torch.uint8)
        self._used = 0

    @property
    def address(self) -> int:
        return self._bytes.data_ptr()

    def copy(self, storage: torch.UntypedStorage) -> int:
        """Copies the storage's bytes in; returns their offset (page-aligned, so any dtype's elements align)."""
        offset, nbytes = self._used, storage.nbytes()
        if offset + nbytes > self._bytes.numel():
            raise ValueError(f"the arena holds {self._bytes.numel()} bytes; {offset + nbytes} needed")
        self._bytes[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        self._used = offset + _padded(nbytes)
        return offset

    def like(self, tensor: torch.Tensor, offset: int) -> torch.Tensor:
        """`tensor` (same dtype, shape, strides) as it lies in the copy of its storage made at `offset`."""
        return self._bytes.view(tensor.dtype).as_strided(
            tensor.shape, tensor.stride(), offset // tensor.element_size() + tensor.storage_offset()
        )


def move_to_huge_pages(
    tensors: Sequence[torch.Tensor], rebind: Callable[[int, torch.Tensor], None]
) -> HugePageArena | None:
    """Moves CPU tensors onto huge pages: each storage is copied into one arena, then `rebind(i, new)` is called for
    every tensor on it before the next storage is copied, so an old storage can be freed as soon as it is replaced
    (peak memory: the arena plus one storage, not twice the weights). Returns the arena, which must outlive the
    tensors, or None (nothing moved) where the platform has no MADV_HUGEPAGE, RINGSERVE_WEIGHT_HUGE_PAGES=0, or a
    tensor is not on the CPU."""
    if not huge_pages_wanted() or not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    arena = HugePageArena(sum(_padded(tensors[ids[0]].untyped_storage().nbytes()) for ids in by_storage.values()))
    for ids in by_storage.values():
        offset = arena.copy(tensors[ids[0]].untyped_storage())
        for i in ids:
            rebind(i, arena.like(tensors[i], offset))
    return arena
