"""Reading the GGUF container: metadata, the tensor directory, and each tensor's bytes.

This module owns the file format only (no model semantics). We walk the header ourselves
rather than use ``gguf.GGUFReader`` because that builds a numpy view per array element:
2.1 s for SmolLM2's 49k-token vocabulary against ~0.1 s here, and start-up time matters.
Tensor bytes are never copied: they are views into a private memory map of the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long obsolete
_DEFAULT_ALIGNMENT = 32

# struct format and numpy dtype of each fixed-width metadata value type (little-endian).
_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's directory entry plus its raw bytes."""

    name: str
    ggml_shape: tuple[int, ...]  # ggml order: the fastest-moving (column) dimension first
    ggml_type: GGMLQuantizationType
    data: np.ndarray  # 1-D uint8 view of the stored bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape in torch/numpy order, i.e. ``ggml_shape`` reversed."""
        return tuple(reversed(self.ggml_shape))


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Sequential little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise ValueError(f"{self.path}: GGUF header is truncated") from exc
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")

    def array(self) -> Any:
        element_type, count = self.unpack("<IQ")
        if element_type in _SCALAR_FORMATS:
            # Numeric arrays (e.g. 49k token types) become one numpy array, not a Python list.
            dtype = np.dtype(_SCALAR_FORMATS[element_type])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values
        if element_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        return [self.value(element_type) for _ in range(count)]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse ``path``'s header; tensor data stays on disk until touched.

    Raises ValueError when the file is not a (little-endian, v2/v3) GGUF file.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)"
            )
        # ACCESS_COPY (a private mapping) makes the numpy views writable, so torch can wrap
        # them without a warning, while guaranteeing the file itself is never modified.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: GGUF version {version} is not supported (supported: {_SUPPORTED_VERSIONS}; "
            "a huge number here means a big-endian file)"
        )
    tensor_count, kv_count = cur.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))

    directory = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack("<I")
        dims = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", buf, cur.pos))
        cur.pos += 8 * n_dims
        ggml_type, offset = cur.unpack("<IQ")
        directory.append((name, dims, ggml_type, offset))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in directory:
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(
                f"{path}: tensor {name!r} has unknown ggml type id {type_id}"
            ) from None
        nbytes = _byte_size(dims, ggml_type)
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} extends past the end of the file")
        data = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=data_start + offset)
        tensors[name] = GGUFTensor(name, dims, ggml_type, data)
    return GGUFFile(path, metadata, tensors)


def _byte_size(dims: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    return n_elements // block_size * type_size
