"""What the SDK sends a worker, as its protobuf: messages (pairs, OpenAI-style dicts, or
the worker's own), tools, a reply's required form, and a turn's whole request."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

from agentkv.errors import InvalidArgument
from agentkv.worker.v1 import worker_pb2 as pb

# A (role, content) pair, an OpenAI-style message dict, or the worker's own Message.
Message = Union[tuple[str, str], Mapping[str, Any], pb.Message]  # noqa: UP007 (3.10)
Messages = Union[str, Sequence[Message]]  # noqa: UP007
# OpenAI function tools: a list of {"type": "function", "function": {...}}, or its JSON text.
Tools = Union[str, Sequence[Mapping[str, Any]], None]  # noqa: UP007
OutputFormat = Union[Mapping[str, Any], pb.OutputFormat, None]  # noqa: UP007 (a JSON Schema)


def as_messages(messages: Messages, role: str = "user") -> list[pb.Message]:
    """A text becomes one message with `role`; a sequence of messages is converted as
    pb_messages does."""
    if isinstance(messages, str):
        return [message_of((role, messages))]
    if not isinstance(messages, Iterable) or isinstance(messages, Mapping):
        raise InvalidArgument(
            f"messages must be a text or a list of messages, got {type(messages).__name__}"
        )
    return pb_messages(messages)


def pb_messages(messages: Sequence[Message]) -> list[pb.Message]:
    """Messages as the worker takes them, each one a (role, content) pair, a pb.Message, or
    an OpenAI-style dict: {"role", "content"} (a text, text parts, or None for an assistant
    message that only calls tools), an assistant's "tool_calls" ([{"id", "type":
    "function", "function": {"name", "arguments"}}]), a tool's "tool_call_id"."""
    return [message_of(message, i) for i, message in enumerate(messages)]


def message_of(message: Message, index: int = 0) -> pb.Message:
    """One message of pb_messages' kinds as a pb.Message (the openai client's message
    objects as their dicts; "developer" is "system", as OpenAI reads it); InvalidArgument
    for another."""
    if isinstance(message, pb.Message):
        return message
    message = _dumped(message)
    if isinstance(message, Mapping):
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidArgument(f"message {index} has no role")
        calls = [tool_call_of(call) for call in message.get("tool_calls") or ()]
        return pb.Message(
            role=_text("system" if role == "developer" else role, f"message {index}'s role"),
            content=_content(message.get("content"), index),
            tool_calls=calls,
            tool_call_id=_text(message.get("tool_call_id") or "", f"message {index}'s call id"),
        )
    if isinstance(message, (tuple, list)) and len(message) == 2:
        role = _text(message[0], f"message {index}'s role")
        return pb.Message(role=role, content=_content(message[1], index))
    raise InvalidArgument(
        f"message {index} is neither a (role, content) pair nor a message dict: {message!r}"
    )


def _content(content: Any, index: int) -> str:
    """A message's content as text: None is none, text parts are joined; InvalidArgument
    for text that is not Unicode's (a lone surrogate: UTF-8, the wire's, cannot carry it)."""
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, Sequence) and all(_is_text_part(part) for part in content):
        text = "".join(part["text"] for part in content)
    else:
        raise InvalidArgument(f"message {index}'s content is neither a text nor text parts")
    return _text(text, f"message {index}'s content")


