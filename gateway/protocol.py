"""OpenAI's chat-completions wire format, sans I/O: a request body checked into a ChatCall,
replies and stream chunks built from the worker's usage and tool calls, and agentkv's errors
as OpenAI's error JSON with the HTTP status that fits their gRPC code.

Tools are OpenAI function tools, rendered by the model's chat template; the worker parses the
calls the model writes. With tool_choice "auto" the model decides whether to call a tool,
which, and how many; "required", a named function and "none" are enforced by the worker's
constrained decoding, as response_format is (inference_worker/grammar.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from agentkv import ids
from agentkv.errors import AgentKVError

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
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
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MODEL_DECIDES = "the model decides whether to call a tool, and which, unless asked"
NO_CONSTRAINTS = f"{MODEL_DECIDES}: agentkv enforces a call (any, or one named) or none"
OPENAI_CHOICES = (  # OpenAI's API also restricts calls to some tools (allowed_tools)
    f"{MODEL_DECIDES}: agentkv enforces a call (any, one named, or of the allowed_tools) or none"
)
FORMAT_KEYS = {"type", "name", "description", "schema", "strict"}  # a json_schema format
STATUS = {  # gRPC code -> HTTP status, OpenAI error type
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class HTTPError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        # A lone surrogate (a field's name, quoted back) cannot be sent as UTF-8: escaped.
        message, param = escaped(message), escaped(param) if param is not None else None
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    @classmethod
    def of(cls, exc: AgentKVError) -> HTTPError:
        status, kind = STATUS.get(exc.code, (500, "server_error"))
        code = "context_length_exceeded" if exc.code == grpc.StatusCode.OUT_OF_RANGE else None
        return cls(status, exc.message, kind, code=code or exc.code.name.lower())

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


def escaped(text: str) -> str:
    """Text with any lone surrogate written as its escape, so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param, code=code)


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
        _messages(body.get("messages")),
        stream,
        bool(typed(options or {}, "include_usage", bool, False)),
        _sampling(body, default_max_tokens),
        scope=tuple(typed(body, name, str, "") or "" for name in SCOPE),
        tools=_tools(body),
        max_tool_calls=1 if body.get("parallel_tool_calls") is False else 0,
        output_format=_response_format(body.get("response_format")),
    )
    call.choose(tool_choice(body.get("tool_choice"), "function"))
    named_tool(call, "tool_choice.function.name", "tool_choice.allowed_tools.tools")
    return call


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


def output_format(form: Any, where: str, fields: str = "") -> dict[str, Any] | None:
    """A structured output format ({"type": "text" | "json_object" | "json_schema"}, a JSON
    Schema's name, description, schema and strict beside its type, or in `fields`) as the
    worker's OutputFormat fields; None for text. Every schema is enforced, strict or not
    (OpenAI enforces only strict ones); one without a schema is any JSON."""
    if form is None:
        return None
    if not isinstance(form, dict) or not isinstance(form.get("type"), str):
        raise invalid(f'{where} must be an object with a "type"', where)
    kind = form["type"]
    if kind in ("text", "json_object"):
        known_only(form, {"type"}, where)
        return {"json_object": True} if kind == "json_object" else None
    if kind != "json_schema":
        raise invalid(
            f"{where}.type {kind!r} is not one of text, json_object, json_schema",
            f"{where}.type",
            "unsupported_value",
        )
    where = fields or where
    known_only(form, FORMAT_KEYS, where)
    tool_name(form.get("name"), where)  # the same rule as a function's name
    typed(form, "description", str, None, where)
    typed(form, "strict", bool, None, where)
    schema = typed(form, "schema", dict, None, where)
    return {"json_schema": json.dumps({} if schema is None else schema, ensure_ascii=False)}


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


class ToolChoice(NamedTuple):
    """OpenAI's tool_choice, as the worker's TurnRequest takes it (tool_call_*)."""

    required: bool = False
    name: str = ""
    forbidden: bool = False
    allowed: tuple[str, ...] = ()


