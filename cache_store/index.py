"""The LMDB index: blocks, agents, namespaces and counters, each change one transaction.

Keys are `namespace NUL id`, so a namespace is a key range and nothing crosses it.
Sub-databases ("tables"):
  blocks      ns/key     -> BlockRecord
  children    ns/parent  -> child key (dupsort), for longest-prefix search
  unref       ns/key     -> ""  (blocks no manifest references: first to evict)
  lost        ns/key     -> uint64 references held by manifests on a quarantined block, so a
                            re-upload of the same block comes back with its reference count
  agents      ns/agent   -> AgentRecord
  namespaces  ns         -> {agents, blocks, bytes}
  counters    name       -> uint64 (evictions, quarantines)
  remote      ns/key     -> uint64 xxh3_64 of the payload: the block is whole in the object store
  uploaded    ns/agent   -> uint64 generation whose manifest is in the object store (0: a
                            deletion not yet carried out there)
  uploaded_ids ns/agent  -> [generation, created_ms] of the manifest this store last put there
                            or fetched, kept while its deletion is pending: the one version of
                            another store's that the deletion may delete. An index written
                            before it has none (a delete fills it in from the record it drops),
                            and a release without it leaves it unchanged (a table it does not
                            open); one `uploaded` does not back is dropped (integrity.py).
  used        ns/agent   -> uint64 Unix ms of the agent's last use as the retention sweep last
                            saved it (reads since its last commit: idle.py); dropped with it
  meta        name       -> schema_version (schema.py)
  quarantine  table NUL key -> [reason, raw bytes] of a bad agent or block record
Every value is sealed (records.seal). A point read of a bad record raises CorruptRecord, a
listing skips it; both note it in `suspects` for integrity.repair.
"""

from __future__ import annotations

import logging
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import lmdb
import msgpack

from agentkv.errors import (
    AgentLost,
    BlockNotFound,
    CorruptRecord,
    DiskFull,
    FingerprintMismatch,
    IndexUnusable,
    NamespaceQuotaExceeded,
    QuotaExceeded,
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
    encode_uploaded_id,
    encode_usage,
    seal,
)

log = logging.getLogger("agentkv.store")

SEP = b"\x00"
LOW_DISK = 8 << 20  # free bytes under which a failed index write is taken for a full disk
_U32 = struct.Struct(">I")
TABLES = (
    "blocks",
    "children",
    "unref",
    "lost",
    "agents",
    "namespaces",
    "counters",
    "remote",
    "uploaded",
    "uploaded_ids",
    "used",
)
DERIVED = ("children", "unref", "lost", "namespaces")  # rebuilt from blocks and agents
# per namespace: agents, blocks, payload bytes, and the bytes of its agent records (a quota
# covers those too: a record may hold 2^21 token ids and share every block of another)
NO_USAGE = {"agents": 0, "blocks": 0, "bytes": 0, "records": 0}
GENERATIONS_USED = "generations_used"  # counter: the highest generation of an agent deleted
# (or quarantined: by its last legible generation, and every generation committed here)
GENERATIONS_TOP = "generations_top"  # counter: the highest generation committed here


def ns_key(namespace: str, ident: bytes | str) -> bytes:
    raw = ident.encode() if isinstance(ident, str) else ident
    return namespace.encode() + SEP + raw


def child_entry(record: BlockRecord) -> bytes:
    """The children value naming `record`: its token count, then its key (unsealed)."""
    return _U32.pack(len(record.token_ids)) + record.key


def split_key(raw: bytes) -> tuple[str, bytes]:
    ns, _, ident = raw.partition(SEP)
    return ns.decode(), ident


