"""The InferenceWorker's RPCs, sans-IO: each request built from its arguments (a turn's
by client/messages.py); a streamed turn assembled into its result, and a reply's state
with the error of a reply cut off or closed. Shared by the sync (client/worker.py,
client/memory.py) and asyncio (client/aio.py) clients, which add the I/O; routing and
agents are client/core.py's.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, TypeVar, Union

import grpc

from agentkv.channels import ClientSecurity, call_timeout
from agentkv.client.messages import (
    Message,
    Tools,
    pb_messages,
    tools_json,
    turn_request,
)
from agentkv.errors import (
    AgentKVError,
    DeadlineExceeded,
    FailedPrecondition,
    Unavailable,
    from_rpc_error,
)
from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc

T = TypeVar("T")
MaybeAwaitable = Union[T, Awaitable[T]]  # noqa: UP007 (a generic alias needs Union on 3.10)
Responses = Iterator[pb.TurnResponse] | AsyncIterator[pb.TurnResponse]


@dataclass(slots=True)
class TurnResult:
    """A turn's reply as its responses arrive: text pieces, token ids and tool calls (a turn
    with tools: each once the model wrote it whole; its text is not among the pieces), then
    the usage."""

    pieces: list[str] = field(default_factory=list)  # the non-empty text pieces, in order
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[pb.ToolCall] = field(default_factory=list)
    events: list[str | pb.ToolCall] = field(default_factory=list)  # pieces and calls, in order
    usage: pb.Usage | None = None
    started: pb.Usage | None = None  # the prompt's usage, sent before the first token

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, response: pb.TurnResponse) -> None:
        """Takes one streamed response: a chunk of tokens, a tool call, the prompt's usage
        (before the first token), or the usage."""
        kind = response.WhichOneof("item")
        if kind == "started":
            self.started = response.started
            return
        if kind == "tokens":
            self.token_ids += response.tokens.token_ids
            if response.tokens.text:
                self.pieces.append(response.tokens.text)
                self.events.append(response.tokens.text)
        elif kind == "tool_call":
            self.tool_calls.append(response.tool_call)
            self.events.append(response.tool_call)
        elif kind == "usage":
            self.usage = response.usage  # what a later worker may add is passed by


def same(value: T) -> T:
    return value


agent_of = attrgetter("agent")


class BaseWorkerClient:
    """The InferenceWorker RPCs, each request built here. The transport opens the channel
    (`_open`), sends a unary call and unwraps its reply (`_unary`), streams a turn (`_stream`)
    and collects a whole one (`_collect`)."""

    _open: Callable[[ClientSecurity, str], Any]
    _unary: Callable[[str, Any, Callable[[Any], T]], MaybeAwaitable[T]]
    _stream: Callable[[pb.TurnRequest, float], Responses]
    _collect: Callable[[Responses], MaybeAwaitable[TurnResult]]

    def __init__(
        self, address: str, timeout: float = 300.0, security: ClientSecurity | None = None
    ) -> None:
        self.address = address
        self.timeout = call_timeout(timeout)
        self.channel = self._open(security or ClientSecurity(), address)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    def create_agent(
        self, namespace: str, agent_id: str, system: str = "", *, tools: Tools = None, **fields: Any
    ) -> MaybeAwaitable[pb.AgentState]:
        """A new agent: its system prompt (and `tools`, tools_json's, rendered with it)
        prefilled and persisted. `fields`: CreateAgentRequest's phase, metadata, durable."""
        request = pb.CreateAgentRequest(
            namespace=namespace,
            agent_id=agent_id,
            system_prompt=system,
            tools=tools_json(tools),
            **fields,
        )
        return self._unary("CreateAgent", request, agent_of)

    def stream_turn(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[Message],
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> Responses:
        """Streams a turn's responses (`async for` them in asyncio): token chunks and tool
        calls, then the usage. Closing the stream early cancels the turn, which frees its
        slot on the worker. `options`: turn_request's."""
        request = turn_request(namespace, agent_id, messages, **options)
        return self._stream(request, call_timeout(timeout) or self.timeout)

    def open_turn(self, request: pb.TurnRequest, timeout: float | None = None) -> Any:
        """A turn's gRPC call, none of it read yet: what a reply reads (iterates, or `await
        call.read()` in asyncio), and cancels when closed."""
        return self.stub.Turn(request, timeout=call_timeout(timeout) or self.timeout)

    def turn(
        self, namespace: str, agent_id: str, messages: Sequence[Message], **options: Any
    ) -> MaybeAwaitable[TurnResult]:
        """A whole turn: the reply's text, its token ids, its tool calls and the usage. Takes
        stream_turn's options and sampling fields."""
        return self._collect(self.stream_turn(namespace, agent_id, messages, **options))

    def inject(
        self,
        namespace: str,
        agent_id: str,
        messages: Sequence[Message],
        *,
        phase: str = "",
        durable: bool = False,
        request_id: str = "",
    ) -> MaybeAwaitable[pb.InjectContextResponse]:
        """Appends messages to the agent's context; only they are prefilled. A retry with
        the same `request_id` adds nothing once the first was taken."""
        request = pb.InjectContextRequest(
            namespace=namespace,
            agent_id=agent_id,
            messages=pb_messages(messages),
            phase=phase,
            durable=durable,
            request_id=request_id,
        )
        return self._unary("InjectContext", request, same)

    def fork(
        self, namespace: str, source: str, agent_id: str, phase: str = "", request_id: str = ""
    ) -> MaybeAwaitable[pb.AgentState]:
        """A new agent that starts from `source`'s context, sharing its blocks in the store.
        A retry with the same `request_id` is answered with the fork the first call made."""
        request = pb.ForkAgentRequest(
            namespace=namespace,
            source_agent_id=source,
            agent_id=agent_id,
            phase=phase,
            request_id=request_id,
        )
        return self._unary("ForkAgent", request, agent_of)

    def evict(self, namespace: str, agent_id: str) -> MaybeAwaitable[pb.EvictAgentResponse]:
        request = pb.EvictAgentRequest(namespace=namespace, agent_id=agent_id)
        return self._unary("EvictAgent", request, same)

    def describe(self, namespace: str, agent_id: str) -> MaybeAwaitable[pb.AgentState]:
        request = pb.DescribeAgentRequest(namespace=namespace, agent_id=agent_id)
        return self._unary("DescribeAgent", request, agent_of)

    def delete(self, namespace: str, agent_id: str) -> MaybeAwaitable[bool]:
        request = pb.DeleteAgentRequest(namespace=namespace, agent_id=agent_id)
        return self._unary("DeleteAgent", request, attrgetter("deleted"))

    def pin(
        self, namespace: str, agent_id: str, pinned: bool = True
    ) -> MaybeAwaitable[pb.AgentState]:
        """Pins the agent in this worker's RAM (evicted last), or unpins it."""
        request = pb.PinAgentRequest(namespace=namespace, agent_id=agent_id, pinned=pinned)
        return self._unary("PinAgent", request, agent_of)

    def info(self) -> MaybeAwaitable[pb.GetWorkerInfoResponse]:
        return self._unary("GetWorkerInfo", pb.GetWorkerInfoRequest(), same)

    def count_tokens(self, messages: Sequence[Message], tools: Tools = None) -> MaybeAwaitable[int]:
        """The tokens a whole conversation (its system message first) renders to through
        the model's chat template, ready for the reply: a fresh agent's prompt_tokens."""
        request = pb.CountTokensRequest(messages=pb_messages(messages), tools=tools_json(tools))
        return self._unary("CountTokens", request, attrgetter("prompt_tokens"))


class ReplyCutOff(Unavailable):
    """A reply cut off after `num_tokens` tokens: its worker (at `worker`) went away."""

    def __init__(self, message: str, worker: str, num_tokens: int) -> None:
        super().__init__(message)
        self.worker, self.num_tokens = worker, num_tokens

    def __reduce__(self) -> tuple:  # pickled and copied with every argument
        return (type(self), (self.message, self.worker, self.num_tokens))


def tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def cut_off(exc: AgentKVError, worker: str, num_tokens: int, agent: object) -> AgentKVError:
    """What readers of a reply that `exc` cut short get: a worker that went away may have
    kept the turn (a cut link) or lost it (a stopped worker); a call that ran out of time
    after a token of it came kept the turn with the reply so far (one before: undone,
    unless a token was sent that had not yet come); an answer of its own stands."""
    if isinstance(exc, DeadlineExceeded) and not exc.remote:
        said = DeadlineExceeded(
            f"{exc.message} after {tokens(num_tokens)} of the reply of {agent!r}: its worker "
            f"{worker_kept(num_tokens)}"
        )
        said.peer = exc.peer
        return said
    if isinstance(exc, Unavailable) and not exc.remote:
        return ReplyCutOff(
            f"worker {worker} went away after {tokens(num_tokens)} of the reply of {agent!r}; "
            "the turn may be in the agent's context (a cut link) or not committed (a stopped "
            "worker): describe() the agent before saying it, and say it again only if its "
            "context lacks the turn",
            worker,
            num_tokens,
        )
    return exc


def worker_kept(num_tokens: int) -> str:
    """What a worker did with a turn whose caller stopped reading after `num_tokens` of its
    reply came (Engine._turn_done): kept, once a token of it was sent; else undone."""
    if num_tokens:
        return "keeps the turn, with the reply so far"
    return (
        "undoes the turn unless a token of it was on its way: describe() the agent before "
        "saying it again"
    )


CHANNEL_CLOSED = "Channel closed!"  # gRPC's words for a call its own client's close() ended


def no_reply(worker: str, agent: object) -> Unavailable:
    return Unavailable(f"worker {worker} ended the turn of {agent!r} at once")


class BaseReply:
    """A reply's state as its gRPC call's responses arrive: pieces, token ids, usage, and the
    error that ended it (cut off, or closed), raised again to every later reader. The
    transport reads the call one response at a time into `_took` (its errors into `_failed`)
    and gives `_whole()`: the reply once whole (sync: waits for it)."""

    _whole: Callable[[], TurnResult]

    def __init__(
        self, agent: object, call: Any, first: pb.TurnResponse | None, worker: str
    ) -> None:
        """`first`: the call's first response, read by the transport; None (the call ended
        at once) raises Unavailable."""
        if first is None:
            raise no_reply(worker, agent)
        self.agent, self.worker = agent, worker
        self._call = call
        self._result = TurnResult()
        self._result.add(first)
        self._error: Exception | None = None
        self._ended = False
        # A reader ending the reply and close() from another thread settle it one at a
        # time: a reply that came whole stays whole, one closed stays closed.
        self._settling = threading.Lock()

    @property
    def done(self) -> bool:
        """Whether the reply is whole: its usage came, then the call's status, OK (a durable
        turn whose commit failed sends its usage, then the error), and it was not closed."""
        return self._ended and self._error is None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _took(self, response: pb.TurnResponse | None) -> None:
        """Takes what one read gave: a response, or None when the call ended with an OK
        status (whole if its usage came). Takes nothing once the reply failed or closed."""
        with self._settling:
            if self._error is not None:
                return
            if response is not None:
                self._result.add(response)
            elif self._result.usage is None:
                self._error = Unavailable(f"the reply of {self.agent!r} ended without its usage")
            else:
                self._ended = True

    def _failed(self, exc: Exception) -> None:
        """Keeps what a read raised (a gRPC error as its agentkv class), as every later
        reader will get it; an error kept before stands (close() before the read it cut)."""
        if isinstance(exc, grpc.RpcError):
            exc = from_rpc_error(exc)
        if isinstance(exc, AgentKVError) and CHANNEL_CLOSED in exc.message:
            exc = self._closed()  # its memory's close(): as the reply's own, and asyncio's
        elif isinstance(exc, AgentKVError):
            exc = cut_off(exc, self.worker, len(self._result.token_ids), self.agent)
        with self._settling:
            if self._error is None:
                self._error = exc

    def _close(self) -> None:
        """close() for both transports: a reply not yet whole fails as closed, for every
        reader, and its call is cancelled (thread-safe; a read waiting on it wakes)."""
        with self._settling:
            if self.done:
                return
            if self._error is None:
                self._error = self._closed()
        self._call.cancel()  # the worker ends the turn: kept, if a token of it went out

    def _closed(self) -> FailedPrecondition:
        num_tokens = len(self._result.token_ids)
        return FailedPrecondition(
            f"the reply of {self.agent!r} was closed after {num_tokens} tokens; its worker "
            f"{worker_kept(num_tokens)}"
        )

    @property
    def usage(self) -> pb.Usage:
        """The turn's usage; whole once the reply has ended, as `.text`."""
        return self._whole().usage

    @property
    def started(self) -> pb.Usage | None:
        """The prompt's usage (prompt_tokens, the tokens reused and prefilled, cache_state),
        known from the first token on, before the reply ends; None for a turn that generated
        nothing, or from a worker that does not send it."""
        return self._result.started

    @property
    def text(self) -> str:
        return self._whole().text

    @property
    def tool_calls(self) -> list[pb.ToolCall]:
        """The reply's tool calls (id, name, arguments as JSON text), parsed by the worker
        from what the model wrote (a turn with tools); whole once the reply has ended, as
        `.text`, which holds none of their text."""
        return list(self._whole().tool_calls)

    @property
    def token_ids(self) -> list[int]:
        return list(self._whole().token_ids)

    @property
    def time_to_first_token_ms(self) -> float:
        return self._whole().usage.time_to_first_token_ms

    @property
    def cache_state(self) -> str:
        return self._whole().usage.cache_state
