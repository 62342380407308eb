"""Continuous batching through the worker process: concurrent turns decode together and say
exactly what they would alone; a cancelled stream frees its slot; a full queue refuses."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request

import grpc
import pytest

from agentkv.client.worker import WorkerClient
from agentkv.errors import (
    AgentExists,
    AgentNotFound,
    FailedPrecondition,
    ResourceExhausted,
    ServerBusy,
)
from agentkv.worker.v1 import worker_pb2 as pb
from tests.helpers import long_turn, metric, read_tokens, until

PROMPTS = {f"agent{i}": "You are the warden. " * (3 + 11 * i) for i in range(4)}
QUESTION = [("user", "Where were you?")]
DECODE_STEPS = "agentkv_worker_batch_size_count"  # one observation a decode step


def test_concurrent_turns_batch_and_match_sequential(tiny_model_dirs, start_worker):
    model = tiny_model_dirs["llama"]
    alone = WorkerClient(start_worker(model, "--max-batch", "1", name="alone").address)
    proc = start_worker(
        model, "--max-batch", "4", "--metrics-listen", "127.0.0.1:0", name="batched"
    )
    batched = WorkerClient(proc.address)
    expected = {}
    for agent, system in PROMPTS.items():
        alone.create_agent("seq", agent, system)
        expected[agent] = alone.turn("seq", agent, QUESTION, max_tokens=48).token_ids
        batched.create_agent("par", agent, system)
    # Each turn runs long (3000 tokens, a stop never met), so that once every one has
    # streamed a token all four are in the batch at once, however late each was admitted.
    calls = {agent: long_turn(batched, "par", agent, QUESTION) for agent in PROMPTS}
    got: dict[str, list[int]] = {agent: [] for agent in PROMPTS}
    for agent, call in calls.items():
        read_tokens(call, 1, got[agent])
    for agent, call in calls.items():
        read_tokens(call, 48, got[agent])
        got[agent] = got[agent][:48]
        call.cancel()
    assert got == expected
    serving = proc._find_event("serving", 0)
    text = urllib.request.urlopen(f"http://{serving['metrics']}/metrics", timeout=10).read()
    single = next(
        line
        for line in text.decode().splitlines()
        if line.startswith('agentkv_worker_batch_size_bucket{le="1.0"}')
    )
    total = next(
        line
        for line in text.decode().splitlines()
        if line.startswith("agentkv_worker_batch_size_count")
    )
    assert float(single.split()[-1]) < float(total.split()[-1])  # some steps decoded several


def test_cancelled_stream_frees_its_slot_and_keeps_the_agent(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"], "--max-batch", "1").address)
    w.create_agent("default", "talker", "You talk.")
    w.create_agent("default", "next", "You wait.")
    call = long_turn(w, "default", "talker")
    next(call)  # generating now, holding the only slot
    call.cancel()
    start = time.monotonic()
    reply = w.turn("default", "next", QUESTION, max_tokens=4)
    assert len(reply.token_ids) == 4 and time.monotonic() - start < 30
    again = w.turn("default", "talker", QUESTION, max_tokens=4)  # the agent is intact
    assert len(again.token_ids) == 4 and again.usage.cache_state == "hot"


def test_a_full_queue_is_refused_with_resource_exhausted(tiny_model_dirs, start_worker):
    proc = start_worker(
        tiny_model_dirs["llama"],
        *("--max-batch", "1", "--queue-limit", "1", "--metrics-listen", "127.0.0.1:0"),
    )
    w = WorkerClient(proc.address)
    for agent in ("a", "b", "c"):
        w.create_agent("default", agent, "You talk.")
    running = long_turn(w, "default", "a")
    next(running)
    waiting = long_turn(w, "default", "b")  # queued behind a
    until(lambda: metric(proc, "agentkv_worker_turns_waiting") >= 1, "b queued behind a")
    before = w.describe("default", "c").num_tokens
    with pytest.raises(ResourceExhausted, match="queue limit 1") as full:
        w.turn("default", "c", QUESTION, max_tokens=4)
    assert type(full.value) is ServerBusy  # passing, unlike a quota (a gateway says retry)
    running.cancel()
    waiting.cancel()
    with pytest.raises(grpc.RpcError):
        next(running)
    assert w.describe("default", "c").num_tokens == before  # the refused turn left no trace
    retried = w.turn("default", "c", QUESTION, max_tokens=4)
    assert retried.usage.reused_hot_tokens == before  # no message was half-appended
    assert retried.usage.prompt_tokens == before + retried.usage.prefilled_tokens


def test_an_empty_append_only_turn_ends_at_once(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address, timeout=30)
    w.create_agent("default", "quiet", "You wait.")
    reply = w.turn("default", "quiet", [], max_tokens=0)
    assert reply.usage.finish_reason == "none" and reply.usage.prefilled_tokens == 0
    assert len(w.turn("default", "quiet", QUESTION, max_tokens=3).token_ids) == 3


def test_a_long_system_prompt_is_prefilled_between_the_others_steps(tiny_model_dirs, start_worker):
    """CreateAgent's prefill is scheduled as a turn's is, a chunk per step between the decode
    steps: an agent decoding meanwhile gets a token per chunk, where the whole prefill used
    to run as one job (a dozen long system prompts froze every stream for minutes)."""
    proc = start_worker(
        tiny_model_dirs["llama"], "--prefill-chunk", "64", "--metrics-listen", "127.0.0.1:0"
    )
    w = WorkerClient(proc.address)
    w.create_agent("default", "talker", "You talk.")
    call = long_turn(w, "default", "talker")
    next(call)  # decoding now, for 3000 tokens

    def drain() -> None:  # the stream is read, so that the worker never waits to send
        with contextlib.suppress(grpc.RpcError):  # cancelled below
            for _ in call:
                pass

    reader = threading.Thread(target=drain)
    reader.start()
    # Decode steps, counted by the worker: a reader thread's count lags behind it.
    before = metric(proc, DECODE_STEPS)
    system = "The archivist indexes every scroll. " * 150
    request = pb.CreateAgentRequest(namespace="default", agent_id="reader", system_prompt=system)
    made = w.stub.CreateAgent(request, timeout=120)
    during = metric(proc, DECODE_STEPS) - before
    call.cancel()
    reader.join()
    chunks = made.usage.prefilled_tokens // 64
    assert chunks >= 30, made.usage
    assert during >= chunks, during  # a decode step a chunk (59 for 51 here); before: 3 to 6


def test_a_create_while_the_same_agent_is_being_made_is_answered_once_it_is(
    tiny_model_dirs, start_worker
):
    """Two creates of one agent: the second, arriving while the first still prefills the
    system prompt, waits for it and is told the agent exists, so a turn right after it
    finds the agent made (it had been told at once, then refused: "turn in progress")."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"], "--prefill-chunk", "64").address)
    system = "The archivist indexes every scroll. " * 150
    for attempt in range(10):  # a test starved through a whole prefill missed it: again
        agent = f"twice{attempt}"
        first = threading.Thread(target=lambda a=agent: w.create_agent("", a, system))
        first.start()
        if refused_while_made(w, agent):
            break
        first.join()
    else:
        pytest.fail("no empty turn came while a create prefilled, in 10 tries")
    with pytest.raises(AgentExists):
        w.create_agent("default", agent, system)
    reply = w.turn("default", agent, QUESTION, max_tokens=4)
    assert len(reply.token_ids) == 4 and reply.usage.cache_state == "hot"
    first.join()
    assert w.describe("default", agent).num_tokens > 3000  # one agent, in "default"


def refused_while_made(w: WorkerClient, agent: str) -> bool:
    """Empty turns of `agent` until one is refused as its create prefills (True), or one
    is taken: the create had ended (False)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            w.turn("default", agent, [], max_tokens=0)
            return False
        except FailedPrecondition:
            return True
        except AgentNotFound:
            assert time.monotonic() < deadline, "the first create never started"
