"""The LMDB index: blocks, agents, namespaces and counters, each change one transaction.

Keys are `namespace NUL id`, so a namespace is a key range and nothing crosses it.
Sub-databases:
  blocks      ns/key     -> BlockRecord
  children    ns/parent  -> child key (dupsort), for longest-prefix search
  unref       ns/key     -> ""  (blocks no manifest references: first to evict)
  lost        ns/key     -> uint64 references held by manifests on a quarantined block, so a
                            re-upload of the same block comes back with its reference count
  agents      ns/agent   -> AgentRecord
  namespaces  ns         -> {agents, blocks, bytes}
  counters    name       -> uint64 (evictions, quarantines)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import lmdb
import msgpack

from agentkv.errors import BlockNotFound, DiskFull, FingerprintMismatch, QuotaExceeded
from cache_store.records import AgentRecord, BlockRecord

SEP = b"\x00"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct(">I")


def ns_key(namespace: str, ident: bytes | str) -> bytes:
    raw = ident.encode() if isinstance(ident, str) else ident
    return namespace.encode() + SEP + raw


def _child(record: BlockRecord) -> bytes:
    return _U32.pack(len(record.token_ids)) + record.key


def split_key(raw: bytes) -> tuple[str, bytes]:
    ns, _, ident = raw.partition(SEP)
    return ns.decode(), ident


class Index:
    def __init__(self, path: Path, map_bytes: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=map_bytes, max_dbs=8, max_readers=256)
        self._blocks = self.env.open_db(b"blocks")
        self._children = self.env.open_db(b"children", dupsort=True)
        self._unref = self.env.open_db(b"unref")
        self._lost = self.env.open_db(b"lost")
        self._agents = self.env.open_db(b"agents")
        self._namespaces = self.env.open_db(b"namespaces")
        self._counters = self.env.open_db(b"counters")

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """A write transaction; a full map or disk becomes a typed error, and nothing commits."""
        try:
            with self.env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as exc:
            raise QuotaExceeded(f"index is full (lmdb map size reached): {exc}") from exc
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.DiskError) or "space" in str(exc).lower():
                raise DiskFull(f"index write failed, disk full: {exc}") from exc
            raise

    def read(self) -> lmdb.Transaction:
        return self.env.begin()

    # blocks

    def get_block(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> BlockRecord | None:
        raw = txn.get(ns_key(namespace, key), db=self._blocks)
        return BlockRecord.decode(raw) if raw is not None else None

    def require_block(
        self, txn: lmdb.Transaction, namespace: str, fingerprint: str, key: bytes, field: str
    ) -> BlockRecord:
        """The block, or BlockNotFound / FingerprintMismatch naming `field`."""
        record = self.get_block(txn, namespace, key)
        if record is None:
            raise BlockNotFound(f"{field} {key.hex()} not found in namespace {namespace!r}")
        if record.fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"{field} {key.hex()} was written under fingerprint {record.fingerprint!r}, "
                f"not {fingerprint!r}"
            )
        return record

    def put_block(self, txn: lmdb.Transaction, record: BlockRecord) -> None:
        k = ns_key(record.namespace, record.key)
        lost = txn.pop(k, db=self._lost)
        if lost:
            record = replace(record, refcount=_U64.unpack(lost)[0])
        txn.put(k, record.encode(), db=self._blocks)
        txn.put(ns_key(record.namespace, record.parent_key), _child(record), db=self._children)
        if record.refcount == 0:
            txn.put(k, b"", db=self._unref)
        self._add_usage(txn, record.namespace, blocks=1, num_bytes=record.num_bytes)

    def delete_block(self, txn: lmdb.Transaction, record: BlockRecord, lost: bool = False) -> None:
        """Drops a block; `lost` (quarantine) remembers its references for a re-upload."""
        k = ns_key(record.namespace, record.key)
        if lost and record.refcount:
            txn.put(k, _U64.pack(record.refcount), db=self._lost)
        txn.delete(k, db=self._blocks)
        txn.delete(ns_key(record.namespace, record.parent_key), _child(record), db=self._children)
        txn.delete(k, db=self._unref)
        self._add_usage(txn, record.namespace, blocks=-1, num_bytes=-record.num_bytes)

    def add_ref(self, txn: lmdb.Transaction, namespace: str, key: bytes, delta: int) -> None:
        """Moves a block's reference count, or that remembered for a quarantined block."""
        record = self.get_block(txn, namespace, key)
        if record is None:
            self._add_lost_ref(txn, ns_key(namespace, key), delta)
            return
        record = replace(record, refcount=max(0, record.refcount + delta))
        k = ns_key(namespace, key)
        txn.put(k, record.encode(), db=self._blocks)
        if record.refcount == 0:
            txn.put(k, b"", db=self._unref)
        else:
            txn.delete(k, db=self._unref)

    def _add_lost_ref(self, txn: lmdb.Transaction, k: bytes, delta: int) -> None:
        raw = txn.get(k, db=self._lost)
        count = (_U64.unpack(raw)[0] if raw else 0) + delta
        if count > 0:
            txn.put(k, _U64.pack(count), db=self._lost)
        else:
            txn.delete(k, db=self._lost)

    def children(
        self, txn: lmdb.Transaction, namespace: str, parent: bytes
    ) -> list[tuple[int, bytes]]:
        """(num_tokens, key) of every block whose parent is `parent`."""
        cursor = txn.cursor(db=self._children)
        if not cursor.set_key(ns_key(namespace, parent)):
            return []
        return [(_U32.unpack_from(v)[0], v[4:]) for v in cursor.iternext_dup()]

    def unreferenced(self, txn: lmdb.Transaction, namespace: str | None) -> list[tuple[str, bytes]]:
        return [split_key(k) for k in self._keys(txn, self._unref, namespace)]

    def blocks(self, txn: lmdb.Transaction, namespace: str | None) -> Iterator[BlockRecord]:
        for _, raw in self._items(txn, self._blocks, namespace):
            yield BlockRecord.decode(raw)

    def block_page(
        self, txn: lmdb.Transaction, namespace: str, after: bytes, limit: int
    ) -> list[BlockRecord]:
        return [
            BlockRecord.decode(raw)
            for raw in self._page(txn, self._blocks, namespace, after, limit)
        ]

    # agents

    def get_agent(self, txn: lmdb.Transaction, namespace: str, agent_id: str) -> AgentRecord | None:
        raw = txn.get(ns_key(namespace, agent_id), db=self._agents)
        return AgentRecord.decode(raw) if raw is not None else None

    def put_agent(self, txn: lmdb.Transaction, record: AgentRecord, created: bool) -> None:
        txn.put(ns_key(record.namespace, record.agent_id), record.encode(), db=self._agents)
        if created:
            self._add_usage(txn, record.namespace, agents=1)

    def delete_agent(self, txn: lmdb.Transaction, record: AgentRecord) -> None:
        txn.delete(ns_key(record.namespace, record.agent_id), db=self._agents)
        self._add_usage(txn, record.namespace, agents=-1)

    def agents(self, txn: lmdb.Transaction, namespace: str | None) -> Iterator[AgentRecord]:
        for _, raw in self._items(txn, self._agents, namespace):
            yield AgentRecord.decode(raw)

    def agent_page(
        self, txn: lmdb.Transaction, namespace: str, after: str, limit: int
    ) -> list[AgentRecord]:
        rows = self._page(txn, self._agents, namespace, after.encode(), limit)
        return [AgentRecord.decode(raw) for raw in rows]

    # namespaces and counters

    def namespaces(self, txn: lmdb.Transaction) -> dict[str, dict[str, int]]:
        return {
            k.decode(): msgpack.unpackb(v) for k, v in txn.cursor(db=self._namespaces).iternext()
        }

    def usage_bytes(self, txn: lmdb.Transaction, namespace: str | None = None) -> int:
        """Payload bytes in one namespace, or in all of them."""
        if namespace is not None:
            raw = txn.get(namespace.encode(), db=self._namespaces)
            return msgpack.unpackb(raw)["bytes"] if raw else 0
        return sum(u["bytes"] for u in self.namespaces(txn).values())

    def counter(self, txn: lmdb.Transaction, name: str) -> int:
        raw = txn.get(name.encode(), db=self._counters)
        return _U64.unpack(raw)[0] if raw else 0

    def bump(self, txn: lmdb.Transaction, name: str, delta: int = 1) -> None:
        txn.put(name.encode(), _U64.pack(self.counter(txn, name) + delta), db=self._counters)

    def _add_usage(
        self,
        txn: lmdb.Transaction,
        namespace: str,
        agents: int = 0,
        blocks: int = 0,
        num_bytes: int = 0,
    ) -> None:
        k = namespace.encode()
        raw = txn.get(k, db=self._namespaces)
        usage = msgpack.unpackb(raw) if raw else {"agents": 0, "blocks": 0, "bytes": 0}
        usage["agents"] += agents
        usage["blocks"] += blocks
        usage["bytes"] += num_bytes
        if usage == {"agents": 0, "blocks": 0, "bytes": 0}:
            txn.delete(k, db=self._namespaces)
        else:
            txn.put(k, msgpack.packb(usage), db=self._namespaces)

    # cursor helpers

    def _items(
        self, txn: lmdb.Transaction, db: lmdb._Database, namespace: str | None
    ) -> Iterator[tuple[bytes, bytes]]:
        cursor = txn.cursor(db=db)
        prefix = namespace.encode() + SEP if namespace is not None else b""
        if not cursor.set_range(prefix):
            return
        for k, v in cursor:
            if not k.startswith(prefix):
                return
            yield k, v

    def _keys(
        self, txn: lmdb.Transaction, db: lmdb._Database, namespace: str | None
    ) -> list[bytes]:
        return [k for k, _ in self._items(txn, db, namespace)]

    def _page(
        self, txn: lmdb.Transaction, db: lmdb._Database, namespace: str, after: bytes, limit: int
    ) -> list[bytes]:
        prefix = namespace.encode() + SEP
        cursor = txn.cursor(db=db)
        rows: list[bytes] = []
        if not cursor.set_range(prefix + after):
            return rows
        for k, v in cursor:
            if not k.startswith(prefix) or len(rows) == limit:
                break
            if after and k == prefix + after:
                continue
            rows.append(v)
        return rows
