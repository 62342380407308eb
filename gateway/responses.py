"""OpenAI's Responses API (POST /v1/responses) request, sans I/O: a request body checked into
the ChatCall the chat route makes too (so a conversation goes to the same agent, whichever
API sends it), and the ids of responses; response_reply.py writes the reply, as a Response
object or the Responses stream's events.

`instructions` is the system prompt; `input` is the conversation as items: messages (text
parts), the model's function_call items (an assistant message's tool calls) and the
caller's function_call_output items (tool messages). The whole input may be sent each call,
as the OpenAI Agents SDK and Codex send it, or only what is new, after a
`previous_response_id`. agentkv keeps no response objects: a response's id names its agent
and the point its reply ended at in the agent's conversation (TurnRequest.mark_name), which
the agent keeps with its cache, in the store too. So a call that continues a response sends
only the new items to that agent, after that point, whatever happened since (the gateway
restarted, the agent was evicted); one that continues an earlier response than the agent's
last goes on in a fork of the agent, so that both branches stay. `conversation` stays
refused, and `store` is a hint: the conversation's cache is kept anyway.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
from typing import Any

from agentkv import ids
from agentkv.errors import AgentKVError
from agentkv.gateway.errors import HTTPError, invalid
from agentkv.gateway.fields import checked_body, known_only, metadata, numbers, typed, utf8
from agentkv.gateway.messages import in_call_order, merged_assistant
from agentkv.gateway.protocol import SCOPE, ChatCall, named_tool
from agentkv.gateway.tooling import output_format, tool_choice, tool_name, tools_text

# Taken and meaningless here, or equal to what agentkv does anyway (every conversation's
# cache is kept, whatever store and prompt_cache_retention say).
IGNORED = {"model", "input", "instructions", "stream", "store", "metadata", "service_tier"}
IGNORED |= {"prompt_cache_retention", "prompt_cache_options"}
CHECKED = {"tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "include"}
CHECKED |= {"stream_options", "previous_response_id"}
SAMPLING = {"temperature", "top_p", "max_output_tokens"}
NEUTRAL = {  # accepted at these values only (or null)
    "background": (False,),
    "truncation": ("disabled",),  # "auto" would drop the conversation's start
    "top_logprobs": (0,),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "context_management": (),
}
KNOWN = {*IGNORED, *CHECKED, *SAMPLING, *NEUTRAL, *SCOPE}
# What `include` may ask for when the reply has none of it: encrypted reasoning (there is no
# reasoning; Codex asks for it on every call).
INCLUDABLE = {"reasoning.encrypted_content"}
FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}
ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "namespace"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "caller", "name"},
}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
INCOMPLETE = {"length", "deadline", "none"}  # finish reasons of a reply that was cut
MARK_NAME_CHARS = 12  # a response's mark name: hex digits, the first of its id after resp_
MARK_NAME = re.compile(f"[0-9a-f]{{{MARK_NAME_CHARS}}}")
REASONING = ("effort", "summary", "generate_summary", "context", "mode")  # hints: no reasoning


def parse_responses(body: Any, default_max_tokens: int) -> ChatCall:
    """The request body as a ChatCall; HTTPError 400 for anything agentkv would not do as
    OpenAI specifies (an unknown field or a refused value is never silently dropped)."""
    body = checked_body(body, KNOWN, NEUTRAL, _WHY)
    _hints(body)
    stream = bool(typed(body, "stream", bool, False))
    if (options := typed(body, "stream_options", dict, None)) is not None:
        if not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        known_only(options, {"include_obfuscation"}, "stream_options")  # no padding here
        typed(options, "include_obfuscation", bool, None, "stream_options")
    model = typed(body, "model", str, None)
    if not model:
        raise invalid("model: a model id is required", "model")
    instructions = typed(body, "instructions", str, None)
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools, sampling = _tools(body), _sampling(body, default_max_tokens)
    text = typed(body, "text", dict, None) or {}
    after = _previous(body, instructions, tools_text(tools))
    call = ChatCall(
        model,
        (system if after is None else []) + _input(body.get("input"), after is not None),
        stream,
        False,
        sampling,
        scope=tuple(typed(body, name, str, "") or "" for name in SCOPE),
        tools=tools_text(tools),
        max_tool_calls=1 if body.get("parallel_tool_calls") is False else 0,
        output_format=output_format(typed(text, "format", dict, None, "text"), "text.format"),
        echo=_echo(body, instructions, sampling["max_tokens"]),
    )
    call.choose(tool_choice(body.get("tool_choice")))
    named_tool(call, "tool_choice.name", "tool_choice.tools")
    call.after, call.mark_name = after, secrets.token_hex(MARK_NAME_CHARS // 2)
    return call


def response_id(agent_id: str, mark_name: str, instructions: str | None, tools: str) -> str:
    """A response's id: the point its reply ends at (`mark_name`, hex digits), then its
    agent and what its conversation was set up with (a digest of its instructions and
    tools), so that a call continuing it goes to that point of that agent's conversation."""
    named = json.dumps([agent_id, _setup(instructions, tools)], separators=(",", ":"))
    return f"resp_{mark_name}{base64.urlsafe_b64encode(named.encode()).decode().rstrip('=')}"


