"""Keeping the index sound: its schema version, bad records found and quarantined, and what
derives from blocks and agents rebuilt from them.

A bad agent or block record (checksum or decode failure) moves to the `quarantine` table with
its bytes and the reason: the agent then reads as lost (DATA_LOSS) until deleted or committed
anew, the block as missing from the manifests naming it (they restore cold). A bad derived
entry (children, unref, lost, namespaces) is dropped and rebuilt; a bad counter restarts at 0.
A bad object-store entry is dropped, and so is an uploaded_ids entry that no sound `uploaded`
entry backs (absent, or of another generation: left by a release without the table).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial

import lmdb
import msgpack

from agentkv.errors import CorruptRecord, IndexUnusable
from cache_store import schema
from cache_store.index import (
    DERIVED,
    GENERATIONS_TOP,
    NO_USAGE,
    SEP,
    TABLES,
    Index,
    ns_key,
    prefixed,
)
from cache_store.records import (
    CHECKSUM_BYTES,
    DECODE_ERRORS,
    AgentRecord,
    BlockRecord,
    decode_u64,
    decode_uploaded_id,
    decode_usage,
    decode_value,
    encode_u64,
    record_name,
    seal,
    unseal,
)

log = logging.getLogger("agentkv.store")
# in `meta` once a rebuild counted agent records' bytes and generations_top (an index written
# before those were kept is recounted at its first start)
RECOUNTED_KEY = b"records_counted"

PRIMARY = ("blocks", "agents")  # quarantined and reported; everything else is rebuilt
CHECKS: dict[str, Callable[[bytes, bytes], object]] = {
    "blocks": BlockRecord.decode,
    "agents": AgentRecord.decode,
    "children": lambda k, v: decode_value("children", k, v, _child),
    "unref": lambda k, v: decode_value("unref", k, v, _empty),
    "lost": lambda k, v: decode_u64("lost", k, v),
    "namespaces": lambda k, v: decode_usage("namespaces", k, v),
    "counters": lambda k, v: decode_u64("counters", k, v),
    # A bad object-store entry is dropped: the block or manifest is written through again.
    "remote": lambda k, v: decode_u64("remote", k, v),
    "uploaded": lambda k, v: decode_u64("uploaded", k, v),
    "uploaded_ids": lambda k, v: decode_uploaded_id("uploaded_ids", k, v),
    "used": lambda k, v: decode_u64("used", k, v),  # a bad one is dropped: the commit's stands
}
# A scan of every record checks the checksums of the big ones only: decoding every block
# would double start-up time, and a sealed record that does not decode is caught on its read.
QUICK_CHECKS = {**CHECKS, "blocks": partial(unseal, "blocks"), "agents": partial(unseal, "agents")}


@dataclass(frozen=True, slots=True)
class BadRecord:
    """An index record that failed its checksum or would not decode."""

    table: str
    key: bytes
    reason: str

    @property
    def namespace(self) -> str:
        """The tenant it belongs to; empty for store-wide records (counters)."""
        if self.table == "counters":
            return ""
        ns = self.key if self.table == "namespaces" else self.key.partition(SEP)[0]
        return ns.decode(errors="replace")

    @property
    def ident(self) -> str:
        """The agent id, the block key in hex, or the entry's key as text."""
        if self.table in ("namespaces", "counters"):
            return self.key.decode(errors="replace")
        ident = self.key.partition(SEP)[2]
        return ident.decode(errors="replace") if self.table == "agents" else ident.hex()


@dataclass(slots=True)
class Findings:
    """What a scan found: bad records (with their bytes), and tables holding a record that
    LMDB cannot find by its key (a damaged branch page)."""

    bad: list[tuple[BadRecord, bytes]] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.bad or self.unreachable)

    @property
    def records(self) -> list[BadRecord]:
        return [bad for bad, _ in self.bad]


def open_index(index: Index) -> list[BadRecord]:
    """At start-up: checks the schema version (sealing an index of version 0), quarantines
    every bad record and rebuilds what derives from them. IndexUnusable if it cannot."""
    try:
        with index.write() as txn:
            migrated = schema.check(index, txn)
            found = scan(index, txn)
            if found or migrated:
                fix(index, txn, found)
            elif txn.get(RECOUNTED_KEY, db=index.dbs["meta"]) is None:
                rebuild(index, txn)  # an index from before records and generations_top
                if index.namespaces(txn):  # not a new one
                    log.info("index usage recounted with agent records")
    except lmdb.Error as exc:
        raise IndexUnusable(
            f"the index at {index.path} is damaged beyond single records ({exc}); restore the "
            "data dir from a backup, or move it away to start empty"
        ) from exc
    index.take_suspects()  # all checked just now
    return found.records


