"""The gateway's HTTP plumbing on Starlette: every error of a route answered in its API's
error JSON, a stop's cut-off requests ended as 503s (or an error event), and steps that end
when the client goes away."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.errors import AgentKVError
from agentkv.gateway.apis import API, api_of
from agentkv.gateway.errors import HTTPError

log = logging.getLogger("agentkv.gateway")
T = TypeVar("T")

STOPPED = "the gateway is stopping: this reply did not end within its drain; send it again"


def answering_errors(route: Callable[[Request], Awaitable[Response]], api: API) -> Callable:
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
        return JSONResponse(api.error_body(error), error.status, error.headers())

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
            error = HTTPError(503, STOPPED, "service_unavailable", code="unavailable", retry=True)
            api = api_of(scope["path"])
            if not sent:
                answer = JSONResponse(api.error_body(error), 503, error.headers())
                await answer(scope, receive, send)
            elif sent[0]["type"] == "http.response.start" or sent[0].get("more_body"):
                reply = scope.get("agentkv.reply")  # the stream under way: its next event
                body = (reply.error(error) if reply else api.error_event(error)).encode()
                await send({"type": "http.response.body", "body": body, "more_body": False})


async def no_route(request: Request, exc: HTTPException) -> Response:
    error = HTTPError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(api_of(request.url.path).error_body(error), status_code=exc.status_code)


async def while_connected(request: Request, step: Awaitable[T]) -> tuple[bool, T | None]:
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


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
