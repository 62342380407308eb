"""Retention: agents nobody has read or written for their namespace's --agent-idle are
deleted, with the blocks no other agent shares, by the store on its own.

The rules run against the store in this process under a clock the test moves (an hour
passes in an instant); the flags, the sweep thread, the stats and the CLI against a real
store process; what a worker and its caller see of an agent deleted while the worker held
it against real store and worker processes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentNotFound
from agentkv.v1 import store_pb2 as pb
from cache_store import capacity, idle
from cache_store import store as store_module
from cache_store.idle import Retention
from cache_store.manifests import Commit
from tests.helpers import (
    FP,
    StoreProcess,
    cli,
    local_store,
    make_chain,
    put_items,
    until,
)

HOUR = 3600.0
LEASE = ["--lease-seconds", "1"]  # so that 10 s is a retention the store takes
BLOCK = 64


class Clock:
    """Unix ms for the store's recency and the sweep, moved by the test."""

    def __init__(self) -> None:
        self.now = capacity.now_ms()

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1000)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(capacity, "now_ms", clock)
    monkeypatch.setattr(idle, "now_ms", clock)
    monkeypatch.setattr(store_module, "now_ms", clock)  # commits' updated_ms
    return clock


@pytest.fixture
def store(tmp_path):
    """The store's domain with no sweep thread of its own: the tests sweep."""
    store = local_store(tmp_path / "data")
    yield store
    store.close()


def retention(store, agent_idle: float = HOUR, **per_namespace: float) -> Retention:
    """The store's retention under these settings."""
    store.retention.config = replace(
        store.config, agent_idle_seconds=agent_idle, namespace_agent_idle=per_namespace
    )
    return store.retention


def save(store, ns: str, agent: str, tokens: list[int], seed: int = 0) -> list[bytes]:
    """Puts the blocks of `tokens` and commits the agent over them; their keys."""
    blocks, keys = make_chain(tokens, seed=seed, block_tokens=BLOCK)
    _, lease, _ = store.put_stream(put_items(ns, FP, blocks))
    store.leases.release(lease)
    store.commit_agent(Commit(ns, agent, FP, 0, tokens, keys))
    return keys


def agents(store, ns: str) -> list[str]:
    views, _ = store.list_agents(ns, "", 100)
    return [v.record.agent_id for v in views]


def num_blocks(store, ns: str) -> int:
    return store.list_namespaces().get(ns, {}).get("blocks", 0)


def test_an_idle_agent_goes_with_its_own_blocks_and_a_shared_prefix_stays(store, clock):
    shared = list(range(BLOCK))
    old_keys = save(store, "t", "old", shared + list(range(1000, 1000 + 2 * BLOCK)))
    young_tokens = shared + list(range(2000, 2000 + BLOCK))
    young_keys = save(store, "t", "young", young_tokens)
    assert old_keys[0] == young_keys[0] and num_blocks(store, "t") == 4
    clock.advance(2 * HOUR)
    store.get_agent("t", "young")  # read an hour after the other: the worker restored it
    clock.advance(0.5 * HOUR)
    retention(store).sweep(lambda: False)
    assert agents(store, "t") == ["young"]
    with pytest.raises(AgentNotFound, match=r"'old' not found .*: deleted at .*unused for 9000 s"):
        store.get_agent("t", "old")
    assert num_blocks(store, "t") == 2  # old's two own blocks went at once, not at GC
    assert not store.get_agent("t", "young").missing_block_keys
    assert store.verify("t")[0::2] == (2, [])  # both read whole, checksums good
    assert store.stats()["num_expired_agents"] == 1
    assert store.stats()["num_evicted_agents"] == 0