def tool_choice(choice: Any, inner: str = "") -> ToolChoice:
    """OpenAI's tool_choice as (a call required, the tool named, a call forbidden, the tools
    allowed): "auto" (or none given) lets the model decide, "required" makes the reply open
    with a call, {"type": "function", ...} with a call of the function named (under `inner`
    on the chat route, beside the type on the Responses route), "none" makes none;
    {"type": "allowed_tools", ...} lets its calls be of some tools only (allowed_tools)."""
    if choice in (None, "auto", "required", "none"):
        return ToolChoice(required=choice == "required", forbidden=choice == "none")
    if isinstance(choice, dict) and choice.get("type") == "function":
        known_only(choice, {"type", inner or "name"}, "tool_choice")
        named = _within(choice, inner, "tool_choice")
        where = f"tool_choice.{inner}" if inner else "tool_choice"
        known_only(named, {"name"} if inner else {"type", "name"}, where)
        return ToolChoice(required=True, name=tool_name(named.get("name"), where))
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, "allowed_tools" if inner else "", inner)
    if not isinstance(choice, dict):
        raise invalid(
            f'tool_choice must be "auto", "none", "required" or an object, got {choice!r}',
            "tool_choice",
        )
    raise invalid(f"tool_choice={choice!r}: {OPENAI_CHOICES}", "tool_choice", "unsupported_value")


def _allowed_tools(choice: dict, outer: str, inner: str) -> ToolChoice:
    """allowed_tools' mode and function tools (under `outer` and each tool's `inner` on the
    chat route, beside the type on the Responses route). Allowing none is "none"."""
    known_only(choice, {"type", outer} if outer else {"type", "mode", "tools"}, "tool_choice")
    where = f"tool_choice.{outer}" if outer else "tool_choice"
    body = _within(choice, outer, "tool_choice")
    known_only(body, {"mode", "tools"} | (set() if outer else {"type"}), where)
    mode, tools = body.get("mode"), body.get("tools")
    if mode not in ("auto", "required"):
        raise invalid(f'{where}.mode must be "auto" or "required", got {mode!r}', f"{where}.mode")
    if not isinstance(tools, list):
        raise invalid(f"{where}.tools must be an array of tools", f"{where}.tools")
    names = []
    for i, tool in enumerate(tools):
        at = f"{where}.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{at}: agentkv calls only function tools", at, "unsupported_value")
        known_only(tool, {"type", inner or "name"}, at)
        named = _within(tool, inner, at)
        names.append(tool_name(named.get("name"), f"{at}.{inner}" if inner else at))
    if not names and mode == "required":
        raise invalid(f"{where}.tools: a required call needs a tool allowed", f"{where}.tools")
    allowed = tuple(dict.fromkeys(names))
    return ToolChoice(required=mode == "required", forbidden=not names, allowed=allowed)


def _within(obj: dict, key: str, where: str) -> dict:
    """obj[key], an object, where the chat route nests a tool choice's fields under it
    (`key`); `obj` itself where the Responses route puts them beside its type (`key` "")."""
    return (typed(obj, key, dict, None, where) or {}) if key else obj


def typed(body: dict, name: str, kind: type, default: Any, where: str = "") -> Any:
    """body[name] when it is a `kind` (null or absent: `default`); `where`: the object's
    place in the request, when not the body."""
    value, param = body.get(name, default), f"{where}.{name}" if where else name
    if (
        value is not None
        and value is not default
        and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
    ):
        raise invalid(f"{param} must be a {kind.__name__}, got {value!r}", param)
    if kind is str and value:
        utf8(value, param)
    return value