class Index:
    def __init__(
        self,
        path: Path,
        map_bytes: int,
        quotas: Callable[[str], tuple[int, int]] = lambda namespace: (0, 0),
    ) -> None:
        """`quotas`: a namespace's quota and the store's, in bytes (0: none), which agent
        records count against (put_agent)."""
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._suspects: set[tuple[str, bytes]] = set()  # (table, key) read bad, not repaired
        self._suspects_lock = threading.Lock()
        try:
            self.env = lmdb.open(str(path), map_size=map_bytes, max_dbs=16, max_readers=256)
            self.dbs = {
                name: self.env.open_db(name.encode(), dupsort=name == "children")
                for name in (*TABLES, "meta", "quarantine")
            }
        except lmdb.Error as exc:
            raise IndexUnusable(f"cannot open the index at {path}: {exc}") from exc
        self._blocks, self._children = self.dbs["blocks"], self.dbs["children"]
        self._unref, self._lost = self.dbs["unref"], self.dbs["lost"]
        self._agents, self._namespaces = self.dbs["agents"], self.dbs["namespaces"]
        self._counters, self._quarantine = self.dbs["counters"], self.dbs["quarantine"]
        self._remote, self._uploaded = self.dbs["remote"], self.dbs["uploaded"]
        self._uploaded_ids, self._used = self.dbs["uploaded_ids"], self.dbs["used"]
        self.quotas = quotas

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
            eio = "Input/output error" in str(exc)  # LMDB's commit on a full tmpfs
            low = eio and shutil.disk_usage(self.path).free < LOW_DISK
            if isinstance(exc, lmdb.DiskError) or "space" in str(exc).lower() or low:
                raise DiskFull(
                    f"no space left on the store's disk while writing the index: {exc}"
                ) from exc
            raise

    def read(self) -> lmdb.Transaction:
        return self.env.begin()

    def take_suspects(self) -> set[tuple[str, bytes]]:
        """(table, key) of the records read bad since the last call, for integrity.repair."""
        with self._suspects_lock:
            taken, self._suspects = self._suspects, set()
        return taken

    def note_suspects(self, suspects: set[tuple[str, bytes]]) -> None:
        with self._suspects_lock:
            self._suspects |= suspects

    # blocks

    def get_block(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> BlockRecord | None:
        """The block's record, None if absent; CorruptRecord if its record is bad."""
        k = ns_key(namespace, key)
        raw = txn.get(k, db=self._blocks)
        return self._checked(BlockRecord.decode, k, raw) if raw is not None else None

    def block_bytes(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> bytes | None:
        """The block's record as stored, undecoded; None if absent."""
        raw = txn.get(ns_key(namespace, key), db=self._blocks)
        return bytes(raw) if raw is not None else None

    def find_block(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> BlockRecord | None:
        """Like get_block, but a block whose record is bad reads as absent (and is noted)."""
        try:
            return self.get_block(txn, namespace, key)
        except CorruptRecord:
            return None

    def require_block(
        self, txn: lmdb.Transaction, namespace: str, fingerprint: str, key: bytes, field: str
    ) -> BlockRecord:
        """The block, or BlockNotFound / FingerprintMismatch / CorruptRecord naming `field`."""
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
            record = replace(record, refcount=self._u64("lost", k, lost))
        txn.put(k, record.encode(k), db=self._blocks)
        self.put_child(txn, record)
        if record.refcount == 0:
            self.put_unref(txn, k)
        txn.delete(quarantine_key("blocks", k), db=self._quarantine)
        self._add_usage(txn, record.namespace, blocks=1, num_bytes=record.local_bytes)

    def delete_block(self, txn: lmdb.Transaction, record: BlockRecord, lost: bool = False) -> None:
        """Drops a block; `lost` (quarantine) remembers its references for a re-upload."""
        k = ns_key(record.namespace, record.key)
        if lost and record.refcount:
            txn.put(k, encode_u64(k, record.refcount), db=self._lost)
        txn.delete(k, db=self._blocks)
        parent = ns_key(record.namespace, record.parent_key)
        txn.delete(parent, seal(parent, child_entry(record)), db=self._children)
        txn.delete(k, db=self._unref)
        txn.delete(k, db=self._remote)  # a later block under this key is uploaded anew
        self._add_usage(txn, record.namespace, blocks=-1, num_bytes=-record.local_bytes)

    def set_local(self, txn: lmdb.Transaction, record: BlockRecord, local: bool) -> BlockRecord:
        """Marks a block's payload on local disk or only in the object store (usage follows)."""
        k = ns_key(record.namespace, record.key)
        current = self.get_block(txn, record.namespace, record.key)
        if current is None or current.created_ms != record.created_ms:
            raise BlockNotFound(f"block {record.key.hex()} is gone or was replaced")
        if current.local == local:
            return current
        updated = replace(current, local=local)
        txn.put(k, updated.encode(k), db=self._blocks)
        delta = updated.num_bytes if local else -updated.num_bytes
        self._add_usage(txn, record.namespace, num_bytes=delta)
        return updated

    # the object store's copies

    def remote_checksum(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> int | None:
        """The payload checksum of a block whole in the object store; None if it is not."""
        k = ns_key(namespace, key)
        raw = txn.get(k, db=self._remote)
        return self._lenient(lambda key, v: decode_u64("remote", key, v), k, raw) if raw else None

    def put_remote(self, txn: lmdb.Transaction, namespace: str, key: bytes, checksum: int) -> None:
        k = ns_key(namespace, key)
        txn.put(k, encode_u64(k, checksum), db=self._remote)

    def drop_remote(self, txn: lmdb.Transaction, namespace: str, key: bytes) -> None:
        """Forgets a block's object-store copy (found gone): it is uploaded anew."""
        txn.delete(ns_key(namespace, key), db=self._remote)

    def uploaded_generation(
        self, txn: lmdb.Transaction, namespace: str, agent_id: str
    ) -> int | None:
        """The generation of the agent's manifest in the object store (0: deletion pending)."""
        k = ns_key(namespace, agent_id)
        raw = txn.get(k, db=self._uploaded)
        return self._u64("uploaded", k, raw) if raw is not None else None

    def put_uploaded(
        self,
        txn: lmdb.Transaction,
        namespace: str,
        agent_id: str,
        generation: int,
        created_ms: int = 0,
    ) -> None:
        """Records the manifest in the object store: its generation and the agent's creation
        time; generation 0, its deletion pending (the manifest it is to delete is kept)."""
        k = ns_key(namespace, agent_id)
        txn.put(k, encode_u64(k, generation), db=self._uploaded)
        if generation:
            txn.put(k, encode_uploaded_id(k, generation, created_ms), db=self._uploaded_ids)

    def delete_uploaded(self, txn: lmdb.Transaction, namespace: str, agent_id: str) -> None:
        k = ns_key(namespace, agent_id)
        txn.delete(k, db=self._uploaded)
        txn.delete(k, db=self._uploaded_ids)

    def uploaded_id(
        self, txn: lmdb.Transaction, namespace: str, agent_id: str
    ) -> tuple[int, int] | None:
        """(generation, created_ms) of the agent's manifest this store last put in the object
        store or fetched from it; None if unknown (none, an older index's, or a bad entry)."""
        k = ns_key(namespace, agent_id)
        raw = txn.get(k, db=self._uploaded_ids)
        if raw is None:
            return None
        return self._lenient(lambda key, v: decode_uploaded_id("uploaded_ids", key, v), k, raw)

    def uploads_done(self, txn: lmdb.Transaction) -> Iterator[tuple[str, str, int]]:
        """(namespace, agent id, generation) of every manifest entry in `uploaded`."""
        for k, raw in txn.cursor(db=self._uploaded):
            ns, ident = split_key(k)
            yield ns, ident.decode(errors="replace"), self._u64("uploaded", k, raw)

    def remote_keys(self, txn: lmdb.Transaction) -> set[tuple[str, bytes]]:
        return {split_key(k) for k, _ in txn.cursor(db=self._remote)}

    def put_child(self, txn: lmdb.Transaction, record: BlockRecord) -> None:
        parent = ns_key(record.namespace, record.parent_key)
        txn.put(parent, seal(parent, child_entry(record)), db=self._children)

    def put_unref(self, txn: lmdb.Transaction, k: bytes) -> None:
        txn.put(k, seal(k, b""), db=self._unref)

    def add_ref(self, txn: lmdb.Transaction, namespace: str, key: bytes, delta: int) -> None:
        """Moves a block's reference count, or that remembered for a quarantined block."""
        record = self.find_block(txn, namespace, key)
        k = ns_key(namespace, key)
        if record is None:
            self._add_lost_ref(txn, k, delta)
            return
        record = replace(record, refcount=max(0, record.refcount + delta))
        txn.put(k, record.encode(k), db=self._blocks)
        if record.refcount == 0:
            self.put_unref(txn, k)
        else:
            txn.delete(k, db=self._unref)

    def _add_lost_ref(self, txn: lmdb.Transaction, k: bytes, delta: int) -> None:
        raw = txn.get(k, db=self._lost)
        count = (self._u64("lost", k, raw) if raw else 0) + delta
        if count > 0:
            txn.put(k, encode_u64(k, count), db=self._lost)
        else:
            txn.delete(k, db=self._lost)

    def children(
        self, txn: lmdb.Transaction, namespace: str, parent: bytes
    ) -> list[tuple[int, bytes]]:
        """(num_tokens, key) of every block whose parent is `parent`; bad entries skipped."""
        k = ns_key(namespace, parent)
        cursor = txn.cursor(db=self._children)
        if not cursor.set_key(k):
            return []
        entries = []
        for raw in cursor.iternext_dup():
            entry = self._lenient(lambda key, v: decode_value("children", key, v, bytes), k, raw)
            if entry is not None and len(entry) > _U32.size:
                entries.append((_U32.unpack_from(entry)[0], entry[_U32.size :]))
        return entries

    def unreferenced(self, txn: lmdb.Transaction, namespace: str | None) -> list[tuple[str, bytes]]:
        """(namespace, key) of every block no manifest references; bad entries skipped."""
        return [
            split_key(k)
            for k, raw in self._items(txn, self._unref, namespace)
            if self._lenient(lambda key, v: decode_value("unref", key, v, bytes), k, raw) == b""
        ]

    def blocks(self, txn: lmdb.Transaction, namespace: str | None) -> Iterator[BlockRecord]:
        """Every block with a sound record; bad ones are skipped and noted."""
        for k, raw in self._items(txn, self._blocks, namespace):
            record = self._lenient(BlockRecord.decode, k, raw)
            if record is not None:
                yield record

    def block_page(
        self, txn: lmdb.Transaction, namespace: str, after: bytes, limit: int
    ) -> tuple[list[BlockRecord], bytes]:
        """Up to `limit` blocks after key `after`, and the key to list on after (b"" at the
        end); a bad record is skipped but counted, so a short page need not be the last."""
        rows, more = self._page(txn, self._blocks, namespace, after, limit)
        records = [r for r in (self._lenient(BlockRecord.decode, k, v) for k, v in rows) if r]
        return records, _last_id(rows, namespace) if more else b""

    # agents

    def get_agent(self, txn: lmdb.Transaction, namespace: str, agent_id: str) -> AgentRecord | None:
        """The manifest, None if absent; CorruptRecord if it is bad or was quarantined."""
        k = ns_key(namespace, agent_id)
        raw = txn.get(k, db=self._agents)
        if raw is not None:
            return self._checked(AgentRecord.decode, k, raw)
        reason = self.quarantined(txn, "agents", k)
        if reason is not None:
            raise lost_agent(namespace, agent_id, reason)
        return None

    def find_agent(
        self, txn: lmdb.Transaction, namespace: str, agent_id: str
    ) -> AgentRecord | None:
        """Like get_agent, but a bad or quarantined manifest reads as absent."""
        try:
            return self.get_agent(txn, namespace, agent_id)
        except CorruptRecord:
            return None

    def put_agent(
        self, txn: lmdb.Transaction, record: AgentRecord, created: bool, checked: bool = True
    ) -> None:
        """Puts the record. `checked`: QuotaExceeded (nothing written) when its growth passes
        a quota (_check_quotas); a manifest read back from the object store is counted, not
        refused (it exists already; refusing it would refuse a read)."""
        k = ns_key(record.namespace, record.agent_id)
        value, old = record.encode(k), txn.get(k, db=self._agents)
        grown = len(value) - (len(old) if old is not None else 0)
        if checked and grown > 0:
            self._check_quotas(txn, record.namespace, grown)
        txn.put(k, value, db=self._agents)
        self.raise_counter(txn, GENERATIONS_TOP, record.generation)
        if created:
            txn.delete(quarantine_key("agents", k), db=self._quarantine)
        self._add_usage(txn, record.namespace, agents=int(created), records=grown)

    def delete_agent(self, txn: lmdb.Transaction, record: AgentRecord) -> None:
        k = ns_key(record.namespace, record.agent_id)
        old = txn.get(k, db=self._agents)
        txn.delete(k, db=self._agents)
        self.raise_counter(txn, GENERATIONS_USED, record.generation)
        txn.delete(k, db=self._used)
        freed = len(old) if old is not None else 0
        self._add_usage(txn, record.namespace, agents=-1, records=-freed)
        uploaded = self.uploaded_generation(txn, record.namespace, record.agent_id)
        if uploaded and self.uploaded_id(txn, record.namespace, record.agent_id) is None:
            # an index written before the table, or an entry that was bad
            txn.put(k, encode_uploaded_id(k, uploaded, record.created_ms), db=self._uploaded_ids)

    def agent_used(self, txn: lmdb.Transaction, namespace: str, agent_id: str) -> int:
        """The agent's last use as last saved (Unix ms); 0 if none was."""
        k = ns_key(namespace, agent_id)
        raw = txn.get(k, db=self._used)
        return self._u64("used", k, raw) if raw is not None else 0

    def save_agent_used(
        self, txn: lmdb.Transaction, namespace: str, agent_id: str, ms: int
    ) -> bool:
        """Saves the last use of an agent that exists; whether it does."""
        k = ns_key(namespace, agent_id)
        if txn.get(k, db=self._agents) is None:
            return False
        return txn.put(k, encode_u64(k, ms), db=self._used)

    def forget_lost_agent(self, txn: lmdb.Transaction, namespace: str, agent_id: str) -> bool:
        """Drops a quarantined manifest (its references were already recounted without it)."""
        return txn.delete(
            quarantine_key("agents", ns_key(namespace, agent_id)), db=self._quarantine
        )

    def agents(self, txn: lmdb.Transaction, namespace: str | None) -> Iterator[AgentRecord]:
        """Every agent with a sound manifest; bad ones are skipped and noted."""
        for k, raw in self._items(txn, self._agents, namespace):
            record = self._lenient(AgentRecord.decode, k, raw)
            if record is not None:
                yield record

    def agent_page(
        self, txn: lmdb.Transaction, namespace: str, after: str, limit: int
    ) -> tuple[list[AgentRecord], str]:
        """Up to `limit` agents after id `after`, and the id to list on after ("" at the end);
        a bad record is skipped but counted, so a short page need not be the last."""
        rows, more = self._page(txn, self._agents, namespace, after.encode(), limit)
        records = [r for r in (self._lenient(AgentRecord.decode, k, v) for k, v in rows) if r]
        return records, _last_id(rows, namespace).decode(errors="replace") if more else ""

    # quarantined records

    def quarantine(self, txn: lmdb.Transaction, table: str, key: bytes, raw: bytes, reason: str):
        """Keeps a bad agent or block record's bytes and why (the caller drops it from `table`)."""
        qk = quarantine_key(table, key)
        txn.put(qk, seal(qk, msgpack.packb([reason, raw])), db=self._quarantine)
        if table == "agents":  # as deleted, at a generation that may not be legible
            top = max(self.counter(txn, GENERATIONS_TOP), _legible_generation(raw))
            self.raise_counter(txn, GENERATIONS_USED, top)

    def quarantined(self, txn: lmdb.Transaction, table: str, key: bytes) -> str | None:
        """Why the record under `key` was quarantined, or None if it was not."""
        qk = quarantine_key(table, key)
        raw = txn.get(qk, db=self._quarantine)
        if raw is None:
            return None
        try:
            return decode_value("quarantine", qk, raw, lambda p: str(msgpack.unpackb(p)[0]))
        except CorruptRecord:
            return "its index record was corrupt"

    def quarantined_records(self, txn: lmdb.Transaction) -> list[tuple[str, bytes, str]]:
        """(table, key, reason) of every quarantined record."""
        rows = []
        for qk, _ in txn.cursor(db=self._quarantine):
            table, _, key = qk.partition(SEP)
            rows.append((table.decode(), key, self.quarantined(txn, table.decode(), key) or ""))
        return rows

    # namespaces and counters

    def namespaces(self, txn: lmdb.Transaction) -> dict[str, dict[str, int]]:
        usage = {}
        for k, raw in txn.cursor(db=self._namespaces):
            u = self._lenient(lambda key, v: decode_usage("namespaces", key, v), k, raw)
            if u is not None:
                usage[k.decode(errors="replace")] = u
        return usage

    def quota_usage(self, txn: lmdb.Transaction, namespace: str | None = None) -> int:
        """What a quota counts: payload bytes and agent records' bytes, in one namespace or
        in all of them."""
        usages = [self._usage(txn, namespace.encode())] if namespace is not None else None
        return sum(u["bytes"] + u["records"] for u in usages or self.namespaces(txn).values())

    def _check_quotas(self, txn: lmdb.Transaction, namespace: str, grown: int) -> None:
        """QuotaExceeded (NamespaceQuotaExceeded for the namespace's own) when `grown` more
        bytes of agent records pass a quota; its `room` says whose and how much, for the
        caller to make room and try again (Capacity.with_room)."""
        namespace_quota, store_quota = self.quotas(namespace)
        for quota, scope in ((namespace_quota, namespace), (store_quota, None)):
            if quota and (used := self.quota_usage(txn, scope)) + grown > quota:
                where = "store" if scope is None else f"namespace {namespace!r}"
                error = (QuotaExceeded if scope is None else NamespaceQuotaExceeded)(
                    f"{where} quota of {quota} bytes reached ({used} used by payloads and "
                    f"agent records): an agent record {grown} bytes bigger does not fit"
                )
                error.room = (scope, quota, grown)  # QuotaExceeded.room
                raise error

    def put_usage(self, txn: lmdb.Transaction, namespace: str, usage: dict[str, int]) -> None:
        k = namespace.encode()
        if usage == NO_USAGE:
            txn.delete(k, db=self._namespaces)
        else:
            txn.put(k, encode_usage(k, usage), db=self._namespaces)

    def first_generation(self, txn: lmdb.Transaction) -> int:
        """A new agent's first generation: past every generation of every agent deleted
        (or quarantined) here, so that no copy of a deleted agent (a worker's RAM) is ever
        taken for one made anew under its id."""
        return self.counter(txn, GENERATIONS_USED) + 1

    def counter(self, txn: lmdb.Transaction, name: str) -> int:
        k = name.encode()
        raw = txn.get(k, db=self._counters)
        return self._u64("counters", k, raw) if raw else 0

    def bump(self, txn: lmdb.Transaction, name: str, delta: int = 1) -> None:
        k = name.encode()
        txn.put(k, encode_u64(k, self.counter(txn, name) + delta), db=self._counters)

    def raise_counter(self, txn: lmdb.Transaction, name: str, value: int) -> None:
        """Sets the counter to `value` where that is higher."""
        k = name.encode()
        if value > self.counter(txn, name):
            txn.put(k, encode_u64(k, value), db=self._counters)

    def _add_usage(
        self,
        txn: lmdb.Transaction,
        namespace: str,
        agents: int = 0,
        blocks: int = 0,
        num_bytes: int = 0,
        records: int = 0,
    ) -> None:
        usage = self._usage(txn, namespace.encode())
        usage["agents"] += agents
        usage["blocks"] += blocks
        usage["bytes"] += num_bytes
        # an index from before records were counted: never below 0 until a rebuild
        usage["records"] = max(0, usage["records"] + records)
        self.put_usage(txn, namespace, usage)

    def _usage(self, txn: lmdb.Transaction, k: bytes) -> dict[str, int]:
        raw = txn.get(k, db=self._namespaces)
        usage = None
        if raw is not None:
            usage = self._lenient(lambda key, v: decode_usage("namespaces", key, v), k, raw)
        return usage or dict(NO_USAGE)

    # decoding with a note of what failed

    def _checked(self, decode: Callable[[bytes, bytes], object], k: bytes, raw: bytes):
        try:
            return decode(k, raw)
        except CorruptRecord as exc:
            self.note_suspects({(exc.table, k)})
            log.warning("corrupt index record", extra={"table": exc.table, "reason": exc.message})
            raise

    def _lenient(self, decode: Callable[[bytes, bytes], object], k: bytes, raw: bytes):
        try:
            return self._checked(decode, k, raw)
        except CorruptRecord:
            return None

    def _u64(self, table: str, k: bytes, raw: bytes) -> int:
        return self._lenient(lambda key, v: decode_u64(table, key, v), k, raw) or 0

    # cursor helpers

    def _items(
        self, txn: lmdb.Transaction, db: lmdb._Database, namespace: str | None
    ) -> Iterator[tuple[bytes, bytes]]:
        return prefixed(txn, db, namespace.encode() + SEP if namespace is not None else b"")

    def _page(
        self, txn: lmdb.Transaction, db: lmdb._Database, namespace: str, after: bytes, limit: int
    ) -> tuple[list[tuple[bytes, bytes]], bool]:
        """Up to `limit` rows of `namespace` after `after`, and whether more follow."""
        prefix = namespace.encode() + SEP
        cursor = txn.cursor(db=db)
        rows: list[tuple[bytes, bytes]] = []
        if not cursor.set_range(prefix + after):
            return rows, False
        for k, v in cursor:
            if not k.startswith(prefix):
                break
            if after and k == prefix + after:
                continue
            if len(rows) == limit:
                return rows, True
            rows.append((k, v))
        return rows, False


def prefixed(
    txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes
) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every row whose key starts with `prefix`, in key order."""
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return
    for k, v in cursor:
        if not k.startswith(prefix):
            return
        yield k, v


def _last_id(rows: list[tuple[bytes, bytes]], namespace: str) -> bytes:
    return rows[-1][0][len(namespace.encode()) + len(SEP) :]


def quarantine_key(table: str, key: bytes) -> bytes:
    return table.encode() + SEP + key


def lost_agent(namespace: str, agent_id: str, reason: str) -> AgentLost:
    return AgentLost(
        f"agent {agent_id!r} in namespace {namespace!r} is lost: {reason}; its manifest is "
        "quarantined (delete the agent, or commit it anew with expected_generation 0)",
        "agents",
        ns_key(namespace, agent_id),
    )


def _legible_generation(raw: bytes) -> int:
    """A bad agent record's generation where its payload still decodes to one, else 0."""
    try:
        generation = msgpack.unpackb(raw[CHECKSUM_BYTES:])["g"]
    except (*DECODE_ERRORS, IndexError):
        return 0
    return generation if isinstance(generation, int) and generation > 0 else 0
