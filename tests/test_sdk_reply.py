"""The sync SDK's Reply (client/memory.py) against a real worker process: close() ends it for
every reader, threads reading it at the time included, and frees the turn's slot on its
worker, which keeps what it generated; `with` closes it."""

from __future__ import annotations

import re
import threading
import time

import pytest

from agentkv.client.memory import Agent, AgentMemory, Reply
from agentkv.errors import FailedPrecondition

SYSTEM = "You are the keeper of the lighthouse. " * 12
ASK = "What did you see from the lamp room last night?"
AGAIN = "And the night before?"
LONG = 3000  # tokens: about 4.5 s of decoding, far from whole when it is closed
CLOSED = r"the reply of Agent\(default/keeper\) was closed after \d+ tokens"


def said_again(agent: Agent, text: str) -> Reply:
    """A short turn, said again while the agent's last turn has not yet left its worker."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return agent.say(text, max_tokens=4).wait()
        except FailedPrecondition as exc:
            assert "turn in progress" in exc.message and time.monotonic() < deadline


class Reader(threading.Thread):
    """Reads a reply to its end in a thread of its own; `error`: what ended it otherwise."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(daemon=True)
        self.reply, self.pieces = reply, []
        self.reading = threading.Event()  # a first piece came: it reads the live stream
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for piece in self.reply:
                self.pieces.append(piece)
                self.reading.set()
        except Exception as exc:
            self.error = exc


def test_closing_a_reply_other_threads_read_ends_it_for_every_reader(tiny_model_dirs, start_worker):
    with AgentMemory(start_worker(tiny_model_dirs["llama"]).address) as mem:
        agent = mem.agent("keeper", system=SYSTEM)
        before = agent.describe().num_tokens
        reply = agent.say(ASK, max_tokens=LONG)
        readers = [Reader(reply), Reader(reply)]
        for reader in readers:
            reader.start()
            assert reader.reading.wait(60)
        reply.close()
        for reader in readers:
            reader.join(60)
            assert isinstance(reader.error, FailedPrecondition), reader.error
            assert re.search(CLOSED, reader.error.message)
        with pytest.raises(FailedPrecondition, match=CLOSED):
            list(reply)  # and a later reader
        with pytest.raises(FailedPrecondition, match=CLOSED):
            _ = reply.text
        assert not reply.done
        reply.close()  # again: nothing more
        kept = said_again(agent, AGAIN).usage.prompt_tokens
        assert kept < before + LONG  # the worker cut the turn short


def test_closing_the_memory_a_reply_is_read_through_closes_the_reply(tiny_model_dirs, start_worker):
    """AgentMemory.close() while a thread reads a reply: the reader got gRPC's own words
    ("Stream removed (Channel closed!)") as a bare AgentKVError, where asyncio's SDK and
    reply.close() say the reply was closed; and a call after close() raised gRPC's
    ValueError. Now both say so, as FailedPrecondition."""
    address = start_worker(tiny_model_dirs["llama"]).address
    mem = AgentMemory(address)
    agent = mem.agent("keeper", system=SYSTEM)
    reader = Reader(agent.say(ASK, max_tokens=LONG))
    reader.start()
    assert reader.reading.wait(60)
    mem.close()
    reader.join(60)
    assert isinstance(reader.error, FailedPrecondition), reader.error
    assert re.search(CLOSED, reader.error.message)
    for call in (lambda: agent.say(AGAIN), agent.describe, lambda: mem.agent("other", SYSTEM)):
        with pytest.raises(FailedPrecondition, match="this AgentMemory was closed"):
            call()


def test_a_reply_used_with_with_is_closed_at_its_end(tiny_model_dirs, start_worker):
    with AgentMemory(start_worker(tiny_model_dirs["llama"]).address) as mem:
        agent = mem.agent("keeper", system=SYSTEM)
        before = agent.describe().num_tokens
        with agent.say(ASK, max_tokens=LONG) as reply:
            first = next(iter(reply))
        with pytest.raises(FailedPrecondition, match=CLOSED):
            list(reply)
        assert first and said_again(agent, AGAIN).usage.prompt_tokens < before + LONG

        with agent.say(AGAIN, max_tokens=8) as whole:
            pieces = list(whole)
        assert whole.done and whole.text == "".join(pieces)  # a whole reply stays whole
        assert whole.usage.generated_tokens == len(whole.token_ids) == 8


def test_a_replys_prompt_usage_comes_with_its_first_token(tiny_model_dirs, start_worker):
    """`started`: what the prompt cost (tokens reused, prefilled, its cache state), known
    before the reply ends, equal to that of the turn's usage at its end."""
    with AgentMemory(start_worker(tiny_model_dirs["llama"]).address) as mem:
        agent = mem.agent("keeper", system=SYSTEM)
        with agent.say(ASK, max_tokens=LONG) as reply:
            next(iter(reply))
            started = reply.started
            assert not reply.done  # told while the reply runs
        said = said_again(agent, AGAIN)
        for prompt in (started, said.started):
            assert prompt is not None and prompt.generated_tokens == 1
            assert prompt.prompt_tokens > len(SYSTEM) // 8
        end = said.usage
        fields = ("prompt_tokens", "reused_hot_tokens", "reused_store_tokens", "prefilled_tokens")
        fields += ("cache_state", "restore_path", "time_to_first_token_ms")
        assert [getattr(said.started, f) for f in fields] == [getattr(end, f) for f in fields]
        assert said.started.reused_hot_tokens > 0  # the first turn's context, in RAM
        assert agent.say([], max_tokens=0).wait().started is None  # nothing generated
