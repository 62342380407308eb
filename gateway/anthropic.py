"""Anthropic's Messages API request, sans I/O: a request body checked into the ChatCall the
OpenAI route makes too (so a conversation goes to the same agent, whichever API sends it);
anthropic_reply.py writes the reply, as a Message or Anthropic's stream events, and errors as
Anthropic's error JSON.

Content blocks map onto OpenAI-style messages: a message's text blocks are joined (as the
OpenAI route joins text parts); an assistant's tool_use blocks are its tool calls (input as
JSON text); a user's tool_result blocks, which come first, are tool messages. Custom tools
({name, description, input_schema}) reach the chat template as function tools. cache_control
is taken and needs nothing: every conversation's cache is kept anyway.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentkv.gateway.errors import invalid
from agentkv.gateway.fields import checked_body, known_only, numbers, typed, utf8
from agentkv.gateway.messages import in_call_order, merged_assistant
from agentkv.gateway.protocol import ChatCall, named_tool
from agentkv.gateway.tooling import (
    NO_CONSTRAINTS,
    TOOL_NAME,
    schema_format,
    tool_name,
    tools_text,
)

# Checked where they are read, or meaningless here. A top-level cache_control (mark the last
# block) needs nothing: every conversation's cache is kept.
IGNORED = {"model", "messages", "max_tokens", "stream", "system", "metadata", "service_tier"}
IGNORED |= {"cache_control", "inference_geo", "user_profile_id", "workspace_id"}
# Older clients' sampling fields (the SDK since 2.x sends none: 1.0 is Anthropic's default).
SAMPLING = {"temperature", "top_p", "top_k", "stop_sequences"}
CHECKED = {"tools", "tool_choice", "thinking", "output_config", "context_management"}
NEUTRAL = {  # accepted at these values only (or null)
    "speed": ("standard",),
    "container": (),
    "diagnostics": (),  # would ask why the cache missed; agentkv's reason is its usage
}
KNOWN = {*IGNORED, *SAMPLING, *CHECKED, *NEUTRAL}  # a body's fields
# Thinking the model may do or not: a reply without thinking is a valid answer to all three.
THINKING = ("disabled", "adaptive", "enabled")
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}
TOOL_KEYS |= {"eager_input_streaming"}  # calls are streamed whole anyway
# Claude Code's first system block: a per-request billing stamp, no instruction to the model.
# Kept, it would make every request another conversation (llama.cpp and vLLM drop it too).
BILLING = "x-anthropic-billing-header:"


def parse_messages(body: Any, counting: bool = False) -> ChatCall:
    """The request body as a ChatCall; HTTPError 400 for anything agentkv would not do as
    Anthropic specifies (an unknown field or a refused value is never silently dropped).
    `counting`: a count_tokens body, which may end with the assistant's message."""
    body = checked_body(body, KNOWN, NEUTRAL)
    _hints(body)
    model = typed(body, "model", str, None)
    if not model:
        raise invalid("model: a model id is required", "model")
    tools, max_tool_calls, required, name, forbidden = _tools(body)
    config = body.get("output_config") or {}
    metadata = typed(body, "metadata", dict, {}) or {}
    known_only(metadata, {"user_id"}, "metadata")  # Anthropic's one field there
    user = typed(metadata, "user_id", str, "", "metadata")
    call = ChatCall(
        model,
        in_call_order([*_system(body.get("system")), *_messages(body.get("messages"), counting)]),
        bool(typed(body, "stream", bool, False)),
        False,
        _sampling(body),
        scope=("", user or "", ""),  # metadata.user_id is OpenAI's `user`
        tools=tools,
        max_tool_calls=max_tool_calls,
        tool_call_required=required,
        tool_call_name=name,
        tool_call_forbidden=forbidden,
        output_format=_output_format(typed(config, "format", dict, None, "output_config")),
    )
    named_tool(call, "tool_choice.name")
    return call


