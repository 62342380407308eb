"""The cache store's domain: agents and inspection. Blocks in, blocks out, the quota and the
upkeep (start-up, verification, quarantine) live in uploads.py, reads.py, capacity.py and
upkeep.py.

Never sees protobuf (the servicer converts) and never imports MLX: a block is named, typed
arrays of bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from agentkv import ids
from agentkv.errors import (
    AgentKVError,
    AgentLost,
    AgentNotFound,
    BucketUnreachable,
    FingerprintMismatch,
    GenerationConflict,
)
from cache_store import idle, integrity, manifests, schema
from cache_store.capacity import Capacity, now_ms
from cache_store.config import StoreConfig
from cache_store.fetcher import LostManifest, NotInBucket
from cache_store.index import Index
from cache_store.leases import Leases
from cache_store.lock import DataDirLock
from cache_store.metrics import StoreMetrics
from cache_store.objects import Bucket, Location, ObjectStoreDown, failure
from cache_store.parts import Parts
from cache_store.payloads import Payloads
from cache_store.reads import BlockReads
from cache_store.records import AgentRecord, BlockRecord
from cache_store.tier import ObjectTier
from cache_store.upkeep import Upkeep
from cache_store.uploads import PutHeader, PutResult, Uploads

log = logging.getLogger("agentkv.store")


class CacheStore:
    def __init__(self, config: StoreConfig, metrics: StoreMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or StoreMetrics()
        try:
            config.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:  # a file where the directory goes (a typo for its folder)
            raise NotADirectoryError(
                f"--data-dir {config.data_dir} is a file, not a directory"
            ) from None
        self.lock = DataDirLock(config.data_dir)
        self.lock.acquire()  # before anything below touches the directory
        try:
            self._open()
        except BaseException:
            self.lock.release()
            raise

    def _open(self) -> None:
        config = self.config
        self.payloads = Payloads(config.data_dir)
        self.index = Index(config.data_dir / "index", config.lmdb_map_bytes, config.quotas)
        self.leases = Leases(config.max_leases_per_namespace)
        self.parts = Parts(config, self.index, self.payloads, self.leases, self.metrics)
        self.capacity = Capacity(self.parts)
        self.upkeep = Upkeep(self.parts)
        self.reads = BlockReads(self.parts, self.capacity, self.upkeep.quarantine)
        r = self.reads
        self.select, self.reading, self.read, self.locate = r.select, r.reading, r.read, r.locate
        self.path_of, self.report_corrupt = r.path_of, r.report_corrupt
        self.longest_prefix = r.longest_prefix
        self.uploads = Uploads(
            self.parts,
            self.capacity,
            self.upkeep.quarantine,
            before_write=self._before_write,
            stored=self._block_stored,
        )
        self.upkeep.recover()
        self.tier = self._object_tier() if config.object_store else None
        self.capacity.uploads = self.reads.tier = self.tier
        self.metrics.watch_usage(self.stats)
        self.retention = idle.Retention(config, self.index, self.capacity, self)
        self.sweeper = idle.sweeper(config, self.capacity, self.retention)

    def _object_tier(self) -> ObjectTier:
        config = self.config
        location = Location.parse(config.object_store)
        schema.bind_object_store(self.index, str(location))
        bucket = Bucket(location, config.s3_endpoint, self.metrics)
        return ObjectTier(self.parts, self.capacity, bucket, self.upkeep.quarantine)

    def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.close()  # before the index it reads closes
        if self.tier is not None:
            self.tier.close()
        self.index.close()
        self.lock.release()

    # blocks in

    def put_stream(
        self, items: Iterator[PutHeader | memoryview]
    ) -> tuple[list[PutResult], str, int]:
        return self.uploads.put_stream(items)

    # agents

    def commit_agent(self, c: manifests.Commit, release_lease_id: str = "") -> manifests.AgentView:
        c.namespace = ids.namespace(c.namespace)
        ids.agent_id(c.agent_id)
        ids.fingerprint(c.fingerprint)
        c.token_ids = ids.token_ids(c.token_ids, self.config.max_agent_tokens)
        c.metadata = ids.metadata(c.metadata)
        c.phase = ids.phase(c.phase)
        c.block_keys = [ids.key(k, f"block_keys[{i}]") for i, k in enumerate(c.block_keys)]
        self._before_write(c.namespace, c.agent_id, replaces=c.expected_generation == 0)
        spare = [(c.namespace, c.agent_id)]  # its record's room is never its own
        record, result = self.capacity.with_room(self._commit, c, spare=spare)
        if release_lease_id:
            self.leases.release(release_lease_id)
        self.capacity.touch_agent(record.namespace, record.agent_id)
        self.retention.forget(record.namespace, record.agent_id)
        self._agent_changed(record.namespace, record.agent_id)
        return result

    def _commit(self, c: manifests.Commit) -> tuple[Any, manifests.AgentView]:
        with self.index.read() as txn:  # checked before the write, which other puts wait for
            chain = manifests.checked_chain(self.index, txn, c)
        with self.index.write() as txn:
            if not manifests.unchanged(self.index, txn, c.namespace, chain):  # its refcount,
                chain = manifests.checked_chain(self.index, txn, c)  # say: checked again here
            record = manifests.commit(self.index, txn, c, now_ms(), chain.blocks)
        return record, manifests.view_of(record, chain.blocks)

    def get_agent(
        self, namespace: str, agent_id: str, fingerprint: str = "", peek: bool = False
    ) -> manifests.AgentView:
        """The manifest and its blocks' state. A read for use (not a `peek`) counts as the
        agent's use: retention and LRU eviction take it as recent."""
        ns = ids.namespace(namespace)
        ids.agent_id(agent_id)
        if fingerprint:
            ids.fingerprint(fingerprint)
        if self.tier is not None:
            self._fetch_if_newer(ns, agent_id)
        if not peek:
            self.retention.mark_used(ns, agent_id)  # before the read (idle.Retention)
        try:
            with self.upkeep.repairing(), self.index.read() as txn:
                record = self._get(txn, ns, agent_id)
                if fingerprint and record.fingerprint != fingerprint:
                    raise FingerprintMismatch(
                        f"agent {agent_id!r} was written under fingerprint "
                        f"{record.fingerprint!r}, not {fingerprint!r}"
                    )
                return manifests.view(self.index, txn, record)
        except AgentNotFound:
            if not peek:
                self.capacity.forget_agent(ns, agent_id)  # no use kept of what is not there
            raise

    def _get(self, txn: Any, namespace: str, agent_id: str) -> AgentRecord:
        """The agent's manifest; a not-found error says when retention deleted it."""
        try:
            return manifests.get(self.index, txn, namespace, agent_id)
        except AgentNotFound as exc:
            if why := self.retention.why_gone(namespace, agent_id):
                raise AgentNotFound(f"{exc.message}: {why}") from None
            raise

    def _fetch_if_newer(
        self,
        namespace: str,
        agent_id: str,
        writing: bool = False,
        replaces: bool = False,
        deleting: bool = False,
    ) -> bool:
        """An agent absent here is fetched from the object store; one this store has not
        written or checked since it began to write the namespace is fetched again when the
        object store holds a newer generation. While the object store is down, a read of an
        agent absent here is UNAVAILABLE (it may be there), and so is a write of one known to
        be there; a write of another goes on locally (its upload will not overwrite one made
        elsewhere). An unreadable manifest there is a lost agent: DATA_LOSS, but a write that
        `replaces` the agent, absent here, or `deleting` it, drops it first. Whether it did."""
        with self.index.read() as txn:
            local = self.index.find_agent(txn, namespace, agent_id)
            uploaded = self.index.uploaded_generation(txn, namespace, agent_id)
        if uploaded == 0 or (local is not None and self.tier.writes_current(namespace, agent_id)):
            return False  # deleted here (its copy there goes next), or this copy is current
        try:
            self.tier.fetch_agent(namespace, agent_id, local.generation if local else None)
            self.tier.mark_current(namespace, agent_id)
        except NotInBucket:
            assert local is not None
            if uploaded == local.generation and not self.tier.writers.holds(namespace):
                self._drop_deleted_elsewhere(local)
            else:
                self.tier.mark_current(namespace, agent_id)  # not uploaded yet, or ours
        except LostManifest as exc:
            if not replaces or (local is not None and not deleting):
                raise AgentLost(
                    f"{exc.message}: agent {agent_id!r} is lost (delete it, or commit it anew "
                    "with expected_generation 0: either drops that manifest)"
                ) from None
            self.tier.fetcher.drop_lost(namespace, agent_id, exc)
            return True
        except ObjectStoreDown as exc:
            if local is None and (not writing or uploaded):  # it may be, or is, there
                # Unknown here (BucketUnreachable: a new agent may be made), or known to be
                # in the bucket (not new: it waits for the bucket).
                error = BucketUnreachable if uploaded is None else ObjectStoreDown
                raise error(
                    f"agent {agent_id!r} in namespace {namespace!r} is not on this store's disk "
                    f"and the object store cannot be asked for it: {exc.message}"
                ) from exc
            log.warning(f"object store {failure(exc)}: serving the local manifest of {agent_id!r}")
        return False

    def _drop_deleted_elsewhere(self, local: AgentRecord) -> None:
        """Drops a standby's copy of an agent the bucket held at that generation and holds
        no longer: the namespace's writer deleted it (served on, it came back once this
        store took the namespace over)."""
        ns, agent_id = local.namespace, local.agent_id
        with self.index.write() as txn:
            try:
                manifests.delete(self.index, txn, ns, agent_id, local.generation)
            except (AgentNotFound, GenerationConflict):
                return  # changed here meanwhile: that copy stands
            self.index.delete_uploaded(txn, ns, agent_id)
        self.capacity.forget_agent(ns, agent_id)
        log.info("agent deleted in the object store: dropped here", extra={"agent": agent_id})

    def list_agents(
        self, namespace: str, page_token: str, page_size: int
    ) -> tuple[list[manifests.AgentView], str]:
        """A page of agents in id order, and the token of the next ("" at the end): this
        store's, and with an object store also those only the bucket holds (fetched on their
        first GetAgent)."""
        ns = ids.namespace(namespace)
        if page_token:  # the last agent id of a page: anything else is none ListAgents gave
            ids.agent_id(page_token, "page_token")
        limit = page_size_limit(page_size)
        with self.upkeep.repairing(), self.index.read() as txn:
            page, after = self.index.agent_page(txn, ns, page_token, limit)
            views = [manifests.view(self.index, txn, r) for r in page]
        if self.tier is None:
            return views, after
        try:
            bucket, bucket_after = self.tier.bucket_agents(ns, page_token, limit)
        except ObjectStoreDown as exc:
            log.warning("listing this store's agents only: %s", exc.message)
            return views, after
        views, after = merge_pages(views, after, bucket, bucket_after, limit)
        if self.tier.writers.holds(ns):
            return views, after
        listed = {v.record.agent_id for v in bucket}
        return [v for v in views if not self._gone_from(listed, bucket_after, v.record)], after

    def _gone_from(self, listed: set[str], listed_to: str, local: AgentRecord) -> bool:
        """Whether a standby's copy of an agent that the bucket's listing passed over (it
        listed `listed` up to `listed_to`, "" for the end), which the bucket held at that
        generation, was deleted by the namespace's writer: it is checked, as a read of it
        is, and dropped if so."""
        ns, agent_id = local.namespace, local.agent_id
        if agent_id in listed or (listed_to and agent_id > listed_to):
            return False
        with self.index.read() as txn:
            if self.index.uploaded_generation(txn, ns, agent_id) != local.generation:
                return False  # not uploaded yet, or deleted here
        try:
            self._fetch_if_newer(ns, agent_id)
        except AgentKVError:  # an unreadable manifest there, say: a read of it says so
            return False
        with self.index.read() as txn:
            return self.index.find_agent(txn, ns, agent_id) is None

    def delete_agent(
        self, namespace: str, agent_id: str, expected_generation: int = 0, counter: str = ""
    ) -> int:
        """Deletes the agent (here and in the object store); the blocks it released. `counter`
        names a stats counter the deletion counts in."""
        ns = ids.namespace(namespace)
        ids.agent_id(agent_id)
        lost = self._before_write(ns, agent_id, deleting=True)
        with self.index.write() as txn:
            try:
                released = manifests.delete(self.index, txn, ns, agent_id, expected_generation)
            except AgentNotFound:
                if not lost:
                    raise
                return 0  # its unreadable manifest, all there was of it, is gone
            if counter:
                self.index.bump(txn, counter)
            if self.tier is not None:
                self.index.put_uploaded(txn, ns, agent_id, 0)  # delete it there too
        self.capacity.forget_agent(ns, agent_id)
        self._agent_changed(ns, agent_id)
        return released

    def fork_agent(
        self,
        namespace: str,
        source_id: str,
        new_id: str,
        num_tokens: int,
        phase: str,
        metadata: dict[str, str],
    ) -> manifests.AgentView:
        ns = ids.namespace(namespace)
        ids.agent_id(source_id, "source_agent_id")
        ids.agent_id(new_id, "new_agent_id")
        metadata = ids.metadata(metadata)
        phase = ids.phase(phase)
        self._before_write(ns, new_id)
        if self.tier is not None:
            self._fetch_if_newer(ns, source_id)
        self.retention.mark_used(ns, source_id)  # a template agent forked from is in use
        fork = (ns, source_id, new_id, num_tokens, phase, metadata)
        spare = [(ns, source_id), (ns, new_id)]  # its record may need room, never theirs
        view = self.capacity.with_room(self._fork, *fork, spare=spare)
        self.capacity.touch_agent(ns, new_id)
        self.retention.forget(ns, new_id)
        self._agent_changed(ns, new_id)
        return view

    def _fork(self, ns: str, source_id: str, new_id: str, *rest: Any) -> manifests.AgentView:
        with self.index.write() as txn:
            record = manifests.fork(self.index, txn, ns, source_id, new_id, *rest, now_ms())
            return manifests.view(self.index, txn, record)

    # inspection and maintenance

    def list_namespaces(self) -> dict[str, dict[str, float]]:
        """Each namespace's agents, blocks, bytes, quota (0: none of its own) and retention
        (agent_idle seconds; 0: kept)."""
        with self.index.read() as txn:
            usage = self.index.namespaces(txn)
        config = self.config
        return {
            n: {**u, "quota": config.namespace_quota(n), "agent_idle": config.agent_idle(n)}
            for n, u in usage.items()
        }

    def list_blocks(
        self, namespace: str, page_token: bytes, page_size: int
    ) -> tuple[list[BlockRecord], bytes]:
        """A page of blocks in key order, and the key to list on after (b"" at the end)."""
        ns = ids.namespace(namespace)
        with self.index.read() as txn:
            return self.index.block_page(txn, ns, page_token, page_size_limit(page_size))

    def last_access_ms(self, record: BlockRecord) -> int:
        return self.capacity.block_last_access((record.namespace, record.key), record.created_ms)

    def stats(self) -> dict[str, Any]:
        with self.index.read() as txn:
            usage = self.index.namespaces(txn)
            counters = {
                n: self.index.counter(txn, n)
                for n in (
                    "evicted_blocks",
                    "evicted_agents",
                    "expired_agents",
                    "quarantined",
                    "quarantined_records",
                    "demoted_blocks",
                    "rehydrated_blocks",
                )
            }
        tier = self.tier.stats() if self.tier is not None else {}
        return {
            "num_namespaces": len(usage),
            "num_agents": sum(u["agents"] for u in usage.values()),
            "num_blocks": sum(u["blocks"] for u in usage.values()),
            "num_bytes": sum(u["bytes"] for u in usage.values()),
            "quota_bytes": self.config.quota_bytes,
            "num_evicted_blocks": counters["evicted_blocks"],
            "num_evicted_agents": counters["evicted_agents"],
            "num_expired_agents": counters["expired_agents"],
            "num_quarantined": counters["quarantined"] + counters["quarantined_records"],
            "num_leases": len(self.leases),
            "disk_free_bytes": self.payloads.disk_free(),
            "num_demoted_blocks": counters["demoted_blocks"],
            "num_rehydrated_blocks": counters["rehydrated_blocks"],
            **tier,
        }

    def verify(self, namespace: str = "") -> tuple[int, int, list[tuple[BlockRecord, str]], int]:
        """Checks every index record and reads every payload on this disk, checking every
        checksum; quarantines what fails. (blocks checked, bytes read, the corrupt and why,
        blocks only in the object store)"""
        return self.upkeep.verify(namespace)

    def bad_records(self, namespace: str = "") -> list[integrity.BadRecord]:
        """Agent and block records found corrupt and quarantined (see Upkeep.bad_records)."""
        return self.upkeep.bad_records(namespace)

    def collect_garbage(self, namespace: str = "") -> tuple[int, int, int]:
        """Deletes unreferenced, unleased blocks, then orphan files. (blocks, bytes, orphans)"""
        ns = ids.namespace(namespace) if namespace else None
        self.payloads.check_root()  # it deletes files: never in a directory that replaced it
        deleted, freed = self.capacity.collect(ns)
        return deleted, freed, self.upkeep.remove_orphans(ns)

    # helpers

    def _before_write(
        self, namespace: str, agent_id: str = "", replaces: bool = True, deleting: bool = False
    ) -> bool:
        """With an object store: this store must be the namespace's writer, and an agent
        written that is not here, or not current here, is fetched first (so its generation
        is the bucket's). Whether its manifest there was unreadable, and dropped: a write
        that `replaces` the agent (a delete, a commit anew, a fork's new agent) drops it; a
        commit that expects a generation of it is DATA_LOSS, as a read is."""
        if self.tier is not None:
            self.tier.check_writer(namespace)
            if agent_id:
                return self._fetch_if_newer(namespace, agent_id, True, replaces, deleting)
        return False

    def writes(self, namespace: str) -> bool:
        """Whether this store writes the namespace now (always, without an object store);
        asks for nothing (a standby store never takes a namespace over to delete in it)."""
        return self.tier is None or self.tier.writers.holds(namespace)

    def _block_stored(self, record: BlockRecord) -> None:
        if self.tier is not None:
            self.tier.block_stored(record)

    def _agent_changed(self, namespace: str, agent_id: str) -> None:
        if self.tier is not None:
            self.tier.agent_changed(namespace, agent_id)


def page_size_limit(page_size: int) -> int:
    """The page size a listing uses: 100 by default, 1000 at most."""
    return min(page_size or 100, 1000)


def merge_pages(
    local: list[manifests.AgentView],
    local_after: str,
    bucket: list[manifests.AgentView],
    bucket_after: str,
    limit: int,
) -> tuple[list[manifests.AgentView], str]:
    """One page of two sources' pages (this store's copy wins), and its next token: up to
    the first place either source's listing stopped, so neither skips an agent."""
    merged = {v.record.agent_id: v for v in bucket}
    merged.update((v.record.agent_id, v) for v in local)
    after = min((a for a in (local_after, bucket_after) if a), default="")
    page = sorted(a for a in merged if not after or a <= after)
    if len(page) > limit:
        page, after = page[:limit], page[limit - 1]
    return [merged[a] for a in page], after
