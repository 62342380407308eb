"""The object-store tier behind the local one: write-through in commit order, demotion instead
of loss, rehydration, and one writing store per namespace.

The bucket describes itself (objects under the location's prefix):
  <ns>/blocks/<key hex>.safetensors   a block's payload file, byte for byte; metadata: format,
                                      namespace, fingerprint, key, parent, num-tokens, xxh3
  <ns>/agents/<agent id>              a manifest (JSON): the agent record, per block its key,
                                      token count, size and payload xxh3; metadata: format,
                                      namespace, agent, fingerprint, generation, xxh3 (of the
                                      JSON)
  <ns>/writer.lease                   which store writes the namespace, and until when

Order: a block is written after it is durable locally (it is read back from its file, every
checksum verified); a manifest only once every block it names is in the bucket (a block that
is not is uploaded first; one that is lost ends the manifest's chain there, and the tokens past
it are re-prefilled). What is in the bucket is recorded in the index (`remote`, `uploaded`), so
the queue of what is not is the index itself: a restart rescans it and resumes, and the queue
in memory is bounded (past the bound the store reports `backlogged` and rescans later).

Several stores, one bucket: each namespace has one writing store at a time, the holder of
`<ns>/writer.lease` (created with If-None-Match, renewed with If-Match, taken over with
If-Match once it has expired). A store that finds another's live lease refuses the
namespace's writes (FAILED_PRECONDITION) and serves it read-only from the bucket. A store
that cannot reach the bucket keeps writing locally and uploads nothing of a namespace until
it holds the lease again.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from agentkv.errors import (
    BlockNotFound,
    CorruptBlock,
    CorruptRecord,
    FailedPrecondition,
    InvalidArgument,
)
from agentkv.units import utc_time
from cache_store import manifests, validation
from cache_store.capacity import Capacity, now_ms
from cache_store.config import StoreConfig
from cache_store.index import Index
from cache_store.leases import Leases
from cache_store.manifests import AgentView
from cache_store.metrics import StoreMetrics
from cache_store.objects import Bucket, Conflict, Got, ObjectStoreDown
from cache_store.payloads import Payloads
from cache_store.records import AgentRecord, BlockRecord

log = logging.getLogger("agentkv.store")

BLOCK_FORMAT = "agentkv-block-v1"
AGENT_FORMAT = "agentkv-agent-v1"
LEASE_FORMAT = "agentkv-writer-lease-v1"
RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)  # uploader back-off while the bucket is down
FETCH_AHEAD = 4  # blocks of a fetched agent downloading at once
PARKED_RETRY_SECONDS = 5.0  # how often uploads of a namespace another store writes try again


def block_object(namespace: str, key: bytes) -> str:
    return f"{namespace}/blocks/{key.hex()}.safetensors"


def agent_object(namespace: str, agent_id: str) -> str:
    """No suffix: the bucket lists manifests in agent-id order, as the index does (pages of
    ListAgents merge the two)."""
    return f"{namespace}/agents/{agent_id}"


def lease_object(namespace: str) -> str:
    return f"{namespace}/writer.lease"


def store_identity(data_dir: Path, configured: str) -> str:
    """This store's name in writer leases: --store-id, else one made once and kept in the data
    dir (so a restarted store takes its own lease back at once)."""
    if configured:
        return configured
    path = data_dir / "store-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        ident = f"{socket.gethostname()}-{secrets.token_hex(4)}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(ident)
        os.replace(tmp, path)
        return ident


class NamespaceHeld(FailedPrecondition):
    """Another store holds the namespace's writer lease in the shared bucket."""


class NotWriter(Exception):
    """The uploader may not write this namespace now (no verified lease)."""


@dataclass(slots=True)
class _Held:
    etag: str
    valid_until: float  # time.monotonic(): past it, this store no longer counts as the writer


