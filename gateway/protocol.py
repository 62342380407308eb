"""OpenAI's chat-completions request, sans I/O: a body checked into a ChatCall (its messages,
sampling, tools and tool_choice, response_format), and the agent a call goes to. Its parts
are checked apart: fields.py (types, unknown fields), messages.py, tooling.py (tools, tool
choices, output formats); completion.py writes the reply, errors.py the errors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from agentkv import ids
from agentkv.gateway.errors import invalid
from agentkv.gateway.fields import known_only, metadata, numbers, typed, utf8
from agentkv.gateway.messages import chat_messages
from agentkv.gateway.tooling import (
    FORMAT_KEYS,
    ToolChoice,
    check_tool,
    output_format,
    tool_choice,
    tools_text,
)

# Accepted and meaningless here, or equal to what agentkv does anyway.
IGNORED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "store",
    "metadata",
    "service_tier",
}
TOOLING = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}  # checked apart
# Accepted at their neutral value only; any other value is refused, never ignored.
NEUTRAL = {
    "n": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": None,
    "functions": None,  # the legacy form of tools
    "function_call": None,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "web_search_options": None,
    "verbosity": None,
}
SCOPE = ("prompt_cache_key", "user", "safety_identifier")  # ChatCall.scope
SAMPLING = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed"}
KNOWN = {*IGNORED, *SCOPE, *SAMPLING, *NEUTRAL, *TOOLING}  # a body's fields
MAX_STOPS = 4  # OpenAI's own limit


@dataclass(slots=True)
class ChatCall:
    """A checked chat-completions request."""

    model: str
    # OpenAI-style message dicts as the SDK takes them: role (developer as system) and
    # content (text), an assistant's tool_calls, a tool's tool_call_id.
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # the worker's SamplingParams
    # Whose conversation it is: prompt_cache_key, user, safety_identifier. In OpenAI's API
    # they name a group of requests and an end user, never one conversation.
    scope: tuple[str, ...] = ()
    tools: str = ""  # the function tools as compact JSON, keys sorted; "" for none
    max_tool_calls: int = 0  # 1 for parallel_tool_calls false: the reply ends after one
    tool_call_required: bool = False  # tool_choice "required": the reply opens with a call
    tool_call_name: str = ""  # a named tool_choice: the reply is one call of it
    tool_call_forbidden: bool = False  # tool_choice "none": the reply makes no call
    # tool_choice allowed_tools: its calls are of these tools only, the tools kept whole
    tool_call_allowed: tuple[str, ...] = ()
    output_format: dict[str, Any] | None = None  # the worker's OutputFormat fields; None: text
    echo: dict[str, Any] = field(default_factory=dict)  # what the API's reply repeats of it
    # The Responses API's previous_response_id: the agent and the point of its conversation
    # that `messages` (only what is new) follow; None: `messages` are the whole conversation.
    after: tuple[str, str] | None = None
    mark_name: str = ""  # the name of the point this turn ends at (the response's id)
    agent_id: str = ""  # the agent that took the turn, once it started

    def choose(self, choice: ToolChoice) -> None:
        """Takes OpenAI's tool_choice, as tool_choice() reads it."""
        self.tool_call_required, self.tool_call_name = choice.required, choice.name
        self.tool_call_forbidden, self.tool_call_allowed = choice.forbidden, choice.allowed

    @property
    def system(self) -> str:
        """The leading system message's text, the agent's system prompt."""
        first = self.messages[0] if self.messages else {}
        return first["content"] if first.get("role") == "system" else ""

    def anonymous_id(self) -> str:
        """The agent a request with no identity goes to: one per scope, system prompt, first
        user message and tools, so that a client that resends its history finds it again."""
        first = next((("user", m["content"]) for m in self.messages if m["role"] == "user"), None)
        key = (*self.scope, self.system, first) if any(self.scope) else (self.system, first)
        key += (self.tools,) if self.tools else ()
        h = hashlib.blake2b(repr(key).encode(), digest_size=12)
        return f"anon-{h.hexdigest()}"


