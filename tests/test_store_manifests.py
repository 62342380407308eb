"""Manifests: dedup across agents, compare-and-swap commits, forks, reference counts, prefixes."""

from __future__ import annotations

import threading

import pytest

from agentkv.errors import GenerationConflict
from cache_store.manifests import AgentView
from cache_store.records import AgentRecord
from cache_store.store import merge_pages
from tests.helpers import FP, NS, make_chain


def commit(store, agent_id, tokens, keys, generation=0, **extra):
    return store.commit_agent(
        namespace=NS,
        agent_id=agent_id,
        fingerprint=FP,
        expected_generation=generation,
        token_ids=tokens,
        block_keys=keys,
        **extra,
    )


def refcounts(store) -> dict[bytes, int]:
    return {b.key: b.refcount for b in store.list_blocks(NS)}


def test_shared_prefix_is_stored_once(store):
    shared = list(range(128))
    a_blocks, a_keys = make_chain(shared + [1000 + i for i in range(64)], block_tokens=64)
    b_blocks, b_keys = make_chain(shared + [2000 + i for i in range(64)], block_tokens=64)
    store.put_blocks(NS, FP, a_blocks)
    put_b = store.put_blocks(NS, FP, b_blocks)
    assert [r.deduplicated for r in put_b.blocks] == [True, True, False]
    assert a_keys[:2] == b_keys[:2]
    commit(store, "a", shared + [1000 + i for i in range(64)], a_keys)
    commit(store, "b", shared + [2000 + i for i in range(64)], b_keys)
    assert store.stats().num_blocks == 4
    counts = refcounts(store)
    assert [counts[k] for k in a_keys] == [2, 2, 1]
    assert counts[b_keys[2]] == 1


