"""The agentkv SDK for asyncio: client/memory.py's agents, routing and errors, on grpc.aio.

    async with AsyncAgentMemory(["127.0.0.1:7001", "127.0.0.1:7002"]) as mem:
        marco = await mem.agent("marco", system="You are Marco, a careful analyst.")
        reply = await marco.say("What changed since yesterday?")
        async for piece in reply:
            print(piece, end="", flush=True)
        await marco.inject("Luca said: the numbers are final.")  # prefills only these tokens

Routing, failover and retries are the sync SDK's (the same Router, so both send an agent to
the same worker); only awaiting differs. Make an AsyncAgentMemory inside the event loop that
uses it: grpc.aio channels belong to the loop they were made in.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from agentkv.channels import ClientSecurity
from agentkv.errors import (
    AgentExists,
    AgentKVError,
    InvalidArgument,
    Unavailable,
    from_rpc_error,
)
from agentkv.v1 import store_pb2, store_pb2_grpc
from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc
from client.memory import Messages, as_messages, cut_off
from client.routing import Attempts, Router
from client.worker import TurnResult, pb_messages

T = TypeVar("T")
DESCRIBE_CONCURRENCY = 16  # agents() describes this many agents at once


class AsyncWorkerClient:
    """An asyncio connection to one inference worker; `await close()` when done."""

    def __init__(
        self, address: str, timeout: float = 300.0, security: ClientSecurity | None = None
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = (security or ClientSecurity()).aio_channel(address)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def create_agent(
        self, namespace: str, agent_id: str, system: str = "", **fields: Any
    ) -> pb.AgentState:
        request = pb.CreateAgentRequest(
            namespace=namespace, agent_id=agent_id, system_prompt=system, **fields
        )
        return (await self.call("CreateAgent", request)).agent

    async def stream_turn(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[tuple[str, str]],
        *,
        phase: str = "",
        priority: int = 0,
        deadline_ms: int = 0,
        durable: bool = False,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[pb.TurnResponse]:
        """Streams a turn's responses: token chunks, then the usage. Closing the iterator
        early cancels the turn, which frees its slot on the worker."""
        request = pb.TurnRequest(
            namespace=namespace,
            agent_id=agent_id,
            messages=pb_messages(messages),
            sampling=pb.SamplingParams(**sampling),
            phase=phase,
            priority=priority,
            deadline_ms=deadline_ms,
            durable=durable,
        )
        call = self.stub.Turn(request, timeout=timeout or self.timeout)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def turn(
        self, namespace: str, agent_id: str, messages: Sequence[tuple[str, str]], **options: Any
    ) -> TurnResult:
        """A whole turn: the reply's text, its token ids and the usage. Takes stream_turn's
        options and sampling fields."""
        result = TurnResult()
        async for response in self.stream_turn(namespace, agent_id, messages, **options):
            result.add(response)
        return result

    async def inject(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[tuple[str, str]],
        *,
        phase: str = "",
        durable: bool = False,
    ) -> pb.InjectContextResponse:
        """Appends messages to the agent's context; only they are prefilled."""
        request = pb.InjectContextRequest(
            namespace=namespace,
            agent_id=agent_id,
            messages=pb_messages(messages),
            phase=phase,
            durable=durable,
        )
        return await self.call("InjectContext", request)

    async def fork(
        self, namespace: str, source: str, agent_id: str, phase: str = ""
    ) -> pb.AgentState:
        """A new agent that starts from `source`'s context, sharing its blocks in the store."""
        request = pb.ForkAgentRequest(
            namespace=namespace, source_agent_id=source, agent_id=agent_id, phase=phase
        )
        return (await self.call("ForkAgent", request)).agent

    async def evict(self, namespace: str, agent_id: str) -> pb.EvictAgentResponse:
        request = pb.EvictAgentRequest(namespace=namespace, agent_id=agent_id)
        return await self.call("EvictAgent", request)

    async def describe(self, namespace: str, agent_id: str) -> pb.AgentState:
        request = pb.DescribeAgentRequest(namespace=namespace, agent_id=agent_id)
        return (await self.call("DescribeAgent", request)).agent

    async def delete(self, namespace: str, agent_id: str) -> bool:
        request = pb.DeleteAgentRequest(namespace=namespace, agent_id=agent_id)
        return (await self.call("DeleteAgent", request)).deleted

    async def info(self) -> pb.GetWorkerInfoResponse:
        return await self.call("GetWorkerInfo", pb.GetWorkerInfoRequest())


