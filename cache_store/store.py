"""The cache store's domain: blocks in, blocks out, manifests, leases, quarantine and quota.

Never sees protobuf (the servicer converts) and never imports MLX: a block is named, typed
arrays of bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from agentkv.errors import (
    BlockNotFound,
    CorruptBlock,
    FingerprintMismatch,
    InvalidArgument,
    QuotaExceeded,
)
from agentkv.keys import block_key
from cache_store import manifests, validation
from cache_store.config import StoreConfig
from cache_store.index import Index
from cache_store.leases import BlockId, Leases
from cache_store.metrics import StoreMetrics
from cache_store.payloads import BlockWriter, Payloads, safetensors_header
from cache_store.records import AgentRecord, BlockRecord, Segment
from cache_store.validation import TensorLayout

log = logging.getLogger("agentkv.store")


def now_ms() -> int:
    return int(time.time() * 1000)


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
class Selection:
    """The tensors and checksummed segments of a block that a reader asked for."""

    record: BlockRecord
    tensors: list[TensorLayout]
    segments: list[Segment]

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.segments)

    @property
    def identity(self) -> tuple:
        """Names these exact bytes: a re-uploaded block gets a new created_ms and checksums."""
        r = self.record
        return (
            r.namespace,
            r.key,
            r.created_ms,
            tuple((s.layer, s.checksum) for s in self.segments),
        )


class CacheStore:
    def __init__(self, config: StoreConfig, metrics: StoreMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or StoreMetrics()
        self.payloads = Payloads(config.data_dir)
        self.index = Index(config.data_dir / "index", config.lmdb_map_bytes)
        self.leases = Leases()
        self._space_lock = threading.Lock()  # reservations and evictions
        self._publish_lock = threading.Lock()  # rename..index commit vs the orphan sweep
        self._reserved = 0
        self._access: dict[BlockId, int] = {}
        self._agent_access: dict[tuple[str, str], int] = {}
        self.recover()
        self.metrics.watch_usage(self.stats)

    def close(self) -> None:
        self.index.close()

    # start-up

    def recover(self) -> None:
        """Sweeps uploads cut short and orphans, and quarantines entries whose file is gone."""
        tmp = self.payloads.sweep_tmp()
        orphans = self._remove_orphans()
        with self.index.read() as txn:
            records = list(self.index.blocks(txn, None))
        lost = 0
        for record in records:
            path = self.payloads.path(record.relpath)
            size = path.stat().st_size if path.exists() else -1
            if size != record.num_bytes:
                self._quarantine(
                    record, f"file is {size} bytes at start-up, index says {record.num_bytes}"
                )
                lost += 1
        log.info(
            "recovered",
            extra={
                "tmp_removed": tmp,
                "orphans_removed": orphans,
                "blocks": len(records) - lost,
                "quarantined": lost,
            },
        )

    # blocks in

    def begin_put(self, header: PutHeader) -> BlockUpload:
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
                self._require(txn, ns, fp, parent, "parent_key")
            existing = self.index.get_block(txn, ns, key)
        if existing is not None:
            self._touch(ns, key)
            return BlockUpload(self, existing, layout, writer=None)
        meta = {
            "format": "agentkv-block-v1",
            "key": key.hex(),
            "parent": parent.hex(),
            "fingerprint": fp,
            "namespace": ns,
            "num_tokens": str(len(tokens)),
        }
        header = safetensors_header(layout, meta)
        size = len(header) + sum(t.num_bytes for t in layout)
        self._reserve(size)
        try:
            writer = self.payloads.writer(header, layout)
        except BaseException:
            self._unreserve(size)
            raise
        record = BlockRecord(
            ns, key, parent, fp, tokens, [], [], size, self.payloads.relpath(ns, key), now_ms()
        )
        return BlockUpload(self, record, layout, writer)

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
                        results.append(self._finish(upload, lease_id))
                    upload = self.begin_put(item)
                elif upload is None:
                    raise InvalidArgument("a chunk arrived before any block header")
                elif len(item) > self.config.max_chunk_bytes:
                    limit = self.config.max_chunk_bytes
                    raise InvalidArgument(f"chunk of {len(item)} bytes exceeds the limit {limit}")
                else:
                    upload.write(item)
            if upload is not None:
                results.append(self._finish(upload, lease_id))
                upload = None
        except BaseException:
            if upload is not None:
                upload.abort()
            self.leases.release(lease_id)
            raise
        return results, lease_id, expires

    def _finish(self, upload: BlockUpload, lease_id: str) -> PutResult:
        result = upload.finish()
        self.leases.extend(lease_id, [(upload.record.namespace, result.key)])
        return result

    def _publish(self, upload: BlockUpload) -> PutResult:
        """fsync, then, one upload at a time: rename into place and index (or find a twin)."""
        writer, draft = upload.writer, upload.record
        assert writer is not None
        try:
            segments = writer.seal()
            tensors = [_shift(t, writer.header_len) for t in upload.layout]
            record = replace(draft, segments=segments, tensors=tensors)
            with self._publish_lock:
                with self.index.read() as txn:
                    twin = self.index.get_block(txn, record.namespace, record.key)
                if twin is None:  # else a concurrent upload of the same block got there first
                    writer.publish(self.payloads.path(record.relpath))
                    self._index_block(record)
        finally:
            self._release(upload)
        self._touch(record.namespace, record.key)
        if twin is not None:
            self.metrics.dedup_hits.inc()
            return PutResult(twin.key, len(twin.token_ids), twin.num_bytes, deduplicated=True)
        self.metrics.put_bytes.inc(record.num_bytes)
        return PutResult(record.key, len(record.token_ids), record.num_bytes, deduplicated=False)

    def _index_block(self, record: BlockRecord) -> None:
        try:
            with self.index.write() as txn:
                self.index.put_block(txn, record)
        except BaseException:
            self.payloads.delete(record)  # renamed but never indexed: not a block
            raise

    # blocks out

    def select(
        self, namespace: str, fingerprint: str, keys: Sequence[bytes], layers: Sequence[int]
    ) -> list[Selection]:
        """Checks every key first, so a stream never starts for a request that must fail."""
        ns = validation.namespace(namespace)
        fp = validation.fingerprint(fingerprint)
        if not keys:
            raise InvalidArgument("no keys requested")
        with self.index.read() as txn:
            records = [self._require(txn, ns, fp, validation.key(k), "key") for k in keys]
        return [_select(r, set(layers)) for r in records]

    @contextmanager
    def reading(self, selections: Sequence[Selection]) -> Iterator[None]:
        """Holds a lease on the blocks for the duration of a streamed read."""
        lease_id, _ = self.leases.grant(
            [(s.record.namespace, s.record.key) for s in selections], self.config.max_lease_seconds
        )
        try:
            yield
        finally:
            self.leases.release(lease_id)

    def read(self, selection: Selection, max_run: int) -> Iterator[memoryview]:
        """The selected bytes in verified runs; a bad payload is quarantined (CorruptBlock)."""
        record = selection.record
        self._touch(record.namespace, record.key)
        try:
            yield from self.payloads.read(record, selection.segments, max_run)
        except CorruptBlock as exc:
            self._quarantine(record, exc.message)
            raise
        self.metrics.get_bytes.inc(selection.num_bytes)

    def locate(
        self,
        namespace: str,
        fingerprint: str,
        keys: Sequence[bytes],
        layers: Sequence[int],
        lease_seconds: int,
    ) -> tuple[str, int, list[Selection]]:
        seconds = lease_seconds or self.config.lease_seconds
        if seconds > self.config.max_lease_seconds:
            raise InvalidArgument(
                f"lease_seconds {seconds} exceeds the limit {self.config.max_lease_seconds}"
            )
        selections = self.select(namespace, fingerprint, keys, layers)
        blocks = [(s.record.namespace, s.record.key) for s in selections]
        lease_id, expires = self.leases.grant(blocks, seconds)
        for ns, key in blocks:
            self._touch(ns, key)
        return lease_id, expires, selections

    def path_of(self, record: BlockRecord) -> str:
        return str(self.payloads.path(record.relpath))

    def report_corrupt(self, namespace: str, key: bytes, reason: str) -> bool:
        ns, key = validation.namespace(namespace), validation.key(key)
        with self.index.read() as txn:
            record = self.index.get_block(txn, ns, key)
        if record is None:
            raise BlockNotFound(f"block {key.hex()} not found in namespace {ns!r}")
        try:
            self.payloads.verify(record)
        except CorruptBlock as exc:
            self._quarantine(record, f"{exc.message} (reported: {reason})")
            return True
        log.warning("corruption report not confirmed", extra={"key": key.hex(), "reason": reason})
        return False

    def longest_prefix(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> list[BlockRecord]:
        ns, fp = validation.namespace(namespace), validation.fingerprint(fingerprint)
        tokens = validation.token_ids(token_ids, self.config.max_agent_tokens)
        chain: list[BlockRecord] = []
        parent, pos = b"", 0
        with self.index.read() as txn:
            while pos < len(tokens):
                record = self._longest_child(txn, ns, fp, parent, tokens, pos)
                if record is None:
                    break
                chain.append(record)
                parent, pos = record.key, pos + len(record.token_ids)
        (self.metrics.prefix_hits if chain else self.metrics.prefix_misses).inc()
        return chain

    def _longest_child(
        self, txn: Any, ns: str, fp: str, parent: bytes, tokens: list[int], pos: int
    ) -> BlockRecord | None:
        children = self.index.children(txn, ns, parent)
        keys = {key for _, key in children}
        for n in sorted({n for n, _ in children}, reverse=True):
            if pos + n <= len(tokens):
                key = block_key(fp, parent, tokens[pos : pos + n])
                if key in keys:
                    return self.index.get_block(txn, ns, key)
        return None

    # agents

    def commit_agent(self, c: manifests.Commit, release_lease_id: str = "") -> manifests.AgentView:
        c.namespace = validation.namespace(c.namespace)
        validation.agent_id(c.agent_id)
        validation.fingerprint(c.fingerprint)
        c.token_ids = validation.token_ids(c.token_ids, self.config.max_agent_tokens)
        c.metadata = validation.metadata(c.metadata)
        c.block_keys = [validation.key(k, f"block_keys[{i}]") for i, k in enumerate(c.block_keys)]
        with self.index.write() as txn:
            record = manifests.commit(self.index, txn, c, now_ms())
            result = manifests.view(self.index, txn, record)
        if release_lease_id:
            self.leases.release(release_lease_id)
        self._agent_access[(record.namespace, record.agent_id)] = now_ms()
        return result

    def get_agent(
        self, namespace: str, agent_id: str, fingerprint: str = ""
    ) -> manifests.AgentView:
        ns = validation.namespace(namespace)
        validation.agent_id(agent_id)
        if fingerprint:
            validation.fingerprint(fingerprint)
        with self.index.read() as txn:
            record = manifests.get(self.index, txn, ns, agent_id)
            if fingerprint and record.fingerprint != fingerprint:
                raise FingerprintMismatch(
                    f"agent {agent_id!r} was written under fingerprint {record.fingerprint!r}, "
                    f"not {fingerprint!r}"
                )
            result = manifests.view(self.index, txn, record)
        self._agent_access[(ns, agent_id)] = now_ms()
        return result

    def list_agents(
        self, namespace: str, page_token: str, page_size: int
    ) -> list[manifests.AgentView]:
        ns = validation.namespace(namespace)
        with self.index.read() as txn:
            page = self.index.agent_page(txn, ns, page_token, _page_size(page_size))
            return [manifests.view(self.index, txn, r) for r in page]

    def delete_agent(self, namespace: str, agent_id: str, expected_generation: int = 0) -> int:
        ns = validation.namespace(namespace)
        validation.agent_id(agent_id)
        with self.index.write() as txn:
            released = manifests.delete(self.index, txn, ns, agent_id, expected_generation)
        self._agent_access.pop((ns, agent_id), None)
        return released

    def fork_agent(
        self,
        namespace: str,
        source_id: str,
        new_id: str,
        num_tokens: int,
        phase: str,
        metadata: dict[str, str],
    ) -> manifests.AgentView:
        ns = validation.namespace(namespace)
        validation.agent_id(source_id, "source_agent_id")
        validation.agent_id(new_id, "new_agent_id")
        metadata = validation.metadata(metadata)
        with self.index.write() as txn:
            record = manifests.fork(
                self.index, txn, ns, source_id, new_id, num_tokens, phase, metadata, now_ms()
            )
            return manifests.view(self.index, txn, record)

    # inspection and maintenance

    def list_namespaces(self) -> dict[str, dict[str, int]]:
        with self.index.read() as txn:
            return self.index.namespaces(txn)

    def list_blocks(self, namespace: str, page_token: bytes, page_size: int) -> list[BlockRecord]:
        ns = validation.namespace(namespace)
        with self.index.read() as txn:
            return self.index.block_page(txn, ns, page_token, _page_size(page_size))

    def last_access_ms(self, record: BlockRecord) -> int:
        return self._access.get((record.namespace, record.key), record.created_ms)

    def stats(self) -> dict[str, Any]:
        with self.index.read() as txn:
            usage = self.index.namespaces(txn)
            counters = {
                n: self.index.counter(txn, n)
                for n in ("evicted_blocks", "evicted_agents", "quarantined")
            }
        return {
            "num_namespaces": len(usage),
            "num_agents": sum(u["agents"] for u in usage.values()),
            "num_blocks": sum(u["blocks"] for u in usage.values()),
            "num_bytes": sum(u["bytes"] for u in usage.values()),
            "quota_bytes": self.config.quota_bytes,
            "num_evicted_blocks": counters["evicted_blocks"],
            "num_evicted_agents": counters["evicted_agents"],
            "num_quarantined": counters["quarantined"],
            "num_leases": len(self.leases),
            "disk_free_bytes": self.payloads.disk_free(),
        }

    def verify(self, namespace: str = "") -> tuple[int, int, list[tuple[BlockRecord, str]]]:
        """Reads every payload and checks every checksum; quarantines what fails."""
        ns = validation.namespace(namespace) if namespace else None
        with self.index.read() as txn:
            records = list(self.index.blocks(txn, ns))
        corrupt: list[tuple[BlockRecord, str]] = []
        checked = num_bytes = 0
        for record in records:
            try:
                self.payloads.verify(record)
                checked += 1
                num_bytes += record.num_bytes
            except CorruptBlock as exc:
                self._quarantine(record, exc.message)
                corrupt.append((record, exc.message))
        return checked + len(corrupt), num_bytes, corrupt

    def collect_garbage(self, namespace: str = "") -> tuple[int, int, int]:
        """Deletes unreferenced, unleased blocks, then orphan files. (blocks, bytes, orphans)"""
        ns = validation.namespace(namespace) if namespace else None
        with self.index.read() as txn:
            candidates = self.index.unreferenced(txn, ns)
        deleted = freed = 0
        with self._space_lock:
            for block in candidates:
                size = self._delete_unreferenced(block, count_eviction=False)
                deleted, freed = deleted + (size > 0), freed + size
        return deleted, freed, self._remove_orphans()

    # capacity

    def _reserve(self, size: int) -> None:
        with self._space_lock:
            quota = self.config.quota_bytes
            if quota:
                self._make_room(size, quota)
            self._reserved += size

    def _unreserve(self, size: int) -> None:
        with self._space_lock:
            self._reserved -= size

    def _release(self, upload: BlockUpload) -> None:
        """Ends an upload's claim on disk space and its temporary file, whatever happened."""
        if upload.writer is not None:
            upload.writer.abort()
            self._unreserve(upload.record.num_bytes)
            upload.writer = None

    def _make_room(self, size: int, quota: int) -> None:
        if size > quota:
            raise QuotaExceeded(f"block of {size} bytes exceeds the store quota of {quota} bytes")
        while self._used() + self._reserved + size > quota:
            if self._evict_one_block() or (self.config.evict_agents and self._evict_one_agent()):
                continue
            raise QuotaExceeded(
                f"store quota of {quota} bytes reached ({self._used()} used, {self._reserved} "
                f"in flight) and nothing can be evicted: every block is referenced or leased"
            )

    def _used(self) -> int:
        with self.index.read() as txn:
            return self.index.usage_bytes(txn)

    def _evict_one_block(self) -> bool:
        with self.index.read() as txn:
            candidates = [
                b for b in self.index.unreferenced(txn, None) if not self.leases.is_held(b)
            ]
            created = {b: self.index.get_block(txn, *b) for b in candidates}
        for block in sorted(candidates, key=lambda b: self._access.get(b, created[b].created_ms)):
            if self._delete_unreferenced(block, count_eviction=True):
                self.metrics.evictions.labels("block").inc()
                return True
        return False

    def _evict_one_agent(self) -> bool:
        """Deletes the least recently used agent whose blocks would then become evictable."""
        with self.index.read() as txn:
            agents = sorted(self.index.agents(txn, None), key=self._agent_last_access)
            victim = next((a for a in agents if self._frees_space(txn, a)), None)
        if victim is None:
            return False
        with self.index.write() as txn:
            manifests.delete(self.index, txn, victim.namespace, victim.agent_id, 0)
            self.index.bump(txn, "evicted_agents")
        self._agent_access.pop((victim.namespace, victim.agent_id), None)
        self.metrics.evictions.labels("agent").inc()
        log.info("agent evicted", extra={"namespace": victim.namespace, "agent": victim.agent_id})
        return True

    def _agent_last_access(self, agent: AgentRecord) -> int:
        return self._agent_access.get((agent.namespace, agent.agent_id), agent.updated_ms)

    def _frees_space(self, txn: Any, agent: AgentRecord) -> bool:
        for key in agent.block_keys:
            block = self.index.get_block(txn, agent.namespace, key)
            if block and block.refcount == 1 and not self.leases.is_held((agent.namespace, key)):
                return True
        return False

    def _delete_unreferenced(self, block: BlockId, count_eviction: bool) -> int:
        """Deletes a block if still unreferenced and unleased; returns bytes freed."""
        if self.leases.is_held(block):
            return 0
        with self.index.write() as txn:
            record = self.index.get_block(txn, *block)
            if record is None or record.refcount:
                return 0
            self.index.delete_block(txn, record)
            if count_eviction:
                self.index.bump(txn, "evicted_blocks")
        self.payloads.delete(record)
        self._access.pop(block, None)
        return record.num_bytes

    # helpers

    def _require(self, txn: Any, ns: str, fp: str, key: bytes, field: str) -> BlockRecord:
        record = self.index.get_block(txn, ns, key)
        if record is None:
            raise BlockNotFound(f"{field} {key.hex()} not found in namespace {ns!r}")
        if record.fingerprint != fp:
            raise FingerprintMismatch(
                f"{field} {key.hex()} was written under fingerprint {record.fingerprint!r}, "
                f"not {fp!r}"
            )
        return record

    def _touch(self, ns: str, key: bytes) -> None:
        self._access[(ns, key)] = now_ms()

    def _quarantine(self, record: BlockRecord, reason: str) -> None:
        with self.index.write() as txn:
            if self.index.get_block(txn, record.namespace, record.key) is None:
                return  # someone else got there first
            self.index.delete_block(txn, record, lost=True)
            self.index.bump(txn, "quarantined")
        dest = self.payloads.quarantine(record)
        self.metrics.quarantines.inc()
        log.warning(
            "block quarantined",
            extra={
                "namespace": record.namespace,
                "key": record.key.hex(),
                "reason": reason,
                "moved_to": str(dest),
            },
        )

    def _remove_orphans(self) -> int:
        with self.index.read() as txn:
            known = {r.relpath for r in self.index.blocks(txn, None)}
        suspects = [p for p in self.payloads.block_files() if p not in known]
        removed = 0
        with self._publish_lock:  # a put between rename and index commit is not an orphan
            with self.index.read() as txn:
                known = {r.relpath for r in self.index.blocks(txn, None)}
            for relpath in suspects:
                if relpath not in known:
                    self.payloads.path(relpath).unlink(missing_ok=True)
                    removed += 1
        return removed


