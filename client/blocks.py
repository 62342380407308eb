"""Blocks as the SDK sees them: named, typed byte arrays for one span of tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from agentkv.errors import CorruptBlock
from agentkv.v1 import store_pb2 as pb


@dataclass(slots=True)
class Tensor:
    """One tensor's bytes; `data` may be bytes, a bytearray or any buffer (numpy, mlx)."""

    name: str  # "layers.<i>.<part>"
    dtype: str  # safetensors dtype, e.g. "U32", "F16"
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        self.data = memoryview(self.data).cast("B")
        self.shape = tuple(self.shape)


@dataclass(slots=True)
class Block:
    """A block to upload: the parent's key, the span's tokens and its tensors in layer order."""

    parent_key: bytes
    token_ids: list[int]
    tensors: list[Tensor]


@dataclass(slots=True)
class StoredBlock:
    """A block read back from the store; its tensors' data are views into one buffer."""

    key: bytes
    parent_key: bytes
    token_ids: list[int]
    tensors: list[Tensor]

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


def block_from_header(header: pb.BlockHeader | pb.BlockLocation, buffer: memoryview) -> StoredBlock:
    """Cuts a buffer holding the selected tensors back to back into Tensor views."""
    tensors, pos = [], 0
    for t in header.tensors:
        tensors.append(Tensor(t.name, t.dtype, tuple(t.shape), buffer[pos : pos + t.num_bytes]))
        pos += t.num_bytes
    return StoredBlock(header.key, header.parent_key, list(header.token_ids), tensors)


def chunk_payloads(tensors: Sequence[Tensor], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The tensors' bytes in order, as lists of pieces totalling at most chunk_bytes each."""
    pieces: list[memoryview] = []
    size = 0
    for t in tensors:
        data = t.data
        while data:
            take = min(len(data), chunk_bytes - size)
            pieces.append(data[:take])
            size += take
            data = data[take:]
            if size == chunk_bytes:
                yield pieces
                pieces, size = [], 0
    if pieces:
        yield pieces


def alloc(num_bytes: int) -> memoryview:
    """An uninitialized byte buffer. numpy skips bytearray's zero-fill and asks for huge pages,
    which makes a fresh 200 MB buffer several times cheaper to fill."""
    return memoryview(np.empty(num_bytes, dtype=np.uint8)).cast("B")


def located_bytes(location: pb.BlockLocation) -> int:
    return sum(s.num_bytes for s in location.segments)


def read_location(location: pb.BlockLocation, buffer: memoryview | None = None) -> StoredBlock:
    """Reads a located block straight from its file and verifies every segment's checksum.

    `buffer` (at least located_bytes(location) long) is filled and viewed by the result; by
    default a fresh one. Raises CorruptBlock (the caller should report it to the store) on a
    missing, short or mismatching file.
    """
    total = located_bytes(location)
    view = (buffer if buffer is not None else alloc(total))[:total]
    try:
        fd = os.open(location.path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise CorruptBlock(f"block {location.key.hex()} file {location.path} is missing") from exc
    try:
        _read_segments(fd, location, view)
    finally:
        os.close(fd)
    return block_from_header(location, view)


def _read_segments(fd: int, location: pb.BlockLocation, view: memoryview) -> None:
    """One preadv and one hash per segment, so each layer is hashed while still in cache."""
    pos = 0
    for s in location.segments:
        segment = view[pos : pos + s.num_bytes]
        if os.preadv(fd, [segment], s.offset) != s.num_bytes:
            raise CorruptBlock(f"block {location.key.hex()} file is truncated at {s.offset}")
        if xxhash.xxh3_64_intdigest(segment) != s.checksum:
            raise CorruptBlock(f"block {location.key.hex()} layer {s.layer} failed its checksum")
        pos += s.num_bytes
