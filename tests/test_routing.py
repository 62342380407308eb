"""Routing without a network: rendezvous order, failover past workers that are down, and the
tries of one call (rounds, backoff, which failures move on and which stand)."""

from __future__ import annotations

import pytest

from agentkv.client.routing import Attempts, Router, rank
from agentkv.errors import Unavailable

WORKERS = [f"10.0.0.{i}:50061" for i in range(1, 5)]


def test_rank_is_stable_and_moves_only_the_agents_a_worker_wins_or_held():
    keys = [f"ns/agent-{i}" for i in range(200)]
    homes = {k: rank(WORKERS, k)[0] for k in keys}
    assert homes == {k: rank(list(reversed(WORKERS)), k)[0] for k in keys}  # order-free
    assert len(set(homes.values())) == len(WORKERS)  # every worker gets some agents
    fewer = WORKERS[:-1]
    moved = [k for k in keys if rank(fewer, k)[0] != homes[k]]
    assert moved and all(homes[k] == WORKERS[-1] for k in moved)  # only the leaver's


def test_a_worker_marked_down_goes_last_until_it_answers():
    router = Router(WORKERS, down_for=60)
    order = router.candidates("ns/a")
    router.mark_down(order[0])
    assert router.candidates("ns/a") == [*order[1:], order[0]]
    router.mark_up(order[0])
    assert router.candidates("ns/a") == order


def test_attempts_go_round_the_workers_with_doubling_backoff():
    router = Router(WORKERS[:2], down_for=60)
    attempts = Attempts(router, "ns/a", retries=2, backoff=0.5)
    tries = []
    for delay, address in attempts:
        tries.append((delay, address))
        attempts.failed(address, Unavailable("connection refused"))
    first, second = router.candidates("ns/a")  # both down now: rank order again
    assert [d for d, _ in tries] == [0.0, 0.0, 0.5, 0.0, 1.0, 0.0]
    assert len(tries) == 6 and {a for _, a in tries} == {first, second}
    message = str(attempts.exhausted("a"))
    assert "no worker could be reached for agent 'a' (6 tries over" in message


def test_a_workers_own_unavailable_is_not_failed_over():
    router = Router(WORKERS, down_for=60)
    attempts = Attempts(router, "ns/a", retries=1, backoff=0.1)
    _, address = next(iter(attempts))
    answered = Unavailable("the store is unreachable")
    answered.remote = True
    with pytest.raises(Unavailable, match="store is unreachable"):
        attempts.failed(address, answered)
    assert router.home("ns/a") == address  # not marked down: the worker itself is fine


def test_a_router_needs_distinct_workers():
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError, match="repeat"):
        Router([WORKERS[0], WORKERS[0]])


@pytest.mark.parametrize("memory", ["sync", "asyncio"])
@pytest.mark.parametrize(
    ("workers", "store", "bad"),
    [("foo", None, "foo"), (["127.0.0.1:1", "h:99999"], None, "h:99999"), ("h:1", "bar", "bar")],
    ids=["worker-without-port", "port-out-of-range", "store"],
)
def test_a_memory_given_a_malformed_address_says_so_at_once(memory, workers, store, bad):
    """AgentMemory("foo") was taken; its first call said "no worker could be reached ...
    over foo", as if a worker were down."""
    from agentkv.client import AgentMemory, AsyncAgentMemory

    cls = AgentMemory if memory == "sync" else AsyncAgentMemory
    with pytest.raises(ValueError, match=f"must be HOST:PORT or unix:PATH, got '{bad}'"):
        cls(workers, store)


def test_grpc_targets_pass_and_a_url_is_refused_saying_what_to_give():
    from agentkv.addresses import client_address, listen_host

    for target in ("unix:///tmp/s.sock", "unix:/tmp/s.sock", "dns:///h:1", "ipv4:127.0.0.1:1"):
        client_address(target)  # the review's: unix:/// was refused with the URLs
    assert listen_host("unix:///tmp/s.sock") is None
    for url in ("http://h:1", "https://h:1/", "grpc://h:1"):
        with pytest.raises(ValueError, match=r"not a \w+:// URL: got .* \(give h:1\)"):
            client_address(url)