def _text(value: Any, what: str) -> str:
    """`value` if it is a text the wire carries; InvalidArgument naming `what` otherwise (not
    a str, or with a lone surrogate, which UTF-8 cannot carry)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} is not a text: {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid text: {exc.reason} at character {exc.start} "
            f"({value[exc.start]!r})"
        ) from None
    return value


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def tool_call_of(call: Mapping[str, Any] | pb.ToolCall) -> pb.ToolCall:
    """A tool call as OpenAI writes it ({"id", "type": "function", "function": {"name",
    "arguments"}}; arguments as JSON text, or an object; or the openai client's object of
    it) as a pb.ToolCall."""
    if isinstance(call, pb.ToolCall):
        return call
    call = _dumped(call)
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidArgument(f'a tool call is not {{"function": {{"name": ...}}}}: {call!r}')
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return pb.ToolCall(
        id=_text(call.get("id") or "", "a tool call's id"),
        name=_text(function["name"], "a tool call's name"),
        arguments=_text(arguments, "a tool call's arguments"),
    )


def _dumped(value: Any) -> Any:
    """A pydantic model (the openai client's messages and calls) as its dict."""
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def tools_json(tools: Tools) -> str:
    """Tools as the worker takes them (CreateAgentRequest.tools, TurnRequest.tools): a list
    of OpenAI function tools written as a JSON array, a text passed as it is, "" for none.
    The worker checks them."""
    if not tools:
        return ""
    return tools if isinstance(tools, str) else json.dumps(list(tools), ensure_ascii=False)


def turn_request(
    namespace: str,
    agent_id: str,
    messages: Sequence[Message],
    *,
    phase: str = "",
    priority: int = 0,
    deadline_ms: int = 0,
    durable: bool = False,
    whole_conversation: bool = False,
    request_id: str = "",
    tools: Tools = None,
    max_tool_calls: int = 0,
    output_format: OutputFormat = None,
    tool_call_required: bool = False,
    tool_call_name: str = "",
    tool_call_forbidden: bool = False,
    tool_call_allowed: Sequence[str] = (),
    after_mark: str = "",
    after_mark_last: bool = False,
    mark_name: str = "",
    keep_named_marks: bool = False,
    **sampling: Any,
) -> pb.TurnRequest:
    """A turn's request. `whole_conversation`: `messages` are the whole conversation so far,
    resent (its system message first), not only what is new (see TurnRequest in the proto).
    A retry with the same `request_id` is not run again once the first was taken: TurnTaken.
    `tools` (tools_json's): with whole_conversation the conversation's, else none (the
    agent's own) or the agent's; `max_tool_calls` (not 0) ends the reply after that many
    calls. `output_format`: the reply's required form, a JSON Schema (a dict) or an
    OutputFormat (a regex, a Lark grammar, any JSON object); `tool_call_required`: the reply
    opens with a tool call, `tool_call_name`: with a call of that tool;
    `tool_call_forbidden`: it makes none; `tool_call_allowed`: its calls are of these tools
    only (the conversation keeping all its tools, and its cache). `after_mark`: `messages`
    follow that point of the agent's conversation (an earlier reply's usage.mark), the turns
    after it dropped; `after_mark_last`: only if none follow it (else TurnsFollow);
    `mark_name`: a name after_mark may give for the point this turn ends at;
    `keep_named_marks`: a resent whole conversation that would drop a named point is
    TurnsFollow instead (branch with a fork). `sampling`:
    SamplingParams' fields (max_tokens, temperature, top_p, top_k, stop, seed)."""
    allowed = [tool_call_allowed] if isinstance(tool_call_allowed, str) else tool_call_allowed
    return pb.TurnRequest(
        namespace=namespace,
        agent_id=agent_id,
        messages=pb_messages(messages),
        sampling=_sampling(sampling, deadline_ms=deadline_ms, max_tool_calls=max_tool_calls),
        phase=phase,
        priority=priority,
        deadline_ms=deadline_ms,
        durable=durable,
        whole_conversation=whole_conversation,
        request_id=request_id,
        tools=tools_json(tools),
        max_tool_calls=max_tool_calls,
        format=as_output_format(output_format),
        tool_call_required=tool_call_required,
        tool_call_name=tool_call_name,
        tool_call_forbidden=tool_call_forbidden,
        tool_call_allowed=allowed,
        after_mark=after_mark,
        after_mark_last=after_mark_last,
        mark_name=mark_name,
        keep_named_marks=keep_named_marks,
    )


def _sampling(sampling: dict[str, Any], **counts: int) -> pb.SamplingParams:
    """A turn's SamplingParams, its options checked where protobuf's own errors would name
    no field: a negative count (`counts`: the turn's other uint32 fields, checked alike),
    an option it lacks, a stop string the wire cannot carry."""
    counts = {**sampling, **counts}
    for name in ("max_tokens", "top_k", "deadline_ms", "max_tool_calls"):  # uint32 fields
        if isinstance(counts.get(name), int) and counts[name] < 0:  # protobuf: "out of range"
            raise InvalidArgument(f"{name} must be >= 0, got {counts[name]}")
    known = pb.SamplingParams.DESCRIPTOR.fields_by_name
    if unknown := sorted(set(sampling) - set(known)):  # as Python names a keyword it lacks
        raise TypeError(f"unexpected option {unknown[0]!r} (sampling: {', '.join(known)})")
    if isinstance(sampling.get("stop"), str):  # one stop string, as OpenAI's API takes it:
        sampling = {**sampling, "stop": [sampling["stop"]]}  # protobuf took its characters
    for stop in sampling.get("stop") or ():
        _text(stop, "a stop string")
    return pb.SamplingParams(**sampling)


def as_output_format(form: OutputFormat) -> pb.OutputFormat | None:
    """A reply's required form: a JSON Schema (a dict) as OutputFormat's json_schema."""
    if form is None or isinstance(form, pb.OutputFormat):
        return form
    if not isinstance(form, Mapping):
        raise TypeError(f"output_format must be a JSON Schema or an OutputFormat, not {form!r}")
    return pb.OutputFormat(json_schema=json.dumps(dict(form), ensure_ascii=False))
