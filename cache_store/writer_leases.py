"""One writing store per namespace in a shared bucket: the holder of `<ns>/writer.lease`.

A lease is created with If-None-Match, renewed with If-Match, and taken over with If-Match
once it has expired. A renewal that loses to a write of this store's own whose answer was lost
(botocore's retry of a try that timed out but landed; a renewal that timed out, landed later)
keeps the lease: only another store's write loses it. A store that finds another's live lease
refuses the namespace's writes (FAILED_PRECONDITION) and serves it read-only from the bucket. A
store that cannot reach the bucket keeps writing locally and uploads nothing of a namespace
until it holds the lease again.
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv.errors import FailedPrecondition
from agentkv.serving import write_atomically
from agentkv.units import utc_time
from cache_store.capacity import now_ms
from cache_store.objects import Bucket, Conflict, ObjectStoreDown, failure

log = logging.getLogger("agentkv.store")

LEASE_FORMAT = "agentkv-writer-lease-v1"


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
        write_atomically(path, ident)
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
        self._terms: collections.Counter[str] = collections.Counter()  # holds begun
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

    def term(self, namespace: str) -> int:
        """How many times this store has begun to hold the namespace's lease (a hold lost
        and had again is a new term: another store may have written meanwhile)."""
        with self._lock:
            return self._terms[namespace]

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
                    f"writer lease unverified: object store {failure(exc)}; writing locally",
                    extra={"namespace": namespace, "reason": exc.message},
                )

    def acquire(self, namespace: str) -> None:
        """Creates, renews or takes over the lease; NamespaceHeld if another store's is live.
        One acquisition or renewal at a time (so none stores an ETag another replaced)."""
        with self._acquiring:
            if not self.holds(namespace):
                self._acquire(namespace)

    def _acquire(self, namespace: str) -> None:
        for _ in range(3):  # each lost race re-reads what won it
            try:
                self._put(namespace, if_none_match=True, begins=True)
                return
            except Conflict:
                pass
            got = self.bucket.get(lease_object(namespace))
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
                self._put(namespace, if_match=got.etag, begins=True)
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

    def _put(self, namespace: str, begins: bool = False, **condition: Any) -> None:
        """Writes the lease under `condition` (if_match or if_none_match) and holds it; the hold
        counts from before the body's writing, so a slow put shortens it, never lengthens it."""
        started = time.monotonic()
        etag = self.bucket.put(lease_object(namespace), *self._body(namespace), **condition)
        with self._lock:
            self._held[namespace] = _Held(etag, started + self.seconds - self.margin)
            self._terms[namespace] += begins

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            with self._lock:
                held = list(self._held)
            for namespace in held:
                try:
                    with self._acquiring:
                        self._renew(namespace)
                except ObjectStoreDown:
                    pass  # it lapses by itself; uploads of the namespace pause meanwhile

    def _renew(self, namespace: str) -> None:
        """Renews a held lease. Its ETag may have changed by a write of this store's own that
        got no answer (one that timed out, or whose retry then lost to it): the lease is still
        this store's; only one another store wrote is lost."""
        with self._lock:
            lease = self._held.get(namespace)
        if lease is None:
            return
        try:
            self._put(namespace, if_match=lease.etag)
        except Conflict:
            holder = self._holder(namespace)
            if holder == self.store_id:
                return
            with self._lock:
                self._held.pop(namespace, None)
            if holder:
                log.error(
                    "writer lease lost: another store took the namespace over",
                    extra={"namespace": namespace, "store": holder},
                )
            else:
                log.warning(
                    "writer lease lost: its object is gone from the bucket, or unreadable; "
                    "the next write takes it again",
                    extra={"namespace": namespace},
                )

    def _holder(self, namespace: str) -> str:
        """Which store the bucket's lease names ("" for none). This store's own is held by
        its ETag, until the expiry its write gave it."""
        got = self.bucket.get(lease_object(namespace))
        holder, expires = _lease_fields(got.body) if got else ("", 0)
        if holder != self.store_id:
            return holder
        left = min((expires - now_ms()) / 1000, self.seconds) - self.margin
        with self._lock:
            self._held[namespace] = _Held(got.etag, time.monotonic() + left)
        log.info(
            "writer lease kept: the bucket holds a renewal of this store's whose answer was lost",
            extra={"namespace": namespace},
        )
        return holder


# 9999-12-31 23:59:59.999 UTC, the last time Python's datetime (utc_time) can write: a lease
# said to run past it is not one a store wrote.
LAST_WRITABLE_MS = 253_402_300_799_999


def _lease_fields(body: bytes) -> tuple[str, int]:
    """(holder, expires_unix_ms) of a lease object; an unreadable one counts as expired."""
    try:
        d = json.loads(body)
        holder, expires = str(d["store"]), int(d["expires_unix_ms"])
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError):  # Infinity too
        return "", 0
    return (holder, expires) if 0 <= expires <= LAST_WRITABLE_MS else ("", 0)