def test_commit_is_compare_and_swap(store):
    tokens = list(range(100))
    blocks, keys = make_chain(tokens, block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    assert commit(store, "marco", tokens, keys).generation == 1
    outcomes: list[object] = []
    barrier = threading.Barrier(8)

    def racer(i: int) -> None:
        barrier.wait()
        try:
            outcomes.append(commit(store, "marco", tokens, keys, generation=1, phase=f"p{i}"))
        except GenerationConflict as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wins = [o for o in outcomes if not isinstance(o, Exception)]
    losses = [o for o in outcomes if isinstance(o, GenerationConflict)]
    assert len(wins) == 1 and len(losses) == 7
    assert all(e.current_generation == 2 and "generation 2" in e.message for e in losses)
    assert store.get_agent(NS, "marco").phase == wins[0].phase


def test_recommit_moves_references(store):
    tokens = list(range(200))
    blocks, keys = make_chain(tokens, block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    commit(store, "marco", tokens[:128], keys[:2])
    m = commit(store, "marco", tokens, keys, generation=1)
    assert m.generation == 2 and list(m.block_keys) == keys
    assert [refcounts(store)[k] for k in keys] == [1, 1, 1, 1]
    commit(store, "marco", tokens[:64], keys[:1], generation=2)
    assert [refcounts(store)[k] for k in keys] == [1, 0, 0, 0]


def test_fork_shares_blocks_and_counts_references(store):
    tokens = list(range(300))
    blocks, keys = make_chain(tokens, block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    commit(store, "warden", tokens, keys)
    before = store.stats().num_blocks
    fork = store.fork_agent(NS, "warden", "analyst", num_tokens=150)
    assert list(fork.token_ids) == tokens[:150]
    assert list(fork.block_keys) == keys[:2]  # the block straddling token 150 is not shared
    assert fork.generation == 1 and store.stats().num_blocks == before
    assert [refcounts(store)[k] for k in keys] == [2, 2, 1, 1, 1]
    assert store.delete_agent(NS, "warden") == 5
    assert [refcounts(store)[k] for k in keys] == [1, 1, 0, 0, 0]
    assert [b.key for b in store.get_blocks(NS, FP, list(fork.block_keys))] == keys[:2]


def test_delete_checks_generation_when_asked(store):
    blocks, keys = make_chain(list(range(64)), block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    commit(store, "a", list(range(64)), keys)
    with pytest.raises(GenerationConflict) as err:
        store.delete_agent(NS, "a", expected_generation=3)
    assert err.value.current_generation == 1
    assert store.delete_agent(NS, "a", expected_generation=1) == 1


def test_manifest_keeps_uncovered_tail_tokens(store):
    tokens = list(range(100))
    blocks, keys = make_chain(tokens[:64], block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    m = commit(store, "a", tokens, keys, metadata={"role": "warden"}, phase="interrogation")
    got = store.get_agent(NS, "a", fingerprint=FP)
    assert list(got.token_ids) == tokens and list(got.block_num_tokens) == [64]
    assert dict(got.metadata) == {"role": "warden"} and got.phase == "interrogation"
    assert got.created_unix_ms == m.created_unix_ms <= got.updated_unix_ms


def test_longest_prefix_follows_full_and_partial_blocks(store):
    tokens = list(range(300))
    blocks, keys = make_chain(tokens, block_tokens=128)  # 128, 128, 44
    store.put_blocks(NS, FP, blocks)
    assert store.longest_prefix(NS, FP, tokens + [7, 8]).num_tokens == 300
    hit = store.longest_prefix(NS, FP, tokens[:270] + [9999])
    assert hit.num_tokens == 256 and list(hit.keys) == keys[:2]
    assert list(store.longest_prefix(NS, FP, tokens[:300]).block_num_tokens) == [128, 128, 44]
    assert store.longest_prefix(NS, FP, [5, 6, 7]).num_tokens == 0
    assert store.longest_prefix(NS, FP + "-other", tokens).num_tokens == 0


def test_longest_prefix_finds_a_chain_cut_otherwise_past_a_longer_first_block(store):
    """The reviewer's: chains [1, 2, 3, 4] and [1, 2] -> [3, 4] -> [5, 6]. The longest first
    block was taken and never given up: 4 tokens found of the 6 stored (a raw client's
    spans, or two workers cutting at different --block-tokens under one fingerprint)."""
    whole, whole_keys = make_chain([1, 2, 3, 4], block_tokens=4)
    cut, keys = make_chain([1, 2, 3, 4, 5, 6], block_tokens=2)
    store.put_blocks(NS, FP, whole)
    store.put_blocks(NS, FP, cut)
    hit = store.longest_prefix(NS, FP, [1, 2, 3, 4, 5, 6, 7])
    assert hit.num_tokens == 6 and list(hit.keys) == keys
    hit = store.longest_prefix(NS, FP, [1, 2, 3, 4, 9])  # as long either way: one block
    assert hit.num_tokens == 4 and list(hit.keys) == whole_keys


def test_list_agents_pages(store):
    blocks, keys = make_chain(list(range(64)), block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    for i in range(130):
        commit(store, f"agent-{i:03d}", list(range(64)), keys)
    ids = [a.agent_id for a in store.list_agents(NS)]
    assert ids == [f"agent-{i:03d}" for i in range(130)]
    assert store.stats().num_agents == 130


def view(agent_id: str, where: str) -> AgentView:
    return AgentView(AgentRecord(NS, agent_id, FP, [], [], [], phase=where), [], 0)


@pytest.mark.parametrize(
    "here, here_after, there, there_after, limit, page, after",
    [
        ("ac", "c", "bcd", "", 3, "abc", "c"),  # this store's listing stopped at c
        ("e", "", "ab", "b", 2, "ab", "b"),  # the bucket's stopped at b
        ("ac", "", "bd", "", 3, "abc", "c"),  # both at their ends, more than a page
        ("ac", "", "bd", "", 4, "abcd", ""),
    ],
)
def test_a_page_of_two_listings_skips_no_agent(
    here, here_after, there, there_after, limit, page, after
):
    """With an object store, ListAgents merges this store's page and the bucket's: the next
    page starts where the first of the two listings stopped, so neither skips an agent; this
    store's copy of an agent wins."""
    local = [view(a, "here") for a in here]
    bucket = [view(a, "there") for a in there]
    views, token = merge_pages(local, here_after, bucket, there_after, limit)
    assert ("".join(v.record.agent_id for v in views), token) == (page, after)
    assert all(v.record.phase == "here" for v in views if v.record.agent_id in here)


def test_reuploaded_quarantined_block_keeps_its_references(store, store_process):
    from agentkv.errors import CorruptBlock

    tokens = list(range(128))
    blocks, keys = make_chain(tokens, block_tokens=64)
    store.put_blocks(NS, FP, blocks)
    commit(store, "a", tokens, keys)
    store.fork_agent(NS, "a", "b")
    victim = (
        store_process.data_dir / "blocks" / NS / keys[1].hex()[:2] / f"{keys[1].hex()}.safetensors"
    )
    victim.unlink()
    with pytest.raises(CorruptBlock):
        list(store.get_blocks(NS, FP, keys))
    assert list(store.get_agent(NS, "a").missing_block_keys) == keys[1:]
    store.delete_agent(NS, "b")  # releases a reference on the quarantined block too
    store.put_blocks(NS, FP, blocks[1:])
    assert refcounts(store) == {keys[0]: 1, keys[1]: 1}
    assert not store.get_agent(NS, "a").missing_block_keys
    store.delete_agent(NS, "a")
    assert refcounts(store) == {keys[0]: 0, keys[1]: 0}
