"""Quota: LRU eviction of unreferenced blocks, then of cold agents; leases protect blocks."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentkv.errors import BlockNotFound, DiskFull, NamespaceQuotaExceeded, QuotaExceeded
from agentkv.v1 import store_pb2 as pb
from cache_store.store import CacheStore
from tests.helpers import (
    FP,
    NS,
    StoreProcess,
    cli,
    local_store,
    make_chain,
    put_items,
    same_bytes,
)

BLOCK_TOKENS = 64


def block_bytes(store_client) -> int:
    blocks, _ = make_chain(list(range(BLOCK_TOKENS)), block_tokens=BLOCK_TOKENS, seed=99)
    put = store_client.put_blocks("probe", FP, blocks)
    return put.blocks[0].num_bytes


@pytest.fixture(scope="module")
def block_size(tmp_path_factory) -> int:
    """The payload bytes of one test block, as the store counts them."""
    root = tmp_path_factory.mktemp("probe")
    probe = StoreProcess(root / "data", root / "probe.log").start()
    with probe.client() as c:
        size = block_bytes(c)
    probe.stop()
    return size


@pytest.fixture
def quota_store(tmp_path, request, block_size):
    """A store whose quota holds 4 blocks; parametrize with extra args via indirect marks."""
    args = getattr(request, "param", [])
    quota = ["--quota", str(4 * block_size + block_size // 2), *args]
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log", extra_args=quota).start()
    yield proc, block_size
    proc.stop()


@pytest.fixture
def ns_quota_store(tmp_path, request, block_size):
    """A store where namespace team-a holds 3 blocks (others unlimited); extra args by param."""
    args = getattr(request, "param", [])
    quota = ["--namespace-quota", f"team-a={3 * block_size + block_size // 2}", *args]
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log", extra_args=quota).start()
    yield proc
    proc.stop()


def put_agent(client, agent_id: str, first_token: int, commit: bool = True, ns: str = NS):
    tokens = list(range(first_token, first_token + BLOCK_TOKENS))
    blocks, keys = make_chain(tokens, block_tokens=BLOCK_TOKENS, seed=first_token)
    if commit:
        client.save_agent(ns, agent_id, FP, tokens, blocks)
    else:
        client.put_blocks(ns, FP, blocks)
    return blocks, keys


def test_unreferenced_blocks_are_evicted_oldest_first(quota_store):
    proc, _ = quota_store
    with proc.client() as c:
        loose = []
        for i in range(3):
            blocks, _ = make_chain([50_000 + 100 * i] * BLOCK_TOKENS, seed=i)
            put = c.put_blocks(NS, FP, blocks)
            c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
            loose.append(put.blocks[0].key)
        kept, kept_keys = put_agent(c, "marco", 0)
        list(c.get_blocks(NS, FP, loose[:1]))  # touch the oldest: it becomes the newest
        gone_after = []
        for i in range(3):
            put_agent(c, f"agent{i}", 1000 * (i + 1))
            remaining = {b.key for b in c.list_blocks(NS)}
            gone_after.append([k for k in loose if k not in remaining])
            assert set(kept_keys) <= remaining  # referenced: never evicted by the block pass
        assert gone_after == [[loose[1]], [loose[1], loose[2]], loose]
        assert c.stats().num_evicted_blocks == 3
        assert same_bytes(kept[0], next(c.get_blocks(NS, FP, kept_keys)))


def test_quota_full_of_referenced_blocks_is_resource_exhausted(quota_store):
    proc, _ = quota_store
    with proc.client() as c:
        for i in range(4):
            put_agent(c, f"agent{i}", 1000 * i)
        before = c.stats()
        with pytest.raises(QuotaExceeded) as err:
            put_agent(c, "one-too-many", 9000)
        assert "quota" in err.value.message and "nothing can be evicted" in err.value.message
        after = c.stats()
        assert (after.num_blocks, after.num_agents) == (before.num_blocks, before.num_agents)
        assert not list((proc.data_dir / "tmp").iterdir())


def test_leased_blocks_survive_eviction(quota_store):
    proc, _ = quota_store
    with proc.client() as c:
        blocks, keys = put_agent(c, "reader", 0, commit=False)  # put lease held
        located = c.call(
            "LocateBlocks", pb.LocateBlocksRequest(namespace=NS, fingerprint=FP, keys=keys)
        )
        for i in range(3):
            put_agent(c, f"agent{i}", 1000 * (i + 1))
        with pytest.raises(QuotaExceeded):
            put_agent(c, "agent3", 4000)
        assert {b.key for b in c.list_blocks(NS)} >= set(keys)
        c.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=located.lease_id))
        assert same_bytes(blocks[0], c.read_blocks_local(NS, FP, keys)[0])


@pytest.mark.parametrize("quota_store", [["--evict-agents"]], indirect=True)
def test_evict_agents_drops_the_least_recently_used_agent(quota_store):
    proc, _ = quota_store
    with proc.client() as c:
        for i in range(4):
            put_agent(c, f"agent{i}", 1000 * i)
        c.get_agent(NS, "agent0")  # agent1 is now the coldest
        put_agent(c, "newcomer", 9000)
        ids = {a.agent_id for a in c.list_agents(NS)}
        assert ids == {"agent0", "agent2", "agent3", "newcomer"}
        assert c.stats().num_evicted_agents == 1


def test_collect_garbage_keeps_referenced_and_leased(store):
    blocks, keys = make_chain(list(range(200)), block_tokens=64)
    put = store.put_blocks(NS, FP, blocks)
    store.commit_agent(
        namespace=NS, agent_id="a", fingerprint=FP, token_ids=list(range(64)), block_keys=keys[:1]
    )
    assert store.call("CollectGarbage", pb.CollectGarbageRequest()).num_blocks_deleted == 0
    store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
    gc = store.call("CollectGarbage", pb.CollectGarbageRequest(namespace=NS))
    assert gc.num_blocks_deleted == 3 and gc.num_bytes_freed > 0
    assert [b.key for b in store.list_blocks(NS)] == keys[:1]


def test_a_tenant_s_collection_removes_its_own_orphan_files_only(store_process):
    """CollectGarbage for one namespace swept every namespace's payload files for orphans,
    and held every put's publishing while it read every tenant's blocks: one tenant's
    collection reached into the others' (its reply counted their files). It sweeps its
    own namespace now; a store-wide collection (no namespace) sweeps them all."""
    name = f"{'ab' * 32}.safetensors"
    orphans = {ns: store_process.data_dir / "blocks" / ns / "ab" / name for ns in ("a", "b")}
    with store_process.client() as c:
        for ns in orphans:
            put_agent(c, "kept", 0, ns=ns)
            orphans[ns].parent.mkdir(parents=True, exist_ok=True)
            orphans[ns].write_bytes(b"left by a crash")
        gc = c.call("CollectGarbage", pb.CollectGarbageRequest(namespace="a"))
        assert gc.num_orphans_removed == 1
        assert not orphans["a"].exists() and orphans["b"].exists()
        gc = c.call("CollectGarbage", pb.CollectGarbageRequest())
        assert gc.num_orphans_removed == 1 and not orphans["b"].exists()
        assert [len(list(c.list_blocks(ns))) for ns in orphans] == [1, 1]  # theirs stay


def test_a_put_stream_past_what_its_reply_can_name_is_refused_at_that_block(tmp_path):
    """The reviewer's: a PutBlocks stream of more blocks than its reply (one result each)
    can name in a message stored and leased them all, then gRPC refused the reply
    (RESOURCE_EXHAUSTED, no agentkv-error): the lease's id never reached the client. The
    block past what the reply can name is refused, before it is stored, with the reason.
    (In one process, the message limit lowered to name 100.)"""
    from agentkv.errors import ReplyTooLarge

    store = local_store(tmp_path / "data", max_message_bytes=64 * 100, max_chunk_bytes=1024)
    try:
        tiny = {"num_layers": 1, "kv_heads": 1}
        blocks, keys = make_chain(list(range(101)), block_tokens=1, **tiny)
        with pytest.raises(ReplyTooLarge, match="takes at most 100 blocks"):
            store.put_stream(put_items(NS, FP, blocks))
        assert store.stats()["num_blocks"] == 100 and store.stats()["num_leases"] == 0
        first, _, _ = store.put_stream(put_items(NS, FP, blocks[:100]))  # again, as it says
        rest, lease, _ = store.put_stream(put_items(NS, FP, blocks[100:]))
        assert [r.key for r in first + rest] == keys and all(r.deduplicated for r in first)
        assert lease
    finally:
        store.close()


@pytest.mark.parametrize("meanwhile", ["collected", "shared"])
def test_a_commit_s_chain_changed_between_its_check_and_its_write(tmp_path, meanwhile):
    """A commit's chain is checked in a read transaction now, before the write (decoding a
    long chain held the write every tenant's put waits for); the write confirms each block
    unchanged. Between the two: its blocks collected, and the commit is refused, nothing
    written; or committed by another agent too (each block's refcount changed), and it is
    checked again and taken, both agents counted. (In one process: the change lands in
    the gap.)"""
    from cache_store.manifests import Commit

    store = local_store(tmp_path / "data")
    try:
        tokens = list(range(2 * BLOCK_TOKENS))
        blocks, keys = make_chain(tokens, block_tokens=BLOCK_TOKENS)
        _, lease, _ = store.put_stream(put_items(NS, FP, blocks))
        store.leases.release(lease)  # unleased and no agent's: collectable
        write, gap = store.index.write, []

        def in_the_gap():
            if not gap:  # the commit's own write, the first: the change lands before it
                gap.append(None)
                gap[0] = (
                    store.collect_garbage(NS)[0]
                    if meanwhile == "collected"
                    else store.commit_agent(Commit(NS, "other", FP, 0, tokens, keys))
                )
            return write()

        store.index.write = in_the_gap
        if meanwhile == "collected":
            with pytest.raises(BlockNotFound, match=r"block_keys\[0\]"):
                store.commit_agent(Commit(NS, "a", FP, 0, tokens, keys))
            assert gap == [2] and store.list_agents(NS, "", 10)[0] == []
            return
        view = store.commit_agent(Commit(NS, "a", FP, 0, tokens, keys))
        assert view.record.block_keys == keys and view.missing_block_keys == []
        blocks_now = {b.key: b.refcount for b in store.list_blocks(NS, b"", 10)[0]}
        assert blocks_now == {k: 2 for k in keys}
    finally:
        store.index.write = write
        store.close()


def test_a_block_s_parent_stays_while_the_block_comes_in(tmp_path):
    """A block's parent, stored by an earlier stream whose lease was let go, was checked
    when the block's header came but not leased: a collection while the block's bytes came
    in deleted it (unleased, no agent's), the put answered OK, and the commit of the chain
    found the parent gone. It is leased with the block now. (In one process: the
    collection runs between the header and the bytes.)"""
    from cache_store.manifests import Commit

    store = local_store(tmp_path / "data")
    try:
        tokens = list(range(2 * BLOCK_TOKENS))
        (parent, child), keys = make_chain(tokens, block_tokens=BLOCK_TOKENS)
        _, lease, _ = store.put_stream(put_items(NS, FP, [parent]))
        store.leases.release(lease)
        collected = []

        def child_stream():
            items = put_items(NS, FP, [child])
            yield next(items)  # the header: its parent is found stored
            collected.append(store.collect_garbage(NS)[0])
            yield from items

        _, lease, _ = store.put_stream(child_stream())
        assert collected == [0]
        store.commit_agent(Commit(NS, "a", FP, 0, tokens, keys))
        store.leases.release(lease)
        assert [b.key for b in store.list_blocks(NS, b"", 10)[0]] == sorted(keys)
    finally:
        store.close()


def test_full_disk_is_resource_exhausted_and_nothing_is_corrupt(small_disk, tmp_path):
    proc = StoreProcess(small_disk("3m") / "data", tmp_path / "store.log").start()
    try:
        with proc.client() as c:
            stored = []
            with pytest.raises(DiskFull) as err:
                for i in range(200):
                    stored.append(put_agent(c, f"agent{i}", 1000 * i))
            assert err.value.code.name == "RESOURCE_EXHAUSTED" and "disk" in err.value.message
            assert not list((proc.data_dir / "tmp").iterdir())
            verify = c.call("VerifyBlocks", pb.VerifyBlocksRequest())
            assert not verify.corrupt and verify.num_checked == len(stored)
            for blocks, keys in stored:
                assert same_bytes(blocks[0], next(c.get_blocks(NS, FP, keys)))
    finally:
        proc.stop()


def test_a_disk_filled_by_agent_records_is_resource_exhausted(small_disk, tmp_path):
    """The red team's INTERNAL: records alone (no block) filled a tmpfs, and LMDB's commit
    failed with "Input/output error", which went out as an internal error. A full disk under
    an index write is RESOURCE_EXHAUSTED (DiskFull), and what was committed stays."""
    proc = StoreProcess(small_disk("12m") / "data", tmp_path / "store.log").start()
    fat = [49151] * (1 << 19)  # a record of 2 MiB
    try:
        with proc.client() as c:
            kept = 0
            with pytest.raises(DiskFull) as err:
                for i in range(12):
                    c.commit_agent(
                        namespace=NS,
                        agent_id=f"fat{i}",
                        fingerprint=FP,
                        token_ids=fat,
                        block_keys=[],
                    )
                    kept += 1
            assert err.value.code.name == "RESOURCE_EXHAUSTED", err.value.message
            assert 0 < kept < 12
            assert [len(c.get_agent(NS, f"fat{i}").token_ids) for i in range(kept)] == [
                len(fat)
            ] * kept
    finally:
        proc.stop()


def loose_blocks(client, ns: str, first_token: int, count: int) -> list[bytes]:
    """Puts `count` unreferenced blocks into `ns` and lets their leases go; their keys."""
    keys = []
    for i in range(count):
        blocks, _ = make_chain([first_token + i] * BLOCK_TOKENS, seed=first_token + i)
        put = client.put_blocks(ns, FP, blocks)
        client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
        keys.append(put.blocks[0].key)
    return keys


def test_a_namespace_at_its_quota_is_refused_while_others_write_on(ns_quota_store, block_size):
    with ns_quota_store.client() as c:
        kept = [put_agent(c, f"a{i}", 1000 * i, ns="team-a") for i in range(3)]
        with pytest.raises(QuotaExceeded) as err:
            put_agent(c, "a3", 3000, ns="team-a")
        assert err.value.code.name == "RESOURCE_EXHAUSTED"
        assert "namespace 'team-a' quota" in err.value.message
        assert "nothing can be evicted" in err.value.message
        for i in range(5):  # team-b has no quota of its own: five blocks go in
            put_agent(c, f"b{i}", 1000 * i, ns="team-b")
        usage = {n.name: n for n in c.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces}
        assert (usage["team-a"].num_agents, usage["team-a"].num_blocks) == (3, 3)
        assert usage["team-a"].quota_bytes == 3 * block_size + block_size // 2
        assert (usage["team-b"].num_blocks, usage["team-b"].quota_bytes) == (5, 0)
        for blocks, keys in kept:
            assert same_bytes(blocks[0], next(c.get_blocks("team-a", FP, keys)))
        assert not list((ns_quota_store.data_dir / "tmp").iterdir())
    listing = cli("store", "namespaces", store=ns_quota_store.address).stdout
    assert re.search(r"^team-a +3 +3 .*KiB +[\d.]+ KiB +none *$", listing, re.M), listing
    assert re.search(r"^team-b +5 +5 .* none +none *$", listing, re.M), listing


def test_a_namespace_evicts_only_its_own_unreferenced_blocks(ns_quota_store):
    with ns_quota_store.client() as c:
        theirs = loose_blocks(c, "team-b", 50_000, 3)  # the oldest blocks in the store
        ours = loose_blocks(c, "team-a", 60_000, 2)
        for i in range(3):
            put_agent(c, f"a{i}", 1000 * i, ns="team-a")
        assert not {b.key for b in c.list_blocks("team-a")} & set(ours)
        assert {b.key for b in c.list_blocks("team-b")} == set(theirs)
        assert c.stats().num_evicted_blocks == 2


@pytest.mark.parametrize("ns_quota_store", [["--evict-agents"]], indirect=True)
def test_a_namespace_evicts_only_its_own_agents(ns_quota_store):
    with ns_quota_store.client() as c:
        put_agent(c, "elder", 9000, ns="team-b")  # the coldest agent in the store
        for i in range(3):
            put_agent(c, f"a{i}", 1000 * i, ns="team-a")
        c.get_agent("team-a", "a0")  # a1 is now team-a's coldest
        put_agent(c, "newcomer", 5000, ns="team-a")
        assert {a.agent_id for a in c.list_agents("team-a")} == {"a0", "a2", "newcomer"}
        assert [a.agent_id for a in c.list_agents("team-b")] == ["elder"]


def test_agent_records_count_against_a_namespace_quota(ns_quota_store, block_size):
    """The red team's attack: agent records of many token ids and no block, or forks that
    share one block, grew the index (190 MB of a 200 MB disk) while the namespace's usage
    said 0 bytes, and the full disk then cost another tenant its agents. A record's bytes
    count against its namespace's quota now."""
    fat = [49151] * block_size  # 4 bytes a token id: a record of four blocks' bytes
    with ns_quota_store.client() as c:
        with pytest.raises(NamespaceQuotaExceeded, match="agent record"):
            c.commit_agent(
                namespace="team-a", agent_id="fat", fingerprint=FP, token_ids=fat, block_keys=[]
            )
        c.commit_agent(  # another tenant's, with no quota, goes in
            namespace="team-b", agent_id="fat", fingerprint=FP, token_ids=fat, block_keys=[]
        )
        put_agent(c, "a0", 0, ns="team-a")
        record = 4 * BLOCK_TOKENS  # a fork's token ids alone
        most = (3 * block_size + block_size // 2) // record
        forks = 0
        with pytest.raises(NamespaceQuotaExceeded, match="agent record"):
            while forks <= most:
                c.fork_agent("team-a", "a0", f"f{forks}")
                forks += 1
        assert 0 < forks < most
        assert [a.agent_id for a in c.list_agents("team-b")] == ["fat"]
        listed = {
            n.name: n for n in c.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces
        }
        assert listed["team-b"].num_record_bytes > 4 * len(fat)  # the quota's figure, shown
        a = listed["team-a"]
        assert forks * record < a.num_record_bytes <= a.quota_bytes - a.num_bytes


def test_a_fork_past_a_namespace_quota_first_evicts_within_it(ns_quota_store, block_size):
    """A fork's record needs room like a commit's: the namespace's unreferenced blocks go
    first (before: refused at once while they held the quota)."""
    with ns_quota_store.client() as c:
        put_agent(c, "a0", 0, ns="team-a")
        loose_blocks(c, "team-a", 70_000, 2)  # 3 blocks of 3.5 now: room for few records
        forks = 0
        with pytest.raises(NamespaceQuotaExceeded, match="agent record"):
            while forks < 1000:
                c.fork_agent("team-a", "a0", f"f{forks}")
                forks += 1
        assert c.stats().num_evicted_blocks == 2  # both loose blocks gave way to records
        assert len(list(c.list_agents("team-a"))) == forks + 1


@pytest.mark.parametrize("ns_quota_store", [["--evict-agents"]], indirect=True)
def test_with_evict_agents_forks_past_a_namespace_quota_evict_its_coldest_agents(
    ns_quota_store, block_size
):
    """Forks share their blocks: deleting one frees no block, only its record, which the
    quota counts. With --evict-agents the namespace's least recently used agents give way to
    new records (before, the fork was refused, as without the flag); another tenant's stay."""
    with ns_quota_store.client() as c:
        put_agent(c, "elder", 9000, ns="team-b")  # the coldest agent in the store
        put_agent(c, "a0", 0, ns="team-a")
        tokens = c.get_agent("team-a", "a0").token_ids
        most = (3 * block_size + block_size // 2) // (4 * BLOCK_TOKENS)
        forks, source = 0, "a0"
        while c.stats().num_evicted_agents < 3:
            assert forks < most, "no agent gave way to the forks' records"
            c.fork_agent("team-a", source, f"f{forks}")
            forks, source = forks + 1, f"f{forks}"
        gone = {"a0", "f0", "f1"}  # the coldest three, in that order
        assert not gone & {a.agent_id for a in c.list_agents("team-a")}
        assert len(list(c.list_agents("team-a"))) == forks + 1 - len(gone)
        assert c.get_agent("team-a", source).token_ids == tokens
        assert [a.agent_id for a in c.list_agents("team-b")] == ["elder"]
        listed = {
            n.name: n for n in c.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces
        }
        a = listed["team-a"]
        assert a.num_bytes + a.num_record_bytes <= a.quota_bytes


@pytest.mark.parametrize("ns_quota_store", [["--evict-agents"]], indirect=True)
def test_a_commit_past_a_namespace_quota_never_evicts_the_agent_it_commits(
    ns_quota_store, block_size
):
    """A commit whose record grows past the quota makes room from other agents, never its
    own: the coldest agent with a block of its own was evicted even when it was the one
    being committed (the commit then failed: its agent was gone), where only the fallback
    for agents sharing their blocks spared it."""
    with ns_quota_store.client() as c:
        tokens = list(range(BLOCK_TOKENS))
        blocks, _ = make_chain(tokens, block_tokens=BLOCK_TOKENS, seed=0)
        _, a0 = c.save_agent("team-a", "a0", FP, tokens, blocks)  # the coldest, unread since
        for i in (1, 2):  # 3 of the 3.5 blocks
            put_agent(c, f"a{i}", 1000 * i, ns="team-a")
        tail = list(range(5000, 5000 + block_size // 4))  # its record: past the quota
        grown = c.commit_agent(
            namespace="team-a",
            agent_id="a0",
            fingerprint=FP,
            expected_generation=a0.generation,
            token_ids=[*tokens, *tail],
            block_keys=list(a0.block_keys),
        )
        assert grown.generation > a0.generation
        assert len(c.get_agent("team-a", "a0").token_ids) == BLOCK_TOKENS + len(tail)
        assert c.stats().num_evicted_agents == 1
        assert sorted(a.agent_id for a in c.list_agents("team-a")) == ["a0", "a2"]


def test_an_agent_committed_after_eviction_chose_it_is_kept(tmp_path, block_size):
    """Eviction picks its agent from one read of the index, then deletes it in a write of
    its own: one committed between the two (its client told its commit took) was deleted
    all the same, whatever its generation. Now the delete expects the generation it chose,
    and the next agent goes instead. (In one process: the commit lands in that gap.)"""
    from tests.test_object_store import NS as TIER_NS
    from tests.test_object_store import commit, put_blocks

    store = local_store(tmp_path / "data", quota_bytes=4 * block_size, evict_agents=True)
    try:
        chains = {}
        for i, agent in enumerate(("a0", "a1")):  # a0 the coldest
            tokens = list(range(1000 * i, 1000 * i + BLOCK_TOKENS))
            blocks, keys = make_chain(tokens, block_tokens=BLOCK_TOKENS, seed=i)
            put_blocks(store, blocks)
            chains[agent] = (tokens, keys, commit(store, agent, tokens, keys, 0).record.generation)
        generations = {agent: chain[2] for agent, chain in chains.items()}
        asked = store.capacity._blocks_in_bucket_now

        def committed_meanwhile(agent):
            if agent.agent_id == "a0" and chains["a0"][2] == agent.generation:
                tokens, keys, generation = chains["a0"]  # a turn's token past its blocks:
                grown = commit(store, "a0", [*tokens, 7], keys, generation).record
                chains["a0"] = (grown.token_ids, keys, grown.generation)
            return asked(agent)

        store.capacity._blocks_in_bucket_now = committed_meanwhile
        with store.capacity._lock:
            assert store.capacity._evict_one_agent(None)
        [kept] = store.list_agents(TIER_NS, "", 10)[0]
        assert (kept.record.agent_id, kept.record.generation) == ("a0", chains["a0"][2])
        assert chains["a0"][2] > generations["a0"]
    finally:
        store.close()


@pytest.mark.parametrize("ns_quota_store", [["--evict-agents"]], indirect=True)
def test_a_put_past_a_namespace_quota_evicts_no_agent_for_its_record_alone(ns_quota_store):
    """Only a record's own growth takes other agents' records as room: a put of blocks still
    evicts only agents whose deletion frees a block (review: the agents sharing one block
    went one by one, records first, for a put's room)."""
    with ns_quota_store.client() as c:
        put_agent(c, "a0", 0, ns="team-a")
        for fork in ("f0", "f1"):
            c.fork_agent("team-a", "a0", fork)  # each shares a0's block: none frees it
        for i in range(2):  # held by their leases: not evictable
            blocks, _ = make_chain([70_000 + i] * BLOCK_TOKENS, seed=70_000 + i)
            c.put_blocks("team-a", FP, blocks)
        with pytest.raises(NamespaceQuotaExceeded):
            put_agent(c, "x", 9000, commit=False, ns="team-a")
        assert sorted(a.agent_id for a in c.list_agents("team-a")) == ["a0", "f0", "f1"]
        assert c.stats().num_evicted_agents == 0


def test_a_record_past_both_quotas_makes_room_under_each(tmp_path, block_size):
    """A commit whose record passes the namespace's quota, then (room made there) the
    store's, makes room under each in turn (before: refused at the second)."""
    args = ["--quota", str(4 * block_size + block_size // 2)]
    args += ["--namespace-quota", f"team-a={3 * block_size + block_size // 5}"]
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log", extra_args=args).start()
    try:
        with proc.client() as c:
            put_agent(c, "a0", 0, ns="team-a")
            loose_blocks(c, "team-a", 70_000, 1)
            loose_blocks(c, "team-b", 80_000, 2)
            fat = [49151] * (2 * block_size // 5)  # 4 bytes a token id: 1.6 blocks' bytes
            c.commit_agent(
                namespace="team-a", agent_id="fat", fingerprint=FP, token_ids=fat, block_keys=[]
            )
            assert c.get_agent("team-a", "fat").token_ids == fat
            assert c.stats().num_evicted_blocks == 2  # team-a's loose block, then a team-b one
    finally:
        proc.stop()


def test_a_default_namespace_quota_and_an_override(tmp_path, block_size):
    args = ["--namespace-quota", f"*={block_size + block_size // 2}"]
    args += ["--namespace-quota", f"big={3 * block_size}"]
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log", extra_args=args).start()
    try:
        with proc.client() as c:
            for ns in ("small", "other"):
                put_agent(c, "one", 0, ns=ns)
                with pytest.raises(QuotaExceeded, match=f"namespace '{ns}' quota"):
                    put_agent(c, "two", 1000, ns=ns)
            put_agent(c, "one", 0, ns="big")
            put_agent(c, "two", 1000, ns="big")
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "flag, message",
    [
        ("team-a", "expected NAMESPACE=SIZE"),
        ("=1G", "expected NAMESPACE=SIZE"),
        ("team-a=lots", "invalid size 'lots'"),
        ("Team A=1G", "invalid namespace 'Team A'"),
        ("team-a=0", "must be > 0"),
    ],
)
def test_bad_namespace_quota_flags_are_refused(flag, message, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cache_store",
            "--data-dir",
            str(tmp_path),
            "--namespace-quota",
            flag,
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and message in run.stderr


# races of a collection with readers, on the store's domain in this process (no client can
# steer a thread between two statements of the store)


@pytest.fixture
def domain(tmp_path) -> Iterator[CacheStore]:
    store = local_store(tmp_path / "data")
    yield store
    store.close()


def put_loose(store: CacheStore, token: int) -> bytes:
    """Puts one block and lets its lease go: unreferenced and collectable. Its key."""
    blocks, (key,) = make_chain([token] * BLOCK_TOKENS, seed=token)
    _, lease_id, _ = store.put_stream(put_items(NS, FP, blocks))
    store.leases.release(lease_id)
    return key


def test_a_lease_taken_as_collection_checks_keeps_the_file(domain):
    """A reader takes its lease the moment after the collection finds the block unleased:
    the block is then either gone for the reader too or kept with its file, never leased to
    a file the collection deletes."""
    key = put_loose(domain, 7)
    located = []
    is_held = domain.leases.is_held

    def reader_right_after(block):
        held = is_held(block)
        if not located:
            located.append(domain.locate(NS, FP, [key], [], 0))
        return held

    domain.leases.is_held = reader_right_after
    domain.collect_garbage(NS)
    for _, _, (selection,) in located:
        assert Path(domain.path_of(selection.record)).exists()
    path = domain.payloads.path(domain.payloads.relpath(NS, key))
    assert is_held((NS, key)) == path.exists()


def test_a_block_collected_between_lookup_and_lease_is_not_found(domain):
    """A reader looked the block up, then the collection deleted it, then the reader's lease
    came: NOT_FOUND, and no lease left, instead of a path to a deleted file."""
    key = put_loose(domain, 8)
    looked_up, collected = threading.Event(), threading.Event()
    select = domain.reads.select

    def select_then_wait(*args):
        selections = select(*args)
        looked_up.set()
        assert collected.wait(60)
        return selections

    domain.reads.select = select_then_wait
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(domain.locate, NS, FP, [key], [], 0)
        assert looked_up.wait(60)
        assert domain.collect_garbage(NS)[0] == 1
        collected.set()
        with pytest.raises(BlockNotFound) as err:
            reader.result(60)
    assert key.hex() in err.value.message and "was deleted" in err.value.message
    assert len(domain.leases) == 0


def test_a_collection_counts_only_the_bytes_it_frees_here(domain):
    """A demoted block (its payload only in the object store, its file gone from here) is
    deleted with the rest, but frees no local bytes."""
    demoted, local = put_loose(domain, 9), put_loose(domain, 10)
    with domain.index.write() as txn:
        record = domain.index.set_local(txn, domain.index.get_block(txn, NS, demoted), False)
    domain.payloads.delete(record)
    with domain.index.read() as txn:
        size = domain.index.get_block(txn, NS, local).num_bytes
    assert domain.collect_garbage(NS)[:2] == (2, size)
