"""The SDK's sans-IO core, shared by the sync (client/memory.py) and asyncio (client/aio.py)
clients: routing attempts, an agent's calls, replies assembled from their stream, the error of
a reply cut off. The worker's RPCs themselves are built in client/worker_core.py, a
turn's request in client/messages.py.

Every public method is written once, in a Base class here; the transport's subclass adds the
I/O, a few lines a kind of call, each returning its result (sync) or an awaitable of it
(asyncio), hence `MaybeAwaitable`. A routed call is an Operation: a generator of Steps (wait,
then call a worker) that the transport does one by one, sending back each result or error.
"""

from __future__ import annotations

import copy
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from operator import attrgetter
from typing import Any, Generic

from agentkv.addresses import client_address
from agentkv.channels import ClientSecurity, call_timeout
from agentkv.client.messages import Messages, Tools, as_messages, tools_json, turn_request
from agentkv.client.routing import Attempts, Router
from agentkv.client.worker_core import BaseReply, BaseWorkerClient, MaybeAwaitable, T, same
from agentkv.errors import (
    AgentExists,
    AgentKVError,
    AgentNotFound,
    FailedPrecondition,
    FingerprintMismatch,
    InvalidArgument,
    NotCommitted,
    ResourceExhausted,
    SystemPromptDiffers,
    Unavailable,
)
from agentkv.v1 import store_pb2
from agentkv.worker.v1 import worker_pb2 as pb

SERVED_KEPT = 1 << 16  # agents whose last worker a memory remembers (~130 bytes each)
OTHER_MODEL = "other model"  # the tier a listing gives an agent written under another model

Step = tuple[float, Callable[[], Any]]  # wait this many seconds, then call (or await) this
Steps = Generator[Step, Any, T]