class BlockUpload:
    """One block arriving in chunks; a block the namespace already holds is only counted."""

    def __init__(
        self,
        store: CacheStore,
        record: BlockRecord,
        layout: list[TensorLayout],
        writer: BlockWriter | None,
    ) -> None:
        self.store, self.record, self.layout, self.writer = store, record, layout, writer
        self.expected = sum(t.num_bytes for t in layout)
        self.received = 0

    def write(self, data: memoryview) -> None:
        if self.received + len(data) > self.expected:
            raise InvalidArgument(
                f"block {self.record.key.hex()} sent {self.received + len(data)}+ bytes but its "
                f"tensors declare {self.expected}"
            )
        self.received += len(data)
        if self.writer is not None:
            self.writer.write(data)

    def finish(self) -> PutResult:
        if self.received != self.expected:
            raise InvalidArgument(
                f"block {self.record.key.hex()} received {self.received} bytes but its "
                f"tensors declare {self.expected}"
            )
        if self.writer is None:
            self.store.metrics.dedup_hits.inc()
            r = self.record
            return PutResult(r.key, len(r.token_ids), r.num_bytes, deduplicated=True)
        return self.store._publish(self)

    def abort(self) -> None:
        self.store._release(self)


def _shift(t: TensorLayout, by: int) -> TensorLayout:
    return TensorLayout(t.name, t.dtype, t.shape, t.layer, t.offset + by, t.num_bytes)


def _select(record: BlockRecord, layers: set[int]) -> Selection:
    if not layers:
        return Selection(record, record.tensors, [s for s in record.segments if s.layer >= 0])
    unknown = layers - set(record.layers)
    if unknown:
        raise InvalidArgument(
            f"block {record.key.hex()} has no layer {sorted(unknown)}; it holds layers "
            f"{record.layers[0]}..{record.layers[-1]}"
        )
    return Selection(
        record,
        [t for t in record.tensors if t.layer in layers],
        [s for s in record.segments if s.layer in layers],
    )


def _page_size(page_size: int) -> int:
    return min(page_size or 100, 1000)