def _output_format(form: dict | None) -> dict[str, Any] | None:
    """output_config.format: {"type": "json_schema", "schema": {...}}, Anthropic's only kind
    (no name, unlike OpenAI's), as the worker's OutputFormat fields."""
    where = "output_config.format"
    if form is None:
        return None
    if form.get("type") != "json_schema":
        raise invalid(f"{where}.type must be json_schema", f"{where}.type", "unsupported_value")
    if not isinstance(form.get("schema"), dict):
        raise invalid(f"{where}.schema must be an object", f"{where}.schema")
    known_only(form, {"type", "schema"}, where)
    return schema_format(form["schema"], f"{where}.schema")


def parse_count(body: Any) -> ChatCall:
    """A count_tokens body (a Messages body without max_tokens or stream) as a ChatCall."""
    for name in ("max_tokens", "stream"):
        if isinstance(body, dict) and name in body:
            raise invalid(f"{name}: count_tokens takes none", name, "unsupported_parameter")
    return parse_messages({**body, "max_tokens": 1} if isinstance(body, dict) else body, True)


def _hints(body: dict) -> None:
    """Fields that ask the model for what it may or may not do, taken when no answer breaks
    them: thinking (none is returned), output_config's effort, context_management that
    clears thinking (there is none to clear). Clearing tool uses (an edit of the history) is
    refused."""
    thinking = typed(body, "thinking", dict, None) or {"type": "disabled"}
    if thinking.get("type") not in THINKING:
        raise invalid(f"thinking.type must be one of {', '.join(THINKING)}", "thinking.type")
    budget = typed(thinking, "budget_tokens", int, None, "thinking")
    if budget is not None and budget < 1024:  # Anthropic's least: a budget below is refused
        raise invalid(
            f"thinking.budget_tokens must be at least 1024, got {budget}", "thinking.budget_tokens"
        )
    config = typed(body, "output_config", dict, None) or {}
    known_only(config, {"effort", "format"}, "output_config")
    typed(config, "effort", str, None, "output_config")
    context = typed(body, "context_management", dict, None) or {}
    known_only(context, {"edits"}, "context_management")
    edits = typed(context, "edits", list, None, "context_management") or []
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str) or not kind.startswith("clear_thinking"):
            where = f"context_management.edits.{i}"
            raise invalid(
                f"{where}: only clear_thinking edits are supported (agentkv keeps the whole "
                "conversation the client sends)",
                where,
                "unsupported_value",
            )


def _system(system: Any) -> list[dict[str, Any]]:
    """The system prompt (a string or text blocks, less a billing stamp) as a leading system
    message, if any."""
    if system is None:
        return []
    if isinstance(system, list):
        blocks = [b for b in system if not _billing(b)]
        text = _text(blocks, "system")
    elif isinstance(system, str):
        text = system
        utf8(text, "system")
    else:
        raise invalid("system must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": text}] if text else []


def _billing(block: Any) -> bool:
    text = block.get("text") if isinstance(block, dict) else None
    return isinstance(text, str) and text.startswith(BILLING)


