"""A cancelled CreateAgent, through real store and worker processes: its prefill stops at the
next step and it makes nothing, so a retry makes the agent as an uninterrupted call does."""

from __future__ import annotations

import time

import pytest

from agentkv.client.worker import WorkerClient
from agentkv.errors import AgentNotFound
from agentkv.worker.v1 import worker_pb2 as pb
from tests.faulty_worker import SLOW_STEP_SEED
from tests.test_worker_hardening import Q1, SAMPLED, SYSTEM, TALK, create, faulty_process

LONG_SYSTEM = SYSTEM * 10  # ~2,500 tokens: some 20 steps of 128 beside a decoding turn


def hot_bytes(w: WorkerClient, ns: str, agent_id: str) -> int:
    """The agent's KV bytes on the worker (what its prefill has made so far); 0 while it is
    not there."""
    try:
        return w.describe(ns, agent_id).num_bytes
    except AgentNotFound:
        return 0


def test_a_cancelled_create_agent_stops_its_prefill_and_leaves_no_agent(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A CreateAgent cancelled mid-prefill (its deadline passed, or its client went away)
    leaves the batch at the next step: no agent on the worker or in the store, its slot
    free for another agent's turn, and a retry makes the agent as a call never cancelled
    does. Before, it was kept and committed with its whole system prompt for context."""
    proc = faulty_process(
        launched, tiny_model_dirs["llama"], store_process, tmp_path, "--max-batch", "2"
    )
    w = WorkerClient(proc.address, timeout=120)
    create(w, ("default", "hog"), ("default", "other"))
    hog = w.stream_turn("default", "hog", TALK, max_tokens=100, seed=SLOW_STEP_SEED)
    next(hog)  # every step now takes seconds, and prefills at most 128 tokens beside it
    request = pb.CreateAgentRequest(agent_id="late", system_prompt=LONG_SYSTEM)
    late = w.stub.CreateAgent.future(request, timeout=120)
    deadline = time.monotonic() + 60
    while hot_bytes(w, "default", "late") == 0:  # until a chunk of its prompt is prefilled
        assert time.monotonic() < deadline and not late.done()
        time.sleep(0.05)
    assert late.cancel()
    # Its slot (of two; the hog holds the other) takes another agent's turn. Durable: a
    # write of "late" queued at its cancel would have landed before this one's.
    assert len(w.turn("default", "other", TALK, max_tokens=1, durable=True).token_ids) == 1
    with pytest.raises(AgentNotFound):
        w.describe("default", "late")
    with store_process.client() as store, pytest.raises(AgentNotFound):
        store.get_agent("default", "late", summary_only=True)
    hog.close()
    retried = w.create_agent("default", "late", LONG_SYSTEM)
    # Another namespace: prefilled as well, not read from the store's blocks of "late".
    twin = w.create_agent("twin", "late", LONG_SYSTEM)
    assert retried.num_tokens == twin.num_tokens > 2000
    replies = [w.turn(ns, "late", Q1, max_tokens=8, **SAMPLED) for ns in ("default", "twin")]
    assert replies[0].token_ids == replies[1].token_ids
