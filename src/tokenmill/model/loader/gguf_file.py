"""A lean GGUF (v2/v3) reader: metadata as Python values, tensors as zero-copy views of a mmap.

gguf's own GGUFReader wraps every string of the vocabulary in numpy views and takes seconds
on a 49K-token model, on every process start; this reads the same header in a fraction of a
second. Dequantization is still gguf's (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct formats (little-endian); 8 = string, 9 = array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (numpy/PyTorch) order: GGUF's dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic {self._mm[:4]!r})")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported; expected 2 or 3")
        num_tensors = self._scalar("<Q")
        num_kv = self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))

        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._scalar("<I")
            dims = struct.unpack_from(f"<{num_dims}Q", self._mm, self._pos)
            self._pos += 8 * num_dims
            ggml_type = self._scalar("<I")
            infos.append((name, dims, ggml_type, self._scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment

        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: list[GGUFTensor] = []
        for name, dims, ggml_type, rel_offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            num_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors.append(GGUFTensor(name, shape, ggml_type, data_start + rel_offset, num_bytes))

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as read-only uint8 rows [..., bytes_per_row], the layout dequantize expects."""
        data = np.frombuffer(self._mm, dtype=np.uint8, count=tensor.num_bytes, offset=tensor.offset)
        return data.reshape(*tensor.shape[:-1], -1)

    def dequantize(self, tensor: GGUFTensor) -> np.ndarray:
        """float32 array of `tensor.shape` (a read-only view for F32 tensors)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.raw(tensor), GGMLQuantizationType(tensor.ggml_type)).astype(
            np.float32, copy=False
        )

    # -- header parsing --------------------------------------------------------------------------

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        raw = self._mm[self._pos : self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type = self._scalar("<I")
            count = self._scalar("<Q")
            if item_type == _STRING:  # vocabularies: tens of thousands of strings, keep this loop tight
                strings, mm, pos, read_length = [], self._mm, self._pos, _U64.unpack_from
                for _ in range(count):
                    (length,) = read_length(mm, pos)
                    strings.append(mm[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
                    pos += 8 + length
                self._pos = pos
                return strings
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                values = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
