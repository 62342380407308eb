"""A chat completion as OpenAI writes it, from the worker's usage and tool calls: the whole
reply, or its chunks as server-sent events; the usage with cached tokens, and agentkv's own
figures of the turn (the `agentkv` object)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.gateway.errors import HTTPError


def finish_reason(usage: Any) -> str:
    """OpenAI's finish_reason of a turn: "length" when max_tokens cut it, "tool_calls" when
    it ended after calling tools, else "stop"."""
    return usage.finish_reason if usage.finish_reason in ("length", "tool_calls") else "stop"


def tool_call_json(call: Any) -> dict[str, Any]:
    """A tool call (the worker's ToolCall) as OpenAI writes it in a message."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def with_creation(usage: Any, created: Any) -> Any:
    """A first call's usage counts what making its agent took too: the tokens its turn
    found in RAM were made then, read from the store (a prefix another agent stored) or
    prefilled. Each prompt token counts once: one the turn ran again (the last of a system
    prompt alone, for its logits) is the turn's."""
    if created is None:
        return usage
    whole = type(usage)()
    whole.CopyFrom(usage)
    made = usage.reused_hot_tokens  # a prefix of what the creation made
    read = min(created.reused_store_tokens, made)
    whole.prefilled_tokens += made - read
    whole.reused_store_tokens += read
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
