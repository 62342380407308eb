"""Index records are checksummed and versioned: a flipped byte in data.mdb never changes what
the store serves, one bad record never stops it, and an index it cannot read stops it at
start-up with one line.

Each test commits agents in two namespaces to a real store process, stops it, damages
index/data.mdb behind its back (found by searching the file for a record's bytes), and starts
it again.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import lmdb
import pytest

from agentkv.client.blocks import Block
from agentkv.client.store import StoreClient
from agentkv.errors import AgentKVError, AgentNotFound, CorruptRecord
from agentkv.keys import token_bytes
from agentkv.v1 import store_pb2 as pb
from tests.helpers import FP, NS, StoreProcess, cli, make_chain, same_bytes

OTHER_NS = "tenant-b"
SHAPE = {"num_layers": 2, "kv_heads": 1, "head_dim": 64}  # small blocks: the index matters here
AGENTS = {  # (namespace, agent) -> token ids; blocks of 64 tokens
    (NS, "victim"): list(range(150)),
    (NS, "victim2"): list(range(1000, 1100)),
    (NS, "sibling"): [*range(128), *range(5000, 5030)],  # shares victim's first two blocks
    (OTHER_NS, "victim"): list(range(150)),  # the same tokens in another tenant
    (OTHER_NS, "other"): list(range(7000, 7200)),
}


@dataclass
class World:
    """What was committed: the truth every later answer is compared with."""

    agents: dict[tuple[str, str], pb.AgentManifest] = field(default_factory=dict)
    blocks: dict[tuple[str, bytes], Block] = field(default_factory=dict)


def commit_world(client: StoreClient) -> World:
    world = World()
    for (ns, agent_id), tokens in AGENTS.items():
        blocks, keys = make_chain(tokens, **SHAPE)
        _, manifest = client.save_agent(ns, agent_id, FP, tokens, blocks, metadata={"k": "v"})
        world.agents[ns, agent_id] = manifest
        world.blocks.update(((ns, k), b) for k, b in zip(keys, blocks, strict=True))
    return world


@pytest.fixture
def stopped(tmp_path) -> Iterator[tuple[StoreProcess, World]]:
    """A store that committed AGENTS, stopped (SIGTERM); stopped again after the test."""
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log").start()
    with proc.client() as client:
        world = commit_world(client)
    assert proc.stop() == 0
    yield proc, world
    proc.stop()


# finding and damaging records in data.mdb


@dataclass(frozen=True)
class Span:
    """Where one index record's bytes lie in data.mdb (every copy of them)."""

    table: str
    key: bytes
    value: bytes
    starts: tuple[int, ...]  # offsets of each copy
    length: int
    value_at: int  # where the value begins within the span


def index_records(data_dir: Path) -> list[tuple[str, bytes, bytes]]:
    """(table, key, value) of every record in the named sub-databases."""
    env = lmdb.open(str(data_dir / "index"), readonly=True, lock=False, max_dbs=32)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        rows = []
        for name in names:
            db = env.open_db(name, create=False, dupsort=name == b"children")
            with env.begin() as txn:
                rows += [(name.decode(), k, v) for k, v in txn.cursor(db=db)]
        return rows
    finally:
        env.close()


def find_all(data: bytes, pattern: bytes) -> tuple[int, ...]:
    starts, at = [], data.find(pattern)
    while at >= 0:
        starts.append(at)
        at = data.find(pattern, at + 1)
    return tuple(starts)


def spans(data_dir: Path) -> list[Span]:
    """Every record found in the file: key and value together where LMDB keeps them so,
    the value alone otherwise (duplicates, values on overflow pages)."""
    data = (data_dir / "index" / "data.mdb").read_bytes()
    found = []
    for table, key, value in index_records(data_dir):
        if starts := find_all(data, key + value):
            found.append(Span(table, key, value, starts, len(key) + len(value), len(key)))
        elif starts := find_all(data, value):
            found.append(Span(table, key, value, starts, len(value), 0))
    return found


