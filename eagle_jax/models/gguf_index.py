"""A GGUF file's metadata and tensor table, read in milliseconds.

`gguf.GGUFReader` turns every metadata value into numpy views one element at a time; a
tokenizer's token and merge lists (about 100k strings in SmolLM2's file) make that 4-6 s of every
model load. `GGUFIndex` reads the same header with `struct` (strings are only skipped until
asked for) and gives what `GGUFModel` uses, under `GGUFReader`'s names: `fields[key].contents()`,
and `tensors` with `name`, `tensor_type`, `shape` (ggml's order, fastest dimension first) and
`data` (a view of the memory-mapped file, typed and shaped as `GGUFReader` types and shapes it).

Layout (GGUF versions 2 and 3, little-endian): "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value (an array is an item
type u32, a count u64 and the items; a string a u64 length and UTF-8 bytes); each tensor a string
name, a u32 dimension count, u64 dimensions, a u32 ggml type and a u64 offset into the data, which
starts at the next multiple of `general.alignment` (default 32) after the table.

Files it does not read (big-endian, other versions, arrays of arrays) raise `UnsupportedGGUF`,
and the caller falls back to `GGUFReader`.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

GGUF_MAGIC = 0x46554747  # "GGUF" read as a little-endian u32
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types → the little-endian numpy type of one scalar (8: string, 9: array)
_SCALARS = {t: np.dtype(d) for t, d in {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                                         7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}.items()}
STRING, ARRAY = 8, 9

# ggml tensor types stored as plain numpy elements (GGUFReader's choice); every other type is
# quantized blocks, read as bytes [rows..., bytes a row]
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


class UnsupportedGGUF(ValueError):
    """A GGUF file this reader does not handle (GGUFReader may)."""


class Field:
    """One metadata value: a scalar, a string, or a flat array of either (`count` items)."""

    def __init__(self, buf, value_type: int, offset: int, count: int = 1, item_type: int | None = None):
        self._buf, self._offset = buf, offset
        self.value_type, self.item_type, self.count = value_type, item_type, count

    def contents(self) -> Any:
        """The value as GGUFReader's `contents()` returns it: a number, a str, or a list."""
        if self.value_type == STRING:
            return _read_string(self._buf, self._offset)[0]
        if self.value_type != ARRAY:
            return np.frombuffer(self._buf, _SCALARS[self.value_type], 1, self._offset)[0].item()
        if self.item_type == STRING:
            out, offs = [], self._offset
            for _ in range(self.count):
                s, offs = _read_string(self._buf, offs)
                out.append(s)
            return out
        return np.frombuffer(self._buf, _SCALARS[self.item_type], self.count, self._offset).tolist()


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml order: fastest-varying dimension first
    data: np.ndarray


def _read_string(buf, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offs)
    end = offs + 8 + n
    if end > len(buf):
        raise UnsupportedGGUF(f"a string at byte {offs} runs past the end of the file")
    return bytes(buf[offs + 8:end]).decode("utf-8"), end


def _skip_strings(buf, offs: int, count: int) -> int:
    if count > (len(buf) - offs) // 8:  # a garbled count: fail now, not after 2^63 steps
        raise UnsupportedGGUF(f"{count} strings cannot fit in the {len(buf) - offs} bytes left")
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        offs += 8 + unpack(buf, offs)[0]
    if offs > len(buf):
        raise UnsupportedGGUF("a string array runs past the end of the file")
    return offs


class GGUFIndex:
    """The metadata (`fields`) and tensor table (`tensors`) of one GGUF file, memory-mapped."""

    def __init__(self, path):
        try:
            self.data = np.memmap(path, mode="r")  # an empty file raises ValueError
            self._read(memoryview(self.data))
        except UnsupportedGGUF:
            raise
        except (struct.error, ValueError) as e:  # truncated or garbled: let GGUFReader say what is wrong
            raise UnsupportedGGUF(f"unreadable header: {e}") from e

    def _read(self, buf) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if len(buf) < 24:
            raise UnsupportedGGUF("shorter than a GGUF header")
        magic, version, n_tensors, n_fields = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC:
            raise UnsupportedGGUF("no GGUF magic")
        if version not in VERSIONS:  # a big-endian file reads as a version ≥ 65536 here
            raise UnsupportedGGUF(f"GGUF version {version} (this reader handles {VERSIONS}, little-endian)")
        offs = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, offs = _read_string(buf, offs)
            (vtype,) = struct.unpack_from("<I", buf, offs)
            offs += 4
            if vtype == STRING:
                self.fields[key] = Field(buf, STRING, offs)
                offs = _skip_strings(buf, offs, 1)
            elif vtype == ARRAY:
                item, count = struct.unpack_from("<IQ", buf, offs)
                offs += 12
                if item == STRING:
                    self.fields[key] = Field(buf, ARRAY, offs, count, STRING)
                    offs = _skip_strings(buf, offs, count)
                elif item in _SCALARS:
                    self.fields[key] = Field(buf, ARRAY, offs, count, item)
                    offs += count * _SCALARS[item].itemsize
                else:
                    raise UnsupportedGGUF(f"metadata {key!r} is an array of value type {item}")
            elif vtype in _SCALARS:
                self.fields[key] = Field(buf, vtype, offs)
                offs += _SCALARS[vtype].itemsize
            else:
                raise UnsupportedGGUF(f"metadata {key!r} has unknown value type {vtype}")
        table = []
        for _ in range(n_tensors):
            name, offs = _read_string(buf, offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = np.frombuffer(buf, np.uint64, n_dims, offs + 4).copy()
            ggml_type, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
            offs += 4 + 8 * n_dims + 12
            table.append((name, dims, ggml_type, rel))
        align = self.fields.get("general.alignment")
        self.alignment = int(align.contents()) if align is not None else DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise UnsupportedGGUF(f"alignment {self.alignment} is not a power of two")
        self.data_offset = -(-offs // self.alignment) * self.alignment
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, ggml_type, rel in table:
            if name in seen:
                raise UnsupportedGGUF(f"tensor {name!r} is listed twice")
            seen.add(name)
            try:
                kind = GGMLQuantizationType(ggml_type)
            except ValueError as e:
                raise UnsupportedGGUF(f"tensor {name!r} has unknown ggml type {ggml_type}") from e
            n_elems = int(np.prod(dims))
            block, type_bytes = GGML_QUANT_SIZES[kind]
            hf_dims = tuple(int(d) for d in reversed(dims.tolist()))
            start = self.data_offset + int(rel)
            if kind.name in _ELEMENT_TYPES:
                dtype, count, np_dims = _ELEMENT_TYPES[kind.name], n_elems, hf_dims
            else:
                if hf_dims[-1] % block:
                    raise UnsupportedGGUF(f"tensor {name!r}: {hf_dims[-1]} is not a whole number of blocks")
                dtype, count = np.uint8, n_elems // block * type_bytes
                np_dims = (*hf_dims[:-1], hf_dims[-1] // block * type_bytes)
            if start + count * np.dtype(dtype).itemsize > len(buf):
                raise UnsupportedGGUF(f"tensor {name!r} runs past the end of the file")
            data = np.frombuffer(self.data, dtype, count, start).reshape(np_dims)
            self.tensors.append(Tensor(name, kind, dims, data))
