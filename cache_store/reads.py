"""Blocks out: selections of a block's layers, streamed reads and located reads under a
lease (a demoted block fetched back from the object store first), corruption reports, and
the longest stored prefix of a token sequence."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentkv import ids
from agentkv.errors import BlockNotFound, CorruptBlock, InvalidArgument
from agentkv.keys import block_key
from agentkv.wire import MAX_KEYS_PER_READ
from cache_store.capacity import Capacity
from cache_store.leases import StreamLease
from cache_store.parts import Parts
from cache_store.records import BlockRecord, Segment
from cache_store.validation import TensorLayout

if TYPE_CHECKING:
    from cache_store.tier import ObjectTier

log = logging.getLogger("agentkv.store")
MAX_PREFIX_BLOCKS = 4096  # a FindLongestPrefix searches so many past its greedy chain
MAX_REASON_CHARS = 1024  # of a ReportCorruptBlock's reason: the rest is not kept


@dataclass(slots=True)
class Selection:
    """The tensors and checksummed segments of a block that a reader asked for."""

    record: BlockRecord
    tensors: list[TensorLayout]
    segments: list[Segment]

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.segments)

    @property
    def identity(self) -> tuple:
        """Names these exact bytes: a re-uploaded block gets a new created_ms and checksums."""
        r = self.record
        return (
            r.namespace,
            r.key,
            r.created_ms,
            tuple((s.layer, s.checksum) for s in self.segments),
        )


class BlockReads:
    def __init__(self, parts: Parts, capacity: Capacity, quarantine: Callable[..., None]) -> None:
        self.config, self.index, self.payloads = parts.config, parts.index, parts.payloads
        self.leases, self.metrics, self.capacity = parts.leases, parts.metrics, capacity
        self.quarantine = quarantine
        self.tier: ObjectTier | None = None  # set once the object-store tier is up

    def select(
        self, namespace: str, fingerprint: str, keys: Sequence[bytes], layers: Sequence[int]
    ) -> list[Selection]:
        """Checks every key first, so a stream never starts for a request that must fail."""
        ns = ids.namespace(namespace)
        fp = ids.fingerprint(fingerprint)
        keys = read_keys(keys)
        with self.index.read() as txn:
            records = [self.index.require_block(txn, ns, fp, k, "key") for k in keys]
        return [select_layers(r, set(layers)) for r in records]

    @contextmanager
    def reading(self, selections: Sequence[Selection]) -> Iterator[Callable[[], None]]:
        """Holds a lease on the blocks while a streamed read runs; yields `moved`, for the
        stream to call as its peer takes each message: the lease is renewed past half its
        life, so it lasts as long as the stream moves (one lease of max_lease_seconds ran
        out under a slow reader, whose blocks a collection then deleted mid-read)."""
        seconds = self.config.max_lease_seconds
        lease = StreamLease(self.leases, seconds)
        lease.hold(*[(s.record.namespace, s.record.key) for s in selections])
        renew_at = time.monotonic() + seconds / 2

        def moved() -> None:
            nonlocal renew_at
            if time.monotonic() < renew_at:
                return
            renew_at = time.monotonic() + seconds / 2
            if lease.renew():  # lapsed, the stream paused that long: its blocks may be gone
                self._ensure_local(selections)  # or demoted: NOT_FOUND, or fetched back

        try:
            self._ensure_local(selections)
            yield moved
        finally:
            lease.release()

    def read(self, selection: Selection, max_run: int) -> Iterator[memoryview]:
        """The selected bytes in verified runs; a bad payload is quarantined (CorruptBlock)."""
        record = selection.record
        self.capacity.touch_block((record.namespace, record.key))
        try:
            yield from self.payloads.read(record, selection.segments, max_run)
        except CorruptBlock as exc:
            self.quarantine(record, exc.message)
            raise
        self.metrics.get_bytes.inc(selection.num_bytes)

    def locate(
        self,
        namespace: str,
        fingerprint: str,
        keys: Sequence[bytes],
        layers: Sequence[int],
        lease_seconds: int,
        check: Callable[[list[Selection]], None] = lambda selections: None,
    ) -> tuple[str, int, list[Selection]]:
        """The selections under a new lease, each block on local disk; `check` may refuse
        them first, before anything is leased or fetched (the servicer: a reply too big)."""
        seconds = lease_seconds or self.config.lease_seconds
        if seconds > self.config.max_lease_seconds:
            raise InvalidArgument(
                f"lease_seconds {seconds} exceeds the limit {self.config.max_lease_seconds}"
            )
        selections = self.select(namespace, fingerprint, keys, layers)
        check(selections)
        blocks = [(s.record.namespace, s.record.key) for s in selections]
        lease_id, expires = self.leases.grant(selections[0].record.namespace, blocks, seconds)
        try:
            self._ensure_local(selections)  # fetched to local disk, then located
        except BaseException:
            self.leases.release(lease_id)
            raise
        for block in blocks:
            self.capacity.touch_block(block)
        return lease_id, expires, selections

    def _ensure_local(self, selections: Sequence[Selection]) -> None:
        """Under the caller's lease (nothing demotes a leased block): each selected block's
        record as it is now, its payload fetched back from the object store if demoted. One
        the object store cannot give back whole is quarantined (DATA_LOSS: a re-prefill); one
        deleted between its selection and the lease is NOT_FOUND, never a path to no file."""
        self.payloads.check_root()  # nor a path into a data directory that went away
        with self.index.read() as txn:
            for s in selections:
                s.record = self._still_there(txn, s.record)
        for s in selections:
            if s.record.local:
                continue
            if self.tier is None:
                raise CorruptBlock(
                    f"block {s.record.key.hex()} is demoted and no object store is set"
                )
            try:
                s.record = self.tier.rehydrate(s.record)
            except CorruptBlock as exc:
                self.quarantine(s.record, exc.message, where="bucket")
                raise

    def _still_there(self, txn: Any, record: BlockRecord) -> BlockRecord:
        current = self.index.get_block(txn, record.namespace, record.key)
        if current is None or current.created_ms != record.created_ms:
            raise BlockNotFound(
                f"block {record.key.hex()} in namespace {record.namespace!r} was deleted or "
                "replaced while it was being looked up; ask again"
            )
        return current

    def path_of(self, record: BlockRecord) -> str:
        return str(self.payloads.path(record.relpath))

    def report_corrupt(
        self, namespace: str, key: bytes, reason: str, does_not_fit: bool = False
    ) -> bool:
        """Quarantines a block whose payload fails a check, or, on a namespace writer's word
        (`does_not_fit`), one whose tensors cannot belong to its model."""
        ns, key = ids.namespace(namespace), ids.key(key)
        reason = reason[:MAX_REASON_CHARS]  # it is logged, and kept with the quarantined block
        with self.index.read() as txn:
            record = self.index.get_block(txn, ns, key)
        if record is None:
            raise BlockNotFound(f"block {key.hex()} not found in namespace {ns!r}")
        if does_not_fit:
            self.quarantine(record, f"reported not to fit its model: {reason}", where="misfit")
            return True
        if not record.local:
            return False  # nothing here to check; a fetch back checks the object store's copy
        try:
            self.payloads.verify(record)
        except CorruptBlock as exc:
            self.quarantine(record, f"{exc.message} (reported: {reason})")
            return True
        log.warning("corruption report not confirmed", extra={"key": key.hex(), "reason": reason})
        return False

    def longest_prefix(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> list[BlockRecord]:
        ns, fp = ids.namespace(namespace), ids.fingerprint(fingerprint)
        tokens = ids.token_ids(token_ids, self.config.max_agent_tokens)
        # Depth first, each block's longest matching child first: the first way down is the
        # greedy chain, whole (where chains are cut alike, a worker's, the longest). Chains
        # cut otherwise (a raw client's spans) are searched after it, MAX_PREFIX_BLOCKS more.
        nodes: list[tuple[BlockRecord, int]] = []  # (a block, its parent's index; -1: none)
        paths, best, best_pos = [(-1, 0)], -1, 0  # (node index, tokens through it)
        budget = len(tokens) + MAX_PREFIX_BLOCKS  # the greedy chain has at most len(tokens)
        with self.index.read() as txn:
            while paths and budget and best_pos < len(tokens):  # none beats a whole match
                at, pos = paths.pop()
                budget -= 1
                if pos > best_pos:
                    best, best_pos = at, pos
                parent = nodes[at][0].key if at >= 0 else b""
                for record in self._children(txn, ns, fp, parent, tokens, pos):
                    nodes.append((record, at))
                    paths.append((len(nodes) - 1, pos + len(record.token_ids)))
        chain = []
        while best >= 0:
            record, best = nodes[best]
            chain.append(record)
        chain.reverse()
        (self.metrics.prefix_hits if chain else self.metrics.prefix_misses).inc()
        return chain

    def _children(
        self, txn: Any, ns: str, fp: str, parent: bytes, tokens: list[int], pos: int
    ) -> list[BlockRecord]:
        """The parent's children whose tokens come next, the longest last."""
        children = self.index.children(txn, ns, parent)
        keys = {key for _, key in children}
        found = []
        for n in sorted({n for n, _ in children}):
            if pos + n <= len(tokens):
                key = block_key(fp, parent, tokens[pos : pos + n])
                if key in keys and (record := self.index.find_block(txn, ns, key)):
                    found.append(record)
        return found


