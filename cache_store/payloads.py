"""Block payload files: safetensors on disk, written durably, read back with checksums.

Layout under the data directory:
  blocks/<namespace>/<first two hex of key>/<key hex>.safetensors   one immutable file per block
  tmp/<random>.part                                                 uploads in flight
  quarantine/<namespace>/<key hex>.<unix ms>.safetensors            payloads that failed a check

A file is the safetensors header (tensors in upload order, layers ascending, so each layer's
tensors are one contiguous range) followed by the data. Each layer's range, and the header,
carries its own xxh3_64 checksum in the index, so a reader of some layers verifies only those.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from agentkv.errors import CorruptBlock, DiskFull, InvalidArgument, Unavailable, os_error_words
from cache_store.records import HEADER_LAYER, BlockRecord, Segment
from cache_store.validation import TensorLayout

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
# The data directory's permissions changed, it went away, or its disk fails: the store's
# trouble, not the call's; any other error is a bug, and stays INTERNAL with its traceback.
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EIO}
SUFFIX = ".safetensors"


def safetensors_header(layout: Sequence[TensorLayout], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file, padded to 8 bytes."""
    header: dict[str, object] = {"__metadata__": metadata}
    for t in layout:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [t.offset, t.offset + t.num_bytes],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def layer_ranges(layout: Sequence[TensorLayout]) -> list[tuple[int, int, int]]:
    """(layer, start, end) data-section ranges, one per layer, in order."""
    ranges: list[tuple[int, int, int]] = []
    for t in layout:
        end = t.offset + t.num_bytes
        if ranges and ranges[-1][0] == t.layer:
            ranges[-1] = (t.layer, ranges[-1][1], end)
        else:
            ranges.append((t.layer, t.offset, end))
    return ranges


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_error(exc: OSError, what: str) -> Exception:
    """A write's OSError as the caller's status: a full disk, or a data directory the store
    cannot write (its permissions changed, or it was deleted): not a crash of the call."""
    if exc.errno in _NO_SPACE:
        return DiskFull(f"no space left on the store's disk while {what}")
    if exc.errno in _UNWRITABLE:
        said = os_error_words(exc)
        return Unavailable(f"the store cannot write its data directory while {what}: {said}")
    return exc


class BlockWriter:
    """Writes one block to a temporary file, checksumming each layer as bytes arrive."""

    def __init__(
        self,
        tmp_path: Path,
        layout: list[TensorLayout],
        header: bytes,
        on_full: Callable[[int], bool] = lambda need: False,
    ) -> None:
        self.tmp_path = tmp_path
        self.on_full = on_full  # asked to free `need` bytes when the disk is full
        self.header_len = len(header)
        self.expected = sum(t.num_bytes for t in layout)
        self.written = 0
        self._ranges = layer_ranges(layout)
        self._segments = [Segment(HEADER_LAYER, 0, len(header), xxhash.xxh3_64_intdigest(header))]
        self._hasher = xxhash.xxh3_64()
        self._fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            self._write_all(memoryview(header))
        except BaseException:
            self.abort()
            raise

    def write(self, data: memoryview) -> None:
        if self.written + len(data) > self.expected:
            raise InvalidArgument(
                f"block sends more bytes than its tensors declare ({self.expected} bytes)"
            )
        self._write_all(data)
        self._hash(data)

    def seal(self) -> list[Segment]:
        """Checks the byte count and fsyncs the data; returns the checksummed segments."""
        if self.written != self.expected:
            raise InvalidArgument(
                f"block received {self.written} bytes but its tensors declare {self.expected}"
            )
        self._close_finished_segments()
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        except OSError as exc:
            raise _disk_error(exc, "saving a block") from exc
        return self._segments

    def publish(self, final_path: Path) -> None:
        """Renames the sealed file into place and makes the rename durable."""
        try:
            final_path.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.tmp_path, final_path)
            _fsync_dir(final_path.parent)
        except OSError as exc:
            raise _disk_error(exc, "saving a block") from exc

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp_path.unlink(missing_ok=True)

    def _write_all(self, data: memoryview) -> None:
        """Writes everything; a full disk first asks on_full for room, then DiskFull."""
        while data:
            try:
                data = data[os.write(self._fd, data) :]
            except OSError as exc:
                if exc.errno in _NO_SPACE and self.on_full(len(data)):
                    continue
                raise _disk_error(exc, "writing a block") from exc

    def _hash(self, data: memoryview) -> None:
        while True:
            self._close_finished_segments()
            if not data:
                return
            end = self._ranges[len(self._segments) - 1][2]
            take = min(len(data), end - self.written)
            self._hasher.update(data[:take])
            self.written += take
            data = data[take:]

    def _close_finished_segments(self) -> None:
        while len(self._segments) <= len(self._ranges):
            layer, start, end = self._ranges[len(self._segments) - 1]
            if self.written != end:
                return
            checksum = self._hasher.intdigest()
            self._segments.append(Segment(layer, self.header_len + start, end - start, checksum))
            self._hasher.reset()


