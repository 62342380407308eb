"""Blocks in: a PutBlocks stream becomes durable, indexed, deduplicated, leased blocks.

Order per block: bytes to a temporary file with per-layer checksums, fsync; then, one upload
at a time, rename into place, fsync the directory and commit the index entry. Two uploads of
the same block race harmlessly: the first to publish wins, the other is a dedup hit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from agentkv.errors import CorruptBlock, InvalidArgument
from agentkv.keys import block_key
from cache_store import validation
from cache_store.capacity import Capacity, now_ms
from cache_store.config import StoreConfig
from cache_store.index import Index
from cache_store.leases import Leases
from cache_store.metrics import StoreMetrics
from cache_store.payloads import BlockWriter, Payloads, safetensors_header
from cache_store.records import BlockRecord
from cache_store.validation import TensorLayout


@dataclass(slots=True)
class PutHeader:
    namespace: str
    fingerprint: str
    parent_key: bytes
    token_ids: list[int]
    tensors: list[tuple[str, str, list[int]]]  # (name, dtype, shape)


@dataclass(slots=True)
class PutResult:
    key: bytes
    num_tokens: int
    num_bytes: int
    deduplicated: bool


@dataclass(slots=True)
class BlockUpload:
    """One block arriving in chunks; with no writer, the namespace holds it already."""

    record: BlockRecord  # the stored twin, or a draft completed when published
    layout: list[TensorLayout]
    writer: BlockWriter | None
    received: int = 0

    @property
    def expected(self) -> int:
        return sum(t.num_bytes for t in self.layout)

    def write(self, data: memoryview) -> None:
        if self.received + len(data) > self.expected:
            raise InvalidArgument(
                f"block {self.record.key.hex()} sent {self.received + len(data)}+ bytes but its "
                f"tensors declare {self.expected}"
            )
        self.received += len(data)
        if self.writer is not None:
            self.writer.write(data)


class Uploads:
    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        payloads: Payloads,
        leases: Leases,
        capacity: Capacity,
        metrics: StoreMetrics,
        quarantine: Callable[[BlockRecord, str], None],
    ) -> None:
        self.config, self.index, self.payloads = config, index, payloads
        self.leases, self.capacity, self.metrics = leases, capacity, metrics
        self.quarantine = quarantine
        self.publish_lock = threading.Lock()  # rename..index commit, against the orphan sweep

    def put_stream(
        self, items: Iterator[PutHeader | memoryview]
    ) -> tuple[list[PutResult], str, int]:
        """Stores blocks from a stream of headers, each followed by its bytes as chunks.

        Every stored block stays leased until the returned lease is released, the agent
        commit that names it arrives, or the lease expires.
        """
        lease_id, expires = self.leases.grant([], self.config.lease_seconds)
        results: list[PutResult] = []
        upload: BlockUpload | None = None
        try:
            for item in items:
                if isinstance(item, PutHeader):
                    if upload is not None:
                        self._finish(upload, lease_id)  # raises: the open block is short
                    upload = self.begin(item)
                else:
                    self._write(upload, item)
                if upload.received == upload.expected:  # durable now, not at the next header
                    results.append(self._finish(upload, lease_id))
                    upload = None
            if upload is not None:
                self._finish(upload, lease_id)  # raises: the stream ended inside a block
        except BaseException:
            if upload is not None:
                self._release(upload)
            self.leases.release(lease_id)
            raise
        return results, lease_id, expires

    def begin(self, header: PutHeader) -> BlockUpload:
        ns = validation.namespace(header.namespace)
        fp = validation.fingerprint(header.fingerprint)
        parent = validation.key(header.parent_key, "parent_key", allow_root=True)
        tokens = validation.token_ids(header.token_ids, self.config.max_block_tokens)
        if not tokens:
            raise InvalidArgument("a block needs at least one token")
        layout = validation.tensor_layout(header.tensors, self.config.max_block_bytes)
        key = block_key(fp, parent, tokens)
        with self.index.read() as txn:
            if parent:
                self.index.require_block(txn, ns, fp, parent, "parent_key")
            existing = self.index.get_block(txn, ns, key)
        if existing is not None and self._intact(existing):
            self.capacity.touch_block((ns, key))
            return BlockUpload(existing, layout, writer=None)
        meta = {
            "format": "agentkv-block-v1",
            "key": key.hex(),
            "parent": parent.hex(),
            "fingerprint": fp,
            "namespace": ns,
            "num_tokens": str(len(tokens)),
        }
        file_header = safetensors_header(layout, meta)
        size = len(file_header) + sum(t.num_bytes for t in layout)
        self.capacity.reserve(size, ns)
        try:
            writer = self.payloads.writer(file_header, layout)
        except BaseException:
            self.capacity.unreserve(size, ns)
            raise
        draft = BlockRecord(
            ns, key, parent, fp, tokens, [], [], size, self.payloads.relpath(ns, key), now_ms()
        )
        return BlockUpload(draft, layout, writer)

    def _intact(self, record: BlockRecord) -> bool:
        """Whether a stored twin's file is whole (a stat); a lost one is quarantined, so this
        upload replaces it and heals every manifest that references it."""
        try:
            self.payloads.check_size(record)
        except CorruptBlock as exc:
            self.quarantine(record, f"{exc.message} (found by a re-upload, which replaces it)")
            return False
        return True

    def _write(self, upload: BlockUpload | None, chunk: memoryview) -> None:
        if upload is None:
            raise InvalidArgument("a chunk arrived with no block open: send a header first")
        if len(chunk) > self.config.max_chunk_bytes:
            limit = self.config.max_chunk_bytes
            raise InvalidArgument(f"chunk of {len(chunk)} bytes exceeds the limit {limit}")
        upload.write(chunk)

    def _finish(self, upload: BlockUpload, lease_id: str) -> PutResult:
        if upload.received != upload.expected:
            raise InvalidArgument(
                f"block {upload.record.key.hex()} received {upload.received} bytes but its "
                f"tensors declare {upload.expected}"
            )
        if upload.writer is None:
            self.metrics.dedup_hits.inc()
            result = _result(upload.record, deduplicated=True)
        else:
            result = self._publish(upload)
        self.leases.extend(lease_id, [(upload.record.namespace, result.key)])
        return result

    def _publish(self, upload: BlockUpload) -> PutResult:
        """fsync, then, one upload at a time: rename into place and index (or find a twin)."""
        writer = upload.writer
        assert writer is not None
        try:
            tensors = [t._replace(offset=t.offset + writer.header_len) for t in upload.layout]
            record = replace(upload.record, segments=writer.seal(), tensors=tensors)
            with self.publish_lock:
                with self.index.read() as txn:
                    twin = self.index.get_block(txn, record.namespace, record.key)
                if twin is None:
                    writer.publish(self.payloads.path(record.relpath))
                    self._index(record)
        finally:
            self._release(upload)
        self.capacity.touch_block((record.namespace, record.key))
        if twin is not None:  # a concurrent upload of the same block published first
            self.metrics.dedup_hits.inc()
            return _result(twin, deduplicated=True)
        self.metrics.put_bytes.inc(record.num_bytes)
        return _result(record, deduplicated=False)

    def _index(self, record: BlockRecord) -> None:
        try:
            with self.index.write() as txn:
                self.index.put_block(txn, record)
        except BaseException:
            self.payloads.delete(record)  # renamed but never indexed: not a block
            raise

    def _release(self, upload: BlockUpload) -> None:
        """Ends an upload's claim on disk space and its temporary file, whatever happened."""
        if upload.writer is not None:
            upload.writer.abort()
            self.capacity.unreserve(upload.record.num_bytes, upload.record.namespace)
            upload.writer = None


def _result(record: BlockRecord, deduplicated: bool) -> PutResult:
    return PutResult(record.key, len(record.token_ids), record.num_bytes, deduplicated)
