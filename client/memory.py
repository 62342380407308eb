"""The agentkv SDK: agents whose KV caches persist, routed across one or more workers.

    mem = AgentMemory(["127.0.0.1:7001", "127.0.0.1:7002"], store="127.0.0.1:7000")
    marco = mem.agent("marco", system="You are Marco, a careful analyst.")
    for piece in marco.say("What changed since yesterday?"):
        print(piece, end="", flush=True)
    marco.inject("Luca said: the numbers are final.")  # prefills only these tokens

Each agent goes to the worker rendezvous hashing picks for it (client/routing.py), so it finds
its cache hot there. When that worker cannot be reached, the call moves to the next-ranked
worker, which restores the agent warm from the store; a call that fails that way is retried,
with backoff, only while nothing of it has reached the caller. Errors are agentkv.errors
classes mapped from gRPC status codes; every call has a deadline (`timeout`). The logic is
client/core.py's, shared with the asyncio SDK; this module does the blocking I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TypeVar

import grpc

from agentkv.channels import ClientSecurity
from agentkv.client.core import BaseAgent, BaseAgentMemory, Operation, Steps
from agentkv.client.messages import Messages, as_messages
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.client.worker_core import BaseReply, TurnResult, cut_off
from agentkv.errors import DeadlineExceeded, typed_errors
from agentkv.worker.v1 import worker_pb2 as pb

__all__ = ["Agent", "AgentMemory", "Messages", "Reply", "as_messages", "cut_off"]
T = TypeVar("T")


class Reply(BaseReply):
    """A reply streaming in: iterate for text pieces (any number of readers, threads
    included, each from the start), or events() for its tool calls too; `.text`,
    `.tool_calls`, `.token_ids` and `.usage` wait for the end. `.worker` is the address that
    served it. close() it (or use `with`) to stop it early."""

    def __init__(
        self, agent: Agent, call: grpc.Call, first: pb.TurnResponse | None, worker: str
    ) -> None:
        super().__init__(agent, call, first, worker)
        self._lock = threading.Lock()  # one reader pulls from the call at a time

    def __iter__(self) -> Iterator[str]:
        """Every text piece from the start; a reply cut off or closed raises its error once
        the pieces that came before it are read."""
        return self._follow(self._result.pieces)

    def events(self) -> Iterator[str | pb.ToolCall]:
        """As iterating, with the reply's tool calls (pb.ToolCall) among its text pieces, in
        the order the worker sent them."""
        return self._follow(self._result.events)

    def _follow(self, items: list[T]) -> Iterator[T]:
        """Every item of `items` (a list of the reply's result) from the start, as they come."""
        seen = 0
        while True:
            with self._lock:
                while seen == len(items) and not self.done:
                    self._pull()
                new = items[seen:]
            seen += len(new)
            yield from new
            if not new and self.done:
                return

    def _pull(self) -> None:
        self._check()
        try:
            self._took(next(self._call, None))
        except Exception as exc:
            self._failed(exc)
        self._check()

    def wait(self) -> Reply:
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stops the reply, from any thread: one not yet whole is cancelled on its worker,
        which keeps what it generated until then in the agent's context (as any turn cut
        short), or undoes the turn if no token of it had been sent yet. Its readers, those
        reading now included, and every later one get FailedPrecondition 'the reply ... was
        closed'. A whole reply stays as it is."""
        self._close()

    def __enter__(self) -> Reply:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _whole(self) -> TurnResult:
        return self.wait()._result


class Agent(BaseAgent):
    """One agent of an AgentMemory. Cheap to make; holds no connection of its own."""

    def _reply(self, worker: str, call: grpc.Call) -> Reply:
        try:
            with typed_errors():
                first = next(call, None)  # a worker that is down raises here
        except DeadlineExceeded as exc:  # before any of it came: say what became of the turn
            raise cut_off(exc, worker, 0, self) from None
        return Reply(self, call, first, worker)


class AgentMemory(BaseAgentMemory):
    """One store and one or more workers. Thread-safe; close() when done (or use `with`)."""

    worker_class = WorkerClient
    agent_class = Agent

    def _open_store(self, address: str, security: ClientSecurity) -> StoreClient:
        return StoreClient(address, timeout=self.timeout, security=security)

    def close(self) -> None:
        """Closes every connection: a reply being read fails as closed (FailedPrecondition),
        and a later call on this memory is FailedPrecondition too."""
        self._shut.set()
        for worker in self.workers.values():
            worker.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> AgentMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def agents(self) -> list[pb.AgentState]:
        """Every agent of the namespace in the store, as its worker sees it (tier, tokens,
        bytes, phase; one written under another model: tier "other model", the store's
        figures). Needs the store's address."""
        self._need_store()
        states = (self._run(self._listed(s)) for s in self.store.list_agents(self.namespace))
        return [state for state in states if state is not None]

    def _run(self, steps: Steps[T]) -> T:
        operation = Operation(steps)
        for delay, call in operation:
            time.sleep(delay)
            with operation.outcome():
                operation.result = call()
        return operation.value
