"""The byte quotas, store-wide and per namespace: reservations for uploads in flight, and LRU
eviction to make room.

Unreferenced blocks go first, least recently used first; with an object store, then the local
copies of blocks safe there (demoted: restorable, fetched back on a read); with
`evict_agents`, then whole least-recently-used agents whose deletion frees a block, and,
past a quota, where none does (forks sharing their blocks), the least recently used agent
of all: its record's bytes count against the quota (with an object store, only agents whose
manifest is there, and every block, each asked: they stay restorable). Leased blocks are
never deleted. A namespace at its own quota evicts only its own blocks and agents: one tenant
never pushes out another's. With an object store, a reservation that finds nothing to free
waits a while for uploads to make blocks safe before it refuses.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, Protocol, TypeVar

from agentkv.errors import (
    AgentNotFound,
    DiskFull,
    GenerationConflict,
    NamespaceQuotaExceeded,
    QuotaExceeded,
    ResourceExhausted,
)
from agentkv.ids import AgentId
from cache_store import manifests
from cache_store.leases import BlockId
from cache_store.parts import Parts
from cache_store.records import AgentRecord, BlockRecord

log = logging.getLogger("agentkv.store")
DISK_SLACK = 1 << 20  # kept free beyond a write that hit a full disk: the index grows too
INDEX_ROOM = 4 << 20  # what a full index write asks to be freed before it tries again
COLLECT_BATCH = 64  # blocks a collection deletes per hold of the capacity lock
MAX_MISSING_PER_DEMOTION = 8  # blocks found gone from the bucket before one demotion gives up
MAX_VICTIMS_ASKED = 8  # agents one eviction tries (each may be committed since, or not whole there)
UPLOAD_WAIT_SECONDS = 30.0  # how long a reservation waits for uploads to free something
T = TypeVar("T")


class UploadQueue(Protocol):
    def pending(self) -> int: ...
    def wait_for_uploads(self, seconds: float) -> None: ...
    def still_holds(self, record: BlockRecord, checksum: int) -> bool: ...


def now_ms() -> int:
    return int(time.time() * 1000)


class Capacity:
    def __init__(self, parts: Parts) -> None:
        self.config, self.index, self.payloads = parts.config, parts.index, parts.payloads
        self.leases, self.metrics = parts.leases, parts.metrics
        self._lock = threading.Lock()  # reservations and evictions
        self._reserved: Counter[str] = Counter()  # bytes in flight, per namespace
        self._block_access: dict[BlockId, int] = {}
        self._agent_access: dict[tuple[str, str], int] = {}
        self.uploads: UploadQueue | None = None  # the object-store tier, when there is one
        self._demotable: dict[str | None, list[BlockId]] = {}  # per scope, from one scan

    # recency

    def touch_block(self, block: BlockId) -> None:
        self._block_access[block] = now_ms()

    def touch_agent(self, namespace: str, agent_id: str) -> None:
        self._agent_access[(namespace, agent_id)] = now_ms()

    def forget_agent(self, namespace: str, agent_id: str) -> None:
        self._agent_access.pop((namespace, agent_id), None)

    def block_last_access(self, block: BlockId, created_ms: int) -> int:
        return self._block_access.get(block, created_ms)

    # reservations

    def check_fits(self, size: int, namespace: str) -> None:
        """Refuses at once a block bigger than a quota it falls under: it could never fit."""
        for quota, scope, error in (
            (
                self.config.namespace_quota(namespace),
                f"namespace {namespace!r}",
                NamespaceQuotaExceeded,
            ),
            (self.config.quota_bytes, "store", QuotaExceeded),
        ):
            if quota and size > quota:
                raise error(f"block of {size} bytes exceeds the {scope} quota of {quota} bytes")

    def reserve(self, size: int, namespace: str) -> None:
        """Claims `size` bytes that have arrived for an upload into `namespace`, evicting to
        make room within the namespace's quota and then the store's; QuotaExceeded if it
        can't, ResourceExhausted past the namespace's bound on bytes in flight."""
        deadline = time.monotonic() + UPLOAD_WAIT_SECONDS
        while True:
            try:
                return self._reserve(size, namespace)
            except QuotaExceeded:
                if not self.uploads or not self.uploads.pending() or time.monotonic() > deadline:
                    raise
            self.uploads.wait_for_uploads(0.5)  # a block made safe can be demoted

    def _reserve(self, size: int, namespace: str) -> None:
        with self._lock:
            limit = self.config.max_namespace_inflight_bytes
            if self._reserved[namespace] + size > limit:
                raise ResourceExhausted(
                    f"namespace {namespace!r} has {self._reserved[namespace]} bytes of uploads "
                    f"in flight, the limit is {limit}: finish those uploads first"
                )
            if quota := self.config.namespace_quota(namespace):
                self._make_room(size, quota, namespace)
            if self.config.quota_bytes:
                self._make_room(size, self.config.quota_bytes, None)
            self._reserved[namespace] += size

    def free_disk(self, need: int) -> bool:
        """The disk is full, quota or not: evicts least recently used unreferenced blocks
        (then agents, with evict_agents) until `need` bytes are free. Whether it freed any."""
        freed = False
        with self._lock:
            while self.payloads.disk_free() < need + DISK_SLACK:
                if not self._free_one(None):
                    break
                freed = True
        if freed:
            log.info("disk full: evicted to make room", extra={"need": need})
        return freed

    def with_room(
        self, write: Callable[..., T], *args: Any, spare: Collection[AgentId] | None = None
    ) -> T:
        """Runs an index write; on a full disk, again after collecting unused blocks, and
        past a quota (an agent record grew), again after evicting within it: once for the
        disk and once for each quota (the namespace's, then the store's). `spare`: the write
        grows these agents' records, so the room may come from any other agent's (with
        evict_agents), never theirs."""
        made: set[object] = set()  # DiskFull, or the scope of a quota made room in
        while True:
            try:
                return write(*args)
            except DiskFull:
                if DiskFull in made or not self.free_disk(INDEX_ROOM):
                    raise
                made.add(DiskFull)
            except QuotaExceeded as exc:
                if exc.room is None or exc.room[0] in made:
                    raise
                scope, quota, grown = exc.room
                made.add(scope)
                try:
                    with self._lock:
                        self._make_room(grown, quota, scope, spare)
                except QuotaExceeded:
                    raise exc from None  # its words: an agent record does not fit

    def unreserve(self, size: int, namespace: str) -> None:
        with self._lock:
            self._reserved[namespace] -= size

    def collect(
        self, namespace: str | None, idle_ms: int = 0, stopping: Callable[[], bool] | None = None
    ) -> tuple[int, int]:
        """Deletes every unreferenced, unleased block (with `idle_ms`, those nobody has read
        or written for that long, checked again as each goes); returns (blocks, bytes freed on
        local disk). The lock is taken a batch at a time, so uploads wait for one batch at
        most; `stopping` ends the sweep between batches."""
        cutoff = now_ms() - idle_ms if idle_ms else 0
        with self.index.read() as txn:
            candidates = self.index.unreferenced(txn, namespace)
            if cutoff:  # only blocks idle now take a write transaction
                records = ((b, self.index.find_block(txn, *b)) for b in candidates)
                candidates = [
                    b for b, r in records if r and self.block_last_access(b, r.created_ms) < cutoff
                ]
        deleted = freed = 0
        for start in range(0, len(candidates), COLLECT_BATCH):
            if stopping is not None and stopping():
                break
            with self._lock:
                for block in candidates[start : start + COLLECT_BATCH]:
                    record = self._delete_unreferenced(block, False, idle_before_ms=cutoff)
                    if record is not None:  # a demoted block frees no local bytes
                        deleted, freed = deleted + 1, freed + record.local_bytes
        return deleted, freed

    # eviction

    def _make_room(
        self, size: int, quota: int, namespace: str | None, spare: Collection[AgentId] | None = None
    ) -> None:
        """Evicts within `namespace` (None: the whole store) until `size` more bytes fit."""
        scope = "store" if namespace is None else f"namespace {namespace!r}"
        while (used := self._used(namespace)) + self._in_flight(namespace) + size > quota:
            if self._free_one(namespace, spare):
                continue
            raise (QuotaExceeded if namespace is None else NamespaceQuotaExceeded)(
                f"{scope} quota of {quota} bytes reached ({used} used, "
                f"{self._in_flight(namespace)} in flight) and nothing can be evicted: every "
                "block is referenced or leased"
            )

    def _free_one(self, namespace: str | None, spare: Collection[AgentId] | None = None) -> bool:
        """Frees one thing in `namespace` (None: anywhere), in the order the module says;
        `spare`: see with_room."""
        if self._evict_one_block(namespace):
            return True
        if self.uploads is not None and self._demote_one_block(namespace):
            return True
        return self.config.evict_agents and self._evict_one_agent(namespace, spare)

    def _demote_one_block(self, namespace: str | None) -> bool:
        """Frees the local copy of the least recently used block safe in the object store.
        Candidates come from one scan, reused (each checked again) until they run out. Each
        is asked for in the bucket (a HEAD, under the lock): a wiped bucket costs a few
        before this gives up for now (their uploads again are queued)."""
        missing = 0
        for fresh in (False, True):  # the candidates of the last scan, then of a new one
            queue = self._demotable.get(namespace) if not fresh else None
            if not queue:
                queue = self._demotable[namespace] = self._demotion_candidates(namespace)
                fresh = True
            while queue and missing < MAX_MISSING_PER_DEMOTION:
                block = queue.pop()
                if self.leases.is_held(block):
                    continue
                if not self._in_bucket_now(block):
                    missing += 1
                    continue
                if self.leases.unless_held(block, lambda b=block: self._demote(b)):
                    self.metrics.demoted_blocks.inc()
                    return True
            if fresh or missing >= MAX_MISSING_PER_DEMOTION:
                return False
        return False

    def _demotion_candidates(self, namespace: str | None) -> list[BlockId]:
        """Local blocks safe in the object store, most recently used first (popped last)."""
        with self.index.read() as txn:
            blocks = [
                b
                for b in self.index.blocks(txn, namespace)
                if b.local and self.index.remote_checksum(txn, b.namespace, b.key) is not None
            ]
        blocks.sort(key=lambda b: self.block_last_access((b.namespace, b.key), b.created_ms))
        return [(b.namespace, b.key) for b in reversed(blocks)]

    def _in_bucket_now(self, block: BlockId) -> bool:
        """Whether the bucket still holds the block as uploaded, asked (outside the leases'
        lock) before its local copy goes: the index says what was uploaded, not what is
        still there. A block no longer a candidate (collected, demoted, put anew) is not
        asked about, nor counted gone: _demote finds it so."""
        with self.index.read() as txn:
            record = self.index.find_block(txn, *block)
            checksum = self.index.remote_checksum(txn, *block)
        if record is None or not record.local or checksum is None:
            return True
        assert self.uploads is not None  # demotion and eviction ask, only with an object store
        return self.uploads.still_holds(record, checksum)

    def _demote(self, block: BlockId) -> bool:
        """Under the leases' lock: marks the block demoted and deletes its file."""
        with self.index.write() as txn:
            current = self.index.find_block(txn, *block)
            if current is None or not current.local:
                return False
            if self.index.remote_checksum(txn, *block) is None:
                return False
            self.index.set_local(txn, current, False)
            self.index.bump(txn, "demoted_blocks")
        self.payloads.delete(current)
        return True

    def _used(self, namespace: str | None) -> int:
        with self.index.read() as txn:
            return self.index.quota_usage(txn, namespace)

    def _in_flight(self, namespace: str | None) -> int:
        return self._reserved[namespace] if namespace is not None else self._reserved.total()

    def _evict_one_block(self, namespace: str | None) -> bool:
        with self.index.read() as txn:
            candidates = [
                b for b in self.index.unreferenced(txn, namespace) if not self.leases.is_held(b)
            ]
            records = {b: self.index.find_block(txn, *b) for b in candidates}
            created = {b: r.created_ms for b, r in records.items() if r is not None and r.local}
        candidates = list(created)
        for block in sorted(candidates, key=lambda b: self.block_last_access(b, created[b])):
            if self._delete_unreferenced(block, count_eviction=True):
                self.metrics.evictions.labels("block").inc()
                return True
        return False

    def _evict_one_agent(
        self, namespace: str | None, spare: Collection[AgentId] | None = None
    ) -> bool:
        """Deletes the least recently used agent whose blocks would then become evictable;
        where none would, for a record's room (`spare` given), the least recently used one
        not being read (no block of it leased): its record's bytes go. Never one `spare`
        names: the write that needs the room grows it."""
        spared = set(spare or ())
        with self.index.read() as txn:
            agents = sorted(self.index.agents(txn, namespace), key=self.agent_last_access)
            agents = [a for a in agents if (a.namespace, a.agent_id) not in spared]
            victims = self._coldest(txn, agents, partial(self._frees_space, txn))
            others = self._coldest(txn, agents, self._unread) if spare is not None else []
        if any(self._evict_agent(a) for a in victims):
            return True
        return any(self._evict_agent(a) for a in others if a not in victims)

    def _coldest(
        self, txn: Any, agents: list[AgentRecord], fits: Callable[[AgentRecord], bool]
    ) -> list[AgentRecord]:
        """The first MAX_VICTIMS_ASKED of `agents` that fit and, with an object store, that
        it holds (they stay restorable)."""
        anywhere = self.uploads is None
        chosen = (a for a in agents if fits(a) and (anywhere or self._in_object_store(txn, a)))
        return list(itertools.islice(chosen, MAX_VICTIMS_ASKED))

    def _evict_agent(self, victim: AgentRecord) -> bool:
        """Deletes `victim` if it is still the generation the scan saw (not committed since)
        and, with an object store, the bucket still holds each block of it here, asked as a
        demotion asks (one found gone there is queued to be uploaded again: its agent stays
        for now). Whether it went."""
        if not self._blocks_in_bucket_now(victim):
            return False
        ns, agent_id = victim.namespace, victim.agent_id
        try:
            with self.index.write() as txn:
                manifests.delete(self.index, txn, ns, agent_id, victim.generation)
                self.index.bump(txn, "evicted_agents")
        except (GenerationConflict, AgentNotFound):
            return False  # committed or deleted since the scan: another goes
        self.forget_agent(ns, agent_id)
        self.metrics.evictions.labels("agent").inc()
        log.info("agent evicted", extra={"namespace": ns, "agent": agent_id})
        return True

    def drop_unreferenced(self, namespace: str, keys: list[bytes]) -> int:
        """Deletes those of these blocks no agent holds and no lease protects; how many. The
        lock is taken a batch at a time, as in collect."""
        dropped = 0
        for start in range(0, len(keys), COLLECT_BATCH):
            with self._lock:
                for key in keys[start : start + COLLECT_BATCH]:
                    dropped += self._delete_unreferenced((namespace, key), False) is not None
        return dropped

    def _blocks_in_bucket_now(self, agent: AgentRecord) -> bool:
        """Whether the bucket still holds each block of `agent` that its eviction would
        delete here (its own, no other agent's), each asked to the first it does not (that
        one is queued to be uploaded again)."""
        if self.uploads is None:
            return True
        with self.index.read() as txn:
            records = (self.index.find_block(txn, agent.namespace, k) for k in agent.block_keys)
            own = [(r.namespace, r.key) for r in records if r and r.local and r.refcount == 1]
        return all(self._in_bucket_now(block) for block in own)

    def _in_object_store(self, txn: Any, agent: AgentRecord) -> bool:
        """Its manifest as it is here, and every block it names, in the bucket: a block
        found gone from there (waiting to be uploaded again) keeps its agent here."""
        uploaded = self.index.uploaded_generation(txn, agent.namespace, agent.agent_id)
        return uploaded == agent.generation and all(
            self.index.remote_checksum(txn, agent.namespace, key) is not None
            for key in agent.block_keys
        )

    def agent_last_access(self, agent: AgentRecord, saved_ms: int = 0) -> int:
        """Its last commit, or a later use: one this process saw, or `saved_ms` (the last
        use saved in the index, idle.py)."""
        seen = self._agent_access.get((agent.namespace, agent.agent_id), 0)
        return max(seen, saved_ms, agent.updated_ms)

    def agent_uses(self) -> dict[tuple[str, str], int]:
        """A copy of the last use of every agent this process saw used (Unix ms)."""
        return self._agent_access.copy()

    def _unread(self, agent: AgentRecord) -> bool:
        """No block of the agent leased (being read, or written)."""
        return not any(self.leases.is_held((agent.namespace, key)) for key in agent.block_keys)

    def _frees_space(self, txn: Any, agent: AgentRecord) -> bool:
        for key in agent.block_keys:
            block = self.index.find_block(txn, agent.namespace, key)
            if (
                block
                and block.local
                and block.refcount == 1
                and not self.leases.is_held((agent.namespace, key))
            ):
                return True
        return False

    def _delete_unreferenced(
        self, block: BlockId, count_eviction: bool, idle_before_ms: int = 0
    ) -> BlockRecord | None:
        """Deletes a block if still unreferenced and unleased (and, with `idle_before_ms`,
        untouched since then); its record, or None. No lease is granted between the check and
        the delete, so no reader leases a block whose file is going."""
        delete = partial(self._delete, block, count_eviction, idle_before_ms)
        record = self.leases.unless_held(block, delete)
        if record is not None:
            self._block_access.pop(block, None)
        return record

    def _delete(
        self, block: BlockId, count_eviction: bool, idle_before_ms: int
    ) -> BlockRecord | None:
        """Under the leases' lock: drops the block's record and file; the record, or None."""
        with self.index.write() as txn:
            record = self.index.find_block(txn, *block)
            if record is None or record.refcount:
                return None
            if (
                idle_before_ms
                and self.block_last_access(block, record.created_ms) >= idle_before_ms
            ):
                return None  # read or deduplicated since the sweep began
            self.index.delete_block(txn, record)
            if count_eviction:
                self.index.bump(txn, "evicted_blocks")
        self.payloads.delete(record)
        return record
