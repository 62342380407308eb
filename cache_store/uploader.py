"""Write-through in commit order: one upload job carried out against the bucket.

A block is written after it is durable locally, read back from its file with every checksum
verified; a manifest only once every block it names is in the bucket (a block that is not is
uploaded first; one lost here ends the manifest's chain there, and the tokens past it are
re-prefilled on restore). A manifest is put conditionally: over the version this store put
last, never over another store's ("diverged": kept here, logged). A deletion likewise deletes
only a version this store deleted here: one it put, or the one it last put or fetched; not
one another store wrote since (while the bucket was away from this one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import xxhash

from agentkv.errors import CorruptBlock, CorruptRecord
from cache_store import bucket_layout as layout
from cache_store.objects import Bucket, Conflict, Got
from cache_store.parts import Parts
from cache_store.records import AgentRecord, BlockRecord
from cache_store.upload_queue import Job
from cache_store.writer_leases import NamespaceHeld, NotWriter, WriterLeases

log = logging.getLogger("agentkv.store")


class Uploader:
    def __init__(
        self,
        parts: Parts,
        bucket: Bucket,
        writers: WriterLeases,
        quarantine: Callable[[BlockRecord, str], None],
    ) -> None:
        self.index, self.payloads, self.metrics = parts.index, parts.payloads, parts.metrics
        self.bucket, self.writers, self.quarantine = bucket, writers, quarantine
        self.diverged: set[tuple[str, str]] = set()  # agents another store wrote meanwhile

    def scan(self) -> list[Job]:
        """Everything the index holds that the bucket does not: local blocks without a remote
        copy (oldest first), then manifests not at their uploaded generation, and deletions."""
        with self.index.read() as txn:
            remote = self.index.remote_keys(txn)
            blocks = [b for b in self.index.blocks(txn, None) if b.local]
            blocks = [b for b in blocks if (b.namespace, b.key) not in remote]
            done = {(ns, a): g for ns, a, g in self.index.uploads_done(txn)}
            agents = [
                a
                for a in self.index.agents(txn, None)
                if done.pop((a.namespace, a.agent_id), None) != a.generation
                and (a.namespace, a.agent_id) not in self.diverged
            ]
        jobs: list[Job] = [
            ("block", b.namespace, b.key.hex()) for b in sorted(blocks, key=lambda b: b.created_ms)
        ]
        jobs += [("agent", a.namespace, a.agent_id) for a in agents]
        jobs += [("agent", ns, a) for (ns, a), g in done.items() if g == 0]
        return jobs

    def carry_out(self, job: Job) -> bool:
        """Carries a job out; whether it is to be looked at again (it raced another put)."""
        kind, namespace, ident = job
        if kind == "agent":
            return self.upload_agent(namespace, ident)
        self.upload_block(namespace, bytes.fromhex(ident))
        return False

    def _writable(self, namespace: str) -> None:
        if not self.writers.holds(namespace):
            try:
                self.writers.acquire(namespace)
            except NamespaceHeld as exc:
                log.warning("upload paused", extra={"namespace": namespace, "reason": exc.message})
                raise NotWriter(namespace) from exc

    def upload_block(self, namespace: str, key: bytes) -> int | None:
        """Writes a local block through; its payload checksum (None: nothing to upload)."""
        with self.index.read() as txn:
            record = self.index.find_block(txn, namespace, key)
            checksum = self.index.remote_checksum(txn, namespace, key)
        if checksum is not None or record is None or not record.local:
            return checksum
        self._writable(namespace)
        try:
            body = b"".join(
                bytes(v) for v in self.payloads.read(record, record.segments, record.num_bytes)
            )
        except CorruptBlock as exc:
            with self.index.read() as txn:
                still = self.index.find_block(txn, namespace, key)
            if still is not None and still.local and still.created_ms == record.created_ms:
                self.quarantine(still, f"{exc.message} (found uploading it)")
            return None
        checksum = xxhash.xxh3_64_intdigest(body)
        self.bucket.put(
            layout.block_object(namespace, key), body, layout.block_metadata(record, checksum)
        )
        with self.index.write() as txn:  # unless collected and put anew meanwhile
            still = self.index.find_block(txn, namespace, key)
            if still is not None and still.created_ms == record.created_ms:
                self.index.put_remote(txn, namespace, key, checksum)
        self.metrics.uploaded.labels("block").inc()
        return checksum

    def upload_agent(self, namespace: str, agent_id: str) -> bool:
        with self.index.read() as txn:
            record = self.index.find_agent(txn, namespace, agent_id)
            done = self.index.uploaded_generation(txn, namespace, agent_id)
        if record is None:
            return done == 0 and self._delete_manifest(namespace, agent_id)  # deleted here
        if done == record.generation:
            return False
        self._writable(namespace)
        body, meta = layout.manifest(record, self._blocks_through(record), self.writers.store_id)
        self._writable(namespace)  # again: the blocks may have taken a while
        condition = self._put_condition(record, done, meta["agentkv-xxh3"])
        if condition is None:
            return False
        try:
            self.bucket.put(layout.agent_object(namespace, agent_id), body, meta, **condition)
        except Conflict:
            return True  # raced: looked at again
        self._mark_uploaded(record)
        self.metrics.uploaded.labels("manifest").inc()
        return False

    def _delete_manifest(self, namespace: str, agent_id: str) -> bool:
        """Deletes the manifest there if it is a version deleted here; whether to look again
        (it changed in between)."""
        self._writable(namespace)
        name = layout.agent_object(namespace, agent_id)
        there = self.bucket.get(name)
        if there is not None and not self._deleted_here(there, namespace, agent_id):
            log.error(
                "agent deletion not carried out: the object store holds another store's "
                "version, written since; kept, and read here from now on",
                extra={"namespace": namespace, "agent": agent_id},
            )
        elif there is not None:
            try:
                self.bucket.delete(name, if_match=there.etag)
            except Conflict:
                return True  # raced: looked at again
            self.metrics.uploaded.labels("deletion").inc()
        with self.index.write() as txn:
            if self.index.find_agent(txn, namespace, agent_id) is None:
                self.index.delete_uploaded(txn, namespace, agent_id)
        return False

    def _deleted_here(self, there: Got, namespace: str, agent_id: str) -> bool:
        """Whether the bucket's manifest is a version this store deleted: one it put itself,
        or another store's that it last put or fetched (same generation and creation)."""
        if there.metadata.get("agentkv-writer") == self.writers.store_id:
            return True
        with self.index.read() as txn:
            known = self.index.uploaded_id(txn, namespace, agent_id)
        try:
            m = layout.read_manifest(there.body, there.metadata, namespace, agent_id)
        except CorruptRecord:
            return False
        return (int(m["generation"]), int(m["created_unix_ms"])) == known

    def _blocks_through(self, record: AgentRecord) -> list[dict[str, Any]]:
        """Uploads the record's blocks the bucket lacks, in chain order; the manifest's block
        entries, up to the first one lost here."""
        blocks = []
        for key, count in zip(record.block_keys, record.block_num_tokens, strict=True):
            checksum = self.upload_block(record.namespace, key)
            with self.index.read() as txn:
                block = self.index.find_block(txn, record.namespace, key)
            if checksum is None or block is None:
                break  # lost here: the chain in the bucket ends before it
            entry = {"key": key.hex(), "num_tokens": count, "num_bytes": block.num_bytes}
            blocks.append({**entry, "xxh3": f"{checksum:016x}"})
        return blocks

    def _put_condition(
        self, record: AgentRecord, done: int | None, checksum: str
    ) -> dict[str, Any] | None:
        """How to put the manifest over what the bucket holds; None: not to put it (this very
        manifest, put before a crash, now recorded as uploaded; or another store's version)."""
        namespace, agent_id = record.namespace, record.agent_id
        there = self.bucket.head(layout.agent_object(namespace, agent_id))
        if there is None:
            return {"if_none_match": True}
        theirs = layout.generation_named(there.metadata)  # None: garbled
        ours = there.metadata.get("agentkv-writer") == self.writers.store_id
        if ours and there.metadata.get("agentkv-xxh3") == checksum:
            self._mark_uploaded(record)  # put before a crash
            return None
        # Ours to replace: the one this store put last, an older one of its own (or one of its
        # own whose generation no longer reads), or one of its own whose deletion is pending
        # (deleted here and created anew).
        older = theirs is None or theirs < record.generation
        if theirs == (done or 0) or (ours and (older or done == 0)):
            return {"if_match": there.etag}
        self.diverged.add((namespace, agent_id))
        log.error(
            "agent diverged: the object store holds another store's version; kept here, not "
            "written over it",
            extra={
                "namespace": namespace,
                "agent": agent_id,
                "theirs": there.metadata.get("agentkv-generation", "")[:40],
            },
        )
        return None

    def _mark_uploaded(self, record: AgentRecord) -> None:
        """Records the generation written, if the agent here is still the one written (not
        deleted, not deleted and created anew meanwhile)."""
        namespace, agent_id = record.namespace, record.agent_id
        with self.index.write() as txn:
            current = self.index.find_agent(txn, namespace, agent_id)
            if (
                current is not None
                and current.generation == record.generation
                and current.created_ms == record.created_ms
            ):
                self.index.put_uploaded(
                    txn, namespace, agent_id, record.generation, record.created_ms
                )
