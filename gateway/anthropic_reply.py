"""Anthropic's Messages API reply, sans I/O: a Message, or Anthropic's stream events
(message_start, content blocks, message_delta, message_stop), its usage and stop reason, and
errors as Anthropic's error JSON with the HTTP status the OpenAI route gives. anthropic.py
reads the request."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall

ERROR_TYPES = {  # HTTP status -> Anthropic's error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
STOP_REASONS = {"length": "max_tokens", "deadline": "max_tokens", "none": "max_tokens"}
STOP_REASONS |= {"tool_calls": "tool_use"}
TOO_LONG = "prompt is too long: "  # Anthropic's words, which clients look for to compact


def error_body(error: HTTPError) -> dict[str, Any]:
    """An error as Anthropic's JSON: its type (by status) and message."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    message = error.message
    if error.code == "context_length_exceeded":
        message = TOO_LONG + message
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(usage: Any, max_tokens: int) -> str:
    """Anthropic's stop_reason of a turn that asked for up to `max_tokens`: one the context's
    room cut shorter is "model_context_window_exceeded"; one cut by the gateway's --timeout
    "max_tokens", as it did not end by itself."""
    if usage.finish_reason == "stop" and usage.stop_sequence:
        return "stop_sequence"
    if usage.finish_reason == "length" and usage.generated_tokens < max_tokens:
        return "model_context_window_exceeded"
    return STOP_REASONS.get(usage.finish_reason, "end_turn")


def usage_json(usage: Any) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those prefilled, cache_read_input_tokens those the
    turn found in RAM or the store (Anthropic's total input is their sum)."""
    cached = max(usage.prompt_tokens - usage.prefilled_tokens, 0)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.generated_tokens,
    }


def tool_use(call: Any) -> dict[str, Any]:
    """A tool call (the worker's ToolCall: arguments a JSON object's text) as a block."""
    arguments = json.loads(call.arguments)
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def model_json(model: str) -> dict[str, Any]:
    """The served model as Anthropic's model object."""
    created = "1970-01-01T00:00:00Z"  # not known: the epoch, as the OpenAI route's 0
    return {"type": "model", "id": model, "display_name": model, "created_at": created}


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: its name, then its JSON."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def error_event(error: HTTPError) -> str:
    return event("error", error_body(error))


@dataclass(slots=True)
class MessageReply:
    """One reply's id and the pieces of Anthropic's JSON it is sent as: streamed (opening,
    text, call, closing), or whole, built by replaying its events through the same steps, so
    the two are the same message. White space is held back until text follows it: before a
    call, or at the end after one, it is no block of its own."""

    model: str
    max_tokens: int  # asked for: a reply cut shorter met the context's end
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")
    blocks: list[dict[str, Any]] = field(default_factory=list)  # as a client adds them up
    calls: int = 0  # tool_use blocks sent
    open: bool = False  # a text block is open
    held: str = ""  # white space not yet sent

    @classmethod
    def of(cls, call: ChatCall) -> MessageReply:
        return cls(call.model, call.sampling["max_tokens"])

    def whole(self, events: Sequence[Any], usage: Any, extension: dict[str, Any]) -> dict:
        for item in events:
            self.text(item) if isinstance(item, str) else self.call(item)
        self.closing(usage, extension, False)
        message = self._message(self.blocks, *self._stop(usage))
        return message | {"usage": usage_json(usage), "agentkv": extension}

    def opening(self, started: Any = None) -> list[str]:
        """message_start, with the prompt's usage as Anthropic's has it (`started`: the
        worker's, sent before the first token; 0 from a worker that sends none), then ping."""
        usage = usage_json(started) if started else {"input_tokens": 0, "output_tokens": 0}
        start = self._message([], None, None) | {"usage": usage}
        return [event("message_start", {"type": "message_start", "message": start}), PING]

    def text(self, piece: str) -> list[str]:
        self.held += piece
        return self._flush() if self.held.strip() else []

    def call(self, call: Any) -> list[str]:
        self.held, self.calls = "", self.calls + 1
        use = tool_use(call)
        out = self._close() + self._start(use | {"input": {}})
        self.blocks[-1]["input"] = use["input"]
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        out += [self._event("content_block_delta", delta=delta)]
        return out + self._close(force=True)

    def closing(self, usage: Any, extension: dict[str, Any], include_usage: bool) -> list[str]:
        out = self._flush() if self.held and (self.open or not self.calls) else []
        out += self._close()
        reason, stop = self._stop(usage)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop}}
        end = delta | {"usage": usage_json(usage), "agentkv": extension}
        return out + [event("message_delta", end), event("message_stop", {"type": "message_stop"})]

    def error(self, error: HTTPError) -> str:
        return error_event(error)

    def _stop(self, usage: Any) -> tuple[str, str | None]:
        return stop_reason(usage, self.max_tokens), usage.stop_sequence or None

    def _message(self, content: list, reason: str | None, stop: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
        }

    def _flush(self) -> list[str]:
        """The text held, in the open text block or a new one."""
        out = [] if self.open else self._start({"type": "text", "text": ""})
        self.open, delta = True, {"type": "text_delta", "text": self.held}
        self.blocks[-1]["text"] += self.held
        self.held = ""
        return out + [self._event("content_block_delta", delta=delta)]

    def _start(self, block: dict[str, Any]) -> list[str]:
        self.blocks.append(dict(block))
        return [self._event("content_block_start", content_block=block)]

    def _close(self, force: bool = False) -> list[str]:
        if not (self.open or force):
            return []
        self.open = False
        return [self._event("content_block_stop")]

    def _event(self, name: str, **data: Any) -> str:
        return event(name, {"type": name, "index": len(self.blocks) - 1, **data})


PING = event("ping", {"type": "ping"})
