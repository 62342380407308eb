"""Leases: blocks a reader or an uncommitted writer holds, which nothing may delete."""

from __future__ import annotations

import heapq
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from agentkv.errors import ResourceExhausted

BlockId = tuple[str, bytes]  # (namespace, key)
T = TypeVar("T")


@dataclass(slots=True)
class Lease:
    namespace: str  # whose count of live leases it is in
    blocks: list[BlockId]
    expires: float  # time.monotonic()
    expires_unix_ms: int


class Leases:
    """In memory on purpose: a restarted store has no readers mid-read, so no lease survives.

    Expiry is a heap, so granting and checking cost O(log n) however many leases one tenant
    holds, and each namespace may hold at most `per_namespace` live leases."""

    def __init__(self, per_namespace: int = 10_000) -> None:
        self.per_namespace = per_namespace
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._held: Counter[BlockId] = Counter()
        self._per_namespace: Counter[str] = Counter()
        self._expiry: list[tuple[float, str]] = []  # (expires, lease id); stale entries skipped

    def grant(self, namespace: str, blocks: Iterable[BlockId], seconds: float) -> tuple[str, int]:
        lease_id = secrets.token_urlsafe(16)
        held = list(blocks)
        with self._lock:
            self._expire()
            if self._per_namespace[namespace] >= self.per_namespace:
                raise ResourceExhausted(
                    f"namespace {namespace!r} holds {self.per_namespace} leases, the limit: "
                    "release leases (ReleaseLease, or commit the blocks) before taking more"
                )
            lease = self._leases[lease_id] = Lease(namespace, held, 0.0, 0)
            self._per_namespace[namespace] += 1
            self._held.update(held)
            self._renew(lease_id, lease, seconds)
        return lease_id, lease.expires_unix_ms

    def extend(self, lease_id: str, blocks: Iterable[BlockId], seconds: float) -> int:
        """Adds blocks to a live lease and renews it for `seconds` from now (an upload's lease
        grows block by block and lasts while its stream moves). The new expiry, Unix ms, or 0
        if the lease is gone (expired or released)."""
        added = list(blocks)
        with self._lock:
            self._expire()
            lease = self._leases.get(lease_id)
            if lease is None:
                return 0
            lease.blocks.extend(added)
            self._held.update(added)
            self._renew(lease_id, lease, seconds)
            return lease.expires_unix_ms

    def namespaces(self, lease_id: str) -> set[str]:
        """Every namespace a live lease touches (empty for an unknown lease)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return {lease.namespace, *(ns for ns, _ in lease.blocks)} if lease else set()

    def release(self, lease_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(lease_id)

    def unless_held(self, block: BlockId, action: Callable[[], T]) -> T | None:
        """Runs `action` unless the block is leased, with no lease granted meanwhile (so a
        reader that takes one afterwards sees what `action` did); None if it was leased."""
        with self._lock:
            self._expire()
            if self._held[block] > 0:
                return None
            return action()

    def is_held(self, block: BlockId) -> bool:
        with self._lock:
            self._expire()
            return self._held[block] > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._leases)

    def _renew(self, lease_id: str, lease: Lease, seconds: float) -> None:
        lease.expires = time.monotonic() + seconds
        lease.expires_unix_ms = int((time.time() + seconds) * 1000)
        heapq.heappush(self._expiry, (lease.expires, lease_id))  # the old entry goes stale

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires <= now:
                self._drop(lease_id)
        if len(self._expiry) > 2 * len(self._leases) + 1024:  # released leases' entries
            self._expiry = [(lease.expires, i) for i, lease in self._leases.items()]
            heapq.heapify(self._expiry)

    def _drop(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for block in lease.blocks:
            self._held[block] -= 1
            if self._held[block] <= 0:
                del self._held[block]
        self._per_namespace[lease.namespace] -= 1
        if self._per_namespace[lease.namespace] <= 0:
            del self._per_namespace[lease.namespace]
        return True


class StreamLease:
    """The lease of one PutBlocks stream on its blocks, counted against the namespace of its
    first block. Renewed with every message, so however long the stream runs, it ends with a
    live lease; one that lapsed while the stream paused is taken anew, and renew says so (the
    blocks it held may have been collected meanwhile)."""

    def __init__(self, leases: Leases, seconds: float) -> None:
        self.leases, self.seconds = leases, seconds
        self.lease_id, self.expires = "", 0
        self.blocks: list[BlockId] = []

    def hold(self, *blocks: BlockId) -> bool:
        """Adds blocks and renews the lease; True if it had lapsed (see renew)."""
        self.blocks += blocks
        return self.renew(list(blocks))

    def renew(self, added: list[BlockId] | None = None) -> bool:
        """Another `seconds` from now; True if the lease had lapsed and was taken anew."""
        if not self.blocks:
            return False  # no block yet, no lease
        if self.lease_id:
            self.expires = self.leases.extend(self.lease_id, added or [], self.seconds)
            if self.expires:
                return False
        lapsed = bool(self.lease_id)
        self.lease_id, self.expires = self.leases.grant(
            self.blocks[0][0], self.blocks, self.seconds
        )
        return lapsed

    def release(self) -> None:
        if self.lease_id:
            self.leases.release(self.lease_id)
