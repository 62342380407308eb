"""The object-store tier behind the local one: write-through in commit order, demotion instead
of loss, rehydration, and one writing store per namespace.

The bucket's layout is bucket_layout.py; the uploads' queue upload_queue.py (the index is
the real queue: a restart rescans it and resumes); one upload uploader.py; reads fetcher.py;
who writes a namespace writer_leases.py. This module runs the uploader threads and keeps the
tier's state: ok, unreachable (the local tier keeps working; uploads retry with back-off) or
backlogged (more is waiting than the queue in memory holds). Any request that gets no answer
(an upload, a read, a lease) makes it unreachable; a probe then asks until the bucket answers.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from cache_store import bucket_layout as layout
from cache_store.capacity import Capacity
from cache_store.fetcher import Fetcher
from cache_store.objects import Bucket, ObjectStoreDown, failure
from cache_store.parts import Parts
from cache_store.records import BlockRecord
from cache_store.upload_queue import PARKED_RETRY_SECONDS, Job, JobQueue
from cache_store.uploader import Uploader
from cache_store.writer_leases import NotWriter, WriterLeases, store_identity

log = logging.getLogger("agentkv.store")

RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)  # uploader back-off while the bucket is down


class ObjectTier:
    def __init__(
        self,
        parts: Parts,
        capacity: Capacity,
        bucket: Bucket,
        quarantine: Callable[[BlockRecord, str], None],
    ) -> None:
        config, self.bucket, self.index = parts.config, bucket, parts.index
        self.store_id = store_identity(config.data_dir, config.store_id)
        self.writers = WriterLeases(bucket, self.store_id, config.writer_lease_seconds)
        self.uploader = Uploader(parts, bucket, self.writers, quarantine)
        self.queue = JobQueue(config.object_queue_max, self.uploader.scan)
        self.fetcher = Fetcher(parts, capacity, bucket)
        self.rehydrate, self.fetch_agent = self.fetcher.rehydrate, self.fetcher.fetch_agent
        self.bucket_agents = self.fetcher.bucket_agents
        self._current: dict[tuple[str, str], int] = {}  # agent -> writer term it is current in
        self.state = "starting"  # ok | unreachable | backlogged
        self._on_state: Callable[[str], None] = lambda state: None
        # The state, whether a probe runs and which uploaders are failing: decided together.
        self._state_lock = threading.RLock()
        self._probing = True  # the first connect is a probe
        self._failing: set[str] = set()  # uploader threads whose last job failed
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._upload_loop, name=f"uploader-{i}", daemon=True)
            for i in range(config.object_uploaders)
        ]
        threading.Thread(target=self._start, name="object-store", daemon=True).start()

    def _start(self) -> None:
        self.bucket.on_down = self._went_down  # from the first request on: none is missed
        self._probe(quiet=False)
        for thread in self._threads:
            thread.start()

    def close(self, drain_seconds: float = 10.0) -> None:
        """Writes out what is queued (for up to `drain_seconds`), then stops."""
        if self.state == "ok":
            self.drain(drain_seconds)
        self._stop.set()
        self.queue.wake()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        self.fetcher.close()
        self.writers.close()

    def watch_state(self, on_state: Callable[[str], None]) -> None:
        self._on_state = on_state
        on_state(self.state)

    # writes: who may, and what to upload

    def check_writer(self, namespace: str) -> None:
        self.writers.check(namespace)

    def block_stored(self, record: BlockRecord) -> None:
        self._enqueue(("block", record.namespace, record.key.hex()))

    def still_holds(self, record: BlockRecord, checksum: int) -> bool:
        """Whether the bucket still holds the block as uploaded (a HEAD: the payload checksum
        in its metadata), asked before its local copy is freed. One gone behind the store's
        back (an age-based lifecycle rule, a hand, a bucket made anew) is uploaded again,
        where demoting it lost its only copy. While the bucket is away, the index's word: the
        local tier keeps taking writes, as it did before this check."""
        if self.state not in ("ok", "backlogged"):
            return True
        try:
            there = self.bucket.head(layout.block_object(record.namespace, record.key))
        except ObjectStoreDown:
            return True
        if there is not None and there.metadata.get("agentkv-xxh3") == f"{checksum:016x}":
            return True
        with self.index.write() as txn:  # unless collected or put anew meanwhile
            still = self.index.find_block(txn, record.namespace, record.key)
            if still is not None and still.created_ms == record.created_ms:
                self.index.drop_remote(txn, record.namespace, record.key)
        log.warning(
            "block gone from the object store: uploading it again",
            extra={"namespace": record.namespace, "key": record.key.hex()},
        )
        self.block_stored(record)
        return False

    def agent_changed(self, namespace: str, agent_id: str) -> None:
        """A commit, fork or delete: the manifest (or its deletion) goes out after its blocks."""
        self.mark_current(namespace, agent_id)
        self._enqueue(("agent", namespace, agent_id))

    def writes_current(self, namespace: str, agent_id: str) -> bool:
        """Whether this store writes the namespace and its copy of the agent is current:
        written here, or checked against the bucket, since this store's hold began."""
        term = self._current.get((namespace, agent_id))
        return self.writers.holds(namespace) and term == self.writers.term(namespace)

    def mark_current(self, namespace: str, agent_id: str) -> None:
        if self.writers.holds(namespace):
            self._current[(namespace, agent_id)] = self.writers.term(namespace)

    def _enqueue(self, job: Job) -> None:
        if not self.queue.add(job):
            self._set_state("backlogged")

    def pending(self) -> int:
        """Jobs queued or running while uploads flow (0 while the bucket is away: nothing
        will become safe soon, so a reservation need not wait for it)."""
        return self.queue.pending() if self.state in ("ok", "backlogged") else 0

    def backlog(self) -> int:
        return self.queue.backlog()

    def wait_for_uploads(self, seconds: float) -> None:
        """Waits up to `seconds` for the uploader to finish a job (quota pressure waits)."""
        self.queue.wait(seconds)

    def drain(self, seconds: float) -> bool:
        """Waits until nothing is queued (tests, benchmarks, a clean stop); whether it was."""
        return self.queue.drain(seconds)

    def _set_state(self, state: str) -> None:
        with self._state_lock:  # the uploaders, a probe and a read's thread may all say
            if state != self.state:
                log.info("object store state", extra={"state": state, "was": self.state})
                self.state = state
                self._on_state(state)

    def _went_down(self, reason: str) -> None:
        """A request got no answer: an upload, or a read or a lease renewal, after which no
        upload may be waiting to find out when the bucket is back. A probe asks until then."""
        with self._state_lock:
            if self._stop.is_set():
                return
            self._set_state("unreachable")
            if self._probing:
                return
            self._probing = True
        log.warning("object store unreachable", extra={"reason": reason})
        threading.Thread(target=self._probe, name="object-store-probe", daemon=True).start()

    def _probe(self, quiet: bool = True) -> None:
        """Asks until the bucket answers (the local tier works meanwhile; uploads wait), then
        says "ok": unless a request got no answer since (it asks again) or an uploader's
        last job failed (that uploader says "ok" once one lands; an uploader says
        "backlogged" after its next job)."""
        for attempt in itertools.count():
            try:
                self.bucket.ensure_bucket()
                with self._state_lock:
                    if self._stop.is_set() or not self.bucket.down:
                        self._probing = False
                        if not (self._stop.is_set() or self._failing):
                            self._set_state("ok")
                        return
            except ObjectStoreDown as exc:
                if attempt == 0 and not quiet:  # a probe's cause was said when it started
                    log.warning(f"object store {failure(exc)}", extra={"reason": exc.message})
                self._set_state("unreachable")
            if self._stop.wait(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]):
                with self._state_lock:
                    self._probing = False
                return

    # the uploaders

    def _upload_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            job = self.queue.take()
            if job is None:
                continue
            try:
                if self.uploader.carry_out(job):
                    self.queue.retry(job)
                failures = 0
                with self._state_lock:
                    self._failing.discard(threading.current_thread().name)
                    self._set_state("backlogged" if self.queue.overflow else "ok")
            except ObjectStoreDown as exc:
                self.queue.retry(job)
                if failures == 0:
                    log.warning(f"object store {failure(exc)}", extra={"reason": exc.message})
                with self._state_lock:
                    self._failing.add(threading.current_thread().name)
                    self._set_state("unreachable")
                self._stop.wait(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
                failures += 1
            except NotWriter:
                self.queue.park(job)
            except Exception:
                log.exception("object store upload failed", extra={"job": list(job)})
                self.queue.rescan_later()  # found again by the next scan, after a pause
                self._stop.wait(PARKED_RETRY_SECONDS)
            finally:
                self.queue.done(job)

    def stats(self) -> dict[str, Any]:
        return {
            "object_store": str(self.bucket.location),
            "object_store_state": self.state,
            "object_queue_depth": self.backlog(),
            "object_put_bytes": self.bucket.moved["put"],
            "object_get_bytes": self.bucket.moved["get"],
        }