def parse_chat(body: Any, default_max_tokens: int) -> ChatCall:
    """The request body as a ChatCall; HTTPError 400 for anything agentkv would not do as
    OpenAI specifies (an unknown field or a refused value is never silently dropped)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    known_only(body, KNOWN)
    metadata(body)  # held to OpenAI's limits, though not stored
    for name, neutral in NEUTRAL.items():
        value = body.get(name)  # null: not given, as OpenAI reads it
        if value is not None and value != neutral:
            raise invalid(
                f"{name}={value!r} is not supported by agentkv (only {neutral!r})",
                name,
                "unsupported_value",
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: a model id is required", "model")
    utf8(model, "model")
    stream = typed(body, "stream", bool, False)
    options = typed(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    call = ChatCall(
        model,
        chat_messages(body.get("messages")),
        stream,
        _include_usage(options),
        _sampling(body, default_max_tokens),
        scope=tuple(typed(body, name, str, "") or "" for name in SCOPE),
        tools=_tools(body),
        max_tool_calls=1 if body.get("parallel_tool_calls") is False else 0,
        output_format=_response_format(body.get("response_format")),
    )
    call.choose(tool_choice(body.get("tool_choice"), "function"))
    named_tool(call, "tool_choice.function.name", "tool_choice.allowed_tools.tools")
    return call


def _include_usage(options: dict | None) -> bool:
    """stream_options: include_usage, and include_obfuscation, which changes nothing here
    (agentkv pads no stream event; OpenAI's default pads them)."""
    options = options or {}
    known_only(options, {"include_usage", "include_obfuscation"}, "stream_options")
    typed(options, "include_obfuscation", bool, None, "stream_options")
    return bool(typed(options, "include_usage", bool, False, "stream_options"))


def _response_format(value: Any) -> dict[str, Any] | None:
    """Chat's response_format: output_format's, its json_schema's fields under "json_schema"."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        known_only(value, {"type", "json_schema"}, "response_format")
        where = "response_format.json_schema"
        inner = typed(value, "json_schema", dict, None, "response_format")
        if inner is None:
            raise invalid(f"{where} is required", where)
        known_only(inner, FORMAT_KEYS - {"type"}, where)
        return output_format({"type": "json_schema", **inner}, "response_format", where)
    return output_format(value, "response_format")


def named_tool(call: ChatCall, where: str, allowed: str = "") -> None:
    """A named tool_choice must name one of the request's tools, and allowed_tools (at
    `allowed`) list only them; allowing all of them restricts nothing (and needs no worker
    that can)."""
    names = [tool["function"]["name"] for tool in json.loads(call.tools or "[]")]
    listed = ", ".join(names) or "none"
    if call.tool_call_name and call.tool_call_name not in names:
        raise invalid(f"{where} {call.tool_call_name!r} is not among the tools ({listed})", where)
    for name in call.tool_call_allowed:
        if name not in names:
            raise invalid(f"{allowed}: {name!r} is not among the tools ({listed})", allowed)
    if set(names) <= set(call.tool_call_allowed):
        call.tool_call_allowed = ()


def _tools(body: dict) -> str:
    """The request's function tools as compact JSON, keys sorted (the worker's canonical
    form), "" for none (tool_choice: tool_choice())."""
    typed(body, "parallel_tool_calls", bool, None)
    tools = body.get("tools")
    if tools is None:
        return ""
    if not isinstance(tools, list):
        raise invalid("tools must be an array of function tools", "tools")
    for i, tool in enumerate(tools):
        check_tool(tool, f"tools[{i}]")
    return tools_text(tools)


def _sampling(body: dict, default_max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 1.0}  # OpenAI's default: sampled
    out |= numbers(body, (("temperature", 0, 2), ("top_p", 0, 1)))
    given = _max_tokens(body)
    out["max_tokens"] = given or default_max_tokens
    if given is None:  # as OpenAI: the reply may use what room the context has left
        out["fit_max_tokens"] = True
    stops = _stops(body.get("stop"))
    if stops:
        out["stop"] = stops
    seed = typed(body, "seed", int, None)
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise invalid(f"seed must be in [-2^63, 2^64), got {seed}", "seed")
        out["seed"] = seed % 2**64  # OpenAI's seeds are signed, the worker's unsigned
    return out


def _max_tokens(body: dict) -> int | None:
    """max_completion_tokens, else the older max_tokens; each given is checked."""
    given = []
    for name in ("max_completion_tokens", "max_tokens"):
        value = typed(body, name, int, None)
        if value is not None and not 1 <= value < 2**32:
            raise invalid(f"{name} must be in [1, 2^32), got {value}", name)
        given += [] if value is None else [value]
    return given[0] if given else None


def _stops(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop has {len(stops)} strings, at most {MAX_STOPS}", "stop")
    for s in stops:
        utf8(s, "stop")
    return stops


def sent_as(header: str) -> str:
    """A header's value as its sender wrote it: HTTP carries bytes, which the ASGI server
    reads as Latin-1, so UTF-8 text (a refused agent id, quoted back) came out garbled."""
    try:
        return header.encode("latin-1").decode("utf-8")
    except UnicodeError:  # Latin-1 text after all
        return header


def agent_id(header: str, session: str, call: ChatCall) -> str:
    """The agent a call goes to: X-Agent-Id as given, else X-Session-ID, used as given when
    it is a valid agent id and digested when not, else the anonymous agent of its scope,
    system prompt and first message."""
    if header:
        return ids.agent_id(sent_as(header), "X-Agent-Id")
    if not session:
        return call.anonymous_id()
    if ids.AGENT_ID_RE.fullmatch(session):
        return session
    return "s-" + hashlib.blake2b(session.encode(), digest_size=12).hexdigest()
