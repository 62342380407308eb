"""OpenAI's Responses API reply, sans I/O: a Response object, or the Responses stream's
events, built by the same steps so that the two are the same Response; its usage, and its
errors as events. responses.py reads the request and names the response (response_id)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.gateway.errors import HTTPError
from agentkv.gateway.protocol import ChatCall
from agentkv.gateway.responses import INCOMPLETE, response_id


def _failure(error: HTTPError) -> dict[str, str]:
    """A failed Response's error: one of the codes OpenAI's types allow (the error event
    before it carries agentkv's own)."""
    code = {429: "rate_limit_exceeded", 400: "invalid_prompt"}.get(error.status, "server_error")
    return {"code": code, "message": error.message}


def usage_json(usage: Any) -> dict[str, Any]:
    """The Responses API's usage; cached_tokens are those the turn did not prefill."""
    cached = max(usage.prompt_tokens - usage.prefilled_tokens, 0)
    return {
        "input_tokens": usage.prompt_tokens,
        # the rest was prefilled, and is kept in the cache from now on
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": usage.prefilled_tokens,
        },
        "output_tokens": usage.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
    }


def error_event(error: HTTPError, sequence_number: int = 0) -> str:
    """An error once the stream has begun: the Responses stream's error event."""
    data = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
    return event("error", data | {"sequence_number": sequence_number})


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event as OpenAI's Responses stream sends it: its type, then its JSON."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class ResponseReply:
    """One reply's ids and the pieces of the Responses API's JSON it is sent as: streamed
    (opening, text, call, closing), or whole, built by replaying its events through the
    same steps, so the two are the same Response. White space is held back until text
    follows it: before a function call, or at the end after one, it is no message."""

    request: ChatCall
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)  # items, as a client adds up
    sequence: int = 0  # events sent
    open: bool = False  # a message item is open
    held: str = ""  # white space not yet sent
    calls: int = 0

    @classmethod
    def of(cls, call: ChatCall) -> ResponseReply:
        """The reply to `call`, whose id names the point its turn ends at (response_id)."""
        named = (call.agent_id, call.mark_name, call.echo.get("instructions"), call.tools)
        return cls(call, response_id(*named)) if call.mark_name else cls(call)

    def whole(self, events: Sequence[Any], usage: Any, extension: dict[str, Any]) -> dict:
        for item in events:
            self.text(item) if isinstance(item, str) else self.call(item)
        self.closing(usage, extension, False)
        return self._response(usage) | {"agentkv": extension}

    def opening(self, started: Any = None) -> list[str]:
        """response.created and response.in_progress (a Response has no usage before its
        end: `started`, the prompt's usage, is not sent)."""
        response = self._response(None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def text(self, piece: str) -> list[str]:
        self.held += piece
        return self._flush() if self.held.strip() else []

    def call(self, call: Any) -> list[str]:
        """A function call, whole: its item added, its arguments in one delta, done."""
        self.held, self.calls = "", self.calls + 1
        out = self._close()
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress"}
        item |= {"arguments": "", "call_id": call.id, "name": call.name}
        out += self._add(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out.append(
            self._event("response.function_call_arguments.delta", **at, delta=call.arguments)
        )
        item["arguments"] = call.arguments
        done = {"arguments": call.arguments, "name": call.name}
        out.append(self._event("response.function_call_arguments.done", **at, **done))
        return out + self._done(item)

    def closing(self, usage: Any, extension: dict[str, Any], include_usage: bool) -> list[str]:
        """The text held (a reply of nothing else is a message, even an empty one), the open
        message done, then response.completed, or response.incomplete for a reply cut short."""
        empty = not self.output
        out = self._flush() if (self.held and (self.open or not self.calls)) or empty else []
        out += self._close("incomplete" if usage.finish_reason in INCOMPLETE else "completed")
        response = self._response(usage) | {"agentkv": extension}
        return out + [self._event(f"response.{response['status']}", response=response)]

    def error(self, error: HTTPError) -> str:
        """An error once the stream has begun: the error event, then response.failed."""
        self.sequence += 1
        failed = self._response(None, error)
        return error_event(error, self.sequence - 1) + self._event(
            "response.failed", response=failed
        )

    # steps

    def _flush(self) -> list[str]:
        """The text held, in the open message or a new one."""
        out: list[str] = []
        if not self.open:
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress"}
            out += self._add(item | {"role": "assistant", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output[-1]["content"].append(part)
            out.append(self._event("response.content_part.added", **self._at(), part=part))
            self.open = True
        out.append(
            self._event("response.output_text.delta", **self._at(), delta=self.held, logprobs=[])
        )
        self.output[-1]["content"][0]["text"] += self.held
        self.held = ""
        return out

    def _close(self, status: str = "completed") -> list[str]:
        """The open message's text and part done, then the message."""
        if not self.open:
            return []
        self.open = False
        item, at = self.output[-1], self._at()
        part = item["content"][0]
        text = {"text": part["text"], "logprobs": []}
        out = [self._event("response.output_text.done", **at, **text)]
        out.append(self._event("response.content_part.done", **at, part=part))
        return out + self._done(item, status)

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        return [
            self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        ]

    def _done(self, item: dict[str, Any], status: str = "completed") -> list[str]:
        item["status"] = status
        index = len(self.output) - 1
        return [self._event("response.output_item.done", output_index=index, item=item)]

    def _at(self) -> dict[str, Any]:
        """Where the open message's text is."""
        index = len(self.output) - 1
        return {"item_id": self.output[-1]["id"], "output_index": index, "content_index": 0}

    def _event(self, kind: str, **data: Any) -> str:
        self.sequence += 1
        return event(kind, {"type": kind, "sequence_number": self.sequence - 1, **data})

    def _response(self, usage: Any, failed: HTTPError | None = None) -> dict[str, Any]:
        """The Response object: in progress (no usage yet), completed, incomplete, or failed
        (with its error)."""
        echo, status, incomplete = self.request.echo, "in_progress", None
        if failed is not None:
            status = "failed"
        elif usage is not None:
            cut = usage.finish_reason in INCOMPLETE
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": _failure(failed) if failed else None,
            "incomplete_details": incomplete,
            "model": self.request.model,
            "output": json.loads(json.dumps(self.output)),  # as it stands now
            "service_tier": "default",
            "truncation": "disabled",
            "usage": usage_json(usage) if usage is not None else None,
            **echo,
        }
