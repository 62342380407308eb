"""A GGUF file's header: its metadata and, for each tensor, its GGML type, shape and where
its data lies. agentkv reads tensors itself (gguf_quants) rather than through `mx.load`,
which misreads Q4_K and refuses a whole file for one Q5_0, Q3_K or Q5_K tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from inference_worker.gguf_tokenizer import GGUFError

GGML_TYPES = {  # ggml.h's type ids
    **{0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1"},
    **{10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K"},
    **{16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S"},
    **{22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"},
    **{29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0"},
}
# GGUF metadata value types: numbers by struct code, then string and array.
_NUMBERS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
MAX_ARRAY_DEPTH = 8  # arrays of arrays: real files nest none; a parser must stop somewhere
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as the header describes it."""

    name: str
    kind: str  # GGML type name ("Q4_K"), or "type N" for an id agentkv does not know
    shape: tuple[int, ...]  # rows first, as numpy and MLX index it (GGUF lists dims reversed)
    offset: int  # of its data, from the start of the file

    @property
    def size(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    metadata: dict
    tensors: list[TensorInfo]


class _Cursor:
    """Reads little-endian values from the mapped file, a GGUFError where it ends early."""

    def __init__(self, path: Path, data) -> None:
        self.path, self.data, self.pos = path, data, 0

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self.take(struct.calcsize(fmt)))

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.data):
            raise GGUFError(f"GGUF header of {self.path} ends early: the file is cut short")
        self.pos += size
        return memoryview(self.data)[self.pos - size : self.pos]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q")[0])).decode("utf-8", "replace")

    def value(self, kind: int, depth: int = 0):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            kind, count = self.unpack("<IQ")
            if kind in _NUMBERS:  # one numpy array, not a million Python numbers
                dtype = np.dtype(_NUMBERS[kind]).newbyteorder("<")
                return np.frombuffer(self.take(dtype.itemsize * count), dtype).copy()
            if kind == _ARRAY and depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(
                    f"GGUF metadata of {self.path} nests arrays past {MAX_ARRAY_DEPTH} levels"
                )
            return [self.value(kind, depth + 1) for _ in range(count)]
        if kind in _NUMBERS:
            return self.unpack("<" + _NUMBERS[kind])[0]
        raise GGUFError(f"GGUF metadata has a value of unknown type {kind}")


def read_header(path: Path) -> Header:
    """The metadata (numbers as Python scalars or numpy arrays, strings as str) and the
    tensors, with their offsets resolved against the file's data section."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise GGUFError(f"{path} is not a GGUF file of version 2 or 3")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(path, data))


def _parse(cur: _Cursor) -> Header:
    magic, version = cur.unpack("<4sI") if len(cur.data) >= 8 else (b"", 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise GGUFError(f"{cur.path} is not a GGUF file of version 2 or 3")
    num_tensors, num_kv = cur.unpack("<QQ")
    metadata = {}
    for _ in range(num_kv):
        key = cur.string()
        if key in metadata:  # llama.cpp refuses it too: which one is meant?
            raise GGUFError(f"GGUF {cur.path} holds metadata key {key!r} twice")
        metadata[key] = cur.value(cur.unpack("<I")[0])
    infos, names = [], set()
    for _ in range(num_tensors):
        name = cur.string()
        if name in names:
            raise GGUFError(f"GGUF {cur.path} holds tensor {name!r} twice")
        names.add(name)
        dims = cur.unpack(f"<{cur.unpack('<I')[0]}q")  # int64, as llama.cpp reads them
        kind, offset = cur.unpack("<IQ")
        infos.append((name, GGML_TYPES.get(kind, f"type {kind}"), tuple(reversed(dims)), offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align % 8:  # the spec: a multiple of 8
        raise GGUFError(f"GGUF {cur.path} has general.alignment {align!r}: not a multiple of 8")
    for name, _, shape, at in infos:
        _check_tensor(cur.path, name, shape, at, align)
    start = -(-cur.pos // align) * align
    tensors = [TensorInfo(name, kind, shape, start + at) for name, kind, shape, at in infos]
    return Header(metadata, tensors)


def _check_tensor(path: Path, name: str, shape: tuple[int, ...], at: int, align: int) -> None:
    """Refuses a tensor the spec does not allow: a dimension under 1 (an empty tensor, which
    MLX later refuses to load), or data that starts off the file's alignment (read from
    there, its blocks decode to garbage and NaNs)."""
    empty = [dim for dim in shape if dim <= 0]
    if empty:
        raise GGUFError(
            f"GGUF {path}: tensor {name!r} has shape {list(shape)}, with a dimension of {empty[0]}"
        )
    if at % align:
        raise GGUFError(
            f"GGUF {path}: tensor {name!r} starts at offset {at}, not a multiple of the "
            f"file's alignment {align}"
        )