def utf8(text: str, where: str) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text can hold."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise invalid(f"{where} holds a lone surrogate escape, not valid Unicode", where) from None


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty array of messages is required", "messages")
    out = [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    if out[-1]["role"] == "assistant":
        raise invalid(
            "the last message is the assistant's: agentkv does not continue a partial reply",
            f"messages[{len(out) - 1}]",
            "unsupported_value",
        )
    _answered(out)
    return in_call_order(out)


def merged_assistant(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two assistant messages in a row as one, as Anthropic's API and the Responses API read
    the model's turns: texts joined, calls in order."""
    calls = [*first.get("tool_calls", ()), *then.get("tool_calls", ())]
    message = {"role": "assistant", "content": first["content"] + then["content"]}
    return message | ({"tool_calls": calls} if calls else {})


def in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant message's tool results (the tool messages after it)
    in its calls' order, whatever order they came in: chat templates pair a result with a
    call by its place (Qwen 2.5's and Llama 3's name no call id)."""
    out: list[dict[str, Any]] = []
    order: dict[str, int] = {}  # the last assistant message's call ids, by place
    for message in messages:
        if message["role"] != "tool":
            order = {c["id"]: i for i, c in enumerate(message.get("tool_calls", ()))}
            out.append(message)
            continue
        at = len(out)  # after the tool messages before it that answer a call placed earlier
        place = order.get(message.get("tool_call_id"), len(order))
        while (
            at
            and out[at - 1]["role"] == "tool"
            and order.get(out[at - 1].get("tool_call_id"), len(order)) > place
        ):
            at -= 1
        out.insert(at, message)
    return out


def _message(message: Any, where: str) -> dict[str, Any]:
    """One message as the SDK takes it: its role, its text, an assistant's tool calls (its
    content may then be null or absent), a tool's tool_call_id."""
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(
            f"{where}.role {role!r} is not supported ({', '.join(ROLES)})",
            f"{where}.role",
            "unsupported_value",
        )
    if message.get("function_call") is not None:
        raise invalid(
            f"{where}: function_call (the legacy form of tool_calls) is not supported",
            f"{where}.function_call",
            "unsupported_value",
        )
    calls, content = message.get("tool_calls"), message.get("content")
    out: dict[str, Any] = {"role": ROLES[role]}
    if calls and role != "assistant":  # [] is none, as null
        raise invalid(f"{where}: only an assistant message has tool_calls", f"{where}.tool_calls")
    if calls:  # [] is none
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    text_needed = not calls or content is not None
    out["content"] = _text(content, f"{where}.content") if text_needed else ""
    call_id = message.get("tool_call_id")
    if role == "tool" or call_id is not None:
        if role != "tool" or not isinstance(call_id, str) or not call_id:
            raise invalid(
                f"{where}: a tool message, and only one, has a tool_call_id (a string)",
                f"{where}.tool_call_id",
            )
        utf8(call_id, f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, each {"id", "type": "function", "function":
    {"name", "arguments"}} with string fields (arguments: the JSON text of an object)."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be an array of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type") != "function":
            raise invalid(f'{at} must be {{"type": "function", "function": {{...}}}}', at)
        fields = {"id": call.get("id"), **{k: function.get(k) for k in ("name", "arguments")}}
        for name, value in fields.items():
            if not isinstance(value, str) or not (value or name == "arguments"):
                raise invalid(f"{at}: its {name} must be a non-empty string", f"{at}.{name}")
            utf8(value, f"{at}.{name}")
        function = {"name": fields["name"], "arguments": fields["arguments"]}
        out.append({"id": fields["id"], "type": "function", "function": function})
    return out


def _answered(messages: list[dict[str, Any]]) -> None:
    """OpenAI's rule: a tool message answers a call of the assistant message before it
    (tool messages only between them), and every call is answered before another message
    comes or the conversation ends."""
    pending: set[str] = set()  # the last assistant message's calls not yet answered
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            if message["tool_call_id"] not in pending:
                raise invalid(
                    f"messages[{i}]: a tool message must answer a tool call of the assistant "
                    f"message before it; {message['tool_call_id']!r} is none of its calls",
                    f"messages[{i}].tool_call_id",
                )
            pending.discard(message["tool_call_id"])
            continue
        _all_answered(pending, i)
        pending = {call["id"] for call in message.get("tool_calls", ())}
    _all_answered(pending, len(messages) - 1)


def _all_answered(pending: set[str], i: int) -> None:
    if pending:
        raise invalid(
            f"messages[{i}]: the tool calls {sorted(pending)} of the assistant message before "
            "it have no tool message answering them",
            f"messages[{i}]",
        )


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts are refused)."""
    if isinstance(content, str):
        utf8(content, where)
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{where}: {kind!r} parts are not supported, only text", where)
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}: a text part's text must be a string", where)
            texts.append(part["text"])
        text = "".join(texts)
        utf8(text, where)
        return text
    raise invalid(f"{where} must be a string or an array of text parts", where)


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
        _tool(tool, f"tools[{i}]")
    return tools_text(tools)


def tools_text(tools: list[dict[str, Any]]) -> str:
    """Function tools as the worker's canonical form: compact JSON, keys sorted ("" for
    none)."""
    text = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    utf8(text, "tools")
    return text if tools else ""


def _tool(tool: Any, where: str) -> None:
    """One tool: {"type": "function", "function": {"name", "description", "parameters",
    "strict"}}, as OpenAI specifies it; other kinds of tool are refused. `strict` passes to
    the worker (OpenAI's Agents SDK sets it on every function tool), which holds every call
    to the tools' `parameters` where the model's calls can be held; a call's arguments are
    held so wherever the worker constrains the call (required, named, allowed, or beside a
    response_format), whatever `strict` says."""
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    if tool["type"] != "function":
        raise invalid(
            f"{where}: only function tools are supported, not {tool['type']!r} tools",
            f"{where}.type",
            "unsupported_value",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object", f"{where}.function")
    known_only(tool, {"type", "function"}, where)
    where += ".function"
    known_only(function, FUNCTION_KEYS, where)
    tool_name(function.get("name"), where)
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        typed(function, key, kind, None, where)


def tool_name(name: Any, where: str) -> str:
    """A function's name, as OpenAI's rule has it (1 to 64 letters, digits, _ or -)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(
            f"{where}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
            f"{where}.name",
        )
    return name


def checked_body(
    body: Any, known: set[str], neutral: dict[str, tuple], why: dict[str, str] | None = None
) -> dict:
    """The request body: a JSON object of `known` fields only, each field of `neutral` null
    or one of its values (else a 400 naming it, with `why` it is refused, when given)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    known_only(body, known)
    for name, values in neutral.items():
        if body.get(name) not in (None, *values):
            allowed = " or ".join(map(repr, (None, *values)))
            reason = (why or {}).get(name, "")
            raise invalid(f"{name}: only {allowed} is supported{reason}", name, "unsupported_value")
    return body


def known_only(obj: dict, known: set[str], where: str = "") -> None:
    """Refuses a field of `obj` (at `where`; "": the body) that is not `known`, as an unknown
    parameter: one is never silently dropped. The first, by name, is named."""
    extra = sorted(set(obj) - known)
    if extra:
        param = f"{where}.{extra[0]}" if where else extra[0]
        raise invalid(f"unsupported parameter: {param}", param, "unsupported_parameter")


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


def numbers(body: dict, ranges: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    """The fields of `ranges` (name, lowest, highest) that the body gives, each a number
    within its range; a top_p of 0 as greedy (both APIs' reading; the worker's 0 is off)."""
    out = {}
    for name, low, high in ranges:
        value = body.get(name)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not low <= value <= high:
            raise invalid(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
        out[name] = float(value)
    if out.get("top_p", 1.0) <= 1e-6:  # the worker's 0 turns nucleus off; the APIs' is greedy
        out["temperature"], out["top_p"] = 0.0, 1.0
    return out


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = typed(body, name, int, None)
        if value is not None:
            if not 1 <= value < 2**32:
                raise invalid(f"{name} must be in [1, 2^32), got {value}", name)
            return value
    return None


def _stops(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop must be a string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop has {len(stops)} strings, at most {MAX_STOPS}", "stop")
    for s in stops:
        utf8(s, "stop")
    return stops


def agent_id(header: str, session: str, call: ChatCall) -> str:
    """The agent a call goes to: X-Agent-Id as given, else X-Session-ID, used as given when
    it is a valid agent id and digested when not, else the anonymous agent of its scope,
    system prompt and first message."""
    if header:
        return ids.agent_id(header, "X-Agent-Id")
    if not session:
        return call.anonymous_id()
    if ids.AGENT_ID_RE.fullmatch(session):
        return session
    return "s-" + hashlib.blake2b(session.encode(), digest_size=12).hexdigest()


def finish_reason(usage: Any) -> str:
    """OpenAI's finish_reason of a turn: "length" when max_tokens cut it, "tool_calls" when
    it ended after calling tools, else "stop"."""
    return usage.finish_reason if usage.finish_reason in ("length", "tool_calls") else "stop"


def tool_call_json(call: Any) -> dict[str, Any]:
    """A tool call (the worker's ToolCall) as OpenAI writes it in a message."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def with_creation(usage: Any, created: Any) -> Any:
    """A first call's usage counts what making its agent took too: its system prompt's
    tokens were prefilled then, or read from the store (a prefix another agent stored)."""
    if created is None:
        return usage
    whole = type(usage)()
    whole.CopyFrom(usage)
    whole.prefilled_tokens += created.prefilled_tokens
    whole.reused_store_tokens += created.reused_store_tokens
    whole.reused_hot_tokens = 0  # this call made what the turn found in RAM
    whole.cache_state = created.cache_state
    whole.restore_path = created.restore_path
    return whole


def usage_json(usage: Any) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens are those the turn did not prefill."""
    cached = max(usage.prompt_tokens - usage.prefilled_tokens, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.generated_tokens,
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def agentkv_json(namespace: str, agent: str, worker: str, usage: Any) -> dict[str, Any]:
    """agentkv's own figures of a turn: the `agentkv` extension object."""
    return {
        "namespace": namespace,
        "agent_id": agent,
        "worker": worker,
        "cache_state": usage.cache_state,
        "time_to_first_token_ms": round(usage.time_to_first_token_ms, 3),
        "reused_hot_tokens": usage.reused_hot_tokens,
        "reused_store_tokens": usage.reused_store_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
        "restore_path": usage.restore_path,
        "restore_failure": usage.restore_failure,
    }


@dataclass(slots=True)
class Completion:
    """One reply's ids and the pieces of OpenAI's JSON it is sent as."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    calls: int = 0  # tool calls streamed

    def whole(self, events: Sequence[Any], usage: Any, extension: dict[str, Any]) -> dict[str, Any]:
        """The whole reply, from its events (text pieces and tool calls, in order). With tool
        calls, its content is null when the model wrote no other text than white space (as
        OpenAI's)."""
        text = "".join(e for e in events if isinstance(e, str))
        tool_calls = [e for e in events if not isinstance(e, str)]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text if text.strip() else None
            message["tool_calls"] = [tool_call_json(call) for call in tool_calls]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": finish_reason(usage),
            "logprobs": None,
        }
        return {
            **self._head("chat.completion"),
            "choices": [choice],
            "usage": usage_json(usage),
            "agentkv": extension,
        }

    # the reply streamed, as server-sent events

    def opening(self, started: Any = None) -> list[str]:
        """The first chunk (`started`, the prompt's usage, is not sent before the end)."""
        return [sse(self.chunk({"role": "assistant", "content": ""}))]

    def text(self, piece: str) -> list[str]:
        return [sse(self.chunk({"content": piece}))]

    def call(self, call: Any) -> list[str]:
        """A tool call, whole in one chunk."""
        self.calls += 1
        return [sse(self.tool_call_chunk(call, self.calls - 1))]

    def closing(self, usage: Any, extension: dict[str, Any], include_usage: bool) -> list[str]:
        """The last chunk (its finish_reason, with the `agentkv` object), the usage chunk
        when asked for, then [DONE]."""
        out = [sse({**self.chunk({}, finish_reason(usage)), "agentkv": extension})]
        out += [sse(self.usage_chunk(usage, extension))] if include_usage else []
        return out + ["data: [DONE]\n\n"]

    def error(self, error: HTTPError) -> str:
        return sse(error.body())

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def tool_call_chunk(self, call: Any, index: int) -> dict[str, Any]:
        """A tool call, whole in one delta; `index`: its place among the reply's calls."""
        return self.chunk({"tool_calls": [{"index": index, **tool_call_json(call)}]})

    def usage_chunk(self, usage: Any, extension: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [],
            "usage": usage_json(usage),
            "agentkv": extension,
        }

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def sse(data: dict[str, Any]) -> str:
    """One server-sent event of OpenAI's stream: its JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
