"""Cross-phase context injection and forks, through real store and worker processes.

Injecting messages then taking a turn gives the same context as one agent that saw the same
messages in a single prefill, while prefilling only what was injected; a fork shares its
source's blocks in the store, so the store grows only by the fork's new blocks.
"""

from __future__ import annotations

import pytest

from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentExists, AgentNotFound, InvalidArgument
from tests.conftest import ARCHS

SYSTEM = "You are the warden of the prison. " * 12
Q1 = [("user", "Where were you on the night of the fourteenth?")]
HEARD = [("user", "Prisoner B said: I was at home, ask my mother.")]
Q2 = [("user", "Prove it, prisoner.")]


@pytest.mark.parametrize("arch", ARCHS)
def test_inject_then_say_equals_one_prefill(tiny_model_dirs, start_worker, arch):
    w = WorkerClient(start_worker(tiny_model_dirs[arch]).address)
    for agent in ("injected", "single"):
        w.create_agent("ns", agent, SYSTEM)
        w.turn("ns", agent, Q1, max_tokens=6)  # an open reply: injection must close it
    injected = w.inject("ns", "injected", HEARD, phase="p2")
    reply = w.turn("ns", "injected", Q2, max_tokens=16)
    single = w.turn("ns", "single", HEARD + Q2, max_tokens=16)

    # The same context; the replies agree up to Q4 rounding (the single turn attended the
    # heard message in full precision within its turn, the injected agent as stored).
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert len(reply.token_ids) == len(single.token_ids) == 16
    # Only the injected tokens were prefilled, then only the new question: never the past.
    assert injected.usage.cache_state == "hot" and injected.usage.generated_tokens == 0
    assert injected.usage.finish_reason == "none"
    assert injected.usage.prefilled_tokens + reply.usage.prefilled_tokens == (
        single.usage.prefilled_tokens
    )
    assert injected.agent.phase == "p2" and injected.agent.tier == "hot"
    assert injected.agent.num_tokens == injected.usage.prompt_tokens