def read_keys(keys: Sequence[bytes]) -> list[bytes]:
    """A read's keys, checked: at least one, at most MAX_KEYS_PER_READ, none twice."""
    if not keys:
        raise InvalidArgument("no keys requested")
    if len(keys) > MAX_KEYS_PER_READ:
        raise InvalidArgument(
            f"{len(keys)} keys requested, more than the limit {MAX_KEYS_PER_READ} per request: "
            "read a longer chain in several requests"
        )
    first: dict[bytes, int] = {}
    for i, raw in enumerate(keys):
        k = ids.key(raw)
        if k in first:
            raise InvalidArgument(
                f"key {k.hex()} requested twice (keys[{first[k]}] and keys[{i}]): name each "
                "block once"
            )
        first[k] = i
    return list(first)


def select_layers(record: BlockRecord, layers: set[int]) -> Selection:
    if not layers:
        return Selection(record, record.tensors, [s for s in record.segments if s.layer >= 0])
    unknown = layers - set(record.layers)
    if unknown:
        raise InvalidArgument(
            f"block {record.key.hex()} has no layer {sorted(unknown)}; it holds layers "
            f"{record.layers[0]}..{record.layers[-1]}"
        )
    return Selection(
        record,
        [t for t in record.tensors if t.layer in layers],
        [s for s in record.segments if s.layer in layers],
    )