def _setup(instructions: str | None, tools: str) -> str:
    h = hashlib.blake2b(json.dumps([instructions or "", tools]).encode(), digest_size=6)
    return h.hexdigest()


def _previous(body: dict, instructions: str | None, tools: str) -> tuple[str, str] | None:
    """The agent and point previous_response_id names (response_id's), None without one; a
    400 for an id this gateway did not make, or instructions and tools other than the
    response's (they are at the start of the agent's cached conversation)."""
    previous = typed(body, "previous_response_id", str, None)
    if not previous:
        return None
    try:
        if not previous.startswith("resp_"):
            raise ValueError(previous)
        rest = previous.removeprefix("resp_")
        mark, named = rest[:MARK_NAME_CHARS], rest[MARK_NAME_CHARS:]
        if not MARK_NAME.fullmatch(mark):  # secrets.token_hex's, as response_id writes it
            raise ValueError(mark)
        agent_id, setup = json.loads(base64.urlsafe_b64decode(named + "=" * (-len(named) % 4)))
        agent_id = ids.agent_id(agent_id)
    except (binascii.Error, ValueError, TypeError, RecursionError, AgentKVError):
        raise not_found(previous, "it is not the id of a response agentkv made") from None
    if setup != _setup(instructions, tools):
        raise invalid(
            "previous_response_id: agentkv continues the response's conversation as cached, "
            "which begins with its instructions and tools: send the same ones (or the whole "
            "input, without previous_response_id, to change them)",
            "previous_response_id",
        )
    return agent_id, mark


def not_found(previous: str, why: str) -> HTTPError:
    """OpenAI's error for a previous_response_id it does not find, with agentkv's reason."""
    return invalid(
        f"Previous response with id {previous[:200]!r} not found: {why}",
        "previous_response_id",
        "previous_response_not_found",
    )


_WHY = {
    "conversation": " (agentkv keeps no conversation objects: send the whole input, or "
    "only what is new with previous_response_id)",
    "truncation": " (agentkv keeps the whole conversation the client sends)",
}


def _hints(body: dict) -> None:
    """Fields that ask for what the reply may or may not hold, taken when no answer breaks
    them: reasoning (none is returned), text's verbosity, include of encrypted reasoning."""
    reasoning = typed(body, "reasoning", dict, None) or {}
    known_only(reasoning, set(REASONING), "reasoning")
    for name in REASONING:
        typed(reasoning, name, str, None, "reasoning")
    text = typed(body, "text", dict, None) or {}
    known_only(text, {"format", "verbosity"}, "text")
    typed(text, "verbosity", str, None, "text")
    include = typed(body, "include", list, None) or []
    for i, name in enumerate(include):
        if not isinstance(name, str) or name not in INCLUDABLE:
            raise invalid(
                f"include[{i}] {name!r} is not supported (only {sorted(INCLUDABLE)})",
                f"include[{i}]",
                "unsupported_value",
            )


def _tools(body: dict) -> list[dict[str, Any]]:
    """The function tools in the chat route's form ({"type": "function", "function": {...}},
    which the worker renders); tool_choice: tool_choice()."""
    typed(body, "parallel_tool_calls", bool, None)
    tools = typed(body, "tools", list, None) or []
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise invalid(
            f"{where}: only function tools are supported, not {kind!r}",
            f"{where}.type",
            "unsupported_value",
        )
    known_only(tool, FUNCTION_KEYS, where)
    function: dict[str, Any] = {"name": tool_name(tool.get("name"), where)}
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        value = typed(tool, key, kind, None, where)
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def _input(items: Any, continuing: bool = False) -> list[dict[str, Any]]:
    """The input as OpenAI-style chat messages: a string is one user message; items in a
    row from the model (its message, its function calls) are one assistant message; each
    function_call_output is a tool message answering a call before it, put in its calls'
    order (in_call_order: chat templates pair them by place). `continuing`: those before
    any of the model's items answer the previous response's calls, which the worker keeps
    (it puts them in order, and refuses others' or calls left unanswered)."""
    if isinstance(items, str):
        utf8(items, "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input: a string or a non-empty array of items is required", "input")
    out: list[dict[str, Any]] = []
    asked: list[str] = []  # the last assistant message's calls, in order
    answered: set[str] = set()  # those answered so far
    for i, item in enumerate(items):
        where = f"input[{i}]"
        message = _item(item, where)
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            leading = continuing and all(m["role"] == "tool" for m in out)
            if leading and call_id not in answered:  # the previous response's calls'
                answered.add(call_id)
                out.append(message)
                continue
            if call_id not in asked or call_id in answered:
                raise invalid(
                    f"{where}: a function_call_output answers a function_call before it; "
                    f"{call_id!r} is none of those not yet answered",
                    f"{where}.call_id",
                )
            answered.add(call_id)
            out.append(message)
            continue
        if message["role"] == "assistant" and out and out[-1]["role"] == "assistant":
            out[-1] = message = merged_assistant(out[-1], message)  # the model's items in a row
        else:
            _all_answered(asked, answered, where)
            out.append(message)
        asked, answered = [c["id"] for c in message.get("tool_calls", ())], set()
        if len(set(asked)) < len(asked):
            raise invalid(f"{where}: two function calls have one call_id", f"{where}.call_id")
    _all_answered(asked, answered, f"input[{len(items) - 1}]")
    if out[-1]["role"] == "assistant":
        raise invalid(
            "the last item is the model's: agentkv does not continue a partial reply",
            f"input[{len(items) - 1}]",
            "unsupported_value",
        )
    return in_call_order(out)