def test_a_not_found_says_retention_deleted_it_until_the_id_is_used_again(store, clock):
    keys = save(store, "t", "a", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    retention(store).sweep(lambda: False)
    with pytest.raises(AgentNotFound, match=r"\(--agent-idle 1h\)$"):
        store.get_agent("t", "a")
    save(store, "t", "a", list(range(BLOCK)))  # made anew, then deleted by its owner
    store.delete_agent("t", "a")
    with pytest.raises(AgentNotFound) as plain:
        store.get_agent("t", "a")
    assert plain.value.message == "agent 'a' not found in namespace 't'"
    assert keys


def test_each_namespace_keeps_its_agents_as_long_as_its_setting_says(store, clock):
    for ns in ("default", "brief", "kept"):
        save(store, ns, "a", list(range(BLOCK)))
    rules = retention(store, 2 * HOUR, brief=600.0, kept=0.0)
    clock.advance(HOUR)
    rules.sweep(lambda: False)
    assert (agents(store, "default"), agents(store, "brief"), agents(store, "kept")) == (
        ["a"],
        [],
        ["a"],
    )
    clock.advance(24 * HOUR * 365)
    rules.sweep(lambda: False)
    assert (agents(store, "default"), agents(store, "kept")) == ([], ["a"])


def test_only_named_namespaces_are_swept_when_the_store_wide_setting_keeps(store, clock):
    save(store, "brief", "a", list(range(BLOCK)))
    save(store, "other", "a", list(range(BLOCK)))
    rules = retention(store, 0.0, brief=600.0)
    clock.advance(HOUR)
    assert [a.namespace for a, _ in rules.expired()] == ["brief"]
    rules.sweep(lambda: False)
    assert (agents(store, "brief"), agents(store, "other")) == ([], ["a"])


def test_a_default_for_every_namespace_not_named(store, clock):
    save(store, "x", "a", list(range(BLOCK)))
    save(store, "kept", "a", list(range(BLOCK)))
    rules = retention(store, 0.0, **{"*": 600.0, "kept": 0.0})
    assert (rules.config.agent_idle("x"), rules.config.agent_idle("kept")) == (600.0, 0.0)
    clock.advance(HOUR)
    rules.sweep(lambda: False)
    assert (agents(store, "x"), agents(store, "kept")) == ([], ["a"])


def test_an_agent_committed_after_the_scan_stays(store, clock):
    keys = save(store, "t", "busy", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    rules = retention(store)
    [(seen, last)] = rules.expired()
    store.commit_agent(Commit("t", "busy", FP, seen.generation, list(range(BLOCK)), keys))
    rules.expired = lambda: [(seen, last)]  # the scan happened before the commit
    rules.sweep(lambda: False)
    assert store.get_agent("t", "busy").record.generation == seen.generation + 1
    assert store.stats()["num_expired_agents"] == 0


def test_an_agent_deleted_after_the_scan_is_no_error(store, clock):
    save(store, "t", "gone", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    rules = retention(store)
    seen = rules.expired()
    store.delete_agent("t", "gone")
    rules.expired = lambda: seen
    rules.sweep(lambda: False)  # "idle agent kept": not found
    assert store.stats()["num_expired_agents"] == 0


def test_a_block_under_a_read_lease_outlives_its_expired_agent(store, clock):
    tokens = list(range(2 * BLOCK))
    keys = save(store, "t", "old", tokens)
    selections = store.select("t", FP, keys, [])
    clock.advance(2 * HOUR)
    with store.reading(selections):  # a worker still streaming its blocks
        retention(store).sweep(lambda: False)
        assert agents(store, "t") == []
        assert store.verify("t")[0::2] == (2, [])  # both still there, whole
    assert store.collect_garbage("t")[0] == 2  # unreferenced now: the next collection


def test_a_slow_read_s_lease_lasts_while_its_stream_moves(store, clock, monkeypatch):
    """GetBlocks took one lease of max_lease_seconds (600 s) and never renewed it, though
    a stream that moves is cut only after 30 s without a message: a slow reader's blocks
    (a long chain, a slow link) could be collected mid-read, its stream then DATA_LOSS
    "payload file is missing". The lease is renewed as the stream moves (the peer takes
    each message); a lease that lapsed all the same is taken anew, the blocks checked."""
    import time

    from agentkv.errors import BlockNotFound

    later = [0.0]  # seconds past the real monotonic clock, for the leases
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + later[0])
    keys = save(store, "t", "read", list(range(2 * BLOCK)))
    store.delete_agent("t", "read")  # unreferenced: only the read's lease keeps them
    selections = store.select("t", FP, keys, [])
    lease_seconds = store.config.max_lease_seconds
    with store.reading(selections) as moved:
        for _ in range(4):  # a message taken every 0.4 leases: 1.6 leases in all
            later[0] += 0.4 * lease_seconds
            moved()
        assert store.collect_garbage("t")[0] == 0
        assert store.stats()["num_leases"] == 1
        later[0] += 1.5 * lease_seconds  # a pause past the lease, and a collection
        assert store.collect_garbage("t")[0] == 2
        with pytest.raises(BlockNotFound, match="was deleted"):
            moved()  # the next message would have met missing files: DATA_LOSS
    assert store.stats()["num_leases"] == 0


def test_a_read_for_use_and_a_fork_count_as_use_and_an_inspection_does_not(store, clock):
    for agent in ("restored", "template", "inspected"):
        save(store, "t", agent, list(range(BLOCK)))
    clock.advance(0.75 * HOUR)
    store.get_agent("t", "restored")
    store.fork_agent("t", "template", "child", BLOCK, "", {})
    store.get_agent("t", "inspected", peek=True)
    clock.advance(0.5 * HOUR)
    retention(store).sweep(lambda: False)
    assert agents(store, "t") == ["child", "restored", "template"]


def test_a_use_between_the_scan_and_the_delete_keeps_the_agent(store, clock):
    save(store, "t", "a", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    rules = retention(store)
    seen = rules.expired()
    store.get_agent("t", "a")  # a worker's restore begins
    rules.expired = lambda: seen
    rules.sweep(lambda: False)
    assert agents(store, "t") == ["a"]


def test_uses_are_saved_so_a_restart_does_not_forget_them(tmp_path, clock):
    store = local_store(tmp_path / "data")
    save(store, "t", "a", list(range(BLOCK)))
    clock.advance(0.75 * HOUR)
    store.get_agent("t", "a")  # used 45 min after its commit, never committed again
    retention(store).sweep(lambda: False)  # saves the use
    store.close()
    store = local_store(tmp_path / "data")  # restarted: nothing in memory
    try:
        clock.advance(0.5 * HOUR)  # 75 min since the commit, 30 since the use
        retention(store).sweep(lambda: False)
        assert agents(store, "t") == ["a"]
        clock.advance(HOUR)
        retention(store).sweep(lambda: False)
        assert agents(store, "t") == []
    finally:
        store.close()


def test_a_namespace_another_store_writes_is_left_alone(store, clock):
    save(store, "t", "a", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    store.writes = lambda namespace: False  # a standby of the namespace's writer
    retention(store).sweep(lambda: False)
    assert agents(store, "t") == ["a"]


def test_an_id_forked_into_after_it_expired_is_not_said_to_have_expired(store, clock):
    save(store, "t", "a", list(range(BLOCK)))
    clock.advance(2 * HOUR)
    retention(store).sweep(lambda: False)
    save(store, "t", "template", list(range(BLOCK)))
    store.fork_agent("t", "template", "a", BLOCK, "", {})
    store.delete_agent("t", "a")
    with pytest.raises(AgentNotFound) as plain:
        store.get_agent("t", "a")
    assert plain.value.message == "agent 'a' not found in namespace 't'"


@pytest.mark.parametrize(
    "agent_idle, per_namespace, scopes",
    [
        (HOUR, {}, [None]),
        (0.0, {"brief": 600.0, "kept": 0.0}, ["brief"]),
        (0.0, {"*": 600.0, "kept": 0.0}, [None]),
        (HOUR, {"kept": 0.0}, [None]),
        (0.0, {}, []),
    ],
)
def test_the_scan_reads_only_namespaces_with_a_retention(store, agent_idle, per_namespace, scopes):
    assert retention(store, agent_idle, **per_namespace).scopes() == scopes


@pytest.mark.parametrize(
    "agent_idle, gc_idle, periods",
    [
        (30 * 24 * HOUR, HOUR, [2592.0, 60.0]),  # a month's retention: looked at every 43 min
        (HOUR, 0.0, [60.0]),
        (10.0, 0.0, [2.5]),
        (0.0, 2.0, [0.5]),
    ],
)
def test_each_sweep_runs_at_its_own_period(tmp_path, agent_idle, gc_idle, periods):
    store = local_store(tmp_path / "data", lease_seconds=1)
    config = replace(store.config, agent_idle_seconds=agent_idle, gc_idle_seconds=gc_idle)
    swept = idle.sweeper(config, store.capacity, store.retention)
    try:
        assert [period for period, _ in swept.sweeps] == periods
    finally:
        swept.close()
        store.close()


def test_no_sweeper_without_retention_or_collection(store):
    assert idle.sweeper(store.config, store.capacity, store.retention) is None


# a real store process


def sweep_stats(client) -> tuple[int, int, int]:
    stats = client.stats()
    return stats.num_expired_agents, stats.num_agents, stats.num_blocks


def test_the_store_deletes_idle_agents_on_its_own(tmp_path, launched):
    flags = ["--namespace-agent-idle", "brief=10s", "--namespace-agent-idle", "slow=12h", *LEASE]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        for ns in ("brief", "kept", "slow"):
            blocks, _ = make_chain(list(range(2 * BLOCK)), block_tokens=BLOCK)
            client.save_agent(ns, "a", FP, list(range(2 * BLOCK)), blocks)
        # brief's blocks go after the agent (the counter counts it first)
        swept = (1, 2, 4)  # expired agents, agents, blocks
        until(lambda: sweep_stats(client) == swept, f"the retention sweep: {swept}")
        with pytest.raises(AgentNotFound):
            client.get_agent("brief", "a")
        assert client.get_agent("kept", "a").generation == 1
    assert '"event": "idle agent deleted"' in proc.log_text()
    shown = cli("store", "stats", store=proc.address)
    assert shown.returncode == 0, shown.stderr
    assert any(line.split() == ["expired", "agents", "1"] for line in shown.stdout.splitlines())
    listed = cli("store", "namespaces", store=proc.address).stdout.splitlines()
    assert listed[0].split()[-1] == "retention"
    rows = {line.split()[0]: line.split()[-1] for line in listed[2:]}
    assert rows == {"kept": "none", "slow": "12h"}  # brief is empty now: not listed
    with proc.client() as client:
        reply = client.call("ListNamespaces", pb.ListNamespacesRequest())
        assert {n.name: n.agent_idle_seconds for n in reply.namespaces} == {
            "kept": 0.0,
            "slow": 12 * HOUR,
        }


# what a worker and its caller see


def test_an_agent_expired_while_its_worker_held_it_is_not_found_and_the_gateway_begins_anew(
    tiny_model_dirs, tmp_path, launched
):
    import openai

    from agentkv.launch import gateway_process, worker_process

    flags = ["--namespace-agent-idle", "*=10s", "--namespace-agent-idle", "kept=0"]
    store = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags + LEASE))
    worker = launched(
        worker_process(
            str(tiny_model_dirs["llama"]),
            store.address,
            tmp_path / "worker.log",
            # A hot agent's turn hears the store's word however busy the machine (past 2 s,
            # the RAM copy would stand).
            extra_args=["--block-tokens", "64", "--store-check-timeout", "30"],
        )
    )
    gateway = launched(gateway_process([worker.address], tmp_path / "gw.log", store.address))
    w = WorkerClient(worker.address, timeout=60)
    for ns in ("brief", "kept"):
        w.create_agent(ns, "a", "You index scrolls. " * 20)
        w.turn(ns, "a", [("user", "Which came in?")], max_tokens=4, durable=True)
    chat = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="-", max_retries=0)
    model = chat.models.list().data[0].id
    talk = [{"role": "system", "content": "You index scrolls. " * 20}]
    talk.append({"role": "user", "content": "Which came in?"})
    first = chat.chat.completions.create(model=model, messages=talk, max_tokens=4, temperature=0)
    anonymous = first.agentkv["agent_id"]
    with store.client() as client:
        until(lambda: client.stats().num_expired_agents == 2, "the retention sweep")
        assert [a.agent_id for a in client.list_agents("default")] == []
    assert w.describe("brief", "a").tier == "hot"  # still in the worker's RAM
    with pytest.raises(AgentNotFound) as refused:
        w.turn("brief", "a", [("user", "And now?")], max_tokens=4)
    assert refused.value.message.startswith("agent 'a' not found in namespace 'brief': deleted")
    assert "(--agent-idle 10s)" in refused.value.message
    assert w.turn("kept", "a", [("user", "And now?")], max_tokens=4).usage.prefilled_tokens
    w.create_agent("brief", "a", "Made anew.")  # the id is free again
    assert w.turn("brief", "a", [("user", "Hello")], max_tokens=4).text is not None
    talk += [{"role": "assistant", "content": first.choices[0].message.content}]
    talk += [{"role": "user", "content": "And now?"}]
    again = chat.chat.completions.create(model=model, messages=talk, max_tokens=4, temperature=0)
    assert again.agentkv["agent_id"] == anonymous  # the same conversation, its agent made anew
    assert again.agentkv["prefilled_tokens"] == again.usage.prompt_tokens  # all of it again
