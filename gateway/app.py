"""The gateway: OpenAI's chat-completions and Responses APIs and Anthropic's Messages API over
HTTP, on the asyncio SDK. All are one path: each API's wire format is a sans-I/O module
(gateway/protocol.py, gateway/responses.py, gateway/anthropic.py) that checks a request into
a ChatCall and builds the reply, whole or streamed, and its errors.

Frameworks resend the whole conversation on every call. The gateway holds no KV and no
conversation: it names the agent (X-Agent-Id; else X-Session-ID; else one anonymous agent per
end user, cache key, system prompt, first user message and tools), and sends the whole
conversation, with its tools, to that agent's worker as a `whole_conversation` turn. The
worker resumes from its own last reply, matched by the text it sent (and the tool calls it
made), and prefills only what is new; an edited history resumes from before the edit
(inference_worker/chat.py, `resume`).

Starlette on uvicorn: a small ASGI toolkit (no schema layer: OpenAI's own rules are checked
in gateway/protocol.py and the modules it uses) with streaming responses that are cancelled
when the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv import ids
from agentkv.auth import Principal, TokenTable
from agentkv.client.aio import AsyncAgent, AsyncAgentMemory, AsyncReply
from agentkv.errors import (
    AgentBusy,
    AgentExists,
    AgentKVError,
    AgentNotFound,
    FailedPrecondition,
    FingerprintMismatch,
    MarkNotFound,
    TurnsFollow,
)
from agentkv.gateway import anthropic, responses
from agentkv.gateway.completion import Completion, agentkv_json, sse, with_creation
from agentkv.gateway.config import GatewayConfig
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall, agent_id, parse_chat
from agentkv.worker.v1 import worker_pb2 as pb

log = logging.getLogger("agentkv.gateway")
T = TypeVar("T")
INFO_TIMEOUT = 5.0  # seconds a health check or the model's name waits for a worker
INFO_REQUEST = pb.GetWorkerInfoRequest()
PASSED_BY = {  # what a worker answers that another may not: _first_worker asks the next
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,  # an older worker, during a rolling upgrade
    grpc.StatusCode.UNAUTHENTICATED,  # the gateway's --upstream-* credentials, not the client's
    grpc.StatusCode.PERMISSION_DENIED,
}
# Seconds between tries to delete a spare agent: a turn that was cancelled ends at its
# worker's next step, and the agent cannot be deleted before.
SPARE_DELETE_DELAYS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
STOPPED = "the gateway is stopping: this reply did not end within its drain; send it again"
# Not cached, nor held back by a buffering proxy (nginx reads X-Accel-Buffering).
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass(frozen=True, slots=True)
class API:
    """One HTTP API's wire format: its request body checked into a ChatCall (with the
    gateway's default max_tokens), the reply's builder for a call (whole, from the reply's
    events; or streamed: opening, text, call, closing, error), its error JSON and its
    stream's error event."""

    parse: Callable[[Any, int], ChatCall]
    reply: Callable[[ChatCall], Any]
    error_body: Callable[[HTTPError], dict[str, Any]]
    error_event: Callable[[HTTPError], str]


OPENAI = API(
    parse_chat, lambda call: Completion(call.model), HTTPError.body, lambda e: sse(e.body())
)
ANTHROPIC = API(
    lambda body, _: anthropic.parse_messages(body),
    anthropic.MessageReply.of,
    anthropic.error_body,
    anthropic.error_event,
)

RESPONSES = API(
    responses.parse_responses,
    responses.ResponseReply.of,
    HTTPError.body,
    responses.error_event,
)


