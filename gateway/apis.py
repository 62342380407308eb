"""The HTTP APIs the gateway serves, each one wire format over the same turns: OpenAI's chat
completions (protocol.py, completion.py), OpenAI's Responses API (responses.py,
response_reply.py) and Anthropic's Messages API (anthropic.py, anthropic_reply.py); which a
request's path belongs to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentkv.gateway import anthropic, anthropic_reply, response_reply, responses
from agentkv.gateway.completion import Completion, sse
from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall, parse_chat


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
    anthropic_reply.MessageReply.of,
    anthropic_reply.error_body,
    anthropic_reply.error_event,
)


RESPONSES = API(
    responses.parse_responses,
    response_reply.ResponseReply.of,
    HTTPError.body,
    response_reply.error_event,
)


def api_of(path: str) -> API:
    """The API a request path belongs to (its errors' JSON)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    return RESPONSES if path.startswith("/v1/responses") else OPENAI
