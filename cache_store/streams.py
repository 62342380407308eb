"""Payload streams served at once, and idle ones cut off.

Each PutBlocks or GetBlocks holds an RPC thread for as long as its peer keeps it open. At
most `limit` streams of each kind run at once (the next is refused with RESOURCE_EXHAUSTED),
so the threads left always serve other calls, and one namespace never takes the last
quarter of them, so one tenant's slow or stalled streams leave other tenants some. Where
tokens are checked, a PutBlocks counts from its start, before its first header names its
namespace: in its token's namespace, where the token allows one, else among its token's
streams, where it stays (a token of two namespaces does not take 9 in each). A stream that
moves no message for `idle_seconds` (a stalled reader, a writer that sent a header and went
quiet) is cancelled, which frees its thread, its disk reservation and its leases.
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
    namespace: str | None = None  # whose share it counts in, once known
    token: str | None = None  # the token whose share it counts in too (of some namespaces)


class Beat:
    """A stream's: called on every message moved; `tenant` names its namespace (a PutBlocks
    knows it at its first header), ServerBusy past that namespace's share."""

    def __init__(self, guard: StreamGuard, watch: _Watch) -> None:
        self._guard, self._watch = guard, watch

    def __call__(self) -> None:
        self._watch.last = time.monotonic()

    def tenant(self, namespace: str) -> None:
        if self._watch.namespace is None:  # the first block's namespace: the stream's
            self._guard.claim(self._watch, namespace)


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
    def open(
        self,
        method: str,
        context: grpc.ServicerContext,
        namespace: str | None = None,
        token: str | None = None,
    ) -> Iterator[Beat]:
        """A slot for one stream of `method` (of `namespace`, when known; else counted among
        the `token`'s until it is, given one); yields the beat to call on every message moved."""
        with self._lock:
            slots = self._slots.setdefault(method, threading.BoundedSemaphore(self.limit))
        if not slots.acquire(blocking=False):
            raise ServerBusy(
                f"the store is serving {self.limit} {method} streams, its limit; retry shortly"
            )
        watch = _Watch(method, context, time.monotonic())
        try:
            if token is not None:
                self._count(watch, "token", token, f"the token {token!r}")
            if namespace is not None:
                self.claim(watch, namespace)
            with self._lock:
                self._watches.add(watch)
            yield Beat(self, watch)
        finally:
            with self._lock:
                self._watches.discard(watch)
            slots.release()

    def claim(self, watch: _Watch, namespace: str) -> None:
        """Counts the stream in its namespace's share; ServerBusy past it."""
        self._count(watch, "namespace", namespace, f"namespace {namespace!r}")

    def _count(self, watch: _Watch, field: str, value: str, who: str) -> None:
        """Counts the stream among those whose `field` (namespace, token) is `value`: all but
        the last quarter of the limit (one at least) of one kind at once; ServerBusy past it.
        The stream joins the watched ones."""
        most = max(1, self.limit - max(1, self.limit // 4))
        with self._lock:
            held = sum(
                w is not watch and w.method == watch.method and getattr(w, field) == value
                for w in self._watches
            )
            if held >= most:
                raise ServerBusy(
                    f"{who} holds {most} {watch.method} streams, its share of the store's "
                    f"{self.limit}; retry shortly"
                )
            setattr(watch, field, value)
            self._watches.add(watch)

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
