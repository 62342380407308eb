"""Blocks as the SDK sees them: named, typed byte arrays for one span of tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash

from agentkv import wire
from agentkv.errors import CorruptBlock
from agentkv.v1 import store_pb2 as pb


class Tensor(NamedTuple):
    """One tensor's bytes: `data` is any C-contiguous buffer (bytes, numpy, a memoryview).

    A tuple, because a restore builds thousands of these.
    """

    name: str  # "layers.<i>.<part>"
    dtype: str  # safetensors dtype, e.g. "U32", "F16"
    shape: Sequence[int]  # a read-back tensor's shape is its header's repeated field
    data: Any

    @property
    def num_bytes(self) -> int:
        return memoryview(self.data).nbytes


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
        tensors.append(Tensor(t.name, t.dtype, t.shape, buffer[pos : pos + t.num_bytes]))
        pos += t.num_bytes
    return StoredBlock(header.key, header.parent_key, list(header.token_ids), tensors)


def chunk_payloads(tensors: Sequence[Tensor], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The tensors' bytes in order, as lists of pieces totalling at most chunk_bytes each.
    Checked at the call, not at the first chunk: 0 would yield empty chunks forever, and
    the store refuses a chunk over wire.MAX_CHUNK_BYTES."""
    return _chunks(tensors, check_chunk_bytes(chunk_bytes))


def check_chunk_bytes(chunk_bytes: int) -> int:
    """`chunk_bytes`, or ValueError unless it is in 1..wire.MAX_CHUNK_BYTES: callers check it
    before a stream starts, where an error inside the request iterator would only cancel it."""
    if isinstance(chunk_bytes, bool) or not 1 <= chunk_bytes <= wire.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{wire.MAX_CHUNK_BYTES}, got {chunk_bytes!r}")
    return chunk_bytes


def _chunks(tensors: Sequence[Tensor], chunk_bytes: int) -> Iterator[list[memoryview]]:
    pieces: list[memoryview] = []
    size = 0
    for t in tensors:
        data = memoryview(t.data).cast("B")
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


class CorruptFile(CorruptBlock):
    """A located file failed a check at this reader; `key` names the block to report."""

    def __init__(self, message: str, key: bytes) -> None:
        super().__init__(message)
        self.key = key


class FilesUnreadable(Exception):
    """The located files cannot be read here: another host's or another mount's (a store
    on loopback need not share this filesystem), another user's, or a read that did not
    end within the timeout (`stuck`: the reader may still write into the buffer). Not the
    store's fault: GetBlocks streams the same blocks."""

    def __init__(self, message: str, stuck: bool = False, missing: bytes = b"") -> None:
        super().__init__(message)
        self.stuck = stuck
        self.missing = missing  # the key of a block whose file is not here (the store's too?)


def read_locations(
    locations: Sequence[pb.BlockLocation],
    view: memoryview,
    reader: Executor,
    timeout: float | None = None,
) -> list[StoredBlock]:
    """Reads located blocks back to back into `view`, verifying each.

    The reader thread's preadv releases the GIL, so the next block is read while this
    thread checksums the last one. Raises CorruptFile for the first bad block, and
    FilesUnreadable for one that cannot be read here, or not within `timeout` seconds.
    """
    slices, pos = [], 0
    for location in locations:
        slices.append(view[pos : pos + located_bytes(location)])
        pos += len(slices[-1])
    pending = [reader.submit(_read_file, loc, v) for loc, v in zip(locations, slices, strict=True)]
    stuck = False
    try:
        blocks = []
        for location, block_view, read in zip(locations, slices, pending, strict=True):
            try:
                read.result(timeout)
            except TimeoutError:  # a hung mount: preadv cannot be interrupted
                stuck = True
                raise FilesUnreadable(
                    f"block {location.key.hex()}: {location.path} was not read within "
                    f"{timeout:g} s",
                    stuck=True,
                ) from None
            _verify(location, block_view)
            blocks.append(block_from_header(location, block_view))
        return blocks
    finally:
        for read in pending:
            read.cancel()
        if not stuck:
            wait(pending)  # nothing may still write into the caller's buffer


def _read_file(location: pb.BlockLocation, view: memoryview) -> None:
    """One preadv per run of adjacent segments: one syscall (and one GIL release) a block."""
    key = location.key
    try:
        fd = os.open(location.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there: no hang
    except FileNotFoundError as exc:  # lost, or another mount's: the store knows which
        said = f"block {key.hex()} file {location.path} is missing"
        raise FilesUnreadable(said, missing=key) from exc
    except OSError as exc:  # under its lease the store keeps it: it is not ours to read
        said = f"block {key.hex()}: {location.path} cannot be read here ({exc.strerror})"
        raise FilesUnreadable(said) from exc
    try:
        pos = 0
        for offset, size in _runs(location.segments):
            try:
                read = os.preadv(fd, [view[pos : pos + size]], offset)
            except OSError as exc:  # EIO, or no file to read at an offset: the store judges
                raise FilesUnreadable(
                    f"block {key.hex()}: {location.path}: {exc.strerror}"
                ) from exc
            if read != size:
                raise CorruptFile(f"block {key.hex()} file is truncated at {offset}", key)
            pos += size
    finally:
        os.close(fd)


def _runs(segments: Sequence[pb.Segment]) -> Iterator[tuple[int, int]]:
    """(offset, size) of each run of segments that lie back to back in the file."""
    offset, size = -1, 0
    for s in segments:
        if s.offset != offset + size:
            if size:
                yield offset, size
            offset, size = s.offset, 0
        size += s.num_bytes
    if size:
        yield offset, size


def _verify(location: pb.BlockLocation, view: memoryview) -> None:
    pos = 0
    for s in location.segments:
        if xxhash.xxh3_64_intdigest(view[pos : pos + s.num_bytes]) != s.checksum:
            raise CorruptFile(
                f"block {location.key.hex()} layer {s.layer} failed its checksum", location.key
            )
        pos += s.num_bytes