def api_of(path: str) -> API:
    """The API a request path belongs to (its errors' JSON)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    return RESPONSES if path.startswith("/v1/responses") else OPENAI


@dataclass(slots=True)
class Turn:
    """A turn under way: its reply (from its first token) and what making its agent took
    (its CreateAgent usage; None when it existed)."""

    reply: AsyncReply
    created: Any = None


class Gateway:
    """The routes' state: one AsyncAgentMemory (made in the server's event loop), the token
    table, the model's id."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokens = (
            TokenTable.load(config.security.auth_tokens) if config.security.auth_tokens else None
        )
        self.memory: AsyncAgentMemory | None = None
        self.model_id = config.model_name
        self.fingerprint = ""  # the workers' model's, once asked (_info)
        # Spare agents are made for one turn alone: nothing reaches them once it ends.
        self.spares: set[AsyncAgent] = set()  # made, their deletion not yet begun
        self.deletions: set[asyncio.Task] = set()  # of spare agents, under way
        # CreateAgent calls under way: a spare's deletion waits for its creation to end.
        self.creations: dict[AsyncAgent, asyncio.Future] = {}

    async def start(self) -> None:
        c = self.config
        self.memory = AsyncAgentMemory(
            c.workers, c.store or None, c.namespace, timeout=c.timeout, security=c.upstream
        )

    async def stop(self) -> None:
        """Deletes every spare agent left, each once its creation and turn have ended, then
        closes the connections. Requests have drained by now (or were cancelled)."""
        for agent in list(self.spares):
            self._ended(agent)
        await asyncio.gather(*self.deletions, return_exceptions=True)
        if self.memory is not None:
            await self.memory.close()

    # routes

    async def chat(self, request: Request) -> Response:
        """OpenAI's POST /v1/chat/completions."""
        return await self._converse(request, OPENAI)

    async def responses(self, request: Request) -> Response:
        """OpenAI's POST /v1/responses: the same agents, turns and figures."""
        return await self._converse(request, RESPONSES)

    async def kept_response(self, request: Request) -> Response:
        """GET /v1/responses/{id} (and its input_items), DELETE: a 404 that says why (the
        caller's token checked first)."""
        self._namespace(request)
        message = (
            "agentkv keeps no response objects, only each agent's cache: a response's id is "
            "continued with previous_response_id, not read back or deleted (the store's "
            "retention removes an agent left unused)"
        )
        raise HTTPError(404, message, "invalid_request_error", code="not_found")

    async def messages(self, request: Request) -> Response:
        """Anthropic's POST /v1/messages: the same agents, turns and figures."""
        return await self._converse(request, ANTHROPIC)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's POST /v1/messages/count_tokens: the conversation's tokens through the
        model's chat template, counted by a worker (the first that answers)."""
        self._namespace(request)
        call = await self._call(request, anthropic.parse_count)
        tokens = await self._first_worker(lambda w: w.count_tokens(call.messages, call.tools))
        return JSONResponse({"input_tokens": tokens})

    async def _call(self, request: Request, parse: Callable[[Any], ChatCall]) -> ChatCall:
        """The request's body, checked, for the model served here (else a 404)."""
        call = parse(await self._body(request))
        if call.model != await self._model():
            raise HTTPError(
                404,
                f"model {call.model!r} does not exist here; GET /v1/models lists it",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return call

    async def _converse(self, request: Request, api: API) -> Response:
        namespace = self._namespace(request)
        call = await self._call(request, lambda body: api.parse(body, self.config.max_tokens))
        memory = self.memory.in_namespace(namespace)
        headers = request.headers
        named, session = headers.get("x-agent-id", ""), headers.get("x-session-id", "")
        anonymous = not (named or session)
        if call.after is not None:  # previous_response_id: that agent, whatever the headers
            starting = self._continue(memory, call)
        else:
            starting = self._start(memory, agent_id(named, session, call), call, anonymous)
        started, turn = await _while_connected(request, starting)
        if not started:
            return Response(status_code=499)  # gone before the first token: nobody reads it
        reply = turn.reply
        call.agent_id = reply.agent.id
        facts = {
            "x-agentkv-agent-id": reply.agent.id,
            "x-agentkv-namespace": namespace,
            "x-agentkv-worker": reply.worker,
        }
        completion = api.reply(call)
        request.scope["agentkv.reply"] = completion  # a stop's CutOff ends its stream
        if call.stream:
            events = self._events(turn, call, completion, namespace)
            headers = facts | STREAM_HEADERS
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            if not await self._whole(reply, request):
                return Response(status_code=499)  # nobody reads it: the client has gone
            self._named(call, reply.agent)
        finally:
            self._ended(reply.agent)
        usage = with_creation(reply.usage, turn.created)
        facts |= {
            "x-agentkv-cache-state": usage.cache_state,
            "x-agentkv-ttft-ms": f"{usage.time_to_first_token_ms:.3f}",
        }
        extension = agentkv_json(namespace, reply.agent.id, reply.worker, usage)
        events = [item async for item in reply.events()]  # whole by now
        whole = completion.whole(events, usage, extension)
        return JSONResponse(whole, headers=facts)

    async def models(self, request: Request) -> Response:
        """The model served, in OpenAI's list, or Anthropic's for a client that sends its
        anthropic-version header."""
        self._namespace(request)
        model = await self._model()
        if "anthropic-version" in request.headers:
            page = {"data": [anthropic.model_json(model)], "has_more": False}
            return JSONResponse(page | {"first_id": model, "last_id": model})
        return JSONResponse({"object": "list", "data": [self._model_json(model)]})

    async def one_model(self, request: Request) -> Response:
        self._namespace(request)
        model = await self._model()
        if request.path_params["model"] != model:
            raise HTTPError(
                404,
                f"model {request.path_params['model']!r} does not exist here",
                code="model_not_found",
            )
        if "anthropic-version" in request.headers:
            return JSONResponse(anthropic.model_json(model))
        return JSONResponse(self._model_json(model))

    async def agents(self, request: Request) -> Response:
        """The namespace's agents (agentkv's own endpoint): tier, tokens, bytes, phase."""
        memory = self.memory.in_namespace(self._namespace(request))
        if memory.store is None:
            raise HTTPError(404, "listing agents needs the gateway's --store", code="no_store")
        fields = ("agent_id", "tier", "num_tokens", "num_bytes", "persisted_tokens", "phase")
        agents = [{f: getattr(a, f) for f in fields} for a in await memory.agents()]
        return JSONResponse({"object": "list", "data": agents})

    async def prefetch(self, request: Request) -> Response:
        """agentkv's own POST /v1/agents/{id}/prefetch: brings the agent into its worker's
        RAM ahead of its next call (restored from the store if it was evicted, or its worker
        restarted), adding nothing to its context; what that took."""
        agent = self._path_agent(request)
        started = time.perf_counter()
        usage = await agent.prefetch()
        fields = ("cache_state", "restore_path", "restored_bytes", "restore_failure")
        body = {"object": "agentkv.prefetch", "namespace": agent.memory.namespace}
        body["agent_id"] = agent.id
        body |= {name: getattr(usage, name) for name in fields}
        body["time_ms"] = round((time.perf_counter() - started) * 1000, 3)
        return JSONResponse(body)

    async def pin(self, request: Request) -> Response:
        """agentkv's own POST /v1/agents/{id}/pin and /unpin: the agent's cache is evicted
        last from its worker's RAM (or no longer so); the agent as it now stands."""
        agent = self._path_agent(request)
        state = await agent.pin(request.url.path.endswith("/pin"))
        fields = ("agent_id", "tier", "num_tokens", "num_bytes", "pinned")
        body = {"namespace": agent.memory.namespace}
        return JSONResponse(body | {f: getattr(state, f) for f in fields})

    def _path_agent(self, request: Request) -> AsyncAgent:
        """The agent a /v1/agents/{id}/... path names, in the caller's namespace."""
        memory = self.memory.in_namespace(self._namespace(request))
        return AsyncAgent(memory, ids.agent_id(request.path_params["agent"], "the agent id"))

    async def health(self, request: Request) -> Response:
        """200 while at least one worker answers, 503 when none does. With a token table,
        each worker's address and state only for a caller with a valid token."""

        async def probe(worker: Any) -> str:
            try:
                await asyncio.wait_for(worker.info(), INFO_TIMEOUT)
                return "serving"
            except (AgentKVError, asyncio.TimeoutError):
                return "unavailable"

        states = await asyncio.gather(*map(probe, self.memory.workers.values()))
        up = "serving" in states
        body: dict[str, Any] = {"status": "ok" if up else "unavailable"}
        given = request.headers.get("authorization") or request.headers.get("x-api-key")
        if self.tokens is None or given:
            self._principal(request)  # a token that is given must be valid
            body["workers"] = dict(zip(self.memory.workers, states, strict=True))
        return JSONResponse(body, status_code=200 if up else 503)

    # steps

    @staticmethod
    def _model_json(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "agentkv"}

    def _namespace(self, request: Request) -> str:
        """The caller's namespace: X-Namespace, else its token's only namespace, else the
        gateway's --namespace; with a token table, one the bearer token may use."""
        asked = request.headers.get("x-namespace", "")
        who = self._principal(request)
        if not asked and who is not None and who.namespaces and len(who.namespaces) == 1:
            asked = next(iter(who.namespaces))
        namespace = asked or self.config.namespace
        if who is not None and not who.allows(namespace):
            raise HTTPError(
                403,
                f"token {who.name!r} may not use namespace {namespace!r}",
                "permission_error",
                code="permission_denied",
            )
        return namespace

    def _principal(self, request: Request) -> Principal | None:
        """Who the bearer token (Authorization: Bearer, or Anthropic's X-Api-Key) names."""
        if self.tokens is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        given = (bearer, request.headers.get("x-api-key", "").strip())  # either may be valid
        who = next(filter(None, (self.tokens.principal(t) for t in given if t)), None)
        if who is None:
            raise HTTPError(
                401,
                "a valid bearer token is required (Authorization: Bearer ..., or X-Api-Key)",
                "authentication_error",
                code="invalid_api_key",
            )
        return who

    async def _body(self, request: Request) -> Any:
        limit, chunks, size = self.config.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as exc:
            raise HTTPError(400, f"the request body is not JSON: {exc}") from None
        except RecursionError:
            raise HTTPError(400, "the request body is nested too deeply") from None

    async def _model(self) -> str:
        """The served model's id: --model-name, else the first worker's model."""
        if not self.model_id:
            self.model_id = model_id((await self._info()).model)
        return self.model_id

    async def _info(self) -> Any:
        """The first worker's GetWorkerInfo that answers; 503 when none does. Its
        fingerprint is kept."""
        info = await self._first_worker(lambda worker: worker.info())
        self.fingerprint = info.fingerprint
        return info

    async def _first_worker(self, ask: Callable[[Any], Awaitable[T]]) -> T:
        """ask(worker) of the first worker that answers. One that cannot (unreachable, slow,
        too old for the call, refusing the gateway's own credentials) is passed by; any
        other error is the request's, raised. None answers: a 503 saying the last why."""
        last = "no worker is configured"
        for address, worker in self.memory.workers.items():
            try:
                return await asyncio.wait_for(ask(worker), INFO_TIMEOUT)
            except AgentKVError as exc:
                if exc.code not in PASSED_BY:
                    raise
                last = f"{address}: {exc.message}"
            except asyncio.TimeoutError:
                last = f"{address}: no answer within {INFO_TIMEOUT:g} s"
        message = f"no worker answers (last: {last})"
        raise HTTPError(503, message, "service_unavailable", code="unavailable")

    async def _start(
        self, memory: AsyncAgentMemory, agent_id: str, call: ChatCall, anonymous: bool
    ) -> Turn:
        """The turn, once its reply's first token is in. A call without identity whose
        agent is busy (the same conversation sent twice at once, or resent while its
        stopped turn ends) gets a spare agent, deleted once its turn ends."""
        agent = AsyncAgent(memory, agent_id)
        while True:
            try:
                return await self._say(agent, call)
            except FingerprintMismatch:  # another model's gateway made it, on the same store
                if not anonymous or agent.id != agent_id:
                    raise
                agent = AsyncAgent(memory, f"{agent_id}-{await self._model_key()}")
                continue
            except FailedPrecondition as exc:
                if not anonymous or "in progress" not in exc.message:
                    raise
            agent = AsyncAgent(memory, f"{agent_id}-{uuid.uuid4().hex[:8]}")
            self.spares.add(agent)  # before it exists: a stop meanwhile deletes it too

    async def _model_key(self) -> str:
        """A short hash of the workers' model fingerprint: what tells this model's anonymous
        agents from another's made for the same conversation."""
        fingerprint = self.fingerprint or (await self._info()).fingerprint
        return hashlib.blake2b(fingerprint.encode(), digest_size=4).hexdigest()

    async def _continue(self, memory: AsyncAgentMemory, call: ChatCall) -> Turn:
        """The turn of a call that continues a response (previous_response_id): its new
        messages after the point the response's reply ended at, on its agent, or, when
        later turns follow that point there, on a fork of it (both branches stay). The fork
        is a spare until its response's id goes out (_converse, _events)."""
        agent_id = call.after[0] if call.after else ""
        agent, options = AsyncAgent(memory, agent_id), _options(call)
        previous = call.echo.get("previous_response_id") or ""
        try:
            await _check_features(memory, agent_id, call)
            try:
                say = functools.partial(agent.say, call.messages, **options, after_mark_last=True)
                return Turn(await self._when_idle(say))
            except TurnsFollow:
                branch = AsyncAgent(memory, f"{agent_id[:100]}-b{uuid.uuid4().hex[:8]}")
            self.spares.add(branch)  # before it exists: deleted unless its id goes out
            try:
                await _check_features(memory, branch.id, call)  # it may live on another worker
                await self._when_idle(lambda: _to_the_end(agent.fork(branch.id)))
                return Turn(await branch.say(call.messages, **options))
            except BaseException:  # a branch that never took its turn is not kept
                self._ended(branch)
                raise
        except (AgentNotFound, MarkNotFound) as exc:
            raise responses.not_found(previous, exc.message) from None

    async def _when_idle(self, step: Callable[[], Awaitable[T]]) -> T:
        """`step` on an agent, once the agent's turn under way has ended (another call
        continuing the same response, or one before it): it is tried again until then,
        within the gateway's --timeout."""
        deadline, delay = time.monotonic() + self.config.timeout, 0.02
        while True:
            try:
                return await step()
            except AgentBusy:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _say(self, agent: AsyncAgent, call: ChatCall) -> Turn:
        """The agent's turn, made first when it does not exist (a spare never does)."""
        memory = agent.memory
        options = _options(call)
        await _check_features(memory, agent.id, call)
        if agent not in self.spares:
            with contextlib.suppress(AgentNotFound):
                return Turn(await agent.say(call.messages, **options))
        request = pb.CreateAgentRequest(
            namespace=memory.namespace,
            agent_id=agent.id,
            system_prompt=call.system,
            tools=call.tools,
        )
        created = None
        creating = asyncio.ensure_future(
            memory.route(agent.id, lambda w: w.call("CreateAgent", request))
        )
        self.creations[agent] = creating
        creating.add_done_callback(lambda _: self.creations.pop(agent, None))
        try:
            with contextlib.suppress(AgentExists):  # made meanwhile, or with another system
                # Its worker makes it even once cancelled: a spare is deleted after that.
                made = await _to_the_end(creating)
                created = made.usage  # prompt: the turn resumes from the stored one
            return Turn(await agent.say(call.messages, **options), created)
        except BaseException:
            self._ended(agent)
            raise

    def _named(self, call: ChatCall, agent: AsyncAgent) -> None:
        """The reply's id goes out: a Responses id names its agent, so a spare (or a branch)
        is kept from now on, to be continued."""
        if call.mark_name:
            self.spares.discard(agent)

    def _ended(self, agent: AsyncAgent) -> None:
        """After the agent's turn ended or was closed: a spare agent is deleted, once."""
        if agent in self.spares:
            self.spares.remove(agent)
            task = asyncio.create_task(_delete_spare(agent, self.creations.get(agent)))
            self.deletions.add(task)
            task.add_done_callback(self.deletions.discard)

    async def _whole(self, reply: AsyncReply, request: Request) -> bool:
        """Waits for the whole reply; a client that leaves first cancels the turn (False)."""
        try:
            whole, _ = await _while_connected(request, reply.wait())
        finally:
            await reply.close()  # a no-op once it is whole
        return whole

    async def _events(
        self, turn: Turn, call: ChatCall, reply_of: Any, namespace: str
    ) -> AsyncIterator[str]:
        """The reply as server-sent events in its API's stream format (each tool call whole,
        as the worker sends it). An error after the first event is sent as an error event
        (the status line is gone)."""
        reply = turn.reply
        started = reply.started and with_creation(reply.started, turn.created)
        try:
            for piece in reply_of.opening(started):
                yield piece
            self._named(call, reply.agent)
            async for item in reply.events():
                pieces = reply_of.text(item) if isinstance(item, str) else reply_of.call(item)
                for piece in pieces:
                    yield piece
            usage = with_creation(reply.usage, turn.created)
            extension = agentkv_json(namespace, reply.agent.id, reply.worker, usage)
            for piece in reply_of.closing(usage, extension, call.include_usage):
                yield piece
        except AgentKVError as exc:
            yield reply_of.error(HTTPError.of(exc))
        except Exception as exc:  # a bug of ours: the stream still ends with an error event
            log.exception("a streamed reply failed unexpectedly")
            error = HTTPError(500, f"internal error: {type(exc).__name__}", "server_error")
            yield reply_of.error(error)
        finally:
            with anyio.CancelScope(shield=True):  # a client gone cancels this generator
                await reply.close()
            self._ended(reply.agent)


def _options(call: ChatCall) -> dict[str, Any]:
    """The SDK's say() options for `call`: the whole conversation with its tools, or what
    follows a previous response's point; sampling; tool choice; the reply's form."""
    options = {"whole_conversation": call.after is None, "tools": call.tools, **call.sampling}
    options["max_tool_calls"] = call.max_tool_calls
    options["tool_call_required"] = call.tool_call_required
    options["tool_call_name"] = call.tool_call_name
    options["tool_call_forbidden"] = call.tool_call_forbidden
    options["tool_call_allowed"] = call.tool_call_allowed
    options["mark_name"] = call.mark_name
    options["after_mark"] = call.after[1] if call.after else ""
    if call.output_format is not None:
        options["output_format"] = pb.OutputFormat(**call.output_format)
    return options


def model_id(model: str) -> str:
    """What clients call the workers' model: its --model name, or a path's last part (a
    GGUF file's without .gguf)."""
    name = Path(model).name if "/" in model else model
    return name.removesuffix(".gguf")


async def _while_connected(request: Request, step: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, what `step` returns), or (False, None) when the client goes away first, which
    cancels the step. Raises what the step raises."""
    running = asyncio.ensure_future(step)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
    if running.cancelled():
        return False, None
    return True, running.result()


async def _check_features(memory: AsyncAgentMemory, agent_id: str, call: ChatCall) -> None:
    """Refuses (501) a call that the agent's worker, from before a field the call needs
    (during a rolling upgrade), would misread: it would drop previous_response_id's
    after_mark and add the input at the agent's end, or allowed_tools' tool_call_allowed
    and let every tool be called."""
    needs = {"after_mark": ("previous_response_id", "previous_response_id")} if call.after else {}
    if call.tool_call_allowed:
        needs["tool_call_allowed"] = ("tool_choice", "tool_choice allowed_tools")
    if not needs:
        return

    async def ask(worker: Any) -> Any:
        return await asyncio.wait_for(worker.call("GetWorkerInfo", INFO_REQUEST), INFO_TIMEOUT)

    try:
        info = await memory.route(agent_id, ask)
    except asyncio.TimeoutError:
        message = f"agent {agent_id!r}'s worker did not answer within {INFO_TIMEOUT:g} s"
        raise HTTPError(503, message, "service_unavailable", code="unavailable") from None
    for feature, (param, what) in needs.items():
        if feature not in info.features:
            message = f"agent {agent_id!r}'s worker predates {what}: upgrade it"
            raise HTTPError(501, message, "server_error", param, "not_implemented")


async def _to_the_end(step: Awaitable[T]) -> T:
    """What `step` returns; a caller cancelled meanwhile is so once the step has ended."""
    running = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait({running})
        raise


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _delete_spare(agent: AsyncAgent, creating: asyncio.Future | None) -> None:
    """Deletes a spare agent once its creation (`creating`, when under way: a stop's
    deletion would reach the worker before the agent) and its turn have ended there."""
    if creating is not None:
        await asyncio.wait({creating})
    for delay in SPARE_DELETE_DELAYS:
        await asyncio.sleep(delay)
        try:
            await agent.delete()
            return
        except FailedPrecondition:  # its turn, cancelled, has not ended yet
            continue
        except AgentKVError as exc:
            log.warning(
                "a spare agent was not deleted", extra={"agent": agent.id, "error": str(exc)}
            )
            return
    log.warning("a spare agent's turn did not end", extra={"agent": agent.id})


def _answering_errors(route: Callable[[Request], Awaitable[Response]], api: API) -> Callable:
    """The route, answering every error as its API's error JSON: agentkv's with the status
    of their gRPC code, anything else as a 500 (logged once, with its traceback)."""

    @functools.wraps(route)
    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except (HTTPError, AgentKVError) as exc:
            error = exc if isinstance(exc, HTTPError) else HTTPError.of(exc)
        except ClientDisconnect:  # gone while sending its body: nobody reads an answer
            return Response(status_code=499)
        except Exception as exc:
            log.exception("request failed unexpectedly")
            error = HTTPError(500, f"internal error: {type(exc).__name__}", "server_error")
        if error.status >= 500:
            log.warning("request failed", extra={"status": error.status, "error": error.message})
        return JSONResponse(api.error_body(error), status_code=error.status)

    return answer


class CutOff:
    """ASGI middleware for the end of a stop's drain: the server cancels the requests still
    running, which then end as the worker's turns do, with a 503 `unavailable` (an error
    event once their stream has begun) rather than uvicorn's plain-text 500 or a stream cut
    off, and a traceback. Only a stop cancels a request so: a client's leaving ends its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent: list[Message] = []  # the last message sent

        async def sending(message: Message) -> None:
            await send(message)
            sent[:] = [message]

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            error = HTTPError(503, STOPPED, "service_unavailable", code="unavailable")
            api = api_of(scope["path"])
            if not sent:
                await JSONResponse(api.error_body(error), status_code=503)(scope, receive, send)
            elif sent[0]["type"] == "http.response.start" or sent[0].get("more_body"):
                reply = scope.get("agentkv.reply")  # the stream under way: its next event
                body = (reply.error(error) if reply else api.error_event(error)).encode()
                await send({"type": "http.response.body", "body": body, "more_body": False})


async def _no_route(request: Request, exc: HTTPException) -> Response:
    error = HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(api_of(request.url.path).error_body(error), status_code=exc.status_code)


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [
        Route(path, _answering_errors(route, api_of(path)), methods=[method])
        for method, path, route in (
            ("POST", "/v1/chat/completions", gateway.chat),
            ("POST", "/v1/responses", gateway.responses),
            ("GET", "/v1/responses/{response:path}", gateway.kept_response),
            ("DELETE", "/v1/responses/{response}", gateway.kept_response),
            ("POST", "/v1/messages", gateway.messages),
            ("POST", "/v1/messages/count_tokens", gateway.count_tokens),
            ("GET", "/v1/models", gateway.models),
            ("GET", "/v1/models/{model:path}", gateway.one_model),
            ("GET", "/v1/agents", gateway.agents),
            ("POST", "/v1/agents/{agent}/prefetch", gateway.prefetch),
            ("POST", "/v1/agents/{agent}/pin", gateway.pin),
            ("POST", "/v1/agents/{agent}/unpin", gateway.pin),
            ("GET", "/health", gateway.health),
        )
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    handlers = {HTTPException: _no_route}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[Middleware(CutOff)],
    )
    app.state.gateway = gateway
    return app
