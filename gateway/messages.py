"""A chat conversation's messages checked into the SDK's dicts (role, text content, an
assistant's tool calls, a tool's tool_call_id), with OpenAI's rule that every tool call is
answered before the conversation goes on, and tool results put in their calls' order."""

from __future__ import annotations

from typing import Any

from agentkv.gateway.errors import invalid
from agentkv.gateway.fields import known_only, utf8

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat route's messages, checked, with tool results in their calls' order; the
    last may not be the assistant's."""
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


# A message's fields: `name` (a participant's) is taken and not rendered, as the chat
# templates of most models leave it out; the others of OpenAI's are refused unless null
# (an SDK's model_dump() writes refusal, audio, annotations as null), or, for annotations,
# empty (a reply of OpenAI's own, resent).
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call"}


def _message(message: Any, where: str) -> dict[str, Any]:
    """One message as the SDK takes it: its role, its text, an assistant's tool calls (its
    content may then be null or absent), a tool's tool_call_id."""
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", where)
    if message.get("annotations") == []:  # as OpenAI's own replies carry it: no citations
        message = {k: v for k, v in message.items() if k != "annotations"}
    known_only(message, MESSAGE_KEYS, where)
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{where}.name must be a string", f"{where}.name")
    utf8(name or "", f"{where}.name")
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
        if any(c["id"] == fields["id"] for c in out):  # a result would answer either
            raise invalid(f"{at}: two tool calls have one id, {fields['id']!r}", f"{at}.id")
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