class WriterLeases:
    """The namespaces this store writes in the bucket, renewed on a thread of their own."""

    def __init__(self, bucket: Bucket, store_id: str, seconds: float) -> None:
        self.bucket, self.store_id, self.seconds = bucket, store_id, seconds
        self.margin = seconds / 3  # clock skew and a renewal in flight fit in it
        self._held: dict[str, _Held] = {}
        self._unverified: set[str] = set()  # namespaces written while the bucket was away
        self._lock = threading.Lock()
        self._acquiring = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="writer-leases", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops renewing and hands every lease back (expired at once), so another store
        can take a namespace over without waiting; a lease it cannot hand back lapses."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            held, self._held = self._held, {}
        for namespace, lease in held.items():
            try:
                body, meta = self._body(namespace, expires=0)
                self.bucket.put(lease_object(namespace), body, meta, if_match=lease.etag)
            except (Conflict, ObjectStoreDown):
                pass

    def holds(self, namespace: str) -> bool:
        """Whether this store is the namespace's verified writer right now."""
        with self._lock:
            held = self._held.get(namespace)
        return held is not None and held.valid_until > time.monotonic()

    def check(self, namespace: str) -> None:
        """Before a write: passes while this store holds the lease or can take it, and while
        the bucket is unreachable (the write stays local until the lease is had);
        NamespaceHeld when another store's lease is live."""
        if self.holds(namespace):
            return
        try:
            self.acquire(namespace)
            self._unverified.discard(namespace)
        except ObjectStoreDown as exc:
            if namespace not in self._unverified:  # said once per outage
                self._unverified.add(namespace)
                log.warning(
                    "writer lease unverified: the object store is unreachable; writing locally",
                    extra={"namespace": namespace, "reason": exc.message},
                )

    def acquire(self, namespace: str) -> None:
        """Creates, renews or takes over the lease; NamespaceHeld if another store's is live.
        One acquisition or renewal at a time (so none stores an ETag another replaced)."""
        with self._acquiring:
            if not self.holds(namespace):
                self._acquire(namespace)

    def _acquire(self, namespace: str) -> None:
        key = lease_object(namespace)
        for _ in range(3):  # each lost race re-reads what won it
            try:
                started = time.monotonic()
                etag = self.bucket.put(key, *self._body(namespace), if_none_match=True)
                self._put(namespace, etag, started)
                return
            except Conflict:
                pass
            got = self.bucket.get(key)
            if got is None:
                continue  # deleted in between: create it
            holder, expires = _lease_fields(got.body)
            if holder != self.store_id and expires + self.margin * 1000 > now_ms():
                raise NamespaceHeld(
                    f"namespace {namespace!r} is written by store {holder!r} through "
                    f"{self.bucket.location} (its lease runs until {utc_time(expires)}); this "
                    f"store ({self.store_id!r}) only reads it: send the namespace's writes to "
                    "that store, or stop it and let its lease expire"
                )
            try:
                started = time.monotonic()
                etag = self.bucket.put(key, *self._body(namespace), if_match=got.etag)
                self._put(namespace, etag, started)
                if holder != self.store_id:
                    log.warning(
                        "writer lease taken over",
                        extra={"namespace": namespace, "from": holder, "expired": expires},
                    )
                return
            except Conflict:
                continue
        raise NamespaceHeld(f"namespace {namespace!r}: lost the race for its writer lease")

    def _body(self, namespace: str, expires: int | None = None) -> tuple[bytes, dict[str, str]]:
        expires = now_ms() + int(self.seconds * 1000) if expires is None else expires
        body = json.dumps(
            {
                "format": LEASE_FORMAT,
                "namespace": namespace,
                "store": self.store_id,
                "expires_unix_ms": expires,
            }
        ).encode()
        return body, {"agentkv-format": LEASE_FORMAT, "agentkv-store": self.store_id}

    def _put(self, namespace: str, etag: str, started: float) -> None:
        """Holds the lease written by a put begun at `started` (its expiry counts from the
        body's writing, so a slow put shortens the hold, never lengthens it)."""
        with self._lock:
            self._held[namespace] = _Held(etag, started + self.seconds - self.margin)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            with self._lock:
                held = dict(self._held)
            for namespace in held:
                try:
                    with self._acquiring:
                        with self._lock:
                            lease = self._held.get(namespace)
                        if lease is None:
                            continue
                        started = time.monotonic()
                        body, meta = self._body(namespace)
                        etag = self.bucket.put(
                            lease_object(namespace), body, meta, if_match=lease.etag
                        )
                        self._put(namespace, etag, started)
                except Conflict:
                    with self._lock:
                        self._held.pop(namespace, None)
                    log.error(
                        "writer lease lost: another store took the namespace over",
                        extra={"namespace": namespace},
                    )
                except ObjectStoreDown:
                    pass  # it lapses by itself; uploads of the namespace pause meanwhile


