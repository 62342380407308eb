"""Blocks in: a PutBlocks stream becomes durable, indexed, deduplicated, leased blocks.

Order per block: bytes to a temporary file with per-layer checksums, fsync; then, one upload
at a time, rename into place, fsync the directory and commit the index entry. Two uploads of
the same block race harmlessly: the first to publish wins, the other is a dedup hit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from agentkv import ids
from agentkv.errors import (
    BlockNotFound,
    CorruptBlock,
    FailedPrecondition,
    InvalidArgument,
    ReplyTooLarge,
)
from agentkv.keys import block_key
from cache_store import validation
from cache_store.capacity import Capacity, now_ms
from cache_store.leases import BlockId, StreamLease
from cache_store.parts import Parts
from cache_store.payloads import BlockWriter, safetensors_header
from cache_store.records import BlockRecord
from cache_store.validation import TensorLayout

PUT_RESULT_BYTES = 64  # the most a PutBlockResult takes in a PutBlocksResponse, framed


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
    """One block arriving in chunks; with no writer, the namespace holds it already.

    Disk space is reserved as bytes arrive, never for what a header merely declares: a
    stream that sends headers and no data holds nothing and makes nobody evict."""

    record: BlockRecord  # the stored twin, or a draft completed when published
    layout: list[TensorLayout]
    writer: BlockWriter | None
    received: int = 0
    reserved: int = 0  # bytes of this upload counted against the quotas

    @property
    def block(self) -> BlockId:
        return (self.record.namespace, self.record.key)

    @property
    def expected(self) -> int:
        return sum(t.num_bytes for t in self.layout)


class Uploads:
    def __init__(
        self,
        parts: Parts,
        capacity: Capacity,
        quarantine: Callable[[BlockRecord, str], None],
        before_write: Callable[[str], None] = lambda namespace: None,
        stored: Callable[[BlockRecord], None] = lambda record: None,
    ) -> None:
        self.config, self.index, self.payloads = parts.config, parts.index, parts.payloads
        self.leases, self.capacity, self.metrics = parts.leases, capacity, parts.metrics
        self.quarantine = quarantine
        self.before_write = before_write  # may refuse the namespace (another store writes it)
        self.stored = stored  # told of every block newly stored (the object store's queue)
        self.publish_lock = parts.publish_lock

    def put_stream(
        self, items: Iterator[PutHeader | memoryview]
    ) -> tuple[list[PutResult], str, int]:
        """Stores blocks from a stream of headers, each followed by its bytes as chunks.

        Every stored block stays leased until the returned lease is released, the agent
        commit that names it arrives, or the lease expires, lease_seconds after the stream
        ends however long it ran.
        """
        lease = StreamLease(self.leases, self.config.lease_seconds)
        results: list[PutResult] = []
        upload: BlockUpload | None = None
        try:
            for item in items:
                if isinstance(item, PutHeader):
                    if upload is not None:
                        self._finish(upload)  # raises: the open block is short
                    self._check_reply_room(len(results))
                    upload = self.begin(item, lease)
                else:
                    self._write(upload, item)
                    self._renew(lease, upload)
                if upload.received == upload.expected:  # durable now, not at the next header
                    results.append(self._finish(upload))
                    upload = None
            if upload is not None:
                self._finish(upload)  # raises: the stream ended inside a block
            self._renew(lease)  # the reply's expiry counts from the stream's end
        except BaseException:
            if upload is not None:
                self._release(upload)
            lease.release()
            raise
        return results, lease.lease_id, lease.expires

    def _check_reply_room(self, stored: int) -> None:
        """Refuses a stream's next block past what its reply can name (one result each
        within the message limit): the whole stream would be stored, then its reply, the
        lease with it, refused by gRPC."""
        most = self.config.max_message_bytes // PUT_RESULT_BYTES
        if stored >= most:
            raise ReplyTooLarge(
                f"a PutBlocks stream takes at most {most} blocks (its reply names each, within "
                f"{self.config.max_message_bytes} bytes): put them in streams of at most "
                f"{most}, this one's again too (they are not leased; stored, they deduplicate)"
            )

    def begin(self, header: PutHeader, lease: StreamLease) -> BlockUpload:
        """Opens a block's upload; its key is leased before the store looks for a twin, so
        a twin found (a dedup hit) cannot be collected before the commit that names it, and
        so is its parent, found stored: unleased and no agent's, it went while the block's
        bytes came in, and a commit of the chain found it gone."""
        ns = ids.namespace(header.namespace)
        fp = ids.fingerprint(header.fingerprint)
        parent = ids.key(header.parent_key, "parent_key", allow_root=True)
        tokens = ids.token_ids(header.token_ids, self.config.max_block_tokens)
        if not tokens:
            raise InvalidArgument("a block needs at least one token")
        layout = validation.tensor_layout(header.tensors, self.config.max_block_bytes)
        self.before_write(ns)
        key = block_key(fp, parent, tokens)
        if lease.hold((ns, key), *([(ns, parent)] if parent else [])):
            self._check_kept(lease, writing=(ns, key))  # looked for just below
        with self.index.read() as txn:
            if parent:
                self._require_parent(txn, ns, fp, parent)
            existing = self.index.find_block(txn, ns, key)  # a bad record: replaced
        if existing is not None:
            same_tensors(existing, layout)
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
        self.capacity.check_fits(size, ns)  # refuse at once what could never fit
        self.capacity.reserve(len(file_header), ns)
        try:
            writer = self.payloads.writer(file_header, layout, self.capacity.free_disk)
        except BaseException:
            self.capacity.unreserve(len(file_header), ns)
            raise
        draft = BlockRecord(
            ns, key, parent, fp, tokens, [], [], size, self.payloads.relpath(ns, key), now_ms()
        )
        return BlockUpload(draft, layout, writer, reserved=len(file_header))

    def _require_parent(self, txn: object, ns: str, fp: str, parent: bytes) -> None:
        """A parent must be stored first: FAILED_PRECONDITION, as store.proto says."""
        try:
            self.index.require_block(txn, ns, fp, parent, "parent_key")
        except BlockNotFound as exc:
            raise FailedPrecondition(f"{exc.message}: put the parent block first") from None

    def _intact(self, record: BlockRecord) -> bool:
        """Whether a stored twin's file is whole (a stat), or safe in the object store; a lost
        one is quarantined, so this upload replaces it and heals every manifest that
        references it."""
        if not record.local:
            return True
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
        if upload.received + len(chunk) > upload.expected:
            raise InvalidArgument(
                f"block {upload.record.key.hex()} sent {upload.received + len(chunk)}+ bytes but "
                f"its tensors declare {upload.expected}"
            )
        upload.received += len(chunk)
        if upload.writer is not None:
            self.capacity.reserve(len(chunk), upload.record.namespace)
            upload.reserved += len(chunk)
            upload.writer.write(chunk)

    def _finish(self, upload: BlockUpload) -> PutResult:
        if upload.received != upload.expected:
            raise InvalidArgument(
                f"block {upload.record.key.hex()} received {upload.received} bytes but its "
                f"tensors declare {upload.expected}"
            )
        if upload.writer is not None:
            return self._publish(upload)
        self.metrics.dedup_hits.inc()
        return _result(upload.record, deduplicated=True)

    def _renew(self, lease: StreamLease, pending: BlockUpload | None = None) -> None:
        if lease.renew():
            writing = pending is not None and pending.writer is not None
            self._check_kept(lease, pending.block if writing else None)

    def _check_kept(self, lease: StreamLease, writing: BlockId | None = None) -> None:
        """After the stream paused past its lease: every block it holds but the one it is
        `writing` must be stored still, or the stream fails (a put of them again stores what
        was collected)."""
        with self.index.read() as txn:
            gone = [b for b in lease.blocks if b != writing and not self.index.find_block(txn, *b)]
        if gone:
            raise FailedPrecondition(
                f"block {gone[0][1].hex()} of this PutBlocks stream was collected while the "
                f"stream paused past its lease ({self.config.lease_seconds} s): put it again"
            )

    def _publish(self, upload: BlockUpload) -> PutResult:
        """fsync, then, one upload at a time: rename into place and index (or find a twin)."""
        writer = upload.writer
        assert writer is not None
        try:
            tensors = [t._replace(offset=t.offset + writer.header_len) for t in upload.layout]
            record = replace(upload.record, segments=writer.seal(), tensors=tensors)
            with self.publish_lock:
                with self.index.read() as txn:
                    twin = self.index.find_block(txn, record.namespace, record.key)
                if twin is None:
                    writer.publish(self.payloads.path(record.relpath))
                    self._index(record)
                else:
                    same_tensors(twin, upload.layout)
        finally:
            self._release(upload)
        self.capacity.touch_block((record.namespace, record.key))
        if twin is not None:  # a concurrent upload of the same block published first
            self.metrics.dedup_hits.inc()
            return _result(twin, deduplicated=True)
        self.metrics.put_bytes.inc(record.num_bytes)
        self.stored(record)
        return _result(record, deduplicated=False)

    def _index(self, record: BlockRecord) -> None:
        try:
            self.capacity.with_room(self._put_record, record)  # the index grows too
        except BaseException:
            self.payloads.delete(record)  # renamed but never indexed: not a block
            raise

    def _put_record(self, record: BlockRecord) -> None:
        with self.index.write() as txn:
            self.index.put_block(txn, record)

    def _release(self, upload: BlockUpload) -> None:
        """Ends an upload's claim on disk space and its temporary file, whatever happened."""
        if upload.writer is not None:
            upload.writer.abort()
            self.capacity.unreserve(upload.reserved, upload.record.namespace)
            upload.writer, upload.reserved = None, 0


def same_tensors(stored: BlockRecord, layout: list[TensorLayout]) -> None:
    """A put of a stored block must declare the stored tensors exactly: a dedup hit never
    accepts other bytes under a key (FailedPrecondition naming the first difference)."""
    declared = [(t.name, t.dtype, tuple(t.shape), t.num_bytes) for t in layout]
    held = [(t.name, t.dtype, tuple(t.shape), t.num_bytes) for t in stored.tensors]
    if declared == held:
        return
    for i, (mine, theirs) in enumerate(zip(declared, held, strict=False)):
        if mine != theirs:
            raise FailedPrecondition(
                f"block {stored.key.hex()} is stored with tensor {theirs[0]!r} {theirs[1]} "
                f"{list(theirs[2])}, but this put declares tensors[{i}] {mine[0]!r} {mine[1]} "
                f"{list(mine[2])}: the same key must hold the same tensors"
            )
    raise FailedPrecondition(
        f"block {stored.key.hex()} is stored with {len(held)} tensors, but this put declares "
        f"{len(declared)}: the same key must hold the same tensors"
    )


def _result(record: BlockRecord, deduplicated: bool) -> PutResult:
    return PutResult(record.key, len(record.token_ids), record.num_bytes, deduplicated)