def scan(index: Index, txn: lmdb.Transaction, namespace: str | None = None) -> Findings:
    """Checks every record (of one namespace): its checksum, its decoding, and that LMDB
    finds it by its key."""
    found = Findings()
    for table in TABLES:
        if namespace is None or table != "counters":
            _scan_table(index, txn, table, namespace, found)
    _scan_uploaded_ids(index, txn, namespace, found)
    return found


def fix(index: Index, txn: lmdb.Transaction, found: Findings) -> None:
    """Rewrites unreachable tables, takes bad records out, and rebuilds the derived tables."""
    for table in found.unreachable - set(DERIVED):
        _rewrite_without(index, txn, table, set())
        log.warning(
            "index table rewritten: LMDB could not find some records", extra={"table": table}
        )
    _set_aside(index, txn, found.bad)
    recounted = rebuild(index, txn)
    log.warning("index rebuilt from blocks and agents", extra={"recounted_blocks": recounted})


def repair(
    index: Index, txn: lmdb.Transaction, suspects: Iterable[tuple[str, bytes]]
) -> list[BadRecord]:
    """Re-checks records noted bad while serving, takes out those still bad, and rebuilds
    (also when a suspect has since been overwritten: the bad one was counted)."""
    suspects = set(suspects)
    found = Findings([bad for table, k in suspects for bad in _bad_at(index, txn, table, k)])
    if suspects:
        fix(index, txn, found)
    return found.records


def _scan_table(
    index: Index, txn: lmdb.Transaction, table: str, namespace: str | None, found: Findings
) -> None:
    db = index.dbs[table]
    lookup = txn.cursor(db=db)
    for k, raw in prefixed(txn, db, b"" if namespace is None else namespace.encode()):
        if bad := _check(table, k, raw, namespace, QUICK_CHECKS):
            found.bad.append((bad, raw))
        elif not _reachable(table, txn, db, lookup, k, raw):
            found.unreachable.add(table)


def _scan_uploaded_ids(
    index: Index, txn: lmdb.Transaction, namespace: str | None, found: Findings
) -> None:
    """Finds the uploaded_ids entries, sound themselves, that no sound `uploaded` entry backs:
    kept, one would let a deletion delete a version this store no longer knows of."""
    flagged = {(bad.table, bad.key) for bad in found.records}
    prefix = b"" if namespace is None else namespace.encode() + SEP
    for k, raw in prefixed(txn, index.dbs["uploaded_ids"], prefix):
        if ("uploaded_ids", k) in flagged:
            continue
        uploaded = txn.get(k, db=index.dbs["uploaded"])
        if uploaded is None or ("uploaded", k) in flagged:
            reason = "backs no manifest recorded in the object store"
        else:
            generation = decode_u64("uploaded", k, uploaded)
            named = decode_uploaded_id("uploaded_ids", k, raw)[0]
            if not generation or generation == named:
                continue  # a deletion pending, or the manifest uploaded
            reason = f"names generation {named}, not {generation}, the one uploaded"
        found.bad.append((BadRecord("uploaded_ids", k, reason), raw))


def _reachable(
    table: str, txn: lmdb.Transaction, db: lmdb._Database, lookup: lmdb.Cursor, k, raw
) -> bool:
    if table == "children":
        return lookup.set_key_dup(k, raw)
    return txn.get(k, db=db) == raw


def _bad_at(
    index: Index, txn: lmdb.Transaction, table: str, k: bytes
) -> list[tuple[BadRecord, bytes]]:
    cursor = txn.cursor(db=index.dbs[table])
    values = list(cursor.iternext_dup()) if cursor.set_key(k) else []
    return [(bad, raw) for raw in values if (bad := _check(table, k, raw, None))]


def _set_aside(index: Index, txn: lmdb.Transaction, found: list[tuple[BadRecord, bytes]]) -> None:
    """Takes bad agents and blocks out into quarantine and bad counters out (reset to 0);
    bad derived entries stay for the rebuild, which drops their tables whole."""
    found = [(bad, raw) for bad, raw in found if bad.table not in DERIVED]
    astray: dict[str, set[bytes]] = {}
    for bad, _ in found:
        if not txn.delete(bad.key, db=index.dbs[bad.table]):
            astray.setdefault(bad.table, set()).add(bad.key)  # a damaged key, out of order
    for table, keys in astray.items():
        _rewrite_without(index, txn, table, keys)
    for bad, raw in found:
        _put_aside(index, txn, bad, raw)


def _rewrite_without(index: Index, txn: lmdb.Transaction, table: str, keys: set[bytes]) -> None:
    """Writes a table anew without `keys`: a key LMDB cannot find by search is still walked."""
    db = index.dbs[table]
    rows = [(k, v) for k, v in txn.cursor(db=db) if k not in keys]
    txn.drop(db, delete=False)
    for k, v in rows:
        txn.put(k, v, db=db)


