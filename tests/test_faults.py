"""Faults around the worker: a worker killed mid-turn loses only that turn (the agent's last
committed state is intact and its next turn answers as if the killed turn never happened),
and two workers committing the same agent at once: exactly one wins, the other reports."""

from __future__ import annotations

import threading

import pytest

from agentkv.errors import AgentKVError, Unavailable
from client.worker import WorkerClient

SYSTEM = "You are the keeper of the lighthouse, and you log every ship. " * 8
Q1 = [("user", "Which ships passed tonight?")]
Q2 = [("user", "And the weather?")]


def test_a_worker_killed_mid_turn_loses_only_that_turn(tiny_model_dirs, start_worker):
    model = tiny_model_dirs["llama"]
    doomed = start_worker(model, name="doomed")
    w = WorkerClient(doomed.address)
    for agent in ("keeper", "reference"):
        w.create_agent("ns", agent, SYSTEM)
        w.turn("ns", agent, Q1, max_tokens=8, durable=True)
    committed = w.describe("ns", "keeper")

    stream = w.stream_turn("ns", "keeper", Q2, max_tokens=2000)
    next(stream)  # the turn is generating
    doomed.kill9()
    with pytest.raises(AgentKVError):
        for _ in stream:
            pass

    reborn = WorkerClient(start_worker(model, name="reborn").address)
    after = reborn.describe("ns", "keeper")
    assert (after.num_tokens, after.generation) == (committed.num_tokens, committed.generation)
    assert after.tier == "warm"
    again = reborn.turn("ns", "keeper", Q2, max_tokens=12)
    reference = reborn.turn("ns", "reference", Q2, max_tokens=12)
    assert again.usage.cache_state == "warm" and not again.usage.restore_failure
    assert again.token_ids == reference.token_ids  # as if the killed turn never happened


def test_two_workers_racing_on_one_agent_one_wins_one_reports(tiny_model_dirs, start_worker):
    model = tiny_model_dirs["llama"]
    a = WorkerClient(start_worker(model, name="a").address)
    b = WorkerClient(start_worker(model, name="b").address)
    a.create_agent("ns", "shared", SYSTEM)
    a.turn("ns", "shared", Q1, max_tokens=4, durable=True)
    b.describe("ns", "shared")
    b.turn("ns", "shared", [("user", "Hello from b.")], max_tokens=0, durable=True)  # b holds it
    a.evict("ns", "shared")
    a.turn("ns", "shared", [("user", "Hello from a.")], max_tokens=0, durable=True)  # a reloads
    # Now both hold it hot at the same generation; each commits a turn at once.
    barrier, results = threading.Barrier(2), {}

    def race(name: str, worker: WorkerClient) -> None:
        barrier.wait()
        try:
            results[name] = worker.turn("ns", "shared", Q2, max_tokens=4, durable=True)
        except Unavailable as exc:
            results[name] = exc

    threads = [threading.Thread(target=race, args=(n, w)) for n, w in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [n for n, r in results.items() if not isinstance(r, Exception)]
    lost = [n for n, r in results.items() if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "not committed" in str(results[lost[0]])
    winner, loser = (a, b) if won == ["a"] else (b, a)
    state = winner.describe("ns", "shared")
    assert loser.describe("ns", "shared").generation <= state.generation
    # The loser reloads the winner's state before its next turn: both continue alike.
    x = loser.turn("ns", "shared", [("user", "Go on.")], max_tokens=6)
    assert x.usage.cache_state == "warm"


def test_a_worker_never_answers_from_a_stale_hot_copy(tiny_model_dirs, start_worker):
    """A client fails over to b and later comes back to a, which still holds the agent hot
    from before: a notices the store's newer generation and restores it, turns and all."""
    model = tiny_model_dirs["llama"]
    a = WorkerClient(start_worker(model, name="a").address)
    b = WorkerClient(start_worker(model, name="b").address)
    a.create_agent("ns", "moving", SYSTEM)
    a.turn("ns", "moving", Q1, max_tokens=6, durable=True)
    assert a.describe("ns", "moving").tier == "hot"
    b.turn("ns", "moving", [("user", "Note this: a storm is coming.")], max_tokens=6, durable=True)
    latest = b.describe("ns", "moving")

    back = a.turn("ns", "moving", Q2, max_tokens=8, durable=True)
    assert back.usage.cache_state == "warm"  # not the stale RAM copy
    assert back.usage.prompt_tokens > latest.num_tokens  # b's turn is in its context
    assert a.describe("ns", "moving").generation == latest.generation + 1