def _all_answered(asked: list[str], answered: set[str], where: str) -> None:
    """Refuses a call of the last assistant message that no output answered before `where`."""
    if unanswered := set(asked) - answered:
        raise invalid(
            f"{where}: the function calls {sorted(unanswered)} have no "
            "function_call_output answering them before it",
            where,
        )


def _item(item: Any, where: str) -> dict[str, Any]:
    """One input item as a chat message."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if not isinstance(kind, str) or kind not in ITEM_KEYS:
        raise invalid(
            f"{where}: {kind!r} items are not supported (only {', '.join(ITEM_KEYS)})",
            f"{where}.type",
            "unsupported_value",
        )
    known_only(item, ITEM_KEYS[kind], where)
    if kind == "function_call":
        if item.get("namespace") is not None:
            raise invalid(f"{where}.namespace: namespaced tools are not supported", where)
        fields = {k: typed(item, k, str, None, where) for k in ("call_id", "name", "arguments")}
        for name, value in fields.items():
            if value is None or not (value or name == "arguments"):
                raise invalid(f"{where}.{name}: a non-empty string is required", f"{where}.{name}")
        function = {"name": fields["name"], "arguments": fields["arguments"]}
        call = {"id": fields["call_id"], "type": "function", "function": function}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == "function_call_output":
        call_id = typed(item, "call_id", str, None, where)
        if not call_id:
            raise invalid(f"{where}.call_id: a non-empty string is required", f"{where}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        utf8(text, f"{where}.output")
        return {"role": "tool", "content": text, "tool_call_id": call_id}
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"{where}.role {role!r} is not supported ({', '.join(ROLES)})", where)
    return {"role": ROLES[role], "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's content, or a function's output: a string, or text parts joined (images,
    files and audio are refused)."""
    if isinstance(content, str):
        utf8(content, where)
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or an array of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(kind, str) or kind not in TEXT_PARTS:
            raise invalid(
                f"{where}[{j}]: {kind!r} parts are not supported, only text",
                f"{where}[{j}]",
                "unsupported_value",
            )
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}]: its {TEXT_PARTS[kind]} must be a string", where)
        texts.append(text)
    text = "".join(texts)
    utf8(text, where)
    return text


def _sampling(body: dict, default_max_tokens: int) -> dict[str, Any]:
    """SamplingParams: temperature in [0, 2] (1 by default), top_p (0: greedy), and
    max_output_tokens, a ceiling lowered to the room the context has left (as OpenAI's
    "upper bound"; the gateway's default when not given)."""
    out: dict[str, Any] = {"temperature": 1.0, "fit_max_tokens": True}
    out |= numbers(body, (("temperature", 0, 2), ("top_p", 0, 1)))
    given = typed(body, "max_output_tokens", int, None)
    if given is not None and not 1 <= given < 2**32:
        raise invalid(f"max_output_tokens must be in [1, 2^32), got {given}", "max_output_tokens")
    out["max_tokens"] = given or default_max_tokens
    return out


def _echo(body: dict, instructions: str | None, max_tokens: int) -> dict[str, Any]:
    """The request's parameters as the Response object repeats them (max_output_tokens: the
    cap the reply had, the gateway's --max-tokens when the request gave none)."""
    reasoning = {"effort": None, "summary": None} | (body.get("reasoning") or {})
    text = {"format": {"type": "text"}, "verbosity": "medium"} | (body.get("text") or {})
    text["format"] = text["format"] or {"type": "text"}  # null: left out
    return {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": metadata(body),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id") or None,
        "reasoning": reasoning,
        "store": typed(body, "store", bool, None) is not False,
        "temperature": body.get("temperature", 1.0),
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": body.get("top_p", 1.0),
        **{name: body.get(name) for name in SCOPE},
    }