def rebuild(index: Index, txn: lmdb.Transaction) -> int:
    """Recomputes children, unref, lost, refcounts and namespace usage (records' bytes too)
    from blocks and agents, and raises generations_top to every agent's generation; how
    many blocks' refcounts it corrected."""
    refs: Counter[bytes] = Counter()
    usage: dict[str, dict[str, int]] = {}
    for agent in index.agents(txn, None):
        k = ns_key(agent.namespace, agent.agent_id)
        u = usage.setdefault(agent.namespace, dict(NO_USAGE))
        u["agents"] += 1
        u["records"] += len(txn.get(k, db=index.dbs["agents"]) or b"")
        index.raise_counter(txn, GENERATIONS_TOP, agent.generation)
        refs.update(ns_key(agent.namespace, key) for key in set(agent.block_keys))
    for table in DERIVED:
        txn.drop(index.dbs[table], delete=False)
    recounted = []
    for block in index.blocks(txn, None):
        k = ns_key(block.namespace, block.key)
        count = refs.pop(k, 0)
        if count != block.refcount:
            recounted.append((k, replace(block, refcount=count)))
        index.put_child(txn, block)
        if count == 0:
            index.put_unref(txn, k)
        u = usage.setdefault(block.namespace, dict(NO_USAGE))
        u["blocks"] += 1
        u["bytes"] += block.local_bytes
    for k, block in recounted:
        txn.put(k, block.encode(k), db=index.dbs["blocks"])
    for k, count in refs.items():
        txn.put(k, encode_u64(k, count), db=index.dbs["lost"])
    for namespace, u in usage.items():
        index.put_usage(txn, namespace, u)
    txn.put(RECOUNTED_KEY, seal(RECOUNTED_KEY, b""), db=index.dbs["meta"])
    return len(recounted)


def quarantined(index: Index, txn: lmdb.Transaction, namespace: str | None) -> list[BadRecord]:
    """The quarantined agent and block records (of one namespace), still reported."""
    rows = [BadRecord(t, k, reason) for t, k, reason in index.quarantined_records(txn)]
    return [r for r in rows if namespace is None or r.namespace == namespace]


# one record


def _check(
    table: str, k: bytes, raw: bytes, namespace: str | None, checks=CHECKS
) -> BadRecord | None:
    if namespace is not None:
        ns = namespace.encode()
        if k != ns if table == "namespaces" else not k.startswith(ns + SEP):
            return None  # another namespace's
    try:
        checks[table](k, raw)
    except CorruptRecord as exc:
        return BadRecord(table, k, exc.message)
    return None


def _put_aside(index: Index, txn: lmdb.Transaction, bad: BadRecord, raw: bytes) -> None:
    """Quarantines a bad primary record; one whose only damage is its key (its checksum holds
    for the key its own fields name, and that key is free) is moved back instead. Derived
    entries are dropped (the caller rebuilds them)."""
    if bad.table not in PRIMARY:
        log.warning(
            "bad index entry dropped",
            extra={"record": record_name(bad.table, bad.key), "reason": bad.reason},
        )
        return
    db = index.dbs[bad.table]
    claimed = _claimed_key(bad.table, raw)
    if claimed not in (None, bad.key) and _check(bad.table, claimed, raw, None) is None:
        if txn.get(claimed, db=db) is None:
            txn.put(claimed, raw, db=db)
            log.warning(
                "index record moved back", extra={"record": record_name(bad.table, claimed)}
            )
        return  # else a sound record holds that key already: this is a damaged stale copy
    index.quarantine(txn, bad.table, bad.key, raw, bad.reason)
    index.bump(txn, "quarantined_records")
    log.warning(
        "index record quarantined",
        extra={"record": record_name(bad.table, bad.key), "reason": bad.reason},
    )


def _claimed_key(table: str, raw: bytes) -> bytes | None:
    """The key a record's own fields name (namespace, then block key or agent id), if legible."""
    try:
        d = msgpack.unpackb(raw[CHECKSUM_BYTES:])
        ident = d["k"] if table == "blocks" else d["id"]
        if isinstance(d["ns"], str) and isinstance(ident, str | bytes):
            return ns_key(d["ns"], ident)
    except DECODE_ERRORS:
        pass
    return None


def _child(payload: memoryview) -> bytes:
    if len(payload) <= 4:
        raise ValueError(f"a children entry of {len(payload)} bytes")
    return bytes(payload)


def _empty(payload: memoryview) -> bytes:
    if len(payload):
        raise ValueError(f"an unref entry of {len(payload)} bytes, not 0")
    return b""