def _messages(messages: Any, counting: bool = False) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style messages. Unless `counting` (count_tokens counts a
    conversation that ends with the assistant's message too), a reply is what comes next."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty array of messages is required", "messages")
    out, asked = [], set()  # asked: the last assistant message's tool_use ids not answered
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system") or (role == "system" and not i):
            raise invalid(
                f'{where}: a message is {{"role": "user", "assistant" or "system" (not first: '
                'the top-level system is), "content": ...}',
                where,
            )
        known_only(message, {"role", "content"}, where)
        content = _blocks(message.get("content"), where)
        if role == "assistant" and out and out[-1]["role"] == "assistant":
            # assistant turns in a row are one, as Anthropic reads them: its calls too
            out[-1] = merged_assistant(out[-1], _assistant(content, where))
            asked = {call["id"] for call in out[-1].get("tool_calls") or ()}
            continue
        if role == "assistant":
            turn = [_assistant(content, where)]
        elif role == "user":
            turn = _user(content, where, asked)
        else:
            turn = [{"role": "system", "content": _text(content, f"{where}.content")}]
        if asked:
            raise invalid(
                f"{where}: tool_use ids {sorted(asked)} have no tool_result after them", where
            )
        asked = {call["id"] for call in (turn[0].get("tool_calls") or ())}
        out += turn
    if not counting and (asked or out[-1]["role"] == "assistant"):
        raise invalid(
            "the last message is the assistant's: agentkv does not continue a partial reply",
            f"messages.{len(messages) - 1}",
            "unsupported_value",
        )
    return out


def _blocks(content: Any, where: str) -> list:
    """A message's content as blocks (a string is one text block); never none."""
    if isinstance(content, str):
        utf8(content, f"{where}.content")
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise invalid(f"{where}.content must be a string or a non-empty array of blocks", where)
    return content


def _assistant(content: list, where: str) -> dict[str, Any]:
    """An assistant message: its text blocks joined, its tool_use blocks as tool calls."""
    texts, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _block(block, at, ("text", "tool_use"))
        if kind == "text":
            texts.append(block["text"])
            continue
        name, call_id, given = block.get("name"), block.get("id"), block.get("input")
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise invalid(f"{at}: a tool_use block has a non-empty id and name", at)
        if not isinstance(given, dict):
            raise invalid(f"{at}.input must be an object", f"{at}.input")
        if block.get("caller") not in (None, {"type": "direct"}):
            raise invalid(f"{at}.caller: only a direct call", f"{at}.caller", "unsupported_value")
        if any(c["id"] == call_id for c in calls):  # a result would answer either
            raise invalid(f"{at}: two tool_use blocks have one id, {call_id!r}", f"{at}.id")
        arguments = json.dumps(given, ensure_ascii=False)
        utf8(call_id + name + arguments, at)
        function = {"name": name, "arguments": arguments}
        calls.append({"id": call_id, "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    return message | ({"tool_calls": calls} if calls else {})


def _user(content: list, where: str, asked: set[str]) -> list[dict[str, Any]]:
    """A user message: its tool_result blocks (first, as Anthropic requires) as tool
    messages, each answering one of `asked` (removed from it), then its text as one user
    message. A result marked is_error reads "Error: " before its text."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    answered: set[str] = set()
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if _block(block, at, ("text", "tool_result")) == "text":
            texts.append(block["text"])
            continue
        if texts:
            raise invalid(f"{at}: tool_result blocks come first in a user message", at)
        call_id = typed(block, "tool_use_id", str, None, at)
        if call_id in answered:
            raise invalid(f"{at}: a second tool_result for {call_id!r}", f"{at}.tool_use_id")
        answered.add(call_id)
        if not call_id or call_id not in asked:
            raise invalid(
                f"{at}: a tool_result answers a tool_use of the assistant message before it; "
                f"{call_id!r} is none of them",
                f"{at}.tool_use_id",
            )
        asked.discard(call_id)
        error = typed(block, "is_error", bool, None, at)
        result = block.get("content", "")
        text = result if isinstance(result, str) else _text(result, f"{at}.content")
        utf8(text, f"{at}.content")
        text = f"Error: {text}" if error else text
        out.append({"role": "tool", "content": text, "tool_call_id": call_id})
    return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _block(block: Any, where: str, kinds: Sequence[str]) -> str:
    """A content block's type, one of `kinds`, its fields checked (a text block's text)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise invalid(
            f"{where}: {kind!r} blocks are not supported here, only {', '.join(kinds)}",
            f"{where}.type",
            "unsupported_value",
        )
    known_only(block, BLOCK_KEYS[kind], where)
    if kind == "text":
        if not isinstance(block.get("text"), str) or block.get("citations"):
            raise invalid(f"{where}: a text block has a string text and no citations", where)
        utf8(block["text"], f"{where}.text")
    return kind


def _text(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool's result) joined."""
    if not isinstance(blocks, list):
        raise invalid(f"{where} must be a string or an array of text blocks", where)
    for j, block in enumerate(blocks):
        _block(block, f"{where}.{j}", ("text",))
    return "".join(block["text"] for block in blocks)


def _tools(body: dict) -> tuple[str, int, bool, str, bool]:
    """The custom tools as function tools' compact JSON (the OpenAI route's form), the most
    tool calls a reply may make (1 with disable_parallel_tool_use, else no limit), whether
    the reply must open with one (tool_choice "any"), the tool it must call ("tool"), and
    whether it may make none ("none", which has no other field)."""
    choice = typed(body, "tool_choice", dict, None)
    choice = {"type": "auto"} if choice is None else choice
    if choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid(
            f"tool_choice {choice.get('type')!r}: {NO_CONSTRAINTS}",
            "tool_choice",
            "unsupported_value",
        )
    kind = choice["type"]
    named = kind == "tool"
    keys = {"type"} if kind == "none" else {"type", "disable_parallel_tool_use"}
    known_only(choice, keys | ({"name"} if named else set()), "tool_choice")
    single = typed(choice, "disable_parallel_tool_use", bool, False, "tool_choice")
    tools = typed(body, "tools", list, None) or []
    functions = [_tool(tool, f"tools.{i}") for i, tool in enumerate(tools)]
    name = tool_name(choice.get("name"), "tool_choice") if named else ""
    return tools_text(functions), 1 if single else 0, kind == "any", name, kind == "none"


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """A custom tool as a function tool; a server tool (web search, bash, ...) is refused."""
    if not isinstance(tool, dict):
        raise invalid(f"{where} must be a tool object", where)
    if tool.get("type") not in (None, "custom"):
        raise invalid(
            f"{where}: only custom tools are supported, not {tool['type']!r}",
            f"{where}.type",
            "unsupported_value",
        )
    known_only(tool, TOOL_KEYS, where)
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(f"{where}.name must be 1 to 64 letters, digits, _ or -", f"{where}.name")
    schema = typed(tool, "input_schema", dict, None, where)
    if schema is None:
        raise invalid(f"{where}.input_schema: a JSON schema object is required", where)
    strict = typed(tool, "strict", bool, None, where)  # enforced as the OpenAI route's
    typed(tool, "eager_input_streaming", bool, None, where)  # taken
    description = typed(tool, "description", str, None, where)
    function = {"name": name, "parameters": schema} | ({"strict": True} if strict else {})
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _sampling(body: dict) -> dict[str, Any]:
    """SamplingParams: max_tokens (required, as Anthropic's; a ceiling, lowered to the room
    the context has left; 0 only adds the conversation to the cache), temperature in [0, 1]
    (1 by default), top_p (0: greedy), top_k, stop_sequences."""
    out: dict[str, Any] = {"temperature": 1.0, "fit_max_tokens": True}
    out |= numbers(body, (("temperature", 0, 1), ("top_p", 0, 1)))
    top_k = typed(body, "top_k", int, None)
    if top_k is not None:
        if not 0 <= top_k < 2**32:
            raise invalid(f"top_k must be at least 0, got {top_k}", "top_k")
        out["top_k"] = top_k
    max_tokens = typed(body, "max_tokens", int, None)
    if max_tokens is None or not 0 <= max_tokens < 2**32:
        got = "" if max_tokens is None else f", got {max_tokens}"  # absent, or null
        raise invalid(f"max_tokens: an integer in [0, 2^32) is required{got}")
    out["max_tokens"] = max_tokens
    stops = typed(body, "stop_sequences", list, None) or []
    if not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences must be an array of non-empty strings", "stop_sequences")
    for s in stops:
        utf8(s, "stop_sequences")
    return out | ({"stop": stops} if stops else {})