def _lease_fields(body: bytes) -> tuple[str, int]:
    """(holder, expires_unix_ms) of a lease object; an unreadable one counts as expired."""
    try:
        d = json.loads(body)
        return str(d["store"]), int(d["expires_unix_ms"])
    except (ValueError, KeyError, TypeError):
        return "", 0


Job = tuple[str, str, str]  # ("block", ns, key hex) or ("agent", ns, agent id)


class ObjectTier:
    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        payloads: Payloads,
        leases: Leases,
        capacity: Capacity,
        metrics: StoreMetrics,
        bucket: Bucket,
        publish_lock: threading.Lock,
        quarantine: Callable[[BlockRecord, str], None],
    ) -> None:
        self.config, self.index, self.payloads = config, index, payloads
        self.leases, self.capacity, self.metrics, self.bucket = leases, capacity, metrics, bucket
        self.publish_lock, self.quarantine = publish_lock, quarantine
        self.store_id = store_identity(config.data_dir, config.store_id)
        self.writers = WriterLeases(bucket, self.store_id, config.writer_lease_seconds)
        self.state = "starting"  # ok | unreachable | backlogged
        self.diverged: set[tuple[str, str]] = set()  # agents another store wrote meanwhile
        self._queue: collections.deque[Job] = collections.deque()
        self._queued: set[Job] = set()
        self._inflight: set[Job] = set()  # one job of an agent or block at a time
        self._parked: dict[str, set[Job]] = {}  # namespace: jobs waiting for its lease
        self._unpark_at: dict[str, float] = {}
        self._overflow = True  # start with a scan of the index: uploads resume after a restart
        self._scanning = False
        self._cond = threading.Condition()
        self._download_pool = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="fetch")
        self._fetching: dict[tuple, threading.Lock] = {}  # one download per block or agent
        self._fetching_lock = threading.Lock()
        self._on_state: Callable[[str], None] = lambda state: None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._upload_loop, name=f"uploader-{i}", daemon=True)
            for i in range(config.object_uploaders)
        ]
        threading.Thread(target=self._start, name="object-store", daemon=True).start()

    def _start(self) -> None:
        self._connect()
        for thread in self._threads:
            thread.start()

    def close(self, drain_seconds: float = 10.0) -> None:
        """Writes out what is queued (for up to `drain_seconds`), then stops."""
        if self.state == "ok":
            self.drain(drain_seconds)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        self._download_pool.shutdown(cancel_futures=True)
        self.writers.close()

    def watch_state(self, on_state: Callable[[str], None]) -> None:
        self._on_state = on_state
        on_state(self.state)

    # writes: who may, and what to upload

    def check_writer(self, namespace: str) -> None:
        self.writers.check(namespace)

    def block_stored(self, record: BlockRecord) -> None:
        self._enqueue(("block", record.namespace, record.key.hex()))

    def agent_changed(self, namespace: str, agent_id: str) -> None:
        """A commit, fork or delete: the manifest (or its deletion) goes out after its blocks."""
        self._enqueue(("agent", namespace, agent_id))

    def pending(self) -> int:
        """Jobs queued or running while uploads flow (0 while the bucket is away: nothing
        will become safe soon, so a reservation need not wait for it)."""
        with self._cond:
            if self.state not in ("ok", "backlogged"):
                return 0
            return len(self._queue) + len(self._inflight) + self._overflow

    def backlog(self) -> int:
        """Everything not yet written through that this process knows of."""
        with self._cond:
            parked = sum(len(jobs) for jobs in self._parked.values())
            return len(self._queue) + len(self._inflight) + parked

    def wait_for_uploads(self, seconds: float) -> None:
        """Waits up to `seconds` for the uploader to finish a job (quota pressure waits)."""
        with self._cond:
            self._cond.wait(seconds)

    def drain(self, seconds: float) -> bool:
        """Waits until nothing is queued (tests, benchmarks, a clean stop); whether it was."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._queue or self._inflight or self._overflow or self._scanning:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _enqueue(self, job: Job) -> None:
        with self._cond:
            if job in self._queued or job in self._parked.get(job[1], ()):
                return
            if len(self._queue) >= self.config.object_queue_max:
                self._overflow = True  # the index still knows: it is rescanned once drained
                self._set_state("backlogged")
            else:
                self._queue.append(job)
                self._queued.add(job)
            self._cond.notify_all()

    def _set_state(self, state: str) -> None:
        if state != self.state:
            log.info("object store state", extra={"state": state, "was": self.state})
            self.state = state
            self._on_state(state)

    # the uploaders

    def _connect(self) -> None:
        """Until the bucket answers (the local tier works meanwhile; uploads wait for it)."""
        for attempt in range(1 << 30):
            try:
                self.bucket.ensure_bucket()
                self._set_state("ok")
                return
            except ObjectStoreDown as exc:
                if attempt == 0:
                    log.warning("object store unreachable", extra={"reason": exc.message})
                self._set_state("unreachable")
            if self._stop.wait(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]):
                return

    def _upload_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            job = self._next_job()
            if job is None:
                continue
            try:
                self._carry_out(job)
                failures = 0
                self._set_state("backlogged" if self._overflow else "ok")
            except ObjectStoreDown as exc:
                self._retry(job)
                if failures == 0:
                    log.warning("object store unreachable", extra={"reason": exc.message})
                self._set_state("unreachable")
                self._stop.wait(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
                failures += 1
            except NotWriter:
                with self._cond:
                    self._parked.setdefault(job[1], set()).add(job)
                    self._unpark_at[job[1]] = time.monotonic() + PARKED_RETRY_SECONDS
            except Exception:
                log.exception("object store upload failed", extra={"job": list(job)})
                with self._cond:
                    self._overflow = True  # found again by the next scan, after a pause
                self._stop.wait(PARKED_RETRY_SECONDS)
            finally:
                with self._cond:
                    self._inflight.discard(job)
                    self._cond.notify_all()

    def _next_job(self) -> Job | None:
        """The next job no other uploader is on (jobs of a namespace waiting for its lease
        stay parked until their retry time); None after waiting a while for one."""
        with self._cond:
            now = time.monotonic()
            for namespace in [n for n, at in self._unpark_at.items() if at <= now]:
                del self._unpark_at[namespace]
                jobs = self._parked.pop(namespace, set()) - self._queued
                self._queue.extend(jobs)
                self._queued |= jobs
            if not self._queue and self._overflow and not self._scanning:
                self._scanning, self._overflow = True, False
                scan = True
            else:
                scan = False
        if scan:
            self._rescan()
        with self._cond:
            for _ in range(len(self._queue)):
                job = self._queue.popleft()
                if job in self._inflight:
                    self._queue.append(job)  # its agent or block is being uploaded: after it
                    continue
                if job[1] in self._unpark_at:
                    self._parked.setdefault(job[1], set()).add(job)
                    self._queued.discard(job)
                    continue
                self._queued.discard(job)
                self._inflight.add(job)
                return job
            self._cond.wait(1.0)
            return None

    def _rescan(self) -> None:
        """Refills the queue from the index (outside the queue's lock), up to its bound."""
        try:
            jobs = self._scan()
        except Exception:
            log.exception("object store: scanning the index failed")
            jobs = []
        with self._cond:
            room = self.config.object_queue_max - len(self._queue)
            fresh = [j for j in jobs if j not in self._queued and j not in self._inflight]
            self._queue.extend(fresh[:room])
            self._queued.update(fresh[:room])
            self._overflow = len(fresh) > room
            self._scanning = False
            self._cond.notify_all()

    def _retry(self, job: Job) -> None:
        """Puts a job that failed for the moment back first (within the bound; past it the
        next scan finds it)."""
        with self._cond:
            if job in self._queued:
                return
            if len(self._queue) >= self.config.object_queue_max:
                self._overflow = True
            else:
                self._queue.appendleft(job)
                self._queued.add(job)

    def _scan(self) -> list[Job]:
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

    def _carry_out(self, job: Job) -> None:
        kind, namespace, ident = job
        if kind == "block":
            self._upload_block(namespace, bytes.fromhex(ident))
        else:
            self._upload_agent(namespace, ident)

    def _writable(self, namespace: str) -> None:
        if not self.writers.holds(namespace):
            try:
                self.writers.acquire(namespace)
            except NamespaceHeld as exc:
                log.warning("upload paused", extra={"namespace": namespace, "reason": exc.message})
                raise NotWriter(namespace) from exc

    def _upload_block(self, namespace: str, key: bytes) -> int | None:
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
            if still is not None and still.local:
                self.quarantine(still, f"{exc.message} (found uploading it)")
            return None
        checksum = xxhash.xxh3_64_intdigest(body)
        self.bucket.put(
            block_object(namespace, key),
            body,
            {
                "agentkv-format": BLOCK_FORMAT,
                "agentkv-namespace": namespace,
                "agentkv-fingerprint": record.fingerprint,
                "agentkv-key": key.hex(),
                "agentkv-parent": record.parent_key.hex(),
                "agentkv-num-tokens": str(len(record.token_ids)),
                "agentkv-xxh3": f"{checksum:016x}",
            },
        )
        with self.index.write() as txn:
            if self.index.find_block(txn, namespace, key) is not None:
                self.index.put_remote(txn, namespace, key, checksum)
        self.metrics.uploaded.labels("block").inc()
        return checksum

    def _upload_agent(self, namespace: str, agent_id: str) -> None:
        with self.index.read() as txn:
            record = self.index.find_agent(txn, namespace, agent_id)
            done = self.index.uploaded_generation(txn, namespace, agent_id)
        if record is None:
            if done == 0:  # deleted here: delete it there
                self._writable(namespace)
                self.bucket.delete(agent_object(namespace, agent_id))
                with self.index.write() as txn:
                    if self.index.find_agent(txn, namespace, agent_id) is None:
                        self.index.delete_uploaded(txn, namespace, agent_id)
                self.metrics.uploaded.labels("deletion").inc()
            return
        if done == record.generation:
            return
        self._writable(namespace)
        blocks = []
        for key, count in zip(record.block_keys, record.block_num_tokens, strict=True):
            checksum = self._upload_block(namespace, key)
            with self.index.read() as txn:
                block = self.index.find_block(txn, namespace, key)
            if checksum is None or block is None:
                break  # lost here: the chain in the bucket ends before it
            blocks.append(
                {
                    "key": key.hex(),
                    "num_tokens": count,
                    "num_bytes": block.num_bytes,
                    "xxh3": f"{checksum:016x}",
                }
            )
        body = json.dumps(
            {
                "format": AGENT_FORMAT,
                "namespace": namespace,
                "agent_id": agent_id,
                "fingerprint": record.fingerprint,
                "generation": record.generation,
                "token_ids": record.token_ids,
                "blocks": blocks,
                "metadata": record.metadata,
                "phase": record.phase,
                "created_unix_ms": record.created_ms,
                "updated_unix_ms": record.updated_ms,
                "writer": self.store_id,
            },
            separators=(",", ":"),
        ).encode()
        self._writable(namespace)  # again: the blocks may have taken a while
        name = agent_object(namespace, agent_id)
        there = self.bucket.head(name)
        condition: dict[str, Any] = {"if_none_match": True}
        if there is not None:
            theirs = int(there.metadata.get("agentkv-generation", "0") or 0)
            ours = there.metadata.get("agentkv-writer") == self.store_id
            if ours and theirs == record.generation:
                self._mark_uploaded(namespace, agent_id, record)  # put before a crash
                return
            # Ours to replace: the one this store put last, an older one of its own, or one
            # of its own whose deletion is pending (deleted here and created anew).
            replaceable = theirs == (done or 0) or (
                ours and (theirs < record.generation or done == 0)
            )
            if not replaceable:
                self.diverged.add((namespace, agent_id))
                log.error(
                    "agent diverged: the object store holds another store's version; kept "
                    "here, not written over it",
                    extra={"namespace": namespace, "agent": agent_id, "theirs": theirs},
                )
                return
            condition = {"if_match": there.etag}
        meta = {
            "agentkv-format": AGENT_FORMAT,
            "agentkv-namespace": namespace,
            "agentkv-agent": agent_id,
            "agentkv-fingerprint": record.fingerprint,
            "agentkv-generation": str(record.generation),
            "agentkv-writer": self.store_id,
            "agentkv-xxh3": f"{xxhash.xxh3_64_intdigest(body):016x}",
        }
        try:
            self.bucket.put(name, body, meta, **condition)
        except Conflict:
            self._retry(("agent", namespace, agent_id))  # raced: looked at again
            return
        self._mark_uploaded(namespace, agent_id, record)
        self.metrics.uploaded.labels("manifest").inc()

    def _mark_uploaded(self, namespace: str, agent_id: str, record: AgentRecord) -> None:
        """Records the generation written, if the agent here is still the one written (not
        deleted, not deleted and created anew meanwhile)."""
        with self.index.write() as txn:
            current = self.index.find_agent(txn, namespace, agent_id)
            if (
                current is not None
                and current.generation == record.generation
                and current.created_ms == record.created_ms
            ):
                self.index.put_uploaded(txn, namespace, agent_id, record.generation)

    # reads: rehydration and agents only the bucket holds

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
            got = self.bucket.get(block_object(ns, key))
            if got is None:
                raise CorruptBlock(f"demoted block {key.hex()} is missing from the object store")
            if checksum is not None and xxhash.xxh3_64_intdigest(got.body) != checksum:
                raise CorruptBlock(
                    f"the object store's copy of block {key.hex()} failed its checksum"
                )
            landed = self._land(ns, key, got.body, current)
        self._count_rehydrated(1)
        return landed

    def fetch_agent(self, namespace: str, agent_id: str, local_generation: int | None) -> bool:
        """Copies the bucket's manifest of an agent, and every block it names that is not
        here, into the local tier, when it is newer than `local_generation` (None: absent
        here). Whether it did. A block that is missing or fails its checksum ends the chain
        there (its tokens are re-prefilled); a manifest that fails its own is DATA_LOSS."""
        if local_generation is not None:
            there = self.bucket.head(agent_object(namespace, agent_id))
            theirs = there.metadata.get("agentkv-generation", "0") if there else "0"
            if there is None or int(theirs or 0) <= local_generation:
                return False
        got = self.bucket.get(agent_object(namespace, agent_id))
        if got is None:
            return False
        m = _manifest_object(got.body, got.metadata, namespace, agent_id)
        with self._one_at_a_time(("agent", namespace, agent_id)):
            keys, counts = self._fetch_chain(namespace, m)
            record = AgentRecord(
                namespace=namespace,
                agent_id=agent_id,
                fingerprint=m["fingerprint"],
                token_ids=[int(t) for t in m["token_ids"]],
                block_keys=keys,
                block_num_tokens=counts,
                metadata={str(k): str(v) for k, v in m["metadata"].items()},
                phase=str(m["phase"]),
                created_ms=int(m["created_unix_ms"]),
                updated_ms=int(m["updated_unix_ms"]),
                generation=int(m["generation"]),
            )
            with self.index.write() as txn:
                current = self.index.find_agent(txn, namespace, agent_id)
                if current is not None and current.generation >= record.generation:
                    return False  # committed here meanwhile
                if self.index.uploaded_generation(txn, namespace, agent_id) == 0:
                    return False  # deleted here meanwhile
                manifests.install(self.index, txn, record, current)
                self.index.put_uploaded(txn, namespace, agent_id, record.generation)
        log.info(
            "agent fetched from the object store",
            extra={"namespace": namespace, "agent": agent_id, "blocks": len(keys)},
        )
        return True

    def _fetch_chain(self, namespace: str, m: dict[str, Any]) -> tuple[list[bytes], list[int]]:
        """Lands the manifest's blocks this store lacks, in chain order, while the next
        FETCH_AHEAD of them download; the chain ends at the first that is unusable."""
        keys: list[bytes] = []
        counts: list[int] = []
        parent, pos, fetched = b"", 0, 0
        entries = [(bytes.fromhex(e["key"]), int(e["num_tokens"]), e) for e in m["blocks"]]
        with self.index.read() as txn:
            have = {k: self.index.find_block(txn, namespace, k) for k, _, _ in entries}
        wanted = [k for k, _, _ in entries if have[k] is None or not have[k].local]
        downloads = _Prefetch(
            self._download_pool, wanted, lambda k: self.bucket.get(block_object(namespace, k))
        )
        try:
            for key, count, entry in entries:
                if key in downloads:
                    got = downloads.take(key)
                    why = self._land_fetched(
                        namespace, key, got, entry, have[key], parent, m, pos, count
                    )
                    if why:
                        log.warning(
                            "object store block unusable: the chain ends before it",
                            extra={"namespace": namespace, "key": key.hex(), "reason": why},
                        )
                        break
                    fetched += 1
                keys.append(key)
                counts.append(count)
                parent, pos = key, pos + count
        finally:
            downloads.cancel()
            self._count_rehydrated(fetched)
        return keys, counts

    def _land_fetched(
        self,
        namespace: str,
        key: bytes,
        got: Got | None,
        entry: dict[str, Any],
        have: BlockRecord | None,
        parent: bytes,
        m: dict[str, Any],
        pos: int,
        count: int,
    ) -> str:
        """Lands one downloaded block; why it is unusable, or "" once it is in place."""
        if got is None:
            return "missing"
        if xxhash.xxh3_64_intdigest(got.body) != int(entry["xxh3"], 16):
            return "failed its checksum"
        draft = None if have else _draft(namespace, key, parent, m, pos, count)
        try:
            with self._one_at_a_time(("block", namespace, key)):
                self._land(namespace, key, got.body, have, draft)
        except CorruptBlock as exc:
            return exc.message
        return ""

    def _land(
        self,
        namespace: str,
        key: bytes,
        body: bytes,
        existing: BlockRecord | None,
        draft: BlockRecord | None = None,
    ) -> BlockRecord:
        """Writes a payload from the bucket durably into place and indexes it: checked against
        `existing` (a demoted block's record) or, for `draft`, against its own header."""
        base = existing or draft
        assert base is not None
        header_len, layout = _parse_payload(body, base, self.config.max_block_bytes)
        self.capacity.check_fits(len(body), namespace)
        self.capacity.reserve(len(body), namespace)
        writer = None
        try:
            writer = self.payloads.writer(body[:header_len], layout, self.capacity.free_disk)
            writer.write(memoryview(body)[header_len:])
            segments = writer.seal()
            if existing is not None and segments != existing.segments:
                raise CorruptBlock(
                    f"the object store's copy of block {key.hex()} does not match its record"
                )
            tensors = [t._replace(offset=t.offset + header_len) for t in layout]
            with self.publish_lock:
                with self.index.read() as txn:
                    current = self.index.find_block(txn, namespace, key)
                if existing is not None:
                    if current is None or current.created_ms != existing.created_ms:
                        raise BlockNotFound(f"block {key.hex()} was deleted while fetched")
                    if current.local:
                        return current  # fetched back by another reader meanwhile
                elif current is not None:
                    return current  # uploaded meanwhile: that one stands
                writer.publish(self.payloads.path(base.relpath))
                with self.index.write() as txn:
                    if existing is not None:
                        landed = self.index.set_local(txn, existing, True)
                    else:
                        landed = BlockRecord(
                            namespace,
                            key,
                            base.parent_key,
                            base.fingerprint,
                            base.token_ids,
                            tensors,
                            segments,
                            len(body),
                            base.relpath,
                            base.created_ms,
                        )
                        if self.index.find_block(txn, namespace, key) is None:
                            self.index.put_block(txn, landed)
                    self.index.put_remote(txn, namespace, key, xxhash.xxh3_64_intdigest(body))
        finally:
            if writer is not None:
                writer.abort()
            self.capacity.unreserve(len(body), namespace)
        self.capacity.touch_block((namespace, key))
        return landed

    def _count_rehydrated(self, n: int) -> None:
        if n:
            self.metrics.rehydrated_blocks.inc(n)
            with self.index.write() as txn:
                self.index.bump(txn, "rehydrated_blocks", n)

    def bucket_agents(self, namespace: str, after: str, limit: int) -> list[AgentView]:
        """Agents the bucket holds, in id order after `after`, as the bucket describes them."""
        prefix = f"{namespace}/agents/"
        views = []
        start = agent_object(namespace, after) if after else ""
        for name in self.bucket.list(prefix, start, limit):
            agent_id = name[len(prefix) :]
            with self.index.read() as txn:
                if self.index.uploaded_generation(txn, namespace, agent_id) == 0:
                    continue  # deleted here; its deletion there is queued
            got = self.bucket.get(name)
            if got is None:
                continue
            try:
                m = _manifest_object(got.body, got.metadata, namespace, agent_id)
            except CorruptRecord as exc:
                log.warning(
                    "unreadable manifest in the object store", extra={"reason": exc.message}
                )
                continue
            record = AgentRecord(
                namespace,
                agent_id,
                m["fingerprint"],
                m["token_ids"],
                [bytes.fromhex(b["key"]) for b in m["blocks"]],
                [int(b["num_tokens"]) for b in m["blocks"]],
                m["metadata"],
                m["phase"],
                m["created_unix_ms"],
                m["updated_unix_ms"],
                m["generation"],
            )
            views.append(AgentView(record, [], sum(int(b["num_bytes"]) for b in m["blocks"])))
        return views

    def stats(self) -> dict[str, Any]:
        return {
            "object_store": str(self.bucket.location),
            "object_store_state": self.state,
            "object_queue_depth": self.backlog(),
            "object_put_bytes": self.bucket.moved["put"],
            "object_get_bytes": self.bucket.moved["get"],
        }


class _Prefetch:
    """Downloads `keys` in order, at most the pool's width ahead of the one taken."""

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


def _draft(
    namespace: str, key: bytes, parent: bytes, m: dict[str, Any], pos: int, count: int
) -> BlockRecord:
    """What a manifest says of one of its blocks, before its payload is read."""
    return BlockRecord(
        namespace,
        key,
        parent,
        m["fingerprint"],
        [int(t) for t in m["token_ids"][pos : pos + count]],
        [],
        [],
        0,
        Payloads.relpath(namespace, key),
        now_ms(),
    )


def _parse_payload(
    body: bytes, base: BlockRecord, max_block_bytes: int
) -> tuple[int, list[validation.TensorLayout]]:
    """The header length and tensor layout of a payload file from the bucket, checked to be
    the block `base` names (key, fingerprint, namespace, token count) and laid out as ours."""
    key = base.key.hex()
    try:
        n = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + n])
        meta = header.pop("__metadata__")
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        specs = [(name, e["dtype"], e["shape"]) for name, e in entries]
        offsets = [tuple(e["data_offsets"]) for _, e in entries]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptBlock(
            f"the object store's copy of block {key} has no readable header"
        ) from exc
    claimed = (meta.get("key"), meta.get("fingerprint"), meta.get("namespace"))
    if claimed != (key, base.fingerprint, base.namespace) or meta.get("num_tokens") != str(
        len(base.token_ids)
    ):
        raise CorruptBlock(f"the object store's copy of block {key} names another block")
    try:
        layout = validation.tensor_layout(specs, max_block_bytes)
    except InvalidArgument as exc:
        raise CorruptBlock(f"the object store's copy of block {key}: {exc.message}") from exc
    if [(t.offset, t.offset + t.num_bytes) for t in layout] != offsets or len(body) != 8 + n + sum(
        t.num_bytes for t in layout
    ):
        raise CorruptBlock(
            f"the object store's copy of block {key} is not laid out as its header says"
        )
    return 8 + n, layout


def _manifest_object(
    body: bytes, metadata: dict[str, str], namespace: str, agent_id: str
) -> dict[str, Any]:
    """A manifest from the bucket, checked; CorruptRecord (DATA_LOSS) if it is not whole."""
    where = f"the object store's manifest of agent {agent_id!r} in namespace {namespace!r}"
    if metadata.get("agentkv-xxh3") != f"{xxhash.xxh3_64_intdigest(body):016x}":
        raise CorruptRecord(f"{where} failed its checksum")
    try:
        m = json.loads(body)
        ok = (
            m["format"] == AGENT_FORMAT
            and m["namespace"] == namespace
            and m["agent_id"] == agent_id
            and all(isinstance(b["key"], str) for b in m["blocks"])
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptRecord(f"{where} does not decode: {exc}") from exc
    if not ok:
        raise CorruptRecord(f"{where} names another agent or format")
    return m