class Payloads:
    """The payload files of every block, under one data directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        for d in (root / "blocks", self.tmp_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._check_writable()
        self._opened = self._identity()

    def _identity(self) -> tuple[tuple[int, int], ...]:
        """(device, inode) of the data directory and its blocks/ folder."""
        return tuple(
            (st.st_dev, st.st_ino) for st in map(os.stat, (self.root, self.root / "blocks"))
        )

    def check_root(self) -> None:
        """Unavailable unless the data directory is still the one the store opened: deleted,
        moved, or a volume unmounted from under it, every block's file reads as missing, and
        each would be quarantined (lost, without an object store) for the store's trouble."""
        try:
            same = self._identity() == self._opened
        except OSError:
            same = False
        if not same:
            raise Unavailable(
                f"the store's data directory {self.root} is not the one it opened (deleted, "
                "moved or unmounted while it ran): put it back, or restart the store"
            )

    def _missing(self, record: BlockRecord) -> CorruptBlock:
        self.check_root()  # a block's file, not the whole directory
        return CorruptBlock(f"block {record.key.hex()} payload file is missing")

    def _check_writable(self) -> None:
        """Raises OSError (at start) unless a block can be written and moved into place:
        a data directory another user owns, or a read-only one, fails every write. A full
        disk is no reason not to start: the store makes room as it writes."""
        probe = self.tmp_dir / f"{secrets.token_hex(8)}.probe"
        placed = self.root / "blocks" / probe.name
        try:
            probe.touch(exist_ok=False)
            os.rename(probe, placed)
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
        finally:
            probe.unlink(missing_ok=True)
            placed.unlink(missing_ok=True)

    @staticmethod
    def relpath(namespace: str, key: bytes) -> str:
        h = key.hex()
        return f"blocks/{namespace}/{h[:2]}/{h}{SUFFIX}"

    def path(self, relpath: str) -> Path:
        return self.root / relpath

    def writer(
        self, header: bytes, layout: list[TensorLayout], on_full: Callable[[int], bool]
    ) -> BlockWriter:
        tmp = self.tmp_dir / f"{secrets.token_hex(8)}.part"
        try:
            return BlockWriter(tmp, layout, header, on_full)
        except OSError as exc:
            raise _disk_error(exc, "starting a block") from exc

    def read(
        self, record: BlockRecord, segments: Sequence[Segment], max_run: int
    ) -> Iterator[memoryview]:
        """Yields the segments' bytes in runs of at most max_run bytes.

        A run of whole segments is verified before it is yielded. A segment larger than
        max_run goes out in pieces, hashed as they pass, and its last piece only once the
        whole segment matched its checksum: a reader never completes an unverified layer,
        and a reader's memory stays max_run however large a layer is.
        A view is only valid until the next one is requested (the buffer is reused).
        Raises CorruptBlock for a missing, short or mismatching file.
        """
        try:
            fd = os.open(self.path(record.relpath), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise self._missing(record) from exc
        try:
            buffer = bytearray(max_run)
            for run in _runs(segments, max_run):
                if run[0].num_bytes > max_run:
                    yield from self._read_large(fd, record, run[0], buffer)
                else:
                    yield self._read_run(fd, record, run, buffer)
        finally:
            os.close(fd)

    def _read_large(
        self, fd: int, record: BlockRecord, s: Segment, buffer: bytearray
    ) -> Iterator[memoryview]:
        hasher = xxhash.xxh3_64()
        for start in range(0, s.num_bytes, len(buffer)):
            piece = memoryview(buffer)[: min(len(buffer), s.num_bytes - start)]
            self._pread(fd, record, piece, s.offset + start)
            hasher.update(piece)
            if start + len(piece) == s.num_bytes and hasher.intdigest() != s.checksum:
                raise _checksum_error(record, s)
            yield piece

    def _read_run(
        self, fd: int, record: BlockRecord, run: list[Segment], buffer: bytearray
    ) -> memoryview:
        """One preadv and one hash per segment, so each layer is hashed while still in cache."""
        size = sum(s.num_bytes for s in run)
        view = memoryview(buffer)[:size]
        pos = 0
        for s in run:
            segment = view[pos : pos + s.num_bytes]
            self._pread(fd, record, segment, s.offset)
            if xxhash.xxh3_64_intdigest(segment) != s.checksum:
                raise _checksum_error(record, s)
            pos += s.num_bytes
        return view

    @staticmethod
    def _pread(fd: int, record: BlockRecord, into: memoryview, offset: int) -> None:
        got = os.preadv(fd, [into], offset)
        if got != len(into):
            raise CorruptBlock(
                f"block {record.key.hex()} payload is truncated: wanted {len(into)} bytes "
                f"at {offset}, file has {got}"
            )

    def verify(self, record: BlockRecord) -> None:
        """Reads and checks the whole file; raises CorruptBlock."""
        self.check_size(record)
        for _ in self.read(record, record.segments, 8 << 20):
            pass

    def check_size(self, record: BlockRecord) -> None:
        """Raises CorruptBlock when the file is missing or not the indexed size: one stat."""
        size = self._size(record)
        if size != record.num_bytes:
            raise CorruptBlock(
                f"block {record.key.hex()} payload is {size} bytes, index says {record.num_bytes}"
            )

    def _size(self, record: BlockRecord) -> int:
        try:
            return self.path(record.relpath).stat().st_size
        except FileNotFoundError as exc:
            raise self._missing(record) from exc

    def quarantine(self, record: BlockRecord) -> Path | None:
        """Moves a bad payload aside for inspection; None if the file was already gone."""
        src = self.path(record.relpath)
        dest_dir = self.quarantine_dir / record.namespace
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f"{record.key.hex()}.{int(time.time() * 1000)}{SUFFIX}"
        try:
            os.rename(src, dest)
        except FileNotFoundError:
            return None
        _fsync_dir(dest_dir)
        _fsync_dir(src.parent)
        return dest

    def delete(self, record: BlockRecord) -> None:
        path = self.path(record.relpath)
        path.unlink(missing_ok=True)

    def sweep_tmp(self) -> int:
        """Removes the uploads cut short (and disk probes) a stop left in tmp/: only the
        store's own files, never what else a directory not made for the store holds there."""
        count = 0
        for pattern in ("*.part", "*.probe"):
            for part in self.tmp_dir.glob(pattern):
                part.unlink(missing_ok=True)
                count += 1
        return count

    def block_files(self, namespace: str | None = None) -> Iterator[str]:
        """Relative paths of every payload file under blocks/ (of one namespace's, given)."""
        for path in (self.root / "blocks").glob(f"{namespace or '*'}/*/*{SUFFIX}"):
            yield str(path.relative_to(self.root))

    def disk_free(self) -> int:
        self.check_root()
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


def _checksum_error(record: BlockRecord, s: Segment) -> CorruptBlock:
    return CorruptBlock(
        f"block {record.key.hex()} failed its checksum (layer {s.layer}, "
        f"bytes {s.offset}..{s.offset + s.num_bytes})"
    )


def _runs(segments: Sequence[Segment], max_run: int) -> Iterator[list[Segment]]:
    """Groups adjacent segments into runs of at most max_run bytes (a bigger segment alone)."""
    run: list[Segment] = []
    size = 0
    for s in segments:
        adjacent = run and run[-1].offset + run[-1].num_bytes == s.offset
        if run and (not adjacent or size + s.num_bytes > max_run):
            yield run
            run, size = [], 0
        run.append(s)
        size += s.num_bytes
    if run:
        yield run
