"""Payload streams served at once, and idle ones cut off.

Each PutBlocks or GetBlocks holds an RPC thread for as long as its peer keeps it open. At
most `limit` streams of each kind run at once (the next is refused with RESOURCE_EXHAUSTED),
so the threads left always serve other calls; a stream that moves no message for
`idle_seconds` (a stalled reader, a writer that sent a header and went quiet) is cancelled,
which frees its thread, its disk reservation and its leases.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from agentkv.errors import ServerBusy

log = logging.getLogger("agentkv.store")


@dataclass(slots=True, eq=False)  # hashed by identity
class _Watch:
    method: str
    context: grpc.ServicerContext
    last: float
    cancelled: bool = False


class StreamGuard:
    def __init__(
        self, limit: int, idle_seconds: float, on_cancel: Callable[[str], None] = lambda m: None
    ) -> None:
        self.limit, self.idle_seconds, self._on_cancel = limit, idle_seconds, on_cancel
        self._slots: dict[str, threading.BoundedSemaphore] = {}
        self._watches: set[_Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._patrol, name="stream-guard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    @contextmanager
    def open(self, method: str, context: grpc.ServicerContext) -> Iterator[Callable[[], None]]:
        """A slot for one stream of `method`; yields the beat to call on every message moved."""
        with self._lock:
            slots = self._slots.setdefault(method, threading.BoundedSemaphore(self.limit))
        if not slots.acquire(blocking=False):
            raise ServerBusy(
                f"the store is serving {self.limit} {method} streams, its limit; retry shortly"
            )
        watch = _Watch(method, context, time.monotonic())
        with self._lock:
            self._watches.add(watch)
        try:
            yield lambda: setattr(watch, "last", time.monotonic())
        finally:
            with self._lock:
                self._watches.discard(watch)
            slots.release()

    def _patrol(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_seconds / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [
                    w for w in self._watches if not w.cancelled and now - w.last > self.idle_seconds
                ]
            for watch in idle:
                watch.cancelled = True
                log.warning(
                    "idle stream cancelled",
                    extra={"method": watch.method, "idle_seconds": self.idle_seconds},
                )
                self._on_cancel(watch.method)
                watch.context.cancel()