def flip(data_dir: Path, offsets: list[int], mask: int) -> None:
    path = data_dir / "index" / "data.mdb"
    data = bytearray(path.read_bytes())
    for at in offsets:
        data[at] ^= mask
    path.write_bytes(data)


def agent_span(data_dir: Path, namespace: str, agent_id: str) -> Span:
    key = f"{namespace}\0{agent_id}".encode()
    (span,) = [s for s in spans(data_dir) if s.table == "agents" and s.key == key]
    return span


def flip_token(data_dir: Path, namespace: str, agent_id: str, position: int) -> None:
    """Turns token `position` of an agent's manifest from t into t ^ 1 (20 -> 21), in place."""
    span = agent_span(data_dir, namespace, agent_id)
    tokens = token_bytes(AGENTS[namespace, agent_id])
    at = span.value_at + span.value.index(tokens) + 4 * position
    flip(data_dir, [s + at for s in span.starts], 0x01)


# what a store must answer after damage


def started_or_refused(proc: StoreProcess) -> bool:
    """True if the store started; False if it refused with one line and no traceback."""
    offset = proc.log_path.stat().st_size if proc.log_path.exists() else 0
    try:
        proc.start()
        return True
    except RuntimeError:
        text = proc.log_path.read_text(errors="replace")[offset:]
        plain = [line for line in text.splitlines() if line and not line.startswith("{")]
        assert "Traceback" not in text, text[-3000:]
        assert len(plain) == 1 and plain[0].startswith("agentkv-store: error:"), text[-3000:]
        assert proc.proc.returncode not in (0, None)
        return False


def check_truth(client: StoreClient, world: World) -> set[tuple[str, str]]:
    """Every answer is the committed truth, or a precise error naming what was lost; returns
    the agents reported lost (DATA_LOSS)."""
    lost = {k for k in world.agents if not _agent_true(client, k, world)}
    for ns in (NS, OTHER_NS):
        listed = {a.agent_id: a for a in client.list_agents(ns)}
        alive = {a for n, a in world.agents if n == ns and (n, a) not in lost}
        assert set(listed) == alive
        for agent_id, summary in listed.items():
            truth = world.agents[ns, agent_id]
            assert (summary.num_tokens, summary.generation) == (
                len(truth.token_ids),
                truth.generation,
            )
        _check_blocks(client, world, ns, lost)
    report = client.call("VerifyBlocks", pb.VerifyBlocksRequest())
    assert not report.corrupt
    reported = {(r.namespace, r.id) for r in report.corrupt_records if r.table == "agents"}
    assert reported == lost
    return lost


def _agent_true(client: StoreClient, key: tuple[str, str], world: World) -> bool:
    ns, agent_id = key
    try:
        agent = client.get_agent(ns, agent_id)
    except CorruptRecord as exc:
        assert exc.code == grpc.StatusCode.DATA_LOSS and repr(agent_id) in exc.message
        return False
    truth = world.agents[key]
    assert list(agent.token_ids) == list(truth.token_ids)
    assert list(agent.block_keys) == list(truth.block_keys)
    assert (agent.generation, dict(agent.metadata)) == (truth.generation, dict(truth.metadata))
    assert set(agent.missing_block_keys) <= set(truth.block_keys)
    prefix = client.longest_prefix(ns, FP, truth.token_ids)
    assert list(prefix.keys) == list(truth.block_keys[: len(prefix.keys)])
    return True


def _check_blocks(client: StoreClient, world: World, ns: str, lost: set[tuple[str, str]]) -> None:
    """Listed blocks read back bit-exact with refcounts that match the manifests; the others
    are a precise miss."""
    listed = {b.key: b for b in client.list_blocks(ns)}
    refs: dict[bytes, int] = {}
    for (n, agent_id), truth in world.agents.items():
        if n == ns and (n, agent_id) not in lost:
            for k in set(truth.block_keys):
                refs[k] = refs.get(k, 0) + 1
    assert {k: b.refcount for k, b in listed.items()} == {k: refs.get(k, 0) for k in listed}
    for (n, key), block in world.blocks.items():
        if n != ns:
            continue
        if key in listed:
            (back,) = client.get_blocks(ns, FP, [key])
            assert same_bytes(block, back)
        else:
            with pytest.raises(AgentKVError) as info:
                list(client.get_blocks(ns, FP, [key]))
            assert info.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)
    usage = {
        u.name: u for u in client.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces
    }
    alive = sum(1 for n, _ in world.agents if n == ns) - sum(1 for n, _ in lost if n == ns)
    if alive or listed:
        assert (usage[ns].num_agents, usage[ns].num_blocks) == (alive, len(listed))