def test_inject_into_a_warm_agent_restores_it_first(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    for agent in ("evicted", "hot"):
        w.create_agent("ns", agent, SYSTEM)
    w.evict("ns", "evicted")
    injected = w.inject("ns", "evicted", HEARD)
    assert injected.usage.cache_state == "warm" and injected.usage.reused_store_tokens > 0
    w.inject("ns", "hot", HEARD)
    a, b = (w.turn("ns", agent, Q2, max_tokens=12) for agent in ("evicted", "hot"))
    assert a.token_ids == b.token_ids


def test_a_fork_shares_its_source_blocks(tiny_model_dirs, start_worker, store):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("ns", "source", SYSTEM)
    w.turn("ns", "source", Q1, max_tokens=8, durable=True)
    before = store.stats()
    before_keys = set(store.get_agent("ns", "source").block_keys)

    fork = w.fork("ns", "source", "fork", phase="what-if")
    assert fork.tier == "warm" and fork.phase == "what-if"
    assert fork.num_tokens == w.describe("ns", "source").num_tokens
    after_fork = store.stats()
    assert after_fork.num_bytes == before.num_bytes  # not one block copied
    assert after_fork.num_blocks == before.num_blocks

    sampling = {"max_tokens": 12, "durable": True}
    a = w.turn("ns", "fork", Q2, **sampling)
    b = w.turn("ns", "source", Q2, **sampling)
    assert a.token_ids == b.token_ids  # the fork continues exactly where its source stood
    assert a.usage.cache_state == "warm"
    source_keys = list(store.get_agent("ns", "source").block_keys)
    fork_keys = list(store.get_agent("ns", "fork").block_keys)
    shared = sum(1 for x, y in zip(source_keys, fork_keys, strict=False) if x == y)
    assert shared >= 2  # the system prompt's blocks and more
    # The store grew only by blocks the two turns wrote (the same content dedups to one key).
    new = (set(source_keys) | set(fork_keys)) - before_keys
    assert store.stats().num_blocks - before.num_blocks <= len(new) <= 4


def test_a_fork_retried_with_its_request_id_gets_the_same_reply(tiny_model_dirs, start_worker):
    """A fork's retry (its reply lost) with the same request_id is answered with the agent the
    first call made, as the first reply would have said; a fork onto an agent made otherwise,
    or by another call, is refused as before."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("ns", "source", SYSTEM)
    w.create_agent("ns", "other", SYSTEM)
    w.turn("ns", "source", Q1, max_tokens=8, durable=True)
    first = w.fork("ns", "source", "fork", phase="what-if", request_id="call-1")
    assert w.fork("ns", "source", "fork", phase="what-if", request_id="call-1") == first
    assert first.generation == 1 and first.phase == "what-if"
    with pytest.raises(AgentExists):
        w.fork("ns", "source", "fork", request_id="call-2")
    with pytest.raises(AgentExists):
        w.fork("ns", "source", "fork")
    with pytest.raises(AgentExists):
        w.fork("ns", "source", "other", request_id="call-1")
    with pytest.raises(InvalidArgument, match="request_id of 65 characters is over 64"):
        w.fork("ns", "source", "fork-2", request_id="k" * 65)
    # Once the fork has moved on (its first commit), it is an agent like any other.
    w.turn("ns", "fork", Q2, max_tokens=4, durable=True)
    with pytest.raises(AgentExists):
        w.fork("ns", "source", "fork", phase="what-if", request_id="call-1")


def test_a_forks_retry_is_answered_whatever_its_source_did_since(tiny_model_dirs, start_worker):
    """The source moved on (a turn), or was deleted, between the fork and its retry: the retry
    is answered with the fork made (it was refused: NOT_FOUND for a deleted source)."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("ns", "source", SYSTEM)
    w.turn("ns", "source", Q1, max_tokens=8, durable=True)
    first = w.fork("ns", "source", "fork", request_id="call-1")
    w.turn("ns", "source", Q2, max_tokens=4, durable=True)
    assert w.fork("ns", "source", "fork", request_id="call-1") == first
    w.delete("ns", "source")
    assert w.fork("ns", "source", "fork", request_id="call-1") == first
    with pytest.raises(AgentNotFound):
        w.fork("ns", "source", "fork-2", request_id="call-2")


def test_a_durable_turn_ends_once_committed(tiny_model_dirs, start_worker, store):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("ns", "a", SYSTEM)
    reply = w.turn("ns", "a", Q1, max_tokens=8, durable=True)
    manifest = store.get_agent("ns", "a")
    assert list(manifest.token_ids)[-8:] == reply.token_ids  # committed before the reply ended


def test_bad_injections_and_forks_get_precise_errors(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("ns", "a", SYSTEM)
    w.create_agent("ns", "b", SYSTEM)
    w.wait_durable("ns", "a")  # the create's commit lands asynchronously: compare after it
    state = w.describe("ns", "a")
    with pytest.raises(InvalidArgument, match="at least one message"):
        w.inject("ns", "a", [])
    with pytest.raises(InvalidArgument, match="empty"):
        w.inject("ns", "a", [("user", "  ")])
    with pytest.raises(InvalidArgument, match="empty"):
        w.turn("ns", "a", [("user", "")], max_tokens=4)
    with pytest.raises(InvalidArgument, match="role"):
        w.inject("ns", "a", [("narrator", "hello")])
    with pytest.raises(AgentNotFound):
        w.inject("ns", "ghost", HEARD)
    with pytest.raises(AgentNotFound):
        w.fork("ns", "ghost", "c")
    with pytest.raises(AgentExists):
        w.fork("ns", "a", "b")
    with pytest.raises(InvalidArgument):
        w.fork("ns", "a", "bad id!")
    after = w.describe("ns", "a")
    assert (after.num_tokens, after.generation) == (state.num_tokens, state.generation)
    assert w.turn("ns", "a", Q1, max_tokens=4).usage.cache_state == "hot"


def test_an_injection_is_not_counted_as_a_reply(tiny_model_dirs, start_worker):
    """The worker's TTFT and generated-token metrics count replies only: an injection
    generates nothing, so it adds no time to first token."""
    import urllib.request

    proc = start_worker(tiny_model_dirs["llama"], "--metrics-listen", "127.0.0.1:0")
    w = WorkerClient(proc.address)
    w.create_agent("ns", "listener", SYSTEM)
    w.inject("ns", "listener", HEARD)
    reply = w.turn("ns", "listener", Q2, max_tokens=4)
    w.inject("ns", "listener", HEARD)
    metrics = proc._find_event("serving", 0)["metrics"]
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    assert "agentkv_worker_ttft_seconds_count 1.0" in text
    generated = f"agentkv_worker_generated_tokens_total {float(len(reply.token_ids))}"
    assert generated in text
