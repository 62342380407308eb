"""The object tier off its happy path, against real store processes and a real SeaweedFS: an
index whose record of what the bucket holds is damaged, an S3 front before SeaweedFS that
refuses conditional deletes, and SeaweedFS frozen (SIGSTOP) during a writer lease's renewal."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import lmdb
import pytest
import xxhash

from cache_store.records import encode_uploaded_id
from tests import test_object_store as tier
from tests.helpers import freeze, make_chain
from tests.test_object_store import (
    BUCKET,
    NS,
    assert_restores,
    bucket_agents,
    save,
    start_store,
    tier_args,
    uploaded,
    wait_for,
)
from tests.weed import WeedServer

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


# an S3 front before SeaweedFS

NOT_IMPLEMENTED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NotImplemented</Code><Message>A '
    b"header you provided implies functionality that is not implemented</Message></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect"}


@dataclass
class Seen:
    """One request the front took, and the status it answered (0 while unanswered)."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    status: int = 0

    def on(self, method: str, key: str) -> bool:
        """Whether it is a request of `method` on the object `key` of BUCKET."""
        return self.method == method and self.path == f"/{BUCKET}/{key}"


class S3Front(http.server.ThreadingHTTPServer):
    """An HTTP front for weed's S3 API that passes each request on, one at a time in the order
    they came (as a server taking them in turn), and records them; with `refuse_conditional_
    deletes`, it answers a DELETE with If-Match 501 NotImplemented itself, as object stores
    without conditional deletes do. `before_forward` sees each request before its turn (and
    may hold it), `after_forward` each request weed answered."""

    daemon_threads = True

    def __init__(self, weed: WeedServer, refuse_conditional_deletes: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _FrontHandler)
        self.upstream = urlparse(weed.endpoint).port
        self.refuse_conditional_deletes = refuse_conditional_deletes
        self.after_forward: Callable[[Seen], None] = lambda seen: None
        self.before_forward: Callable[[Seen], None] = lambda seen: None  # not in turn
        self.seen: list[Seen] = []
        self._in_turn = threading.Lock()
        threading.Thread(target=self.serve_forever, name="s3-front", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def requests(self, method: str, key: str) -> list[Seen]:
        """The requests of `method` on the object `key` of BUCKET, in order."""
        return [s for s in list(self.seen) if s.on(method, key)]

    def statuses(self, method: str, key: str) -> list[int]:
        return [s.status for s in self.requests(method, key)]

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    def answer(self, seen: Seen, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        if (
            self.refuse_conditional_deletes
            and seen.method == "DELETE"
            and "if-match" in seen.headers
        ):
            return 501, [("Content-Type", "application/xml")], NOT_IMPLEMENTED
        headers = {k: v for k, v in seen.headers.items() if k not in _HOP_BY_HOP}
        self.before_forward(seen)
        with self._in_turn:
            weed = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=300)
            try:
                weed.request(seen.method, seen.path, body, headers)
                reply = weed.getresponse()
                answered = (reply.status, reply.getheaders(), reply.read())
            finally:
                weed.close()
            self.after_forward(seen)
        return answered


class _FrontHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for botocore's puts
    server: S3Front

    def log_message(self, *args) -> None:
        pass

    def _any(self) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        assert "chunked" not in headers.get("transfer-encoding", ""), "not sent by the store"
        seen = Seen(self.command, self.path.partition("?")[0], headers)
        self.server.seen.append(seen)
        status, reply_headers, body = self.server.answer(
            seen, self.rfile.read(int(headers.get("content-length", 0)))
        )
        seen.status = status
        length = dict((k.lower(), v) for k, v in reply_headers).get("content-length")
        try:
            self.send_response(status)
            for k, v in reply_headers:
                if k.lower() not in _HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Content-Length", length if self.command == "HEAD" else len(body))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError:
            pass  # the client gave up waiting: a retry may follow

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any


def another_stores_version(weed: WeedServer, key: str) -> None:
    """Writes generation 2 of the manifest at `key` as another store would have."""
    s3 = weed.client()
    got = s3.get_object(Bucket=BUCKET, Key=key)
    m = json.loads(got["Body"].read())
    m["generation"] = 2
    body = json.dumps(m).encode()
    meta = {**got["Metadata"], "agentkv-writer": "elsewhere", "agentkv-generation": "2"}
    meta["agentkv-xxh3"] = f"{xxhash.xxh3_64_intdigest(body):016x}"
    s3.put_object(Bucket=BUCKET, Key=key, Body=body, Metadata=meta)


def test_a_bucket_that_refuses_conditional_deletes_still_deletes_only_what_was_deleted_here(
    weed, bucket, tmp_path
):
    """Once a DELETE with If-Match is answered 501, the store reads the ETag just before a
    plain delete instead (it retried the conditional one for good): its own agent is deleted
    there; one another store rewrote after the uploader read it is not."""
    front = S3Front(weed, refuse_conditional_deletes=True)
    store = start_store(tmp_path, "s", tier_args(front, bucket))
    gone, kept = (f"{bucket}/{NS}/agents/{name}" for name in ("gone", "kept"))
    try:
        with store.client() as c:
            save(c, "gone", list(range(1, 100)))
            save(c, "kept", list(range(1000, 1100)), seed=1)
            wait_for("the uploads", lambda: uploaded(c))
            c.delete_agent(NS, "gone")
            wait_for(
                "the deletion, or a second refusal",
                lambda: (
                    "gone" not in bucket_agents(weed, bucket)
                    or front.statuses("DELETE", gone).count(501) > 1
                ),
            )
            assert "gone" not in bucket_agents(weed, bucket)
            wait_for("the queue", lambda: uploaded(c))

            def rewrite(seen: Seen) -> None:  # between the store's read and its delete
                if seen.on("GET", kept):
                    front.after_forward = lambda seen: None
                    another_stores_version(weed, kept)

            front.after_forward = rewrite
            c.delete_agent(NS, "kept")
            wait_for("the deletion's end", lambda: uploaded(c))
            assert bucket_agents(weed, bucket) == {"kept"}
            there = weed.client().head_object(Bucket=BUCKET, Key=kept)
            assert there["Metadata"]["agentkv-writer"] == "elsewhere"
            assert not front.requests("DELETE", kept)  # nor one without If-Match
            assert front.statuses("DELETE", gone) == [501, 204]
    finally:
        store.stop()
        front.close()
    log = (tmp_path / "s.log").read_text()
    assert log.count("object store refuses conditional deletes") == 1
    assert "agent deletion not carried out" in log


def test_a_lease_renewal_retried_across_a_frozen_bucket_is_not_a_lost_lease(bucket, tmp_path):
    """weed stopped (SIGSTOP) under a renewal of the writer lease: its first try times out and
    botocore tries again. Resumed, weed takes the first try, which lands, then the retry,
    whose If-Match names the ETag before it: 412. The store keeps its lease (its own write)
    and renews it; it said 'writer lease lost' and gave it up."""
    weed = WeedServer(tmp_path / "weed").start()  # its own: this test freezes it
    front = S3Front(weed)  # one request at a time, in turn: the first try goes first
    store = start_store(tmp_path, "s", tier_args(front, bucket, "--writer-lease-seconds", "6"))
    lease = f"{bucket}/{NS}/writer.lease"
    try:
        with store.client() as c:
            save(c, "a", list(range(1, 100)))
            wait_for("the upload", lambda: uploaded(c))
        freeze(weed.proc.pid, group=True)
        try:
            wait_for(
                "a renewal's retry",
                lambda: any(
                    s.headers.get("amz-sdk-request", "").startswith("attempt=2")
                    for s in front.requests("PUT", lease)
                ),
            )
        finally:
            os.killpg(weed.proc.pid, signal.SIGCONT)
        log = tmp_path / "s.log"

        def renewed_past_412() -> bool:
            puts = front.statuses("PUT", lease)
            return 412 in puts and 200 in puts[puts.index(412) :]

        wait_for(
            "a renewal after the 412", lambda: "lease lost" in log.read_text() or renewed_past_412()
        )
        assert "writer lease lost" not in log.read_text()
        with store.client() as c:
            save(c, "b", list(range(2000, 2100)), seed=2)  # still this namespace's writer
            wait_for("the upload", lambda: uploaded(c))
    finally:
        store.stop()
        front.close()
        weed.stop(kill=True)


def test_a_lease_object_deleted_behind_the_stores_back_is_not_blamed_on_another_store(
    weed, bucket, tmp_path
):
    """The writer lease's object deleted from the bucket: the renewal's If-Match fails, and
    no other store holds it. The log says the object is gone (not that another store took
    the namespace over), and the next write takes the lease again and uploads."""
    store = start_store(tmp_path, "s", tier_args(weed, bucket, "--writer-lease-seconds", "3"))
    try:
        with store.client() as c:
            save(c, "a", list(range(1, 100)))
            wait_for("the upload", lambda: uploaded(c))
            weed.client().delete_object(Bucket=BUCKET, Key=f"{bucket}/{NS}/writer.lease")
            wait_for("the lost renewal", lambda: "writer lease lost" in store.log_text())
            lost = [x for x in store.log_text().splitlines() if "writer lease lost" in x]
            assert len(lost) == 1 and "its object is gone from the bucket" in lost[0], lost
            save(c, "b", list(range(2000, 2100)), seed=2)  # takes the lease again
            wait_for("the upload", lambda: uploaded(c))
        assert bucket_agents(weed, bucket) == {"a", "b"}
    finally:
        store.stop()


def test_json_in_the_bucket_too_deep_or_out_of_range_is_corrupt_not_a_crash():
    """Python's JSON parser gives up past ~1,000 levels (RecursionError), and reads Infinity,
    1e400 and -1 as numbers: a manifest, a block's header or a lease object written so into
    the bucket is corrupt (DATA_LOSS, a re-prefill) or an expired lease, never an INTERNAL
    error or a dead thread."""
    from agentkv.errors import CorruptBlock, CorruptRecord
    from cache_store.bucket_layout import parse_payload, read_manifest, xxh3
    from cache_store.records import BlockRecord
    from cache_store.writer_leases import _lease_fields

    deep = b"[" * 5000 + b"]" * 5000
    with pytest.raises(CorruptRecord, match="does not decode"):
        read_manifest(deep, {"agentkv-xxh3": xxh3(deep)}, "ns", "a")
    base = BlockRecord("ns", b"k" * 16, b"", "fp", [1], [], [], 0, "x", 0)
    with pytest.raises(CorruptBlock, match="no readable header"):
        parse_payload(len(deep).to_bytes(8, "little") + deep, base, 1 << 20)
    assert _lease_fields(deep) == ("", 0)
    # a header whose sizes add up, with a tensor of -1 bytes: no block of ours
    meta = {"key": base.key.hex(), "fingerprint": "fp", "namespace": "ns", "num_tokens": "1"}
    tensors = {
        "layers.0.k": {"dtype": "U8", "shape": [-1], "data_offsets": [0, -1]},
        "layers.0.v": {"dtype": "U8", "shape": [2], "data_offsets": [-1, 1]},
    }
    header = json.dumps({"__metadata__": meta, **tensors}).encode()
    with pytest.raises(CorruptBlock, match="not whole sizes"):
        parse_payload(len(header).to_bytes(8, "little") + header + b"x", base, 1 << 20)
    tensors = {"layers.0.k": {"dtype": "U8", "shape": 5, "data_offsets": [0, 5]}}  # no list
    header = json.dumps({"__metadata__": meta, **tensors}).encode()
    with pytest.raises(CorruptBlock, match="no readable header"):
        parse_payload(len(header).to_bytes(8, "little") + header + b"x" * 5, base, 1 << 20)
    # Python's JSON reads these; none is an int, or one a message can write as a time
    for expires in (b"Infinity", b"1e400", b"NaN", b"-5", str(2**70).encode()):
        assert _lease_fields(b'{"store": "other", "expires_unix_ms": %s}' % expires) == ("", 0)


def test_a_manifest_whose_generation_no_longer_reads_is_replaced_if_ours_else_kept(
    weed, bucket, tmp_path
):
    """A manifest in the bucket whose agentkv-generation metadata is no number (edited by
    hand, garbled): the uploader's next write of that agent raised ValueError on it, logged
    a traceback, and failed again at every scan after; the new version never reached the
    bucket. Now one this store wrote is replaced by the new version; another store's is
    kept, and the agent marked diverged, as for any version of theirs."""
    store = start_store(tmp_path, "s", tier_args(weed, bucket))
    s3 = weed.client()
    try:
        with store.client() as c:
            for name in ("mine", "theirs"):
                save(c, name, list(range(1, 100)))
            wait_for("the uploads", lambda: uploaded(c))
            for name, writer in (("mine", None), ("theirs", "elsewhere")):
                key = f"{bucket}/{NS}/agents/{name}"
                got = s3.get_object(Bucket=BUCKET, Key=key)
                meta = {**got["Metadata"], "agentkv-generation": "x"}
                meta["agentkv-writer"] = writer or meta["agentkv-writer"]
                s3.put_object(Bucket=BUCKET, Key=key, Body=got["Body"].read(), Metadata=meta)
            for name in ("mine", "theirs"):
                gen = c.get_agent(NS, name).generation
                save(c, name, list(range(1, 170)), seed=1, gen=gen)
            wait_for("the new versions' uploads", lambda: uploaded(c))
            mine = s3.head_object(Bucket=BUCKET, Key=f"{bucket}/{NS}/agents/mine")["Metadata"]
            assert mine["agentkv-generation"] == str(c.get_agent(NS, "mine").generation)
            theirs = s3.head_object(Bucket=BUCKET, Key=f"{bucket}/{NS}/agents/theirs")
            assert theirs["Metadata"]["agentkv-writer"] == "elsewhere"  # not written over
            assert len(c.get_agent(NS, "theirs").token_ids) == 169  # kept here
    finally:
        store.stop()
    log = (tmp_path / "s.log").read_text()
    assert "Traceback" not in log
    assert log.count("agent diverged") == 1 and '"theirs": "x"' in log


def test_an_agent_whose_blocks_are_gone_from_the_bucket_is_not_evicted_into_loss(
    weed, bucket, tmp_path
):
    """With --evict-agents, an agent was evicted when the bucket held its manifest as it
    is here, though its blocks had just been found gone from there (deleted behind the
    store's back; their uploads again queued, not done): its blocks, unreferenced then,
    were deleted next, and the bucket's manifest named blocks nowhere. Now an agent goes
    only with every block of it in the bucket, asked: here the other one goes."""
    tokens = {"a0": list(range(1, 64 * 9 + 1)), "a1": list(range(1000, 1256))}
    tokens["a2"] = list(range(2000, 2256))
    one = make_chain(tokens["a1"])[0][0]
    block = sum(t.data.nbytes for t in one.tensors)
    front = S3Front(weed)
    quota = ("--quota", str(int(block * 19)), "--evict-agents")  # 17 blocks, then 4 more
    store = start_store(tmp_path, "s", tier_args(front, bucket, *quota))
    held = threading.Event()
    try:
        with store.client() as c:
            chains = {a: save(c, a, t, seed=i) for i, (a, t) in enumerate(tokens.items())}
            wait_for("the uploads", lambda: uploaded(c))
            for key in chains["a0"][1]:
                name = f"{bucket}/{NS}/blocks/{key.hex()}.safetensors"
                weed.client().delete_object(Bucket=BUCKET, Key=name)

            def hold_puts(seen: Seen) -> None:  # the uploads again wait
                if seen.method == "PUT" and "/blocks/" in seen.path:
                    held.wait(300)

            front.before_forward = hold_puts
            tokens["a3"] = list(range(3000, 3256))
            chains["a3"] = save(c, "a3", tokens["a3"], seed=3)  # room: an agent evicted
            evicted = store.log_text().count('"event": "agent evicted"')
            assert evicted == 1 and '"agent": "a1"' in store.log_text()
            assert_restores(c, "a0", tokens["a0"], *chains["a0"])  # here, whole
            held.set()
            wait_for("the uploads again", lambda: uploaded(c))
            for agent in tokens:  # a1 from the bucket
                assert_restores(c, agent, tokens[agent], *chains[agent])
        assert "block gone from the object store: uploading it again" in store.log_text()
    finally:
        held.set()
        store.stop()
        front.close()
