"""Reads from the object store into the local tier: a demoted block's payload brought back,
an agent only the bucket holds (or a newer version of it) fetched whole, and the bucket's
agents listed. Every payload is checked against the index's record or the manifest's
checksum and its own safetensors header before it lands.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import xxhash

from agentkv.errors import (
    BlockNotFound,
    CorruptBlock,
    CorruptRecord,
    DiskFull,
    QuotaExceeded,
    Unavailable,
)
from agentkv.keys import block_key
from cache_store import bucket_layout as layout
from cache_store import manifests
from cache_store.capacity import DISK_SLACK, Capacity
from cache_store.index import GENERATIONS_USED
from cache_store.leases import StreamLease
from cache_store.manifests import AgentView
from cache_store.objects import Bucket, Conflict, Got
from cache_store.parts import Parts
from cache_store.records import AgentRecord, BlockRecord

log = logging.getLogger("agentkv.store")

FETCH_AHEAD = 4  # blocks of a fetched agent downloading at once


class Fetcher:
    def __init__(self, parts: Parts, capacity: Capacity, bucket: Bucket) -> None:
        self.index, self.payloads, self.metrics = parts.index, parts.payloads, parts.metrics
        self.capacity, self.bucket, self.publish_lock = capacity, bucket, parts.publish_lock
        self.max_block_bytes = parts.config.max_block_bytes
        self.leases, self.lease_seconds = parts.leases, parts.config.lease_seconds
        self.pool = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="fetch")
        self._fetching: dict[tuple, threading.Lock] = {}  # one download per block or agent
        self._fetching_lock = threading.Lock()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    @contextmanager
    def _one_at_a_time(self, what: tuple) -> Iterator[None]:
        """One download of a block (or fetch of an agent) at a time; others wait for it.
        (The locks stay: one small entry per block ever fetched.)"""
        with self._fetching_lock:
            lock = self._fetching.setdefault(what, threading.Lock())
        with lock:
            yield

    def rehydrate(self, record: BlockRecord) -> BlockRecord:
        """Brings a demoted block's payload back to local disk, checked against the index's
        record; CorruptBlock (the caller quarantines it) if the bucket's copy is missing or
        not those bytes."""
        ns, key = record.namespace, record.key
        with self._one_at_a_time(("block", ns, key)):
            with self.index.read() as txn:
                current = self.index.find_block(txn, ns, key)
                checksum = self.index.remote_checksum(txn, ns, key)
            if current is None:
                raise BlockNotFound(f"block {key.hex()} not found in namespace {ns!r}")
            if current.local:
                return current
            got = self.bucket.get(layout.block_object(ns, key))
            if got is None:
                raise CorruptBlock(f"demoted block {key.hex()} is missing from the object store")
            digest = xxhash.xxh3_64_intdigest(got.body)
            if checksum is not None and digest != checksum:
                raise CorruptBlock(
                    f"the object store's copy of block {key.hex()} failed its checksum"
                )
            landed = self._land(got.body, digest, current, existing=True)
        self._count_rehydrated(1)
        return landed

    def fetch_agent(self, namespace: str, agent_id: str, local_generation: int | None) -> bool:
        """Copies the bucket's manifest of an agent, and every block it names that is not
        here, into the local tier, when it is newer than `local_generation` (None: absent
        here). Whether it did. A block that is missing or fails its checksum ends the chain
        there (its tokens are re-prefilled); a manifest that fails its own is DATA_LOSS. One
        held here that the bucket has no manifest of raises NotInBucket."""
        name = layout.agent_object(namespace, agent_id)
        if local_generation is not None:
            there = self.bucket.head(name)
            if there is None:
                raise NotInBucket(f"agent {agent_id!r} in namespace {namespace!r}")
            theirs = layout.generation_named(there.metadata)
            if theirs is not None and theirs <= local_generation:
                return False  # (a generation that is no number: its manifest says, or is lost)
        got = self.bucket.get(name)
        if got is None:
            return False
        try:
            m = layout.read_manifest(got.body, got.metadata, namespace, agent_id)
        except CorruptRecord as exc:
            raise LostManifest(exc.message, got) from None
        # The chain's blocks are leased until the manifest holds them: not yet any agent's,
        # they would be the first a full disk gave up for the next one's room.
        lease = StreamLease(self.leases, self.lease_seconds)
        with self._one_at_a_time(("agent", namespace, agent_id)):
            try:
                record = layout.manifest_record(m, self._fetch_chain(m, lease))
                # a full disk first gives up blocks safe in the bucket, then the read fails
                if not self.capacity.with_room(
                    self._install, record, spare=[(namespace, agent_id)]
                ):
                    return False
            finally:
                lease.release()
        log.info(
            "agent fetched from the object store",
            extra={"namespace": namespace, "agent": agent_id, "blocks": len(record.block_keys)},
        )
        return True

    def _install(self, record: AgentRecord) -> bool:
        """Indexes a manifest fetched from the bucket; whether it was (not when the agent
        was committed or deleted here meanwhile)."""
        namespace, agent_id = record.namespace, record.agent_id
        with self.index.write() as txn:
            current = self.index.find_agent(txn, namespace, agent_id)
            if current is not None and current.generation >= record.generation:
                return False  # committed here meanwhile
            if self.index.uploaded_generation(txn, namespace, agent_id) == 0:
                return False  # deleted here meanwhile
            manifests.install(self.index, txn, record, current)
            self.index.put_uploaded(txn, namespace, agent_id, record.generation, record.created_ms)
        return True

    def drop_lost(self, namespace: str, agent_id: str, lost: LostManifest) -> None:
        """Deletes an unreadable manifest from the bucket (only that one: a manifest put
        since stays), for a write that replaces or deletes the agent; the generation its
        metadata names, if any, is not given to a new agent here (a worker may hold a copy
        of the lost one)."""
        got = lost.got
        generation = layout.generation_named(got.metadata)
        if generation and generation < 2**63:  # first: never given meanwhile
            with self.index.write() as txn:
                self.index.raise_counter(txn, GENERATIONS_USED, generation)
        try:
            self.bucket.delete(layout.agent_object(namespace, agent_id), if_match=got.etag)
        except Conflict:
            raise Unavailable(
                f"the object store's manifest of agent {agent_id!r} changed while this store "
                "dropped an unreadable one: send the request again"
            ) from None
        with self.index.write() as txn:
            if self.index.find_agent(txn, namespace, agent_id) is None:
                self.index.delete_uploaded(txn, namespace, agent_id)
        log.warning(
            "unreadable manifest dropped from the object store: the agent was lost",
            extra={"namespace": namespace, "agent": agent_id, "reason": lost.message},
        )

    def _fetch_chain(self, m: layout.Manifest, lease: StreamLease) -> list[bytes]:
        """Lands the manifest's blocks this store lacks, in chain order, while the next
        FETCH_AHEAD of them download; the chain (its keys) ends at the first unusable one."""
        namespace, keys = m["namespace"], []
        parent, pos, fetched, lapsed = b"", 0, 0, False
        entries = [(bytes.fromhex(e["key"]), int(e["num_tokens"]), e) for e in m["blocks"]]
        # Leased first: the room an earlier block's landing asks for would otherwise be made
        # from a later one here, not yet any agent's (the agent evicted here, say).
        lease.hold(*((namespace, k) for k, _, _ in entries))
        with self.index.read() as txn:
            have = {k: self.index.find_block(txn, namespace, k) for k, _, _ in entries}
        wanted = [k for k, _, _ in entries if have[k] is None or not have[k].local]
        downloads = _Prefetch(
            self.pool, wanted, lambda k: self.bucket.get(layout.block_object(namespace, k))
        )
        try:
            for key, count, entry in entries:
                tokens = [int(t) for t in m["token_ids"][pos : pos + count]]
                made = block_key(m["fingerprint"], parent, tokens)
                why = "" if key == made else "its tokens and parent make another key"
                lapsed |= lease.renew()  # however long the downloads take
                if not why and key in downloads:
                    draft = have[key] or layout.draft_block(m, key, parent, pos, count)
                    why = self._land_fetched(downloads.take(key), entry, draft, have[key])
                    fetched += not why
                if why:
                    log.warning(
                        "object store block unusable: the chain ends before it",
                        extra={"namespace": namespace, "key": key.hex(), "reason": why},
                    )
                    break
                keys.append(key)
                parent, pos = key, pos + count
        finally:
            downloads.cancel()
            self._count_rehydrated(fetched)
        lapsed |= lease.renew()  # the last download's wait, too
        return self._still_kept(namespace, keys) if lapsed else keys

    def _still_kept(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        """The chain up to its first block collected while the lease had lapsed (a download
        stalled past --lease-seconds): the manifest names no block that is gone."""
        with self.index.read() as txn:
            for i, key in enumerate(keys):
                if self.index.find_block(txn, namespace, key) is None:  # demoted: restorable
                    return keys[:i]
        return keys

    def _land_fetched(
        self, got: Got | None, entry: dict[str, Any], base: BlockRecord, have: BlockRecord | None
    ) -> str:
        """Lands one downloaded block; why it is unusable, or "" once it is in place."""
        if got is None:
            return "missing"
        digest = xxhash.xxh3_64_intdigest(got.body)
        if digest != int(entry["xxh3"], 16):
            return "failed its checksum"
        room = len(got.body) + DISK_SLACK  # the index grows too: the manifest must fit after
        if self.payloads.disk_free() < room:
            self.capacity.free_disk(len(got.body))
            if self.payloads.disk_free() < room:
                return "no room for it on the store's disk (nothing more could be freed)"
        try:
            with self._one_at_a_time(("block", base.namespace, base.key)):
                self._land(got.body, digest, base, existing=have is not None)
        except (CorruptBlock, DiskFull, QuotaExceeded) as exc:  # the last two: room made first
            return exc.message
        return ""

    def _land(self, body: bytes, digest: int, base: BlockRecord, existing: bool) -> BlockRecord:
        """Writes a payload from the bucket (its xxh3 `digest`, already checked) durably into
        place and indexes it, checked against `base`: a demoted block's record (`existing`)
        or a manifest's draft of a new one."""
        header_len, tensors = layout.parse_payload(body, base, self.max_block_bytes)
        self.capacity.check_fits(len(body), base.namespace)
        self.capacity.reserve(len(body), base.namespace)
        writer = None
        try:
            writer = self.payloads.writer(body[:header_len], tensors, self.capacity.free_disk)
            writer.write(memoryview(body)[header_len:])
            segments = writer.seal()
            if existing and segments != base.segments:
                raise CorruptBlock(
                    f"the object store's copy of block {base.key.hex()} does not match its record"
                )
            if not existing:
                shifted = [t._replace(offset=t.offset + header_len) for t in tensors]
                base = replace(base, tensors=shifted, segments=segments, num_bytes=len(body))
            landed = self._publish(writer, base, existing, digest)
        finally:
            if writer is not None:
                writer.abort()
            self.capacity.unreserve(len(body), base.namespace)
        self.capacity.touch_block((base.namespace, base.key))
        return landed

    def _publish(
        self, writer: Any, base: BlockRecord, existing: bool, checksum: int
    ) -> BlockRecord:
        """Moves the written payload into place and indexes it, unless the index changed
        meanwhile (the block deleted, fetched back by another reader, or uploaded)."""
        ns, key = base.namespace, base.key
        with self.publish_lock:
            with self.index.read() as txn:
                current = self.index.find_block(txn, ns, key)
            if existing:
                if current is None or current.created_ms != base.created_ms:
                    raise BlockNotFound(f"block {key.hex()} was deleted while fetched")
                if current.local:
                    return current  # fetched back by another reader meanwhile
            elif current is not None:
                return current  # uploaded meanwhile: that one stands
            writer.publish(self.payloads.path(base.relpath))
            with self.index.write() as txn:
                if existing:
                    landed = self.index.set_local(txn, base, True)
                else:
                    landed = base
                    if self.index.find_block(txn, ns, key) is None:
                        self.index.put_block(txn, landed)
                self.index.put_remote(txn, ns, key, checksum)
        return landed

    def _count_rehydrated(self, n: int) -> None:
        if n:
            self.metrics.rehydrated_blocks.inc(n)
            with self.index.write() as txn:
                self.index.bump(txn, "rehydrated_blocks", n)

    def bucket_agents(self, namespace: str, after: str, limit: int) -> tuple[list[AgentView], str]:
        """Agents the bucket holds, in id order after `after`, as the bucket describes them,
        and the id to list on after ("" at the end: a short listing); one deleted here or
        unreadable there is skipped but counted."""
        prefix = f"{namespace}/agents/"
        views = []
        start = layout.agent_object(namespace, after) if after else ""
        names = list(self.bucket.list(prefix, start, limit))
        for name in names:
            agent_id = name[len(prefix) :]
            with self.index.read() as txn:
                if self.index.uploaded_generation(txn, namespace, agent_id) == 0:
                    continue  # deleted here; its deletion there is queued
            got = self.bucket.get(name)
            if got is None:
                continue
            try:
                m = layout.read_manifest(got.body, got.metadata, namespace, agent_id)
            except CorruptRecord as exc:
                log.warning(
                    "unreadable manifest in the object store", extra={"reason": exc.message}
                )
                continue
            size = sum(int(b["num_bytes"]) for b in m["blocks"])
            views.append(AgentView(layout.manifest_record(m), [], size))
        return views, names[-1][len(prefix) :] if len(names) == limit else ""


class NotInBucket(Exception):
    """The bucket holds no manifest of an agent this store holds: deleted there, or not
    uploaded yet (the store's index tells which)."""


class LostManifest(CorruptRecord):
    """The bucket's manifest of an agent is unreadable: the agent is lost. `got` is the
    object as read."""

    def __init__(self, message: str, got: Got) -> None:
        super().__init__(message)
        self.got = got


class _Prefetch:
    """Downloads `keys` in order, at most FETCH_AHEAD ahead of the one taken."""

    def __init__(self, pool: ThreadPoolExecutor, keys: list[bytes], get: Callable) -> None:
        self._pool, self._get, self._keys = pool, get, collections.deque(keys)
        self._futures: dict[bytes, Future] = {}
        self._wanted = set(keys)
        for _ in range(FETCH_AHEAD):
            self._submit()

    def __contains__(self, key: bytes) -> bool:
        return key in self._wanted

    def _submit(self) -> None:
        if self._keys:
            key = self._keys.popleft()
            self._futures[key] = self._pool.submit(self._get, key)

    def take(self, key: bytes) -> Got | None:
        """The key's download (ObjectStoreDown raised here), and the next one started."""
        future = self._futures.pop(key)
        self._submit()
        return future.result()

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()
