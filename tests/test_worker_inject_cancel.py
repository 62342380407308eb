"""A cancelled InjectContext, through real store and worker processes: all or nothing. Cut
before its prefill ended it adds nothing (its request_id not taken, so the SDK's retry adds
it once); cut after, it is whole, and the retry adds nothing."""

from __future__ import annotations

import os
import signal
import time

import grpc

from agentkv.client.messages import pb_messages
from agentkv.client.worker import WorkerClient
from agentkv.worker.v1 import worker_pb2 as pb
from tests.faulty_worker import SLOW_STEP_SEED
from tests.helpers import freeze
from tests.test_worker_cancel import hot_bytes
from tests.test_worker_hardening import Q1, Q2, SAMPLED, TALK, create, faulty_process

HEARD = [("user", "Prisoner B said: I was at home all night, ask my mother. " * 40)]


def injection(agent_id: str, durable: bool = False) -> pb.InjectContextRequest:
    """HEARD for the agent, as the SDK sends it and resends it after a lost reply."""
    return pb.InjectContextRequest(
        namespace="default",
        agent_id=agent_id,
        messages=pb_messages(HEARD),
        durable=durable,
        request_id=f"heard-{agent_id}",
    )


def cancel_once(w: WorkerClient, call: grpc.Future, agent_id: str, ready) -> None:
    """Cancels the call once `ready` holds of the agent's KV bytes on the worker."""
    deadline = time.monotonic() + 60
    while not ready(hot_bytes(w, "default", agent_id)):
        assert time.monotonic() < deadline and not call.done()
        time.sleep(0.05)
    assert call.cancel()


def same_replies(w: WorkerClient, messages, *agents: str) -> None:
    """The agents give the same seeded reply: their contexts and caches are the same."""
    replies = [w.turn("default", a, messages, max_tokens=8, **SAMPLED) for a in agents]
    assert len({tuple(r.token_ids) for r in replies}) == 1


def test_an_injection_cancelled_mid_prefill_adds_nothing_and_its_retry_adds_it_once(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """Cut after a chunk of its messages was prefilled, it leaves the agent as it was (in
    RAM and in the store) and its slot free; the retry with its request_id adds it once.
    Before, it was kept with a cache holding part of it, committed, and the retry added
    nothing (its request_id was taken)."""
    proc = faulty_process(
        launched, tiny_model_dirs["llama"], store_process, tmp_path, "--max-batch", "2"
    )
    w = WorkerClient(proc.address, timeout=120)
    create(w, ("default", "hog"), ("default", "other"), ("default", "cut"), ("default", "twin"))
    w.wait_durable("default", "cut")  # its creation committed: the generation compared below
    before = w.describe("default", "cut")
    hog = w.stream_turn("default", "hog", TALK, max_tokens=100, seed=SLOW_STEP_SEED)
    next(hog)  # every step now takes seconds, and prefills at most 128 tokens beside it
    request = injection("cut")
    call = w.stub.InjectContext.future(request, timeout=120)
    cancel_once(w, call, "cut", lambda num_bytes: num_bytes > before.num_bytes)
    # Its slot (of two; the hog holds the other) takes another agent's turn, durable: a
    # write of "cut" queued at its cancel lands first.
    assert len(w.turn("default", "other", TALK, max_tokens=1, durable=True).token_ids) == 1
    after = w.describe("default", "cut")
    assert (after.num_tokens, after.num_bytes) == (before.num_tokens, before.num_bytes)
    with store_process.client() as store:
        assert store.get_agent("default", "cut", summary_only=True).generation == (
            before.generation
        )
    hog.close()
    same_replies(w, Q1, "cut", "twin")  # the cut agent is the one that never heard it
    retried = w.stub.InjectContext(request, timeout=120)  # the SDK's retry
    whole = w.inject("default", "twin", HEARD)
    assert retried.agent.num_tokens == whole.agent.num_tokens > before.num_tokens + 1000
    assert retried.usage.prefilled_tokens == whole.usage.prefilled_tokens
    again = w.stub.InjectContext(request, timeout=120)  # now taken: it adds nothing
    assert again.agent.num_tokens == whole.agent.num_tokens
    same_replies(w, Q2, "cut", "twin")


def test_an_injection_cancelled_after_its_prefill_is_whole_and_its_retry_adds_nothing(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A durable injection cut while its commit waits on a hung store: its prefill ended,
    so it stays whole; the retry with its request_id adds nothing (its reply was lost)."""
    proc = faulty_process(launched, tiny_model_dirs["llama"], store_process, tmp_path)
    w = WorkerClient(proc.address, timeout=120)
    create(w, ("default", "cut"), ("default", "twin"))
    whole = w.inject("default", "twin", HEARD)
    request = injection("cut", durable=True)
    freeze(store_process.proc.pid)
    try:  # the hot agent's turn runs without the store's answer (store_check_timeout)
        call = w.stub.InjectContext.future(request, timeout=120)
        cancel_once(w, call, "cut", lambda num_bytes: num_bytes == whole.agent.num_bytes)
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    retried = w.stub.InjectContext(request, timeout=120)
    assert retried.usage.prefilled_tokens == 0
    assert retried.agent.num_tokens == whole.agent.num_tokens
    same_replies(w, Q2, "cut", "twin")