class Operation(Generic[T]):
    """A call the core writes as a generator of Steps. Iterating gives the steps; around each
    one's I/O, the transport sets `result` inside `outcome()`, which hands an error back
    instead (raised where the step was yielded). `value`: what the generator returned."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.result: Any = None
        self._error: Exception | None = None
        self.value: T | None = None

    def __iter__(self) -> Iterator[Step]:
        try:
            step = next(self._steps)
            while True:
                yield step
                error, self._error = self._error, None
                step = self._steps.throw(error) if error else self._steps.send(self.result)
        except StopIteration as stop:
            self.value = stop.value

    @contextmanager
    def outcome(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._error = exc


class BaseAgentMemory:
    """One store and one or more workers: agents, routing and failover. The transport names
    its `worker_class` and `agent_class`, opens the store (`_open_store`) and does an
    Operation's steps (`_run`: sleeps and calls, or awaits them)."""

    worker_class: type[BaseWorkerClient]
    agent_class: type[BaseAgent]
    _open_store: Callable[[str, ClientSecurity], Any]
    _run: Callable[[Steps[T]], MaybeAwaitable[T]]

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
        self.router = Router(addresses, down_for)  # ValueError: none, repeated, malformed
        if store:
            client_address(store)  # before any channel opens
        security = security or ClientSecurity()
        self.workers = {a: self.worker_class(a, timeout, security) for a in addresses}
        self.namespace = namespace
        self.timeout, self.retries = call_timeout(timeout), retries
        self.backoff, self.durable = backoff, durable
        # agent key -> the worker that last served it, for the last SERVED_KEPT agents
        self._served: OrderedDict[str, str] = OrderedDict()
        self._shut = threading.Event()  # close() ran: the channels are gone (in_namespace's too)
        self.store: Any = self._open_store(store, security) if store else None

    def agent(
        self,
        agent_id: str,
        system: str | None = None,
        *,
        tools: Tools = None,
        phase: str = "",
        replace: bool = False,
    ) -> MaybeAwaitable[BaseAgent]:
        """A handle on an agent. With `system`, the agent is created (its system prompt, and
        `tools` with it, prefilled and persisted) unless it already exists with that system
        prompt and those tools, when it is used as it is (`created` False). One that exists
        with another system prompt or other tools raises SystemPromptDiffers, or with
        `replace` is deleted and made anew. Without `system`, the agent must exist by the
        time it is used. `tools`: OpenAI function tools ([{"type": "function", "function":
        {"name", "description", "parameters"}}], or their JSON text) its turns may call;
        only for a model with a tool-call format (GetWorkerInfo's tool_parser), else
        InvalidArgument."""
        return self._run(self._agent(agent_id, system, tools_json(tools), phase, replace))

    def _agent(
        self, agent_id: str, system: str | None, tools: str, phase: str, replace: bool
    ) -> Steps[Any]:
        agent = self.agent_class(self, agent_id)
        if system is None:
            return agent

        def create(worker: Any) -> Any:
            made = worker.create_agent  # durable: once it is in the store, as a turn is
            return made(
                self.namespace, agent_id, system, tools=tools, phase=phase, durable=self.durable
            )

        try:
            agent.state = yield from self._routed(agent_id, create)
        except SystemPromptDiffers:  # before AgentExists, which it is a kind of
            if not replace:
                raise
            yield from self._routed(agent_id, lambda w: w.delete(self.namespace, agent_id))
            agent.state = yield from self._routed(agent_id, create)
        except AgentExists:
            return agent
        agent.created = True
        return agent

    def in_namespace(self, namespace: str) -> BaseAgentMemory:
        """This memory for another namespace, sharing its connections and routing: closing
        either closes both."""
        other = copy.copy(self)
        other.namespace = namespace
        return other

    @property
    def closed(self) -> bool:
        """Whether close() ran, on this memory or on one in_namespace made of it or it of."""
        return self._shut.is_set()

    def _check_open(self) -> None:
        """A call on a closed memory is FailedPrecondition, not gRPC's own error about its
        closed channel (a ValueError, or asyncio's UsageError)."""
        if self.closed:
            raise FailedPrecondition(f"this {type(self).__name__} was closed: make a new one")

    def _need_store(self) -> None:
        self._check_open()
        if self.store is None:
            name = type(self).__name__
            raise InvalidArgument(f"listing agents needs the store: {name}(..., store=ADDR)")

    def worker_for(self, agent_id: str) -> str:
        """The address of the worker the agent goes to now."""
        return self.router.home(self._key(agent_id))

    def route(self, agent_id: str, call: Callable[[Any], Any]) -> Any:
        """Runs `call` on the agent's worker (awaits it, in asyncio); on a worker that cannot
        be reached, on the next one; after a round with none reachable, again after a
        backoff."""
        return self._run(self._routed(agent_id, call))

    def _routed(
        self,
        agent_id: str,
        call: Callable[[Any], Any],
        then: Callable[[Any], T] = same,
        deletes: bool = False,
    ) -> Steps[T]:
        self._check_open()
        key = self._key(agent_id)
        attempts = Attempts(self.router, key, self.retries, self.backoff)
        for delay, address in attempts:
            last = self._served.get(key, address)
            try:
                if last != address and last not in attempts.tried:  # not one found unreachable
                    if self.router.was_down(address):  # back? else the hand-over is for naught
                        yield delay, partial(self.workers[address].info)
                        delay = 0.0
                    if (yield from self._hand_over(last, agent_id)):
                        address = last  # its latest state is there, and there alone
                result = yield delay, partial(call, self.workers[address])
            except Unavailable as exc:
                attempts.failed(address, exc)
                continue
            attempts.succeeded(address)
            self._serve(key, None if deletes else address)
            return then(result)
        raise attempts.exhausted(agent_id)

    def _listed(self, summary: store_pb2.AgentSummary) -> Steps[pb.AgentState | None]:
        """A listed agent as its worker describes it; one written under another model as
        the store lists it (of_other_model); None for one deleted since it was listed."""
        agent_id = summary.agent_id
        try:
            return (
                yield from self._routed(agent_id, lambda w: w.describe(self.namespace, agent_id))
            )
        except FingerprintMismatch:
            return of_other_model(self.namespace, summary)
        except AgentNotFound:
            return None

    def _serve(self, key: str, address: str | None) -> None:
        """Remembers the worker that served the agent last (None: it was deleted there);
        the agents served longest ago are forgotten past SERVED_KEPT (a gateway's memory
        serves every conversation it sees)."""
        self._served.pop(key, None)
        if address is not None:
            self._served[key] = address
            while len(self._served) > SERVED_KEPT:
                self._served.popitem(last=False)

    def _hand_over(self, last: str, agent_id: str) -> Steps[bool]:
        """An agent going to another worker than the one that served it last (for this
        memory: back after a failover, or a worker added) is first evicted there, which
        commits it: a turn that worker took but had not committed would otherwise be missing
        where the agent goes. One that cannot be reached is passed by (its uncommitted turns
        are lost with it, as `durable` says). Whether the agent stays at `last`: that worker
        answered that it could not commit (its store down or full), so its latest state is
        in that worker's RAM alone."""
        try:
            yield 0.0, partial(self.workers[last].evict, self.namespace, agent_id)
        except (NotCommitted, ResourceExhausted) as exc:
            return exc.remote
        except AgentKVError:
            pass
        return False

    def _key(self, agent_id: str) -> str:
        return f"{self.namespace}/{agent_id}"


