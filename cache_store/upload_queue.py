"""The object-store tier's queue of uploads: bounded in memory, backed by the index.

What is in the bucket is recorded in the index, so everything else is the real queue: past
the bound a job is dropped and the index is rescanned once the queue runs dry (and on start,
so uploads resume after a restart). One job of an agent or block runs at a time, so its
generations never overtake each other; jobs of a namespace another store writes are parked
and tried again later.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("agentkv.store")

Job = tuple[str, str, str]  # ("block", ns, key hex) or ("agent", ns, agent id)
PARKED_RETRY_SECONDS = 5.0  # how often uploads of a namespace another store writes try again


class JobQueue:
    def __init__(self, bound: int, scan: Callable[[], list[Job]]) -> None:
        self.bound, self._scan = bound, scan
        self._queue: collections.deque[Job] = collections.deque()
        self._queued: set[Job] = set()
        self._inflight: set[Job] = set()
        self._parked: dict[str, set[Job]] = {}  # namespace: jobs waiting for its lease
        self._unpark_at: dict[str, float] = {}
        self.overflow = True  # start with a scan of the index: uploads resume after a restart
        self._scanning = False
        self._cond = threading.Condition()

    def add(self, job: Job) -> bool:
        """Queues a job; False when the queue is full (the next scan finds it)."""
        with self._cond:
            self._cond.notify_all()
            if job in self._queued or job in self._parked.get(job[1], ()):
                return True
            if len(self._queue) >= self.bound:
                self.overflow = True
                return False
            self._queue.append(job)
            self._queued.add(job)
            return True

    def retry(self, job: Job) -> None:
        """Puts a job that failed for the moment back first (within the bound)."""
        with self._cond:
            if job in self._queued:
                return
            if len(self._queue) >= self.bound:
                self.overflow = True
            else:
                self._queue.appendleft(job)
                self._queued.add(job)

    def park(self, job: Job) -> None:
        """Sets a job of a namespace this store may not write aside, for a while."""
        with self._cond:
            self._parked.setdefault(job[1], set()).add(job)
            self._unpark_at[job[1]] = time.monotonic() + PARKED_RETRY_SECONDS

    def rescan_later(self) -> None:
        with self._cond:
            self.overflow = True

    def done(self, job: Job) -> None:
        with self._cond:
            self._inflight.discard(job)
            self._cond.notify_all()

    def take(self) -> Job | None:
        """The next job no other uploader is on; None after waiting a while for one."""
        if self._begin_scan():
            self._refill()
        with self._cond:
            for _ in range(len(self._queue)):
                job = self._queue.popleft()
                if job in self._inflight:
                    self._queue.append(job)  # its agent or block is being uploaded: after it
                    continue
                self._queued.discard(job)
                if job[1] in self._unpark_at:
                    self._parked.setdefault(job[1], set()).add(job)
                    continue
                self._inflight.add(job)
                return job
            self._cond.wait(1.0)
            return None

    def _begin_scan(self) -> bool:
        """Unparks what is due; whether this caller is to rescan the index."""
        with self._cond:
            now = time.monotonic()
            for namespace in [n for n, at in self._unpark_at.items() if at <= now]:
                del self._unpark_at[namespace]
                jobs = self._parked.pop(namespace, set()) - self._queued
                self._queue.extend(jobs)
                self._queued |= jobs
            if self._queue or not self.overflow or self._scanning:
                return False
            self._scanning, self.overflow = True, False
            return True

    def _refill(self) -> None:
        """Refills the queue from the index (outside the queue's lock), up to its bound."""
        try:
            jobs = self._scan()
        except Exception:
            log.exception("object store: scanning the index failed")
            jobs = []
        with self._cond:
            room = self.bound - len(self._queue)
            fresh = [j for j in jobs if j not in self._queued and j not in self._inflight]
            self._queue.extend(fresh[:room])
            self._queued.update(fresh[:room])
            self.overflow = len(fresh) > room
            self._scanning = False
            self._cond.notify_all()

    def pending(self) -> int:
        """Jobs queued or running, and 1 while the index holds more or is being scanned."""
        with self._cond:
            return self._pending()

    def backlog(self) -> int:
        """Everything not yet written through that this process knows of: pending, and
        parked (between a scan's start and its refill, the queue is empty and no upload
        runs: that is not written through)."""
        with self._cond:
            return self._pending() + sum(len(jobs) for jobs in self._parked.values())

    def _pending(self) -> int:
        return len(self._queue) + len(self._inflight) + (self.overflow or self._scanning)

    def wait(self, seconds: float) -> None:
        """Waits up to `seconds` for a job to finish (or one to be added)."""
        with self._cond:
            self._cond.wait(seconds)

    def drain(self, seconds: float) -> bool:
        """Waits until nothing is queued; whether it was, within `seconds`."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
