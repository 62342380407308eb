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
        expires = time.monotonic() + seconds
        expires_ms = int((time.time() + seconds) * 1000)
        with self._lock:
            self._expire()
            if self._per_namespace[namespace] >= self.per_namespace:
                raise ResourceExhausted(
                    f"namespace {namespace!r} holds {self.per_namespace} leases, the limit: "
                    "release leases (ReleaseLease, or commit the blocks) before taking more"
                )
            self._leases[lease_id] = Lease(namespace, held, expires, expires_ms)
            self._per_namespace[namespace] += 1
            self._held.update(held)
            heapq.heappush(self._expiry, (expires, lease_id))
        return lease_id, expires_ms

    def extend(self, lease_id: str, blocks: Iterable[BlockId]) -> None:
        """Adds blocks to a live lease (an upload's lease grows block by block)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                added = list(blocks)
                lease.blocks.extend(added)
                self._held.update(added)

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
