"""Opening GGUF files: the `gguf` package's reader, without numpy.memmap's per-read overhead.

Shared by the frontend (tokenizer, chat template, context length) and the workers (weights), which each open the
model's file once at start.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType


class GGUFFile(GGUFReader):
    """`gguf.GGUFReader` reading through a plain ndarray view of its file mapping instead of the `numpy.memmap`.

    The reader parses metadata with one small slice per value, and a tokenizer's vocabulary and merges are ~250,000
    of them; `numpy.memmap` runs Python hooks (`__getitem__`, `__array_finalize__`) on every slice. The plain view
    maps the same pages and skips them. Metadata arrays are read in bulk: a number array is one view (not one per
    element), and a string array's elements are memoryview slices found by one loop over their lengths (not two
    numpy views each). Gemma 3's 262,144-token vocabulary is most of that file's metadata.

    So a field's `parts` differ from gguf's reader for arrays: a number array's `data` indexes one part holding all
    its elements, and a string array's parts hold the strings' bytes without their length prefixes; `contents()`
    returns the same values, which is all RingServe reads. Tensors are the same; their data are read-only views of
    the mapping (the mapping lives as long as any view of it).
    """

    def __init__(self, path: os.PathLike[str] | str) -> None:
        super().__init__(path, mode="r")

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[Any]:
        return self._plain_data

    @data.setter
    def data(self, value: npt.NDArray[Any]) -> None:
        self._plain_data = value.view(np.ndarray)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        count = int(length[0])
        offs = orig_offs + 12
        types = [GGUFValueType.ARRAY, GGUFValueType(int(item_type[0]))]
        parts: list[Any] = [item_type, length]
        if types[1] == GGUFValueType.STRING:
            mapping = memoryview(self.data)
            for _ in range(count):
                (size,) = struct.unpack_from("<Q", mapping, offs)
                parts.append(mapping[offs + 8 : offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(2, 2 + count)), types
        number = self.gguf_scalar_to_np.get(types[1])
        if number is None:  # nested arrays: gguf's own element-by-element walk
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, number, count)
        parts.append(values)
        return 12 + int(values.nbytes), parts, [2] if count else [], types