class AsyncAgentMemory:
    """One store and one or more workers, for one event loop; `await close()` when done (or
    use `async with`)."""

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
        security = security or ClientSecurity()
        self.workers = {a: AsyncWorkerClient(a, timeout, security) for a in addresses}
        self.store = store
        self._store_channel = security.aio_channel(store) if store else None
        self.namespace = namespace
        self.timeout, self.retries, self.backoff, self.durable = timeout, retries, backoff, durable

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.close()
        if self._store_channel is not None:
            await self._store_channel.close()

    async def __aenter__(self) -> AsyncAgentMemory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def agent(
        self, agent_id: str, system: str | None = None, *, phase: str = ""
    ) -> AsyncAgent:
        """A handle on an agent. With `system`, the agent is created (its system prompt
        prefilled and persisted) unless it already exists; without, it must exist by the time
        it is used."""
        agent = AsyncAgent(self, agent_id)
        if system is not None:
            try:
                agent.state = await self.route(
                    agent_id,
                    lambda w: w.create_agent(self.namespace, agent_id, system, phase=phase),
                )
                agent.created = True
            except AgentExists:
                pass
        return agent

    async def agents(self) -> list[pb.AgentState]:
        """Every agent of the namespace in the store, as its worker sees it (tier, tokens,
        bytes, phase). Needs the store's address."""
        if self._store_channel is None:
            raise InvalidArgument(
                "listing agents needs the store: AsyncAgentMemory(..., store=ADDR)"
            )
        ids = [summary.agent_id async for summary in self._list_agents()]
        limit = asyncio.Semaphore(DESCRIBE_CONCURRENCY)  # not one RPC per agent all at once

        async def describe(agent_id: str) -> pb.AgentState:
            async with limit:
                return await AsyncAgent(self, agent_id).describe()

        return list(await asyncio.gather(*(describe(agent_id) for agent_id in ids)))

    async def _list_agents(self) -> AsyncIterator[store_pb2.AgentSummary]:
        stub = store_pb2_grpc.CacheStoreStub(self._store_channel)
        token = ""
        while True:
            request = store_pb2.ListAgentsRequest(namespace=self.namespace, page_token=token)
            try:
                page = await stub.ListAgents(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            for summary in page.agents:
                yield summary
            if not page.next_page_token:
                return
            token = page.next_page_token

    def worker_for(self, agent_id: str) -> str:
        """The address of the worker the agent goes to now."""
        return self.router.home(self._key(agent_id))

    async def route(self, agent_id: str, call: Callable[[AsyncWorkerClient], Awaitable[T]]) -> T:
        """Awaits `call` on the agent's worker; on a worker that cannot be reached, on the
        next one; after a round with none reachable, again after a backoff."""
        attempts = Attempts(self.router, self._key(agent_id), self.retries, self.backoff)
        for delay, address in attempts:
            await asyncio.sleep(delay)
            try:
                result = await call(self.workers[address])
            except Unavailable as exc:
                attempts.failed(address, exc)
                continue
            attempts.succeeded(address)
            return result
        raise attempts.exhausted(agent_id)

    def _key(self, agent_id: str) -> str:
        return f"{self.namespace}/{agent_id}"


class AsyncAgent:
    """One agent of an AsyncAgentMemory. Cheap to make; holds no connection of its own."""

    def __init__(self, memory: AsyncAgentMemory, agent_id: str) -> None:
        self.memory, self.id = memory, agent_id
        self.created = False  # this handle created the agent
        self.state: pb.AgentState | None = None  # as the last call that returned it left it

    def __repr__(self) -> str:
        return f"AsyncAgent({self.memory.namespace}/{self.id})"

    async def say(
        self,
        text: Messages,
        *,
        role: str = "user",
        max_tokens: int = 256,
        temperature: float = 0.0,
        phase: str = "",
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncReply:
        """Sends a message and returns once the reply's first response arrives; iterate the
        AsyncReply (`async for`) for its text as it streams, or `await reply.wait()` for all
        of it. `options`: top_p, top_k, stop, seed, priority, deadline_ms."""
        mem = self.memory

        async def start(worker: AsyncWorkerClient) -> AsyncReply:
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
            try:
                first = await anext(stream)  # a worker down raises here
            except StopAsyncIteration:
                raise Unavailable(f"the reply of {self!r} ended before it began") from None
            return AsyncReply(self, stream, first, worker.address)

        return await mem.route(self.id, start)

    async def inject(
        self, messages: Messages, *, role: str = "user", phase: str = ""
    ) -> pb.InjectContextResponse:
        """Appends messages to the agent's context without a reply: only they are prefilled."""
        mem = self.memory
        reply = await mem.route(
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

    async def fork(self, agent_id: str, *, phase: str = "") -> AsyncAgent:
        """A new agent whose context is this one's; in the store they share blocks."""
        mem = self.memory
        fork = AsyncAgent(mem, agent_id)
        fork.state = await mem.route(
            self.id, lambda w: w.fork(mem.namespace, self.id, agent_id, phase)
        )
        fork.created = True
        return fork

    async def describe(self) -> pb.AgentState:
        """Tokens, bytes, tier (hot on its worker, warm in the store, or cold) and phase."""
        mem = self.memory
        self.state = await mem.route(self.id, lambda w: w.describe(mem.namespace, self.id))
        return self.state

    async def evict(self) -> bool:
        """Drops the agent from its worker's RAM once durable; False if it was not hot."""
        mem = self.memory
        return (await mem.route(self.id, lambda w: w.evict(mem.namespace, self.id))).evicted

    async def delete(self) -> bool:
        """Deletes the agent from its worker and the store; False if it did not exist."""
        mem = self.memory
        return await mem.route(self.id, lambda w: w.delete(mem.namespace, self.id))


class AsyncReply:
    """A reply streaming in: `async for` its text pieces (any number of consumers, each from
    the start); `.text`, `.token_ids` and `.usage` are whole once `await wait()` returns.
    `.worker` is the address that served it."""

    def __init__(
        self,
        agent: AsyncAgent,
        stream: AsyncIterator[pb.TurnResponse],
        first: pb.TurnResponse,
        worker: str,
    ) -> None:
        self.agent, self.worker = agent, worker
        self._stream, self._first = stream, first
        self._result = TurnResult()
        self._error: Exception | None = None
        self._lock = asyncio.Lock()  # one reader of the stream at a time

    @property
    def usage(self) -> pb.Usage:
        """The turn's usage, once the reply has ended (await wait()), as `.text`."""
        return self._whole().usage

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        seen, pieces = 0, self._result.pieces
        while True:
            while seen < len(pieces):
                seen += 1
                yield pieces[seen - 1]
            if self.done:
                return
            await self._advance()

    async def _advance(self) -> None:
        """Reads one more response into the reply, unless another consumer finished it."""
        async with self._lock:
            if not self.done:
                self._result.add(await self._next())

    async def _next(self) -> pb.TurnResponse:
        if self._error is not None:
            raise self._error
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            self._error = Unavailable(f"the reply of {self.agent!r} ended without its usage")
        except AgentKVError as exc:  # kept, so a later read raises it again
            self._error = cut_off(exc, self.worker, len(self._result.token_ids), self.agent)
        raise self._error

    @property
    def done(self) -> bool:
        return self._result.usage is not None

    async def wait(self) -> AsyncReply:
        async for _ in self:
            pass
        return self

    def _whole(self) -> TurnResult:
        if self._result.usage is None:
            raise RuntimeError(f"the reply of {self.agent!r} is still streaming: await wait()")
        return self._result

    @property
    def text(self) -> str:
        return self._whole().text

    @property
    def token_ids(self) -> list[int]:
        return list(self._whole().token_ids)

    @property
    def time_to_first_token_ms(self) -> float:
        return self._whole().usage.time_to_first_token_ms

    @property
    def cache_state(self) -> str:
        return self._whole().usage.cache_state
