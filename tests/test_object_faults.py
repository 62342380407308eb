"""The object tier off its happy path, against real store processes and a real SeaweedFS: an
index whose record of what the bucket holds is damaged."""

from __future__ import annotations

from pathlib import Path

import lmdb

from cache_store.records import encode_uploaded_id
from tests import test_object_store as tier
from tests.test_object_store import (
    NS,
    bucket_agents,
    save,
    start_store,
    tier_args,
    uploaded,
    wait_for,
)

weed, bucket, credentials = tier.weed, tier.bucket, tier.credentials  # its fixtures


def uploaded_ids(data_dir: Path) -> dict[bytes, bytes]:
    """A stopped store's uploaded_ids table, key by key."""
    env = lmdb.open(str(data_dir / "index"), max_dbs=32)
    try:
        with env.begin() as txn:
            return dict(txn.cursor(db=env.open_db(b"uploaded_ids", txn=txn)))
    finally:
        env.close()


def put_uploaded_ids(data_dir: Path, rows: dict[bytes, bytes]) -> None:
    env = lmdb.open(str(data_dir / "index"), max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            table = env.open_db(b"uploaded_ids", txn=txn)
            for k, v in rows.items():
                txn.put(k, v, db=table)
    finally:
        env.close()


def test_bad_uploaded_ids_entries_are_dropped_and_deletions_still_go_out(weed, bucket, tmp_path):
    """a read b's agents (the versions it may delete, in uploaded_ids); that table is then
    damaged: an entry of another generation (what a release without the table leaves), a
    flipped byte, one no agent backs. At start-up all three are dropped, logged, and a's
    deletions of b's agents still reach the bucket (a bad entry kept them there)."""
    b = start_store(tmp_path, "b", tier_args(weed, bucket))
    with b.client() as c:
        save(c, "stale", list(range(1, 100)))
        save(c, "flipped", list(range(1000, 1100)), seed=1)
        wait_for("b's uploads", lambda: uploaded(c))
    b.stop()  # a clean stop hands the lease back
    a = start_store(tmp_path, "a", tier_args(weed, bucket))
    with a.client() as c:
        created = {name: c.get_agent(NS, name).created_unix_ms for name in ("stale", "flipped")}
    a.stop()
    key = {name: f"{NS}\0{name}".encode() for name in ("stale", "flipped", "ghost")}
    ids = uploaded_ids(tmp_path / "a")
    assert ids[key["stale"]] == encode_uploaded_id(key["stale"], 1, created["stale"])
    flipped = bytearray(ids[key["flipped"]])
    flipped[-1] ^= 0x01
    put_uploaded_ids(
        tmp_path / "a",
        {
            key["stale"]: encode_uploaded_id(key["stale"], 7, created["stale"]),
            key["flipped"]: bytes(flipped),
            key["ghost"]: encode_uploaded_id(key["ghost"], 1, created["stale"]),
        },
    )

    a.start()
    try:
        with a.client() as c:
            for name in ("stale", "flipped"):
                c.delete_agent(NS, name)
            wait_for("a's deletions", lambda: uploaded(c))
            assert bucket_agents(weed, bucket) == set()
    finally:
        a.stop()
    log = (tmp_path / "a.log").read_text()
    dropped = [line for line in log.splitlines() if "bad index entry dropped" in line]
    assert len(dropped) == 3 and all("uploaded_ids" in line for line in dropped), dropped
    assert '"bad_index_records": 3' in log
    assert uploaded_ids(tmp_path / "a") == {}
