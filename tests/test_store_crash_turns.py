"""kill -9 of the store while a real worker commits real turns, at points inside its put
streams, between put and commit, and between commit and reply. After each restart every turn
the worker acknowledged durable is in the store; once the worker catches up, a fresh worker
restores every agent warm, and its greedy and seeded replies are token for token those of a
reference that never crashed, fed the same conversation.

The store runs as this module (`python -m tests.test_store_crash_turns`): the real store,
which SIGKILLs itself at one point of its write path (see crashing_store)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import assert_store_consistent, free_address

ROOT = Path(__file__).resolve().parent.parent
NS = "ns"
AGENTS = ("a", "b")
SYSTEM = "You are the keeper of the lighthouse, and you log every ship. " * 4  # 2+ blocks
TOKENS = 8
PROBE = [("user", "Read me the whole log.")]


def reply_to(n: int) -> dict:
    """Turn n's sampling: seeded, at temperature 1, so that its tokens hang on all the
    logits (greedy replies of the tiny random model are one token over and over)."""
    return {"temperature": 1.0, "seed": 1 + n, "max_tokens": TOKENS}


def crashing_store(point: str, argv: list[str]) -> None:
    """The store, killed -9 by itself at `point`, counted from its start: msg:P.M before
    message M (from 0: a block's header, then its bytes, then the next header...) of the
    first PutBlocks stream, from its Pth on, that has one (how the worker's catch-up after a
    restart splits into streams is timing); block:N once its Nth new block is published
    (renamed and indexed); commit:N before its Nth commit; committed:N after it, before the
    reply."""
    from agentkv import wire
    from agentkv.v1 import store_pb2 as pb
    from cache_store import service, store, uploads
    from cache_store.__main__ import main

    seen, lock = Counter(), threading.Lock()

    def tick(kind: str, where: str, name: str = "") -> None:
        with lock:
            seen[kind] += 1
            if point == (name or f"{kind}:{seen[kind]}"):
                line = {"event": "killed here", "at": point, "where": where, "seen": seen}
                print(json.dumps(line), flush=True)  # into the store's log
                os.kill(os.getpid(), signal.SIGKILL)

    first_put, _, at_message = point.removeprefix("msg:").partition(".")

    def counted(raw):
        with lock:
            seen["put"] += 1
            put = seen["put"]
        for i, message in enumerate(raw):
            chunk = isinstance(wire.decode(message, pb.PutBlocksRequest), memoryview)
            armed = point.startswith("msg:") and put >= int(first_put) and i == int(at_message)
            tick("msg", "bytes" if chunk else "header", point if armed else f"msg:{put}.{i}")
            yield message

    put_items, publish = service._put_items, uploads.Uploads._publish
    commit = store.CacheStore.commit_agent

    def published(self, upload):
        result = publish(self, upload)
        tick("block", f"put {seen['put']}, {len(upload.record.token_ids)} tokens")
        return result

    def committed(self, c, release_lease_id=""):
        where = f"agent {c.agent_id}, {len(c.token_ids)} tokens"
        tick("commit", where)
        view = commit(self, c, release_lease_id)
        tick("committed", where)
        return view

    service._put_items = lambda raw, beat: put_items(counted(raw), beat)
    uploads.Uploads._publish = published
    store.CacheStore.commit_agent = committed
    main(argv)


CASES = {  # one worker and store per case; the store restarts armed with the next point
    "put_stream": ["msg:1.0", "msg:1.1", "msg:3.0", "msg:3.1", "msg:2.5", "msg:4.2", "msg:1.3"],
    "after_publish": ["block:1", "block:2", "block:3", "block:4"],
    "before_commit": ["commit:1", "commit:2", "commit:3", "commit:4"],
    "mixed": ["msg:2.0", "block:3", "commit:2", "msg:4.1", "msg:3.3"],
    "reply_lost": ["committed:1", "committed:2", "committed:3"],
}


@dataclass
class Rig:
    """A store on a fixed address (restartable, armed with a kill point) and workers on it."""

    tmp: Path
    model: str
    listen: str = field(default_factory=free_address)
    started: list = field(default_factory=list)

    def store(self, point: str = ""):
        from agentkv.launch import ServiceProcess

        args = ["--data-dir", str(self.tmp / "data"), "--listen", self.listen]
        env = {"PYTHONPATH": str(ROOT), "CRASH_AT": point}
        self.started.append(ServiceProcess(__name__, args, self.tmp / "store.log", env))
        return self.started[-1].start()

    def worker(self, name: str):
        from agentkv.launch import worker_process

        log, args = self.tmp / f"{name}.log", ["--block-tokens", "64"]
        self.started.append(worker_process(self.model, self.listen, log, extra_args=args))
        return self.started[-1].start()


@pytest.fixture
def rig(tiny_model_dirs, tmp_path):
    rig = Rig(tmp_path, str(tiny_model_dirs["llama"]))
    yield rig
    for proc in reversed(rig.started):
        proc.stop()


def until(done, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.1)


def reaches_store(w) -> bool:
    """Whether the worker's channel to the (restarted) store is up."""
    from agentkv.errors import AgentNotFound, Unavailable

    try:
        w.describe(NS, "nobody")
    except AgentNotFound:
        return True
    except Unavailable:
        return False


@pytest.mark.parametrize("points", CASES.values(), ids=CASES.keys())
def test_store_kill9_during_worker_commits_loses_no_turn(rig, points):
    from agentkv.client.store import StoreClient
    from agentkv.client.worker import WorkerClient
    from agentkv.errors import Unavailable

    def dead() -> bool:
        return not store.running

    def caught_up() -> bool:  # or the store was killed again, in the catch-up itself
        states = [w.describe(NS, a) for a in AGENTS]
        return dead() or all(s.persisted_tokens >= s.num_tokens - 1 for s in states)

    def say(agent: str) -> bool:
        """One durable turn (seeded), recorded; whether the worker acknowledged it durable."""
        n = len(history[agent])  # a long turn now and then: a put of several blocks
        text = f"Ship {n} for {agent}: what flag?" + " Go on." * (12 if n % 3 == 2 else 0)
        reply: list[int] = []
        try:
            for r in w.stream_turn(NS, agent, [("user", text)], **reply_to(n), durable=True):
                reply += r.tokens.token_ids if r.HasField("tokens") else []
        except Unavailable as exc:
            assert "not committed" in str(exc)
            return False
        finally:
            history[agent].append((text, reply))
        return True

    store, worker = rig.store(), rig.worker("worker")
    w, data = WorkerClient(worker.address, timeout=60), rig.tmp / "data"
    history: dict[str, list[tuple[str, list[int]]]] = {a: [] for a in AGENTS}
    acked: dict[str, list[int]] = {}  # per agent, its tokens at its last acknowledged turn
    last = ""  # the last kill point that fired
    for a in AGENTS:
        w.create_agent(NS, a, SYSTEM)
    until(caught_up, "the agents were not created durable")
    for point in [*points, ""]:
        store.stop()
        store = rig.store(point)
        until(lambda: reaches_store(w), "the worker did not reach the restarted store")
        with StoreClient(rig.listen) as c:  # every acknowledged turn survived the kill
            for a, tokens in acked.items():
                m = c.get_agent(NS, a)
                assert list(m.token_ids[: len(tokens)]) == tokens, (last, a)
                assert not m.missing_block_keys, (last, a)
        until(caught_up, f"the worker never caught up after the kill at {last}")
        if not dead():  # quiet now: no write in flight
            with StoreClient(rig.listen) as c:
                assert_store_consistent(c, data, NS)
        for _ in range(8 if point else 1):  # turns until the store dies at the point
            for a in AGENTS:
                if dead():
                    break
                if not say(a):  # only a kill fails a turn, and stops the turns
                    until(dead, f"a turn of {a} was not committed, yet the store lives")
                    continue
                with StoreClient(rig.listen) as c:
                    acked[a] = list(c.get_agent(NS, a).token_ids)
                assert len(acked[a]) == w.describe(NS, a).num_tokens  # the whole turn
        if point:
            assert dead(), f"the store never died at {point}"
            assert store.proc.returncode == -signal.SIGKILL
            last = point
            for a in AGENTS:  # served while the store is down: hot, not durable
                assert not say(a)
    w.close()
    worker.stop()
    with StoreClient(rig.listen) as c:
        assert_store_consistent(c, data, NS)
        final = {a: list(c.get_agent(NS, a).token_ids) for a in AGENTS}

    w = WorkerClient(rig.worker("fresh").address, timeout=60)  # every agent from the store
    for a in AGENTS:
        ref = f"ref-{a}"  # never crashed: the same conversation, served hot
        w.create_agent(NS, ref, SYSTEM)
        for n, (text, reply) in enumerate(history[a]):  # the same replies, token for token
            assert w.turn(NS, ref, [("user", text)], **reply_to(n)).token_ids == reply, (a, n)
        w.wait_durable(NS, ref)
        with StoreClient(rig.listen) as c:  # every turn served is there, acknowledged or not
            assert final[a] == list(c.get_agent(NS, ref).token_ids), a
        restored = w.turn(NS, a, PROBE, max_tokens=TOKENS)
        assert restored.usage.cache_state == "warm", restored.usage
        assert not restored.usage.restore_failure
        assert restored.usage.reused_store_tokens == len(final[a]) - 1
        assert restored.token_ids == w.turn(NS, ref, PROBE, max_tokens=TOKENS).token_ids
        sampled = reply_to(99) | {"max_tokens": 24}
        assert w.turn(NS, a, PROBE, **sampled).token_ids == (
            w.turn(NS, ref, PROBE, **sampled).token_ids
        )
    w.close()


def test_a_commit_whose_reply_was_lost_is_not_taken_for_another_writers(rig):
    """kill -9 after the store applied a durable turn's commit, before its reply: the worker
    must not take its own commit for another worker's and drop the turn it served while the
    store was down (its next reply must see that turn, like a never-crashed agent's)."""
    from agentkv.client.worker import WorkerClient
    from agentkv.errors import NotCommitted

    store = rig.store("committed:2")  # CreateAgent's commit is the first, the turn's the second
    w = WorkerClient(rig.worker("worker").address, timeout=60)
    turns = [[("user", f"Ship {i}: what flag?")] for i in range(3)]
    w.create_agent(NS, "a", SYSTEM)
    with pytest.raises(NotCommitted, match="not committed"):
        w.turn(NS, "a", turns[0], **reply_to(0), durable=True)
    until(lambda: not store.running, "the store never died after the commit")
    assert w.turn(NS, "a", turns[1], **reply_to(1)).usage.cache_state == "hot"
    rig.store()  # back, with turns[0] committed and turns[1] only in the worker's RAM
    until(lambda: reaches_store(w), "the worker did not reach the restarted store")
    w.create_agent(NS, "ref", SYSTEM)
    for n, turn in enumerate(turns[:2]):
        w.turn(NS, "ref", turn, **reply_to(n))
    after, ref = (w.turn(NS, agent, turns[2], **reply_to(2)) for agent in ("a", "ref"))
    assert after.usage.prompt_tokens == ref.usage.prompt_tokens, "a served turn was dropped"
    assert after.token_ids == ref.token_ids
    w.wait_durable(NS, "a", timeout=60)
    w.close()


if __name__ == "__main__":
    crashing_store(os.environ.get("CRASH_AT", ""), sys.argv[1:])
