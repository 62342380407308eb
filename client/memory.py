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
classes mapped from gRPC status codes; every call has a deadline (`timeout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from agentkv.channels import ClientSecurity
from agentkv.errors import AgentExists, AgentKVError, InvalidArgument, Unavailable
from agentkv.worker.v1 import worker_pb2 as pb
from client.routing import Attempts, Router
from client.store import StoreClient
from client.worker import TurnResult, WorkerClient

T = TypeVar("T")
Messages = str | Sequence[tuple[str, str]]


def as_messages(messages: Messages, role: str = "user") -> list[tuple[str, str]]:
    """A text becomes one message with `role`; (role, content) pairs pass through."""
    if isinstance(messages, str):
        return [(role, messages)]
    return [(r, c) for r, c in messages]


class AgentMemory:
    """One store and one or more workers. Thread-safe; close() when done (or use `with`)."""

    def __init__(
        self,
        workers: str | Sequence[str],
        store: str | None = None,
        namespace: str = "default",
        *,
        timeout: float = 300.0,
        retries: int = 2,
        backoff: float = 0.25,
        down_for: float = 5.0,
        durable: bool = False,
        security: ClientSecurity | None = None,
    ) -> None:
        """`retries`: rounds over every worker when none answers, `backoff` seconds apart
        (doubling). `durable`: turns end only once committed to the store, so losing a
        worker right after a reply loses nothing (costs the commit's latency per turn).
        `security`: TLS and a bearer token for every worker and the store."""
        addresses = [workers] if isinstance(workers, str) else list(workers)
        self.router = Router(addresses, down_for)
        self.workers = {a: WorkerClient(a, timeout, security) for a in addresses}
        self.store = StoreClient(store, security=security) if store else None
        self.namespace = namespace
        self.timeout, self.retries, self.backoff, self.durable = timeout, retries, backoff, durable

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> AgentMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def agent(self, agent_id: str, system: str | None = None, *, phase: str = "") -> Agent:
        """A handle on an agent. With `system`, the agent is created (its system prompt
        prefilled and persisted) unless it already exists; without, it must exist by the time
        it is used."""
        agent = Agent(self, agent_id)
        if system is not None:
            try:
                agent.state = self.route(
                    agent_id,
                    lambda w: w.create_agent(self.namespace, agent_id, system, phase=phase),
                )
                agent.created = True
            except AgentExists:
                pass
        return agent

    def agents(self) -> list[pb.AgentState]:
        """Every agent of the namespace in the store, as its worker sees it (tier, tokens,
        bytes, phase). Needs the store's address."""
        if self.store is None:
            raise InvalidArgument("listing agents needs the store: AgentMemory(..., store=ADDR)")
        ids = [a.agent_id for a in self.store.list_agents(self.namespace)]
        return [Agent(self, agent_id).describe() for agent_id in ids]

    def worker_for(self, agent_id: str) -> str:
        """The address of the worker the agent goes to now."""
        return self.router.home(self._key(agent_id))

    def route(self, agent_id: str, call: Callable[[WorkerClient], T]) -> T:
        """Runs `call` on the agent's worker; on a worker that cannot be reached, on the next
        one; after a round with none reachable, again after a backoff."""
        attempts = Attempts(self.router, self._key(agent_id), self.retries, self.backoff)
        for delay, address in attempts:
            time.sleep(delay)
            try:
                result = call(self.workers[address])
            except Unavailable as exc:
                attempts.failed(address, exc)
                continue
            attempts.succeeded(address)
            return result
        raise attempts.exhausted(agent_id)

    def _key(self, agent_id: str) -> str:
        return f"{self.namespace}/{agent_id}"


class Agent:
    """One agent of an AgentMemory. Cheap to make; holds no connection of its own."""

    def __init__(self, memory: AgentMemory, agent_id: str) -> None:
        self.memory, self.id = memory, agent_id
        self.created = False  # this handle created the agent
        self.state: pb.AgentState | None = None  # as the last call that returned it left it

    def __repr__(self) -> str:
        return f"Agent({self.memory.namespace}/{self.id})"

    def say(
        self,
        text: Messages,
        *,
        role: str = "user",
        max_tokens: int = 256,
        temperature: float = 0.0,
        phase: str = "",
        timeout: float | None = None,
        **options: Any,
    ) -> Reply:
        """Sends a message and returns once the reply's first token arrives; iterate the
        Reply for the rest of its text as it streams, or read `.text` for all of it.
        `options`: top_p, top_k, stop, seed, priority, deadline_ms."""
        mem = self.memory

        def start(worker: WorkerClient) -> Reply:
            stream = worker.stream_turn(
                mem.namespace,
                self.id,
                as_messages(text, role),
                phase=phase,
                durable=mem.durable,
                timeout=timeout,
                max_tokens=max_tokens,
                temperature=temperature,
                **options,
            )
            first = next(stream, None)  # a worker that is down raises here
            if first is None:
                raise Unavailable(f"worker {worker.address} ended the turn of {self!r} at once")
            return Reply(self, stream, first, worker.address)

        return mem.route(self.id, start)

    def inject(
        self, messages: Messages, *, role: str = "user", phase: str = ""
    ) -> pb.InjectContextResponse:
        """Appends messages to the agent's context without a reply: only they are prefilled."""
        mem = self.memory
        reply = mem.route(
            self.id,
            lambda w: w.inject(
                mem.namespace,
                self.id,
                as_messages(messages, role),
                phase=phase,
                durable=mem.durable,
            ),
        )
        self.state = reply.agent
        return reply

    def fork(self, agent_id: str, *, phase: str = "") -> Agent:
        """A new agent whose context is this one's; in the store they share blocks."""
        mem = self.memory
        fork = Agent(mem, agent_id)
        fork.state = mem.route(self.id, lambda w: w.fork(mem.namespace, self.id, agent_id, phase))
        fork.created = True
        return fork

    def describe(self) -> pb.AgentState:
        """Tokens, bytes, tier (hot on its worker, warm in the store, or cold) and phase."""
        mem = self.memory
        self.state = mem.route(self.id, lambda w: w.describe(mem.namespace, self.id))
        return self.state

    def evict(self) -> bool:
        """Drops the agent from its worker's RAM once durable; False if it was not hot."""
        mem = self.memory
        return mem.route(self.id, lambda w: w.evict(mem.namespace, self.id)).evicted

    def delete(self) -> bool:
        """Deletes the agent from its worker and the store; False if it did not exist."""
        mem = self.memory
        return mem.route(self.id, lambda w: w.delete(mem.namespace, self.id))


def cut_off(exc: AgentKVError, worker: str, num_tokens: int, agent: object) -> AgentKVError:
    """What readers of a reply that `exc` cut short get: a worker that went away means the
    turn was not committed; an answer of the worker's own stands."""
    if isinstance(exc, Unavailable) and not exc.remote:
        return Unavailable(
            f"worker {worker} went away after {num_tokens} tokens of the reply of {agent!r}; "
            "the turn was not committed: say it again"
        )
    return exc


class Reply:
    """A reply streaming in: iterate for text pieces; `.text`, `.token_ids` and `.usage` wait
    for the end. `.worker` is the address that served it."""

    def __init__(
        self, agent: Agent, stream: Iterator[pb.TurnResponse], first: pb.TurnResponse, worker: str
    ):
        self.agent, self.worker = agent, worker
        self._stream, self._first = stream, first
        self._result = TurnResult()
        self._error: Exception | None = None  # raised again to every later reader
        self._lock = threading.Lock()  # one reader pulls from the stream at a time

    @property
    def usage(self) -> pb.Usage:
        """The turn's usage; waits for the end of the reply, as `.text` does."""
        return self.wait()._result.usage

    def __iter__(self) -> Iterator[str]:
        """Every piece from the start; several readers (threads included) may iterate."""
        seen, pieces = 0, self._result.pieces
        while True:
            with self._lock:
                while seen == len(pieces) and self._result.usage is None:
                    self._pull()
                new = pieces[seen:]
            seen += len(new)
            yield from new
            if not new and self._result.usage is not None:
                return

    def _pull(self) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._result.add(self._next())
        except Exception as exc:
            self._error = exc
            raise

    def _next(self) -> pb.TurnResponse:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return next(self._stream)
        except StopIteration:
            raise Unavailable(f"the reply of {self.agent!r} ended without its usage") from None
        except AgentKVError as exc:
            raise cut_off(exc, self.worker, len(self._result.token_ids), self.agent) from None

    def wait(self) -> Reply:
        for _ in self:
            pass
        return self

    @property
    def text(self) -> str:
        return self.wait()._result.text

    @property
    def token_ids(self) -> list[int]:
        return list(self.wait()._result.token_ids)

    @property
    def time_to_first_token_ms(self) -> float:
        return self.wait().usage.time_to_first_token_ms

    @property
    def cache_state(self) -> str:
        return self.wait().usage.cache_state
