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
from agentkv.errors import AgentExists, AgentNotFound, FailedPrecondition, ResourceExhausted
from agentkv.worker.v1 import worker_pb2 as pb

PROMPTS = {f"agent{i}": "You are the warden. " * (3 + 11 * i) for i in range(4)}
QUESTION = [("user", "Where were you?")]


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
    got, barrier = {}, threading.Barrier(len(PROMPTS))

    def run(agent: str) -> None:
        barrier.wait()
        got[agent] = batched.turn("par", agent, QUESTION, max_tokens=48).token_ids

    threads = [threading.Thread(target=run, args=(a,)) for a in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
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


def long_turn(worker: WorkerClient, agent: str):
    request = pb.TurnRequest(
        namespace="default",
        agent_id=agent,
        messages=[pb.Message(role="user", content="Talk.")],
        sampling=pb.SamplingParams(max_tokens=3000, stop=["\x00"]),
    )
    return worker.stub.Turn(request, timeout=120)


def test_cancelled_stream_frees_its_slot_and_keeps_the_agent(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"], "--max-batch", "1").address)
    w.create_agent("default", "talker", "You talk.")
    w.create_agent("default", "next", "You wait.")
    call = long_turn(w, "talker")
    next(call)  # generating now, holding the only slot
    call.cancel()
    start = time.monotonic()
    reply = w.turn("default", "next", QUESTION, max_tokens=4)
    assert len(reply.token_ids) == 4 and time.monotonic() - start < 30
    again = w.turn("default", "talker", QUESTION, max_tokens=4)  # the agent is intact
    assert len(again.token_ids) == 4 and again.usage.cache_state == "hot"


def test_a_full_queue_is_refused_with_resource_exhausted(tiny_model_dirs, start_worker):
    w = WorkerClient(
        start_worker(tiny_model_dirs["llama"], "--max-batch", "1", "--queue-limit", "1").address
    )
    for agent in ("a", "b", "c"):
        w.create_agent("default", agent, "You talk.")
    running = long_turn(w, "a")
    next(running)
    waiting = long_turn(w, "b")  # queued behind a
    time.sleep(0.5)
    before = w.describe("default", "c").num_tokens
    with pytest.raises(ResourceExhausted, match="queue limit 1"):
        w.turn("default", "c", QUESTION, max_tokens=4)
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
    w = WorkerClient(start_worker(tiny_model_dirs["llama"], "--prefill-chunk", "64").address)
    w.create_agent("default", "talker", "You talk.")
    call = long_turn(w, "talker")
    got, stop = [len(next(call).tokens.token_ids)], threading.Event()

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled below, once counted
            for response in call:
                got.append(len(response.tokens.token_ids))
                if stop.is_set():
                    return

    reader = threading.Thread(target=read)
    reader.start()
    before = sum(got)
    system = "The archivist indexes every scroll. " * 150
    request = pb.CreateAgentRequest(namespace="default", agent_id="reader", system_prompt=system)
    made = w.stub.CreateAgent(request, timeout=120)
    during = sum(got) - before
    stop.set()
    call.cancel()
    reader.join()
    chunks = made.usage.prefilled_tokens // 64
    assert chunks >= 30, made.usage
    assert during >= chunks // 2, during  # a token a step; before: 3 to 6, sent before it ran


def test_a_create_while_the_same_agent_is_being_made_is_answered_once_it_is(
    tiny_model_dirs, start_worker
):
    """Two creates of one agent: the second, arriving while the first still prefills the
    system prompt, waits for it and is told the agent exists, so a turn right after it
    finds the agent made (it had been told at once, then refused: "turn in progress")."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"], "--prefill-chunk", "64").address)
    system = "The archivist indexes every scroll. " * 150
    first = threading.Thread(target=lambda: w.create_agent("", "twice", system))
    first.start()
    deadline = time.monotonic() + 60
    while True:  # until the first create is prefilling: an empty turn is refused meanwhile
        try:
            w.turn("default", "twice", [], max_tokens=0)
        except FailedPrecondition:
            break
        except AgentNotFound:
            assert time.monotonic() < deadline, "the first create never started"
    with pytest.raises(AgentExists):
        w.create_agent("default", "twice", system)
    reply = w.turn("default", "twice", QUESTION, max_tokens=4)
    assert len(reply.token_ids) == 4 and reply.usage.cache_state == "hot"
    first.join()
    assert w.describe("default", "twice").num_tokens > 3000  # one agent, in "default"