# the attack of issue 14, item 6


def test_a_flipped_token_in_a_manifest_is_data_loss_for_that_agent_only(stopped):
    proc, world = stopped
    flip_token(proc.data_dir, NS, "victim", 20)
    flip_token(proc.data_dir, NS, "victim2", 3)
    proc.start()
    with proc.client() as client:
        for agent_id in ("victim", "victim2"):
            with pytest.raises(CorruptRecord) as info:
                client.get_agent(NS, agent_id)
            assert info.value.code == grpc.StatusCode.DATA_LOSS
            assert repr(agent_id) in info.value.message and repr(NS) in info.value.message
        assert check_truth(client, world) == {(NS, "victim"), (NS, "victim2")}

        done = cli("store", "verify", store=proc.address)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"agents {NS}/victim:" in done.stdout and f"agents {NS}/victim2:" in done.stdout
        assert "2 corrupt index records" in done.stdout

        # deleted, or committed anew from generation 0: the agent is whole again
        assert client.delete_agent(NS, "victim2") == 0
        with pytest.raises(AgentNotFound):
            client.get_agent(NS, "victim2")
        truth = world.agents[NS, "victim"]
        with pytest.raises(AgentKVError) as info:
            client.commit_agent(
                namespace=NS,
                agent_id="victim",
                fingerprint=FP,
                expected_generation=1,
                token_ids=truth.token_ids,
                block_keys=truth.block_keys,
            )
        assert info.value.code == grpc.StatusCode.ABORTED and "lost" in info.value.message
        client.commit_agent(
            namespace=NS,
            agent_id="victim",
            fingerprint=FP,
            expected_generation=0,
            token_ids=truth.token_ids,
            block_keys=truth.block_keys,
        )
        again = client.get_agent(NS, "victim")
        assert list(again.token_ids) == list(truth.token_ids) and not again.missing_block_keys
        assert cli("store", "verify", store=proc.address).returncode == 0