class BaseAgent:
    """One agent of a memory. Cheap to make; holds no connection of its own. The transport
    makes the reply from its turn's gRPC call once its first response arrives (`_reply`)."""

    _reply: Callable[[str, Any], MaybeAwaitable[BaseReply]]

    def __init__(self, memory: BaseAgentMemory, agent_id: str) -> None:
        self.memory, self.id = memory, agent_id
        self.created = False  # this handle created the agent
        self.state: pb.AgentState | None = None  # as the last call that returned it left it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.memory.namespace}/{self.id})"

    def _call(
        self, call: Callable[[Any], Any], then: Callable[[Any], T] = same, deletes: bool = False
    ) -> Any:
        mem = self.memory
        return mem._run(mem._routed(self.id, call, then, deletes))

    def say(
        self,
        text: Messages,
        *,
        role: str = "user",
        max_tokens: int = 256,
        temperature: float = 0.0,
        phase: str = "",
        timeout: float | None = None,
        tools: Tools = None,
        durable: bool | None = None,
        **options: Any,
    ) -> MaybeAwaitable[BaseReply]:
        """Sends a message and returns (in asyncio, awaits) once the reply's first token is
        generated (`reply.started`, the prompt's usage, comes just before it); iterate the
        reply (`async for`, in asyncio) for the rest of its text as it streams, or read
        `.text` for all of it (after `await reply.wait()`, in asyncio).
        `text`: a text (one message with `role`), or messages: (role, content) pairs or
        OpenAI-style dicts (an assistant's "tool_calls", a tool's "tool_call_id" and
        content; see pb_messages). `tools`: OpenAI function tools (a list of dicts, or their
        JSON text); with whole_conversation the conversation's, else none (the agent's own,
        given to agent()) or the agent's. The reply's `.tool_calls` holds the calls the
        model made, and its usage's finish_reason is "tool_calls" when it made any.
        `durable`: the reply ends only once the turn is committed (None: the memory's
        `durable`). `options`: top_p, top_k, stop, seed, priority, deadline_ms, whole_conversation
        (`text` is the whole conversation so far, resent, its system message first),
        output_format (the reply's required form: a JSON Schema as a dict, or an
        OutputFormat), tool_call_required (the reply opens with a tool call), tool_call_name
        (with a call of that tool), tool_call_forbidden (with none), tool_call_allowed
        (calls of these tools only, the conversation's tools kept), after_mark (`text`
        follows that point of the conversation, an earlier reply's usage.mark: the turns
        after it are dropped; after_mark_last: only if none do), mark_name (a name for the
        point this turn ends at), keep_named_marks (a resent whole conversation that would
        drop a named point raises TurnsFollow instead). A retry on another worker
        after a lost first response does not run the turn twice (its request_id): it raises
        TurnTaken when the turn was taken and its reply lost."""
        mem, messages = self.memory, as_messages(text, role)
        options.update(max_tokens=max_tokens, temperature=temperature, tools=tools_json(tools))
        durable = mem.durable if durable is None else durable
        options.update(request_id=secrets.token_hex(16), phase=phase, durable=durable)

        def start(worker: BaseWorkerClient) -> Any:
            request = turn_request(mem.namespace, self.id, messages, **options)
            return self._reply(worker.address, worker.open_turn(request, timeout))

        return self._call(start)

    def inject(
        self,
        messages: Messages,
        *,
        role: str = "user",
        phase: str = "",
        durable: bool | None = None,
    ) -> MaybeAwaitable[pb.InjectContextResponse]:
        """Appends messages (say's kinds) to the agent's context without a reply: only they
        are prefilled. A retry on another worker after a lost reply adds nothing (its
        request_id). `durable`: as say's."""
        mem, said, key = self.memory, as_messages(messages, role), secrets.token_hex(16)
        durable = mem.durable if durable is None else durable
        return self._call(
            lambda w: w.inject(
                mem.namespace, self.id, said, phase=phase, durable=durable, request_id=key
            ),
            self._injected,
        )

    def _injected(self, reply: pb.InjectContextResponse) -> pb.InjectContextResponse:
        self.state = reply.agent
        return reply

    def fork(self, agent_id: str, *, phase: str = "") -> MaybeAwaitable[BaseAgent]:
        """A new agent whose context is this one's; in the store they share blocks. A retry
        on another worker after a lost reply gets the fork made (its request_id), not
        AgentExists."""
        mem, fork, key = self.memory, type(self)(self.memory, agent_id), secrets.token_hex(16)
        return self._call(
            lambda w: w.fork(mem.namespace, self.id, agent_id, phase, request_id=key), fork._made
        )

    def _made(self, state: pb.AgentState) -> BaseAgent:
        self.state, self.created = state, True
        return self

    def describe(self) -> MaybeAwaitable[pb.AgentState]:
        """Tokens, bytes, tier (hot on its worker, warm in the store, or cold) and phase."""
        return self._call(lambda w: w.describe(self.memory.namespace, self.id), self._described)

    def _described(self, state: pb.AgentState) -> pb.AgentState:
        self.state = state
        return state

    def prefetch(self) -> MaybeAwaitable[pb.Usage]:
        """Brings the agent into its worker's RAM now, ahead of its next turn: restored from
        the store if it was evicted (or its worker restarted), so that turn starts hot.
        Nothing is added to its context. The usage says what it took: cache_state "hot" (it
        was in RAM) or "warm" (restore_path, restored_bytes; restore_failure if the store's
        copy could not be used and it was re-prefilled). An agent mid-turn raises
        FailedPrecondition, as a turn does: it is in RAM already."""
        mem = self.memory
        usage = attrgetter("usage")
        return self._call(lambda w: w.turn(mem.namespace, self.id, [], max_tokens=0), usage)

    def pin(self, pinned: bool = True) -> MaybeAwaitable[pb.AgentState]:
        """Pins the agent in its worker's RAM (or, with False, unpins it): when room is
        needed, it is evicted last. The pin lasts while that worker runs; it does not
        restore an evicted agent (prefetch() does)."""
        mem = self.memory
        return self._call(lambda w: w.pin(mem.namespace, self.id, pinned), self._described)

    def evict(self) -> MaybeAwaitable[bool]:
        """Drops the agent from its worker's RAM once durable; False if it was not hot."""
        evicted = attrgetter("evicted")
        return self._call(lambda w: w.evict(self.memory.namespace, self.id), evicted)

    def delete(self) -> MaybeAwaitable[bool]:
        """Deletes the agent from its worker and the store; False if it did not exist."""
        return self._call(lambda w: w.delete(self.memory.namespace, self.id), deletes=True)


def of_other_model(namespace: str, summary: store_pb2.AgentSummary) -> pb.AgentState:
    """A listed agent no worker of this model can describe (FingerprintMismatch), as the
    store lists it: a listing shows it rather than failing for every agent."""
    return pb.AgentState(
        namespace=namespace,
        agent_id=summary.agent_id,
        tier=OTHER_MODEL,
        num_tokens=summary.num_tokens,
        num_bytes=summary.num_bytes,
        generation=summary.generation,
        phase=summary.phase,
    )
