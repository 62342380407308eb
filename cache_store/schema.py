"""The index's schema version, checked at start-up: an index of another version stops the
store with one message, and one written before checksums (version 0) is sealed in place.

Versions: 0, no `meta` table, values unsealed; 1, every value sealed (records.seal).
The `meta` table also names the object store the index's `remote` and `uploaded` tables
describe.
"""

from __future__ import annotations

import logging

import lmdb

from agentkv.errors import CorruptRecord, FailedPrecondition, IndexUnusable
from cache_store.index import DERIVED, TABLES, Index
from cache_store.records import (
    DECODE_ERRORS,
    AgentRecord,
    BlockRecord,
    decode_u64,
    encode_u64,
    seal,
    unseal,
)

log = logging.getLogger("agentkv.store")

SCHEMA_VERSION = 1
SCHEMA_KEY = b"schema_version"
OBJECT_STORE_KEY = b"object_store"


def check(index: Index, txn: lmdb.Transaction) -> bool:
    """Records the version in a new index; True if an index of version 0 was just sealed
    (its derived tables are then empty: rebuild them). IndexUnusable for any other version."""
    version = recorded(index, txn)
    if version == SCHEMA_VERSION:
        return False
    if version is not None:
        raise IndexUnusable(
            f"the index at {index.path} has schema version {version}; this agentkv reads "
            f"version {SCHEMA_VERSION}. Run the agentkv release that wrote it, or move the "
            "data dir away to start empty"
        )
    old = not is_new(index, txn)
    if old:
        _seal_version_0(index, txn)
    txn.put(SCHEMA_KEY, encode_u64(SCHEMA_KEY, SCHEMA_VERSION), db=index.dbs["meta"])
    return old


def is_new(index: Index, txn: lmdb.Transaction) -> bool:
    """Whether the index was never written: no version recorded, and no record."""
    if recorded(index, txn) is not None:
        return False
    return not any(txn.stat(index.dbs[name])["entries"] for name in TABLES)


def bind_object_store(index: Index, location: str) -> None:
    """Records the object store (s3://bucket/prefix/) the index's records of what is in a
    bucket describe; FailedPrecondition if they describe another (blocks would be demoted as
    safe in a bucket that lacks them)."""
    meta = index.dbs["meta"]
    with index.write() as txn:
        raw = txn.get(OBJECT_STORE_KEY, db=meta)
        if raw is None:
            txn.put(OBJECT_STORE_KEY, seal(OBJECT_STORE_KEY, location.encode()), db=meta)
            return
        bound = bytes(unseal("meta", OBJECT_STORE_KEY, raw)).decode()
    if bound != location:
        raise FailedPrecondition(
            f"the data dir {index.path.parent} was written through --object-store {bound}, "
            f"not {location}: its records of what is in the bucket would be wrong there. Start "
            "it with the object store it was written through, or give this one a data dir of "
            "its own"
        )


def recorded(index: Index, txn: lmdb.Transaction) -> int | None:
    """The version the index records; None if it records none; IndexUnusable if damaged."""
    raw = txn.get(SCHEMA_KEY, db=index.dbs["meta"])
    if raw is None:
        return None
    try:
        return decode_u64("meta", SCHEMA_KEY, raw)
    except CorruptRecord as exc:
        raise IndexUnusable(
            f"the index at {index.path} has a damaged schema record ({exc.message}); "
            "restore the data dir from a backup, or move it away to start empty"
        ) from exc


def _seal_version_0(index: Index, txn: lmdb.Transaction) -> None:
    """Seals blocks, agents and counters; drops the derived tables for a rebuild. A record
    that does not decode is quarantined."""
    sealed = 0
    for table, unpack in (("blocks", BlockRecord._unpack), ("agents", AgentRecord._unpack)):
        db = index.dbs[table]
        rows = list(txn.cursor(db=db))
        txn.drop(db, delete=False)
        for k, raw in rows:
            try:
                unpack(raw)
            except DECODE_ERRORS as exc:
                index.quarantine(txn, table, k, raw, f"does not decode ({exc})")
                continue
            txn.put(k, seal(k, raw), db=db)
            sealed += 1
    _seal_counters(index, txn)
    for table in DERIVED:
        txn.drop(index.dbs[table], delete=False)
    log.warning(
        "index of schema version 0 sealed with checksums",
        extra={"records": sealed, "schema_version": SCHEMA_VERSION},
    )


def _seal_counters(index: Index, txn: lmdb.Transaction) -> None:
    db = index.dbs["counters"]
    rows = list(txn.cursor(db=db))
    txn.drop(db, delete=False)
    for k, raw in rows:
        if len(raw) == 8:
            txn.put(k, seal(k, raw), db=db)
