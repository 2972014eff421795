"""The GGUF container, read: metadata decoded to Python values, tensors as
memory-mapped numpy views. Our own reader of the file format (ggml's
docs/gguf.md), because the gguf package's GGUFReader builds a numpy view per
array element: on SmolLM2's 49k-token vocabulary and 49k merges that is 2 s
on a fast core and 6-9 s on a slow one, paid by every process that opens the
default model (each server, each tensor-parallel rank, each benchmark client
reading the tokenizer). Reading the same metadata with `struct` takes a tenth
of a second. The gguf package still names the tensor types
(GGMLQuantizationType, GGML_QUANT_SIZES) and dequantizes (model/gguf_blocks.py).

A tensor's `data` has the form GGUFReader gives, so the gguf package's
`quants.dequantize` reads it: for float and integer types the values in
torch order (the reverse of the file's ne order), for block-quantized types
the raw bytes, [rows..., bytes per row], uint8.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value types, by their number in the file: struct code, size
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9
# ggml types read as typed values rather than bytes
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any            # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # ne order, as the file stores it (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int            # from the start of the file
    data: np.ndarray


class GGUFFile:
    """`fields`: every metadata key with its value (int, float, bool, str, or a
    list of them); `tensors`: the tensors in file order. Raises ValueError for
    a file that is not GGUF, is cut short, or is inconsistent."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as err:           # an empty file cannot be mapped
                raise ValueError(f"{path}: empty file, not GGUF") from err
        self.path = path
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as err:
            raise ValueError(f"{path}: the GGUF header is cut short or corrupt "
                             f"({type(err).__name__}: {err})") from err

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version = struct.unpack_from("<I", buf, 4)[0]
        self.endian = "<"
        if version & 0xFFFF == 0:               # written on a big-endian machine
            self.endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported "
                             f"(supported: {', '.join(map(str, VERSIONS))})")
        self.version = version
        n_tensors, n_fields = struct.unpack_from(self.endian + "QQ", buf, 8)
        offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key, offset = self._string(offset)
            kind, offset = self._u32(offset)
            self.fields[key], offset = self._value(kind, offset)
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            n_dims, offset = self._u32(offset)
            dims = struct.unpack_from(f"{self.endian}{n_dims}Q", buf, offset)
            offset += 8 * n_dims
            kind, rel = struct.unpack_from(self.endian + "IQ", buf, offset)
            offset += 12
            infos.append((name, dims, kind, rel))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment} is not a power of two")
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.path}: a tensor name appears twice")

    def _u32(self, offset: int) -> tuple[int, int]:
        return struct.unpack_from(self.endian + "I", self._map, offset)[0], offset + 4

    def _string(self, offset: int) -> tuple[str, int]:
        n = struct.unpack_from(self.endian + "Q", self._map, offset)[0]
        offset += 8
        if offset + n > len(self._map):
            raise IndexError("a string runs past the end of the file")
        return self._map[offset:offset + n].decode("utf-8"), offset + n

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            code, size = _SCALARS[kind]
            return struct.unpack_from(self.endian + code, self._map, offset)[0], offset + size
        if kind == _STRING:
            return self._string(offset)
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")
        item, n = struct.unpack_from(self.endian + "IQ", self._map, offset)
        offset += 12
        if item in _SCALARS:                    # numbers: one numpy read
            code, size = _SCALARS[item]
            if offset + n * size > len(self._map):
                raise IndexError("an array runs past the end of the file")
            values = np.frombuffer(self._map, dtype=np.dtype(self.endian + code), count=n,
                                   offset=offset)
            return values.tolist(), offset + n * size
        if item == _STRING:                     # the vocabulary and merges: a tight loop
            buf, length, out = self._map, struct.Struct(self.endian + "Q").unpack_from, []
            for _ in range(n):
                size = length(buf, offset)[0]
                offset += 8
                out.append(buf[offset:offset + size].decode("utf-8"))
                offset += size
            if offset > len(buf):
                raise IndexError("a string array runs past the end of the file")
            return out, offset
        out = []
        for _ in range(n):                      # arrays of arrays
            value, offset = self._value(item, offset)
            out.append(value)
        return out, offset

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int,
                rel: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {kind}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise ValueError(f"{self.path}: tensor {name}: rows of {dims[0]} are not whole "
                             f"{qtype.name} blocks of {block}")
        n_bytes = n_elements // block * block_bytes
        begin = start + rel
        if begin + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file "
                             "(truncated?)")
        shape = tuple(reversed(dims))           # torch order
        typed = _TYPED.get(qtype.name)
        if typed is not None:
            data = np.frombuffer(self._map, dtype=np.dtype(typed).newbyteorder(self.endian),
                                 count=n_elements, offset=begin).reshape(shape)
        else:                                   # block bytes, [rows..., bytes per row]
            row = shape[-1] // block * block_bytes if shape else block_bytes
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes,
                                 offset=begin).reshape(*shape[:-1], row)
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), n_elements, n_bytes,
                          begin, data)
