"""The asyncio SDK (client/aio.py) against real store and worker processes.

It gives the sync SDK's greedy tokens for the same history, streams what `.text` holds,
moves an agent to the next worker warm when its own dies (a reply cut short says its turn
was not committed), and raises the same typed errors. Each test runs its coroutine with
asyncio.run: the channels live in that loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from agentkv.client.aio import AsyncAgentMemory, AsyncReply
from agentkv.client.memory import AgentMemory
from agentkv.errors import AgentNotFound, FailedPrecondition, InvalidArgument, Unavailable
from tests.helpers import free_address, freeze, until
from tests.test_sdk_reply import said_again

SYSTEM = "You are the warden of the prison. " * 12
LONG = 3000  # tokens: seconds of decoding, far from whole when the worker is killed or it is closed
Q1 = "Where were you on the night of the fourteenth?"
HEARD = "Prisoner B said: I was at home, ask my mother."
Q2 = "Prove it, prisoner."
T = TypeVar("T")


async def collect(reply: AsyncReply) -> list[str]:
    return [piece async for piece in reply]


def test_async_sdk_gives_the_sync_sdks_tokens(tiny_model_dirs, start_worker, store_process):
    address = start_worker(tiny_model_dirs["llama"]).address
    with AgentMemory(address, durable=True) as mem:
        agent = mem.agent("sync", system=SYSTEM)
        reply = agent.say(Q1, max_tokens=8)
        usage = reply.usage  # read first, before anything iterated: it waits for the end
        assert usage.generated_tokens == len(reply.token_ids) > 0
        first = reply.token_ids
        agent.inject(HEARD)
        second = agent.say(Q2, max_tokens=12).token_ids

    async def run() -> tuple[list[int], list[int], list]:
        async with AsyncAgentMemory(address, store_process.address, durable=True) as mem:
            agent = await mem.agent("async", system=SYSTEM)
            assert agent.created and agent.state.tier == "hot"
            a = await (await agent.say(Q1, max_tokens=8)).wait()
            injected = await agent.inject(HEARD)
            assert injected.usage.generated_tokens == 0 and agent.state == injected.agent
            b = await (await agent.say(Q2, max_tokens=12)).wait()
            assert not (await mem.agent("async", system=SYSTEM)).created  # exists: a handle
            return a.token_ids, b.token_ids, await mem.agents()

    a, b, agents = asyncio.run(run())
    assert (a, b) == (first, second) and len(b) > 0
    assert sorted(s.agent_id for s in agents) == ["async", "sync"]
    assert {s.tier for s in agents} == {"hot"}


def test_a_reply_streams_its_text(tiny_model_dirs, start_worker):
    address = start_worker(tiny_model_dirs["llama"]).address

    async def run() -> None:
        async with AsyncAgentMemory(address) as mem:
            agent = await mem.agent("a", system=SYSTEM)
            reply = await agent.say(Q1, max_tokens=24)
            assert reply.worker == address and not reply.done
            with pytest.raises(RuntimeError, match="still streaming"):
                _ = reply.text
            with pytest.raises(RuntimeError, match="still streaming"):
                _ = reply.usage  # like .text: whole once wait() returns, never None
            # Two consumers at once each get every piece, from the start.
            pieces, again = await asyncio.gather(collect(reply), collect(reply))
            assert pieces == again and len(pieces) > 0 and all(pieces)
            assert "".join(pieces) == reply.text
            assert reply.usage.generated_tokens == len(reply.token_ids) > 0
            assert reply.cache_state == "hot" and reply.time_to_first_token_ms > 0
            assert await collect(reply) == pieces  # a finished reply replays
            fork = await agent.fork("a-fork", phase="what-if")
            assert fork.created and fork.state.phase == "what-if"
            assert (await fork.describe()).num_tokens == (await agent.describe()).num_tokens
            assert await fork.delete() and not await fork.delete()

    asyncio.run(run())


def test_a_lost_worker_moves_its_agents_to_the_next(tiny_model_dirs, start_worker):
    a, b = (start_worker(tiny_model_dirs["llama"], name=name) for name in ("a", "b"))

    async def run() -> None:
        workers = [a.address, b.address]
        async with AsyncAgentMemory(workers, durable=True, retries=1, backoff=0.05) as mem:
            ids = (f"agent-{i}" for i in range(1000))
            agent_id = next(i for i in ids if mem.worker_for(i) == a.address)
            control_id = next(i for i in ids if mem.worker_for(i) == b.address)
            agent = await mem.agent(agent_id, system=SYSTEM)
            control = await mem.agent(control_id, system=SYSTEM)
            for one in (agent, control):
                assert (await (await one.say(Q1, max_tokens=8)).wait()).cache_state == "hot"

            inflight = await agent.say(Q2, max_tokens=LONG)  # about 4.5 s of decoding
            a.kill9()
            cut = r"not committed \(a stopped worker\): describe\(\) the agent before saying it"
            with pytest.raises(Unavailable, match=cut):
                await inflight.wait()
            with pytest.raises(Unavailable, match="not committed"):
                await collect(inflight)  # and again, for any later reader
            reply = await (await agent.say(Q2, max_tokens=12)).wait()
            assert reply.worker == b.address and reply.cache_state == "warm"
            assert reply.usage.reused_store_tokens > 0
            assert mem.worker_for(agent_id) == b.address  # a is down: not tried first
            expected = await (await control.say(Q2, max_tokens=12)).wait()
            # Nothing lost in the move, and nothing of the lost turn kept.
            assert reply.token_ids == expected.token_ids
            assert (await agent.describe()).tier == "hot"

    asyncio.run(run())


def test_bad_input_and_no_worker_get_typed_errors(tiny_model_dirs, start_worker):
    address = start_worker(tiny_model_dirs["llama"]).address

    async def run() -> None:
        async with AsyncAgentMemory(address) as mem:
            agent = await mem.agent("a", system=SYSTEM)
            state = await agent.describe()
            with pytest.raises(InvalidArgument, match="empty"):
                await agent.say("", max_tokens=4)
            with pytest.raises(InvalidArgument, match="role"):
                await agent.inject(HEARD, role="narrator")
            ghost = await mem.agent("ghost")
            with pytest.raises(AgentNotFound):
                await ghost.say(Q1, max_tokens=4)
            with pytest.raises(AgentNotFound):
                await ghost.fork("ghost-fork")
            with pytest.raises(InvalidArgument, match="needs the store"):
                await mem.agents()
            assert (await agent.describe()).num_tokens == state.num_tokens  # unharmed
            assert (await (await agent.say(Q1, max_tokens=4)).wait()).cache_state == "hot"

        nowhere = free_address()
        async with AsyncAgentMemory(nowhere, retries=2, backoff=0.05) as mem:
            start = time.monotonic()
            with pytest.raises(Unavailable, match="no worker could be reached") as caught:
                await mem.agent("a", system=SYSTEM)
            assert time.monotonic() - start < 5 and not caught.value.remote
            assert "3 tries" in caught.value.message

    asyncio.run(run())


def test_both_sdks_give_a_hung_store_their_own_timeout(
    tiny_model_dirs, start_worker, store_process
):
    """AgentMemory(timeout=2) waits 2 s for a store that does not answer (SIGSTOP), as
    AsyncAgentMemory does, not the store client's own 60 s. Each says the store did not
    answer (the asyncio one's error named no peer, so the gateway's GET /v1/agents blamed
    the worker)."""
    import os
    import signal
    import time

    from agentkv.client.memory import AgentMemory
    from agentkv.errors import DeadlineExceeded

    worker = start_worker(tiny_model_dirs["llama"]).address
    with AgentMemory(worker, store=store_process.address, timeout=2) as mem:

        def listed() -> bool:
            try:
                return mem.agents() == []
            except DeadlineExceeded:  # a busy machine's first call, its channel opening
                return False

        until(listed, "the store's first answer")  # connected: what follows waits on one
        freeze(store_process.proc.pid)
        try:
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded) as waited:
                mem.agents()
            assert time.monotonic() - started < 30  # 60 s before
            assert waited.value.peer == "store"

            async def listed_async() -> None:
                async with AsyncAgentMemory(worker, store=store_process.address, timeout=2) as m:
                    await m.agents()

            started = time.monotonic()
            with pytest.raises(DeadlineExceeded) as waited:
                asyncio.run(listed_async())
            assert time.monotonic() - started < 30
            assert waited.value.peer == "store"
        finally:
            os.kill(store_process.proc.pid, signal.SIGCONT)


def test_a_deadline_before_the_first_token_says_what_the_worker_did(tiny_model_dirs, start_worker):
    """A say() whose deadline passed before any of the reply came (its worker hung) raised a
    bare "Deadline Exceeded", naming no agent and saying nothing of the turn; now it says,
    in both SDKs, as one cut off later does."""
    import os
    import signal

    from agentkv.errors import DeadlineExceeded

    worker = start_worker(tiny_model_dirs["llama"])
    said = r"Deadline Exceeded after 0 tokens of the reply of (Async)?Agent\(default/a\): its "
    said += "worker undoes the turn unless a token of it was on its way: describe"
    with AgentMemory(worker.address) as mem:
        agent = mem.agent("a", system=SYSTEM)
        freeze(worker.proc.pid)
        try:
            with pytest.raises(DeadlineExceeded, match=said):
                agent.say(Q1, timeout=1)

            async def run() -> None:
                async with AsyncAgentMemory(worker.address) as amem:
                    with pytest.raises(DeadlineExceeded, match=said):
                        await (await amem.agent("a")).say(Q1, timeout=1)

            asyncio.run(run())
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)


async def mid_read(reader: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """The reader as a task, run until it waits for the reply's next response (a reply of
    hundreds of tokens is far from whole by then)."""
    task = asyncio.ensure_future(reader)
    await asyncio.sleep(0)  # the task runs to its first wait: the read
    return task


def test_a_cancelled_reader_stops_only_itself(tiny_model_dirs, start_worker):
    """A reader cancelled while it reads (as asyncio.wait_for's timeout cancels it) ends
    alone: the other readers, and any later one, get the whole reply."""
    address = start_worker(tiny_model_dirs["llama"]).address

    async def run() -> None:
        async with AsyncAgentMemory(address) as mem:
            agent = await mem.agent("a", system=SYSTEM)
            reply = await agent.say(Q1, max_tokens=256)
            impatient = await mid_read(reply.wait())
            patient = asyncio.ensure_future(collect(reply))
            assert impatient.cancel()  # not done: it was reading
            pieces = await patient
            with pytest.raises(asyncio.CancelledError):
                await impatient
            assert reply.usage.generated_tokens == len(reply.token_ids) > 64
            assert "".join(pieces) == reply.text

            alone = await agent.say(Q2, max_tokens=256)
            sole = await mid_read(alone.wait())
            assert sole.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sole
            assert not alone.done  # the next reader goes on where it was
            whole = await alone.wait()
            assert whole.usage.generated_tokens == len(whole.token_ids) > 64

    asyncio.run(run())


def test_closing_a_reply_another_task_reads_ends_it_for_every_reader(tiny_model_dirs, start_worker):
    """close() while another task reads: that reader, and every later one, get
    FailedPrecondition 'closed'; the worker cuts the turn short."""
    address = start_worker(tiny_model_dirs["llama"]).address
    closed = r"the reply of AsyncAgent\(default/a\) was closed after \d+ tokens"

    async def run() -> int:
        async with AsyncAgentMemory(address) as mem:
            agent = await mem.agent("a", system=SYSTEM)
            before = (await agent.describe()).num_tokens
            reply = await agent.say(Q1, max_tokens=LONG)
            reader = await mid_read(reply.wait())
            await reply.close()
            with pytest.raises(FailedPrecondition, match=closed):
                await reader
            with pytest.raises(FailedPrecondition, match=closed):
                await collect(reply)
            with pytest.raises(FailedPrecondition, match=closed):
                _ = reply.text
            await reply.close()  # again: nothing more
            other = await mem.agent("b", system=SYSTEM)
            async with await other.say(Q2, max_tokens=8) as whole:
                await whole.wait()
            assert whole.done and whole.usage.generated_tokens == len(whole.token_ids)
            assert whole.text  # closing a whole reply kept it whole
            return before

    before = asyncio.run(run())
    with AgentMemory(address) as mem:
        assert said_again(mem.agent("a"), Q2).usage.prompt_tokens < before + LONG


def test_a_closed_async_memory_says_so(tiny_model_dirs, start_worker):
    """A call after close() raised grpc's UsageError ("Channel is closed")."""
    address = start_worker(tiny_model_dirs["llama"]).address

    async def run() -> None:
        mem = AsyncAgentMemory(address)
        agent = await mem.agent("a", system=SYSTEM)
        await mem.close()
        for call in (lambda: agent.say(Q1), agent.describe, lambda: mem.agent("b", SYSTEM)):
            with pytest.raises(FailedPrecondition, match="this AsyncAgentMemory was closed"):
                await call()

    asyncio.run(run())


def test_prefetch_brings_an_agent_back_into_ram_before_its_turn(
    tiny_model_dirs, start_worker, store_process
):
    """An evicted agent, prefetched, is in RAM with its context unchanged: its next turn is
    hot and prefills only its new message. Sync and asyncio."""
    from agentkv.client.memory import Agent

    address = start_worker(tiny_model_dirs["llama"]).address
    with AgentMemory(address, durable=True) as mem:
        agent = mem.agent("fetched", system=SYSTEM)
        agent.say(Q1, max_tokens=8).wait()
        before = agent.describe()
        assert agent.evict() and agent.describe().tier == "warm"
        usage = agent.prefetch()
        assert agent.describe().generation == before.generation  # nothing written
        assert usage.cache_state == "warm" and usage.restored_bytes > 0
        assert not usage.restore_failure and usage.generated_tokens == 0
        after = agent.describe()
        assert after.tier == "hot" and after.num_tokens == before.num_tokens  # nothing added
        assert agent.prefetch().cache_state == "hot"  # already there: nothing to do
        assert agent.describe().generation == before.generation
        reply = agent.say(Q2, max_tokens=8)
        assert reply.usage.cache_state == "hot"
        # all of its context came from RAM but the reply's last token, which a turn feeds
        held = before.num_tokens - 1
        assert reply.usage.prefilled_tokens == reply.usage.prompt_tokens - held
        with pytest.raises(AgentNotFound):
            Agent(mem, "nobody").prefetch()
        assert agent.pin().pinned and agent.describe().pinned  # evicted last, from now on
        assert not agent.pin(False).pinned
        long = agent.say(Q1, max_tokens=3000)  # a turn in flight for seconds
        with pytest.raises(FailedPrecondition, match="in progress"):  # as any turn's
            agent.prefetch()
        assert not long.done  # it was mid-turn
        long.close()

    async def run() -> tuple[str, str]:
        async with AsyncAgentMemory(address, durable=True) as amem:
            agent = await amem.agent("fetched-async", system=SYSTEM)
            await (await agent.say(Q1, max_tokens=4)).wait()
            await agent.evict()
            fetched = await agent.prefetch()
            reply = await (await agent.say(Q2, max_tokens=4)).wait()
            return fetched.cache_state, reply.usage.cache_state

    assert asyncio.run(run()) == ("warm", "hot")


def test_a_timeout_past_grpcs_longest_deadline_waits_that_long(
    tiny_model_dirs, start_worker, store_process
):
    """A timeout of inf, or 1e10 s, overflowed gRPC's deadline (nanoseconds on its clock),
    which had then passed: every call failed at once, DEADLINE_EXCEEDED, in both SDKs, the
    store's client and `agentkv agents --timeout`. Now such a timeout is 31 years long."""
    import math

    from agentkv.client.store import StoreClient
    from agentkv.client.worker import WorkerClient
    from tests.helpers import cli

    worker = start_worker(tiny_model_dirs["llama"]).address
    with AgentMemory(  # durable: the agent is in the store once each call returns
        worker, store=store_process.address, timeout=math.inf, durable=True
    ) as mem:
        agent = mem.agent("patient", system="Be brief.")
        assert agent.say("Hi", max_tokens=2, timeout=math.inf).usage.generated_tokens > 0
        assert [s.agent_id for s in mem.agents()] == ["patient"]
    assert WorkerClient(worker, timeout=1e10).info().num_hot_agents == 1
    with StoreClient(store_process.address, timeout=1e10) as store:
        assert store.stats().num_agents == 1

    async def run() -> list:
        async with AsyncAgentMemory(worker, store=store_process.address, timeout=math.inf) as m:
            return await m.agents()

    assert [s.agent_id for s in asyncio.run(run())] == ["patient"]
    listed = cli("agents", "--worker", worker, "--timeout", "1e10", store=store_process.address)
    assert listed.returncode == 0 and "patient" in listed.stdout, listed.stderr


def test_a_memory_in_another_namespace_is_closed_with_the_one_it_shares_channels_with(
    tiny_model_dirs, start_worker
):
    """in_namespace() shares its memory's channels, but copied its open state: once either
    was closed, a call on the other met gRPC's own error about its closed channel (a
    ValueError in the sync SDK), not FailedPrecondition. Both are closed together now."""
    worker = start_worker(tiny_model_dirs["llama"]).address
    for closed_first in ("the first", "its copy"):
        mem = AgentMemory(worker)
        other = mem.in_namespace("team-b")
        other.agent("b", system="Be brief.")
        (mem if closed_first == "the first" else other).close()
        for memory in (mem, other):
            with pytest.raises(FailedPrecondition, match="was closed"):
                memory.agent("c", system="Be brief.")

    async def run() -> None:
        mem = AsyncAgentMemory(worker)
        with_copy = mem.in_namespace("team-c")
        await with_copy.agent("b", system="Be brief.")
        await with_copy.close()
        for memory in (mem, with_copy):
            with pytest.raises(FailedPrecondition, match="was closed"):
                await memory.agent("c", system="Be brief.")

    asyncio.run(run())


def test_a_memory_forgets_deleted_agents_workers_and_remembers_the_latest_agents_only(
    tiny_model_dirs, start_worker, monkeypatch
):
    """A memory remembers which worker served each agent last (for hand-overs), and kept
    it for every agent it ever served, deleted ones too: a gateway's memory, serving every
    conversation, spares and branches included, grew for good (~130 bytes an agent). It
    forgets a deleted agent's now, and keeps the last SERVED_KEPT agents."""
    from agentkv.client import core

    monkeypatch.setattr(core, "SERVED_KEPT", 2)
    worker = start_worker(tiny_model_dirs["llama"]).address
    with AgentMemory(worker) as mem:
        made = {name: mem.agent(name, system="Be brief.") for name in ("a", "b", "c")}
        assert list(mem._served) == ["default/b", "default/c"]
        assert made["c"].delete()
        assert list(mem._served) == ["default/b"]
        made["a"].describe()  # served again: remembered again, as the latest
        assert list(mem._served) == ["default/b", "default/a"]
