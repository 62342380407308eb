"""Leases: blocks a reader or an uncommitted writer holds, which nothing may delete."""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

BlockId = tuple[str, bytes]  # (namespace, key)


@dataclass(slots=True)
class Lease:
    blocks: list[BlockId]
    expires: float  # time.monotonic()
    expires_unix_ms: int


class Leases:
    """In memory on purpose: a restarted store has no readers mid-read, so no lease survives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._held: Counter[BlockId] = Counter()

    def grant(self, blocks: Iterable[BlockId], seconds: float) -> tuple[str, int]:
        lease_id = secrets.token_urlsafe(16)
        held = list(blocks)
        expires_ms = int((time.time() + seconds) * 1000)
        with self._lock:
            self._expire()
            self._leases[lease_id] = Lease(held, time.monotonic() + seconds, expires_ms)
            self._held.update(held)
        return lease_id, expires_ms

    def extend(self, lease_id: str, blocks: Iterable[BlockId]) -> None:
        """Adds blocks to a live lease (an upload's lease grows block by block)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                added = list(blocks)
                lease.blocks.extend(added)
                self._held.update(added)

    def release(self, lease_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(lease_id)

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
        for lease_id in [i for i, lease in self._leases.items() if lease.expires <= now]:
            self._drop(lease_id)

    def _drop(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._held.subtract(lease.blocks)
        self._held += Counter()  # drop zero counts
        return True
