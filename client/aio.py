"""The agentkv SDK for asyncio: client/memory.py's agents, routing and errors, on grpc.aio.

    async with AsyncAgentMemory(["127.0.0.1:7001", "127.0.0.1:7002"]) as mem:
        marco = await mem.agent("marco", system="You are Marco, a careful analyst.")
        reply = await marco.say("What changed since yesterday?")
        async for piece in reply:
            print(piece, end="", flush=True)
        await marco.inject("Luca said: the numbers are final.")  # prefills only these tokens

Routing, failover and retries are the sync SDK's (client/core.py, the same Router, so both
send an agent to the same worker); only awaiting differs. Make an AsyncAgentMemory inside the
event loop that uses it: grpc.aio channels belong to the loop they were made in. The shared
methods (client/core.py) return awaitables rather than being `async def` themselves: await
them as usual. A bad id or message raises at the call; a sampling option of the wrong type
raises when the call is awaited, as its request is built.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from agentkv.channels import ClientSecurity
from agentkv.client.core import BaseAgent, BaseAgentMemory, Operation, Steps
from agentkv.client.worker_core import BaseReply, BaseWorkerClient, TurnResult, cut_off
from agentkv.errors import DeadlineExceeded, typed_errors
from agentkv.v1 import store_pb2, store_pb2_grpc
from agentkv.worker.v1 import worker_pb2 as pb

T = TypeVar("T")
DESCRIBE_CONCURRENCY = 16  # agents() describes this many agents at once


class AsyncWorkerClient(BaseWorkerClient):
    """An asyncio connection to one inference worker; `await close()` when done."""

    def _open(self, security: ClientSecurity, address: str) -> grpc.aio.Channel:
        return security.aio_channel(address)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, method: str, request: Any) -> Any:
        with typed_errors():
            return await getattr(self.stub, method)(request, timeout=self.timeout)

    async def _unary(self, method: str, request: Any, unwrap: Callable[[Any], T]) -> T:
        return unwrap(await self.call(method, request))

    async def _stream(
        self, request: pb.TurnRequest, timeout: float
    ) -> AsyncIterator[pb.TurnResponse]:
        call = self.stub.Turn(request, timeout=timeout)
        try:
            with typed_errors():
                async for response in call:
                    yield response
        finally:
            call.cancel()  # a no-op once the stream has ended

    @staticmethod
    async def _collect(responses: AsyncIterator[pb.TurnResponse]) -> TurnResult:
        result = TurnResult()
        async for response in responses:
            result.add(response)
        return result


class AsyncReply(BaseReply):
    """A reply streaming in: `async for` its text pieces (any number of consumers, each from
    the start), or events() for its tool calls too; `.text`, `.tool_calls`, `.token_ids` and
    `.usage` are whole once `await wait()` returns.
    `.worker` is the address that served it. A reader cancelled while it waits (as by
    asyncio.wait_for's timeout) stops alone: the turn goes on for the other readers and the
    next one. `await close()` (or `async with`) stops it for all."""

    def __init__(
        self,
        agent: AsyncAgent,
        call: grpc.aio.UnaryStreamCall,
        first: pb.TurnResponse | None,
        worker: str,
    ) -> None:
        super().__init__(agent, call, first, worker)
        self._reading: asyncio.Task[None] | None = None  # the read every waiting reader awaits

    def __aiter__(self) -> AsyncIterator[str]:
        return self._follow(self._result.pieces)

    def events(self) -> AsyncIterator[str | pb.ToolCall]:
        """As `async for` over the reply, with its tool calls (pb.ToolCall) among its text
        pieces, in the order the worker sent them."""
        return self._follow(self._result.events)

    async def _follow(self, items: list[T]) -> AsyncIterator[T]:
        """Every item of `items` (a list of the reply's result) from the start, as they come."""
        seen = 0
        while True:
            while seen < len(items):
                seen += 1
                yield items[seen - 1]
            if self.done:
                return
            await self._advance()

    async def _advance(self) -> None:
        """Waits for one more response, read by a task of the reply's own that the first
        reader to need it starts: a reader cancelled meanwhile leaves that read running."""
        self._check()
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(self._reading)
        self._check()

    async def _read(self) -> None:
        try:
            self._took(await next_response(self._call))
        except asyncio.CancelledError:  # the call cancelled: close(), or the memory's
            self._failed(self._closed())
        except Exception as exc:
            self._failed(exc)
        finally:
            self._reading = None

    async def wait(self) -> AsyncReply:
        async for _ in self:
            pass
        return self

    async def close(self) -> None:
        """Stops the reply: one not yet whole is cancelled on its worker, which keeps what
        it generated until then in the agent's context (as any turn cut short). Its
        readers, those reading now included, and every later one get FailedPrecondition
        'the reply ... was closed'. A whole reply stays as it is."""
        self._close()

    async def __aenter__(self) -> AsyncReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _whole(self) -> TurnResult:
        self._check()
        if not self.done:
            raise RuntimeError(f"the reply of {self.agent!r} is still streaming: await wait()")
        return self._result


async def next_response(call: grpc.aio.UnaryStreamCall) -> pb.TurnResponse | None:
    """The call's next response; None once it ended with an OK status."""
    response = await call.read()
    return None if response is grpc.aio.EOF else response


class AsyncAgent(BaseAgent):
    """One agent of an AsyncAgentMemory. Cheap to make; holds no connection of its own."""

    async def _reply(self, worker: str, call: grpc.aio.UnaryStreamCall) -> AsyncReply:
        try:
            with typed_errors():
                first = await next_response(call)  # a worker that is down raises here
        except DeadlineExceeded as exc:  # before any of it came: say what became of the turn
            raise cut_off(exc, worker, 0, self) from None
        return AsyncReply(self, call, first, worker)


class AsyncAgentMemory(BaseAgentMemory):
    """One store and one or more workers, for one event loop; `await close()` when done (or
    use `async with`)."""

    worker_class = AsyncWorkerClient
    agent_class = AsyncAgent
    _store_channel: grpc.aio.Channel | None = None

    def _open_store(self, address: str, security: ClientSecurity) -> str:
        self._store_channel = security.aio_channel(address)
        return address  # .store is the address

    async def close(self) -> None:
        """As AgentMemory.close()."""
        self._shut.set()
        for worker in self.workers.values():
            await worker.close()
        if self._store_channel is not None:
            await self._store_channel.close()

    async def __aenter__(self) -> AsyncAgentMemory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def agents(self) -> list[pb.AgentState]:
        """Every agent of the namespace in the store, as its worker sees it (tier, tokens,
        bytes, phase; one written under another model: tier "other model", the store's
        figures). Needs the store's address; describes DESCRIBE_CONCURRENCY at once."""
        self._need_store()
        summaries = [summary async for summary in self._list_agents()]
        limit = asyncio.Semaphore(DESCRIBE_CONCURRENCY)  # not one RPC per agent all at once

        async def describe(summary: store_pb2.AgentSummary) -> pb.AgentState | None:
            async with limit:
                return await self._run(self._listed(summary))

        states = await asyncio.gather(*(describe(s) for s in summaries))
        return [state for state in states if state is not None]

    async def _list_agents(self) -> AsyncIterator[store_pb2.AgentSummary]:
        stub = store_pb2_grpc.CacheStoreStub(self._store_channel)
        request = store_pb2.ListAgentsRequest(namespace=self.namespace)
        while True:
            with typed_errors(peer="store"):
                page = await stub.ListAgents(request, timeout=self.timeout)
            for summary in page.agents:
                yield summary
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    async def _run(self, steps: Steps[T]) -> T:
        operation = Operation(steps)
        for delay, call in operation:
            await asyncio.sleep(delay)
            with operation.outcome():
                operation.result = await call()
        return operation.value