def forget_counter(data_dir: Path, name: bytes) -> None:
    env = lmdb.open(str(data_dir / "index"), max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            assert txn.delete(name, db=env.open_db(b"counters", txn=txn, create=False))
    finally:
        env.close()


@pytest.mark.parametrize("damage", ["a token", "the whole record"])
def test_an_agent_made_anew_over_a_quarantined_manifest_starts_past_its_generation(stopped, damage):
    """A worker may still hold the agent whose manifest was quarantined, at its last
    generation: the agent committed anew under its id must not reach that generation, or
    the old copy passes for it (as for a deleted agent). Its generation is read from the
    bad record where it is legible, else the store's highest committed one is taken."""
    proc, world = stopped
    truth = world.agents[NS, "victim"]
    proc.start()
    with proc.client() as client:
        for generation in range(1, 4):  # the victim reaches generation 4
            client.commit_agent(
                namespace=NS,
                agent_id="victim",
                fingerprint=FP,
                expected_generation=generation,
                token_ids=truth.token_ids,
                block_keys=truth.block_keys,
            )
        assert client.get_agent(NS, "victim", summary_only=True).generation == 4
    assert proc.stop() == 0
    if damage == "a token":  # legible: its own generation counts, with no other word of it
        flip_token(proc.data_dir, NS, "victim", 20)
        forget_counter(proc.data_dir, b"generations_top")  # as an index from before it
    else:  # its payload's map header: what is left decodes to no record at all
        span = agent_span(proc.data_dir, NS, "victim")
        flip(proc.data_dir, [s + span.value_at + 8 for s in span.starts], 0x80)
    proc.start()
    with proc.client() as client:
        with pytest.raises(CorruptRecord):
            client.get_agent(NS, "victim")
        for agent_id in ("victim", "newcomer"):  # an agent new to the store starts past it too
            client.commit_agent(
                namespace=NS,
                agent_id=agent_id,
                fingerprint=FP,
                expected_generation=0,
                token_ids=truth.token_ids,
                block_keys=truth.block_keys,
            )
            assert client.get_agent(NS, agent_id, summary_only=True).generation > 4


def test_an_index_from_before_record_counts_is_recounted_at_its_first_start(stopped):
    """An index written before agent records counted against quotas (and before the
    highest committed generation was kept) has no such figures: its first start counts
    them from the agents, once, so its quotas cover its old records too."""
    from cache_store.index import GENERATIONS_TOP, Index

    proc, _ = stopped

    def figures() -> tuple[dict[str, int], int]:
        index = Index(proc.data_dir / "index", 1 << 30)
        try:
            with index.read() as txn:
                records = {ns: u["records"] for ns, u in index.namespaces(txn).items()}
                return records, index.counter(txn, GENERATIONS_TOP)
        finally:
            index.close()

    counted = figures()
    assert counted[1] == 1 and all(counted[0].values())
    index = Index(proc.data_dir / "index", 1 << 30)  # as the older store left it
    try:
        with index.write() as txn:
            assert txn.delete(b"records_counted", db=index.dbs["meta"])
            for namespace, usage in index.namespaces(txn).items():
                index.put_usage(txn, namespace, {**usage, "records": 0})
    finally:
        index.close()
    forget_counter(proc.data_dir, b"generations_top")
    assert figures() == ({ns: 0 for ns in counted[0]}, 0)
    proc.start()
    assert proc.stop() == 0
    assert figures() == counted


def test_a_bad_block_record_reads_as_missing_and_the_rest_serves(stopped):
    proc, world = stopped
    victim = world.agents[NS, "victim"]
    key = f"{NS}\0".encode() + victim.block_keys[2]
    (span,) = [s for s in spans(proc.data_dir) if s.table == "blocks" and s.key == key]
    flip(proc.data_dir, [s + span.value_at + len(span.value) // 2 for s in span.starts], 0x40)
    proc.start()
    with proc.client() as client:
        agent = client.get_agent(NS, "victim")
        assert list(agent.missing_block_keys) == [victim.block_keys[2]]
        assert check_truth(client, world) == set()
        report = client.call("VerifyBlocks", pb.VerifyBlocksRequest(namespace=NS))
        assert [(r.table, r.id) for r in report.corrupt_records] == [
            ("blocks", victim.block_keys[2].hex())
        ]
        # the worker's re-upload of the block brings it back, with its reference
        blocks, _ = make_chain(AGENTS[NS, "victim"], **SHAPE)
        client.put_blocks(NS, FP, blocks[2:])
        assert not client.get_agent(NS, "victim").missing_block_keys
        assert not client.call("VerifyBlocks", pb.VerifyBlocksRequest()).corrupt_records
        assert check_truth(client, world) == set()


def test_a_record_damaged_while_serving_fails_closed_and_is_quarantined(stopped):
    """The page cache changes under a running store: a point read answers DATA_LOSS, a
    listing skips the record, and either way it is quarantined there and then."""
    proc, world = stopped
    proc.start()
    flip_token(proc.data_dir, NS, "victim", 20)
    flip_token(proc.data_dir, NS, "victim2", 3)
    with proc.client() as client:
        with pytest.raises(CorruptRecord) as info:
            client.get_agent(NS, "victim")
        assert "failed its checksum" in info.value.message
        assert {a.agent_id for a in client.list_agents(NS)} == {"sibling"}
        for agent_id in ("victim", "victim2"):
            with pytest.raises(CorruptRecord) as info:
                client.get_agent(NS, agent_id)
            assert "quarantined" in info.value.message
        assert check_truth(client, world) == {(NS, "victim"), (NS, "victim2")}


def listed(client: StoreClient, method: str, request, items: str) -> list:
    """Every item of a listing, page by page, following next_page_token as the SDK does."""
    found = []
    while True:
        page = client.call(method, request)
        found += getattr(page, items)
        if not page.next_page_token:
            return found
        request.page_token = page.next_page_token


def test_a_listing_goes_on_past_a_bad_record(stopped):
    """Two to a page, the second block and the second agent damaged while serving: their
    pages come back short, and their tokens lead on to every record after them."""
    proc, world = stopped
    proc.start()
    keys = sorted(key for ns, key in world.blocks if ns == NS)
    (span,) = [
        s
        for s in spans(proc.data_dir)
        if s.table == "blocks" and s.key == f"{NS}\0".encode() + keys[1]
    ]
    flip(proc.data_dir, [s + span.value_at + len(span.value) // 2 for s in span.starts], 0x40)
    flip_token(proc.data_dir, NS, "victim", 20)  # of sibling, victim, victim2
    with proc.client() as client:
        blocks = listed(
            client, "ListBlocks", pb.ListBlocksRequest(namespace=NS, page_size=2), "blocks"
        )
        assert [b.key for b in blocks] == [keys[0], *keys[2:]]
        agents = listed(
            client, "ListAgents", pb.ListAgentsRequest(namespace=NS, page_size=2), "agents"
        )
        assert [a.agent_id for a in agents] == ["sibling", "victim2"]


def manifest_bytes(span: Span) -> dict[str, tuple[int, bool]]:
    """Offsets within a manifest's span by what they hold, and whether a flip there loses it
    (one in the key only misplaces a record that still checks out under the key it names)."""
    value, at = span.value, span.value_at
    assert at, "the manifest's key and value lie together in the file"
    return {
        "key: namespace": (0, False),
        "key: agent id": (at - 1, False),
        "checksum": (at, True),
        "field: namespace": (at + value.index(NS.encode(), 8), True),
        "field: agent id": (at + value.index(b"victim", 8), True),
        "field: token ids": (at + value.index(token_bytes(AGENTS[NS, "victim"])) + 81, True),
        "field: generation": (at + value.index(b"\xa1g") + 2, True),
    }


def test_a_flip_anywhere_in_a_manifest_is_caught(stopped, tmp_path):
    proc, world = stopped
    span = agent_span(proc.data_dir, NS, "victim")
    for what, (offset, loses) in manifest_bytes(span).items():
        copy = tmp_path / what.replace(" ", "").replace(":", "-")
        shutil.copytree(proc.data_dir, copy)
        flip(copy, [s + offset for s in span.starts], 0x01)
        store = StoreProcess(copy, tmp_path / f"{copy.name}.log").start()
        try:
            with store.client() as client:
                assert check_truth(client, world) == ({(NS, "victim")} if loses else set()), what
        finally:
            store.stop()


# random damage


FLIPS = 40


def test_random_flips_of_index_records_never_change_what_is_served(stopped, tmp_path):
    """Each flip on a fresh copy of the data dir: one byte of one record (any table: blocks,
    agents, children, unref, namespaces, counters, meta), at every copy LMDB left of it."""
    proc, world = stopped
    pristine = tmp_path / "pristine"
    shutil.copytree(proc.data_dir, pristine)
    records = spans(pristine)
    rng = random.Random(14_6)
    outcomes = {"served": 0, "lost": 0, "refused": 0}
    for trial in range(FLIPS):
        span = rng.choice(records)
        at = rng.randrange(span.length)
        copy = tmp_path / f"flip{trial}"
        shutil.copytree(pristine, copy)
        flip(copy, [s + at for s in span.starts], rng.randrange(1, 256))
        store = StoreProcess(copy, tmp_path / f"flip{trial}.log")
        if not started_or_refused(store):
            outcomes["refused"] += 1
            continue
        try:
            with store.client() as client:
                lost = check_truth(client, world)
        finally:
            assert store.stop() == 0
        outcomes["lost" if lost else "served"] += 1
        shutil.rmtree(copy)
    assert sum(outcomes.values()) == FLIPS and outcomes["served"] and outcomes["lost"], outcomes


# schema version


def set_meta(data_dir: Path, value: bytes | None) -> None:
    env = lmdb.open(str(data_dir / "index"), max_dbs=32)
    try:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(b"schema_version", db=meta)
            else:
                txn.put(b"schema_version", value, db=meta)
    finally:
        env.close()


def test_an_index_of_another_schema_version_stops_the_store_with_one_line(stopped):
    from cache_store.records import encode_u64

    proc, _ = stopped
    set_meta(proc.data_dir, encode_u64(b"schema_version", 2))
    assert not started_or_refused(proc)
    assert "schema version 2" in proc.log_path.read_text()
    set_meta(proc.data_dir, b"\x00" * 16)  # a damaged version record
    assert not started_or_refused(proc)
    assert "damaged schema record" in proc.log_path.read_text()


@pytest.mark.parametrize("loss", ["removed", "emptied"])
def test_a_lost_index_beside_block_files_stops_the_store_and_deletes_nothing(stopped, loss):
    """The red team's case: the index gone (its data.mdb removed, or cut to nothing) while
    blocks/ holds the payloads. The store started with a new index, called every payload
    an orphan and deleted them all, logging it at info level. It now refuses to start,
    saying so in one line, and every file stays; with the index put back, all is served."""
    proc, world = stopped
    mdb = proc.data_dir / "index" / "data.mdb"
    saved = mdb.read_bytes()
    files = sorted((proc.data_dir / "blocks").rglob("*.safetensors"))
    assert files
    if loss == "removed":
        mdb.unlink()
    else:
        mdb.write_bytes(b"")
    assert not started_or_refused(proc)
    said = proc.log_path.read_text()
    assert f"holds {len(files)} block files, but its index" in said and "was lost" in said
    assert sorted((proc.data_dir / "blocks").rglob("*.safetensors")) == files
    assert not started_or_refused(proc)  # the next start does not take the new index
    mdb.write_bytes(saved)
    proc.start()
    with proc.client() as client:
        assert check_truth(client, world) == set()


def test_the_start_up_sweep_removes_only_the_stores_own_temporary_files(tmp_path):
    """A --data-dir that was no store's (a project's folder): its tmp/ lost every file in it
    at the store's start. Only uploads cut short (*.part) go now."""
    data = tmp_path / "project"
    (data / "tmp").mkdir(parents=True)
    (data / "tmp" / "notes.txt").write_text("precious")
    (data / "tmp" / "upload.part").write_bytes(b"cut short")
    proc = StoreProcess(data, tmp_path / "store.log").start()
    try:
        assert sorted(p.name for p in (data / "tmp").iterdir()) == ["notes.txt"]
    finally:
        proc.stop()


def test_an_index_written_before_checksums_is_sealed_at_start_up(stopped):
    """Version 0 (no meta, no checksums: what agentkv wrote before) is migrated in place."""
    proc, world = stopped
    env = lmdb.open(str(proc.data_dir / "index"), max_dbs=32)
    try:
        for name in (b"blocks", b"agents", b"counters", b"unref", b"lost", b"namespaces"):
            db = env.open_db(name)
            with env.begin(write=True) as txn:
                for k, v in list(txn.cursor(db=db)):
                    txn.put(k, v[8:], db=db)
        children = env.open_db(b"children", dupsort=True)
        with env.begin(write=True) as txn:
            rows = list(txn.cursor(db=children))
            txn.drop(children, delete=False)
            for k, v in rows:
                txn.put(k, v[8:], db=children)
    finally:
        env.close()
    set_meta(proc.data_dir, None)
    proc.start()
    with proc.client() as client:
        assert check_truth(client, world) == set()
    assert proc.stop() == 0
    proc.start()
    with proc.client() as client:
        assert check_truth(client, world) == set()
    proc.stop()
