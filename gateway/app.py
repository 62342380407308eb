"""The gateway: OpenAI's chat-completions and Responses APIs and Anthropic's Messages API over
HTTP, on the asyncio SDK. All are one path: each API's wire format (apis.py) checks a request
into a ChatCall and builds the reply, whole or streamed, and its errors, sans I/O
(gateway/protocol.py with completion.py and errors.py, gateway/responses.py with
response_reply.py, gateway/anthropic.py with anthropic_reply.py).

Frameworks resend the whole conversation on every call. The gateway holds no KV and no
conversation: it names the agent (X-Agent-Id; else X-Session-ID; else one anonymous agent per
end user, cache key, system prompt, first user message and tools), and sends the whole
conversation, with its tools, to that agent's worker as a `whole_conversation` turn. The
worker resumes from its own last reply, matched by the text it sent (and the tool calls it
made), and prefills only what is new; an edited history resumes from before the edit
(inference_worker/conversation.py, `resume`).

Starlette on uvicorn: a small ASGI toolkit (no schema layer: OpenAI's own rules are checked
in gateway/protocol.py and the modules it uses) with streaming responses that are cancelled
when the client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv import ids
from agentkv.auth import TokenTable
from agentkv.client.aio import AsyncAgent, AsyncAgentMemory, AsyncReply
from agentkv.errors import AgentKVError
from agentkv.gateway import anthropic, anthropic_reply
from agentkv.gateway.apis import ANTHROPIC, API, OPENAI, RESPONSES, api_of
from agentkv.gateway.asgi import CutOff, answering_errors, no_route, while_connected
from agentkv.gateway.callers import Callers
from agentkv.gateway.completion import agentkv_json, with_creation
from agentkv.gateway.config import INFO_TIMEOUT, GatewayConfig
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall, agent_id
from agentkv.gateway.turns import Turn, Turns
from agentkv.gateway.workers import Served

log = logging.getLogger("agentkv.gateway")
# Not cached, nor held back by a buffering proxy (nginx reads X-Accel-Buffering).
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Gateway:
    """The routes' state: one AsyncAgentMemory (made in the server's event loop), the token
    table and callers (callers.py), the served model (workers.py), and the turns under way
    with their spare agents (turns.py)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        auth = config.security.auth_tokens
        tokens = TokenTable.load(auth) if auth else None
        self.memory: AsyncAgentMemory | None = None
        self.callers = Callers(tokens, config.namespace, config.max_body_bytes)
        self.served: Served | None = None  # made with the memory, in the server's loop
        self.turns = Turns(lambda: self.served.model_key(), config.timeout)
        self._started: asyncio.Task[None] | None = None  # the check of the workers at start

    async def start(self) -> None:
        c = self.config
        self.memory = AsyncAgentMemory(
            c.workers, c.store or None, c.namespace, timeout=c.timeout, security=c.upstream
        )
        self.served = Served(self.memory.workers, c.model_name)
        self._started = asyncio.create_task(self._warn_of_silent_workers())

    async def _warn_of_silent_workers(self) -> None:
        """From the start until each worker has answered once: a warning for one that does
        not (its requests go to the others, or get 503), then word when it does, as a worker
        says of its store."""
        waiting, warned, pause = dict(self.memory.workers), set(), 0.5
        while waiting:
            silences = await asyncio.gather(*map(_silence, waiting.values()))
            for address, why in zip(list(waiting), silences, strict=True):
                if not why:
                    del waiting[address]
                    if address in warned:
                        log.info("worker answers", extra={"worker": address})
                elif address not in warned:
                    warned.add(address)
                    log.warning("worker does not answer", extra={"worker": address, "reason": why})
            await asyncio.sleep(pause)
            pause = min(pause * 2, 10.0)

    async def stop(self) -> None:
        """Deletes every spare agent left, each once its creation and turn have ended (for
        --cleanup-seconds), then closes the connections. Requests have drained by now (or
        were cancelled)."""
        if self._started is not None:
            self._started.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._started
        left = await self.turns.stop(self.config.cleanup_seconds)
        if left:
            log.warning(
                "spare agents left in the store: their deletion did not end in time",
                extra={"agents": left, "seconds": self.config.cleanup_seconds},
            )
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
        self.callers.namespace(request)
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
        self.callers.namespace(request)
        call = await self._call(request, anthropic.parse_count)
        tokens = await self.served.first_worker(lambda w: w.count_tokens(call.messages, call.tools))
        return JSONResponse({"input_tokens": tokens})

    async def _call(self, request: Request, parse: Callable[[Any], ChatCall]) -> ChatCall:
        """The request's body, checked, for the model served here (else a 404)."""
        call = parse(await self.callers.body(request))
        if call.model != await self.served.model():
            raise HTTPError(
                404,
                f"model {call.model!r} does not exist here; GET /v1/models lists it",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return call

    async def _converse(self, request: Request, api: API) -> Response:
        namespace = self.callers.namespace(request)
        call = await self._call(request, lambda body: api.parse(body, self.config.max_tokens))
        memory = self.memory.in_namespace(namespace)
        headers = request.headers
        named, session = headers.get("x-agent-id", ""), headers.get("x-session-id", "")
        anonymous = not (named or session)
        if call.after is not None:  # previous_response_id: that agent, whatever the headers
            starting = self.turns.continued(memory, call)
        else:
            starting = self.turns.start(memory, agent_id(named, session, call), call, anonymous)
        started, turn = await while_connected(request, starting)
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
            self.turns.named(call, reply.agent)
        finally:
            self.turns.ended(reply.agent)
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
        self.callers.namespace(request)
        model = await self.served.model()
        if "anthropic-version" in request.headers:
            page = {"data": [anthropic_reply.model_json(model)], "has_more": False}
            return JSONResponse(page | {"first_id": model, "last_id": model})
        return JSONResponse({"object": "list", "data": [self._model_json(model)]})

    async def one_model(self, request: Request) -> Response:
        self.callers.namespace(request)
        model = await self.served.model()
        if request.path_params["model"] != model:
            raise HTTPError(
                404,
                f"model {request.path_params['model']!r} does not exist here",
                code="model_not_found",
            )
        if "anthropic-version" in request.headers:
            return JSONResponse(anthropic_reply.model_json(model))
        return JSONResponse(self._model_json(model))

    async def agents(self, request: Request) -> Response:
        """The namespace's agents (agentkv's own endpoint): tier, tokens, bytes, phase."""
        memory = self.memory.in_namespace(self.callers.namespace(request))
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
        memory = self.memory.in_namespace(self.callers.namespace(request))
        return AsyncAgent(memory, ids.agent_id(request.path_params["agent"], "the agent id"))

    async def health(self, request: Request) -> Response:
        """200 while at least one worker answers, 503 when none does. With a token table,
        each worker's address and state only for a caller with a valid token."""

        async def probe(worker: Any) -> str:
            return "unavailable" if await _silence(worker) else "serving"

        states = await asyncio.gather(*map(probe, self.memory.workers.values()))
        up = "serving" in states
        body: dict[str, Any] = {"status": "ok" if up else "unavailable"}
        given = request.headers.get("authorization") or request.headers.get("x-api-key")
        if self.callers.tokens is None or given:
            self.callers.principal(request)  # a token that is given must be valid
            body["workers"] = dict(zip(self.memory.workers, states, strict=True))
        return JSONResponse(body, status_code=200 if up else 503)

    # steps

    @staticmethod
    def _model_json(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "agentkv"}

    async def _whole(self, reply: AsyncReply, request: Request) -> bool:
        """Waits for the whole reply; a client that leaves first cancels the turn (False)."""
        try:
            whole, _ = await while_connected(request, reply.wait())
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
            self.turns.named(call, reply.agent)
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
            self.turns.ended(reply.agent)


async def _silence(worker: Any) -> str:
    """Why the worker does not answer GetWorkerInfo within INFO_TIMEOUT; "" when it does."""
    try:
        await asyncio.wait_for(worker.info(), INFO_TIMEOUT)
        return ""
    except AgentKVError as exc:
        return exc.message
    except TimeoutError:
        return f"no answer within {INFO_TIMEOUT:g} s"


def create_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)
    routes = [
        Route(path, answering_errors(route, api_of(path)), methods=[method])
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

    handlers = {HTTPException: no_route}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[Middleware(CutOff)],
    )
    app.state.gateway = gateway
    return app
