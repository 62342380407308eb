"""The store's upkeep: start-up recovery, verification, repair of bad index records,
quarantine of bad blocks and the sweep of orphan payload files."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from agentkv import ids
from agentkv.errors import CorruptBlock, IndexUnusable
from cache_store import integrity, schema
from cache_store.parts import Parts
from cache_store.records import BlockRecord

log = logging.getLogger("agentkv.store")


class Upkeep:
    def __init__(self, parts: Parts) -> None:
        self.parts, self.config, self.index = parts, parts.config, parts.index
        self.payloads, self.metrics = parts.payloads, parts.metrics

    def recover(self) -> None:
        """Checks the index (schema version; every record's checksum, quarantining bad ones),
        sweeps uploads cut short and orphans, and quarantines entries whose file is gone.
        A new (or emptied) index beside payload files is a lost one: IndexUnusable, as every
        payload would be an orphan, deleted."""
        self._check_not_lost()
        bad_records = integrity.open_index(self.index)
        self.metrics.quarantines.inc(sum(b.table in integrity.PRIMARY for b in bad_records))
        tmp = self.payloads.sweep_tmp()
        orphans = self.remove_orphans()
        with self.index.read() as txn:
            records = list(self.index.blocks(txn, None))
        lost = 0
        for record in records:
            if not record.local:
                continue  # demoted: its payload is in the object store
            try:
                self.payloads.check_size(record)
            except CorruptBlock as exc:
                self.quarantine(record, f"at start-up: {exc.message}")
                lost += 1
        log.info(
            "recovered",
            extra={
                "tmp_removed": tmp,
                "orphans_removed": orphans,
                "blocks": len(records) - lost,
                "quarantined": lost,
                "bad_index_records": len(bad_records),
            },
        )

    def _check_not_lost(self) -> None:
        with self.index.read() as txn:
            new = schema.is_new(self.index, txn)
        if not new:
            return
        files = sum(1 for _ in itertools.islice(self.payloads.block_files(), 1_000_000))
        if files:
            root = self.payloads.root
            raise IndexUnusable(
                f"the data dir {root} holds {files} block files, but its index "
                f"({self.index.path}) is missing or empty: it was lost, and starting would "
                "delete every block as an orphan. Put the index back (from a backup), or move "
                f"{root / 'blocks'} away to start empty"
            )

    def verify(self, namespace: str = "") -> tuple[int, int, list[tuple[BlockRecord, str]], int]:
        """Checks every index record and reads every payload on this disk, checking every
        checksum; quarantines what fails (bad index records: see bad_records). Returns the
        blocks checked, their bytes, the corrupt, and the blocks only the object store holds
        (not read)."""
        ns = ids.namespace(namespace) if namespace else None
        with self.index.read() as txn:
            damaged = bool(integrity.scan(self.index, txn, ns))
        if damaged:
            with self.index.write() as txn:
                found = integrity.scan(self.index, txn)
                integrity.fix(self.index, txn, found)
            self.metrics.quarantines.inc(sum(b.table in integrity.PRIMARY for b in found.records))
        self.repair()
        with self.index.read() as txn:
            records = list(self.index.blocks(txn, ns))
        corrupt: list[tuple[BlockRecord, str]] = []
        checked = num_bytes = remote = 0
        for record in records:
            if not record.local:
                remote += 1  # in the object store; checked when fetched back
                continue
            try:
                self.payloads.verify(record)
                checked += 1
                num_bytes += record.num_bytes
            except CorruptBlock as exc:
                self.quarantine(record, exc.message)
                corrupt.append((record, exc.message))
        return checked + len(corrupt), num_bytes, corrupt, remote

    def bad_records(self, namespace: str = "") -> list[integrity.BadRecord]:
        """Agent and block records found corrupt and quarantined, until the agent is deleted
        or committed anew, or the block uploaded again."""
        ns = ids.namespace(namespace) if namespace else None
        with self.index.read() as txn:
            return integrity.quarantined(self.index, txn, ns)

    @contextmanager
    def repairing(self) -> Iterator[None]:
        """Quarantines what the enclosed reads found bad (also when they raise for it)."""
        try:
            yield
        finally:
            self.repair()

    def repair(self) -> None:
        suspects = self.index.take_suspects()
        if not suspects:
            return
        with self.index.write() as txn:
            bad = integrity.repair(self.index, txn, suspects)
        self.metrics.quarantines.inc(sum(b.table in integrity.PRIMARY for b in bad))

    def quarantine(self, record: BlockRecord, reason: str, where: str = "local") -> None:
        """Takes a bad block out. `where` failed: "local" (its file: a block whose object-store
        copy is whole is demoted instead, so its next read fetches that copy), "bucket" (the
        object-store copy), or "misfit" (its tensors cannot be its model's: gone everywhere).
        A record that changed since the caller read it (demoted, replaced) is left alone."""
        with self.index.write() as txn:
            current = self.index.find_block(txn, record.namespace, record.key)
            if current is None or current.created_ms != record.created_ms:
                return  # someone else got there first, or a new upload replaced it
            if where == "local" and not current.local:
                return  # demoted meanwhile: its file went on purpose
            remote = self.index.remote_checksum(txn, record.namespace, record.key)
            demote = where == "local" and remote is not None and bool(self.config.object_store)
            if demote:
                self.index.set_local(txn, current, False)
            else:
                self.index.delete_block(txn, current, lost=True)
            self.index.bump(txn, "quarantined")
        dest = self.payloads.quarantine(record)
        self.metrics.quarantines.inc()
        log.warning(
            "block quarantined",
            extra={
                "namespace": record.namespace,
                "key": record.key.hex(),
                "reason": reason,
                "moved_to": str(dest),
            },
        )

    def remove_orphans(self, namespace: str | None = None) -> int:
        """Deletes payload files no local block names (a demoted block's file is one: a
        crash between its demotion and the unlink), in one namespace or (None) all. At
        start-up, or after CacheStore.collect_garbage checked the data directory is still
        the one it opened. The scan holds every put's publishing a moment: one tenant's
        collection reads its own blocks only."""
        with self.index.read() as txn:
            known = {r.relpath for r in self.index.blocks(txn, namespace) if r.local}
        suspects = [p for p in self.payloads.block_files(namespace) if p not in known]
        if not suspects:
            return 0
        removed = 0
        with self.parts.publish_lock:  # a put between rename and index commit is no orphan
            with self.index.read() as txn:
                known = {r.relpath for r in self.index.blocks(txn, namespace) if r.local}
            for relpath in suspects:
                if relpath not in known:
                    self.payloads.path(relpath).unlink(missing_ok=True)
                    removed += 1
        return removed
