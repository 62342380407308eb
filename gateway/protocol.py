"""OpenAI's chat-completions wire format, sans I/O: a request body checked into a ChatCall,
replies and stream chunks built from the worker's usage, and agentkv's errors as OpenAI's
error JSON with the HTTP status that fits their gRPC code."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from agentkv import ids
from agentkv.errors import AgentKVError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Accepted and meaningless here, or equal to what agentkv does anyway.
IGNORED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
}
# Accepted at their neutral value only; any other value is refused, never ignored.
NEUTRAL = {
    "n": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "web_search_options": None,
    "verbosity": None,
}
SCOPE = ("prompt_cache_key", "user", "safety_identifier")  # ChatCall.scope
SAMPLING = {"temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed"}
MAX_STOPS = 4  # OpenAI's own limit
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


def invalid(message: str, param: str | None = None, code: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param, code=code)


@dataclass(slots=True)
class ChatCall:
    """A checked chat-completions request."""

    model: str
    messages: list[tuple[str, str]]  # (role, text), developer messages as system
    stream: bool
    include_usage: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # the worker's SamplingParams
    # Whose conversation it is: prompt_cache_key, user, safety_identifier. In OpenAI's API
    # they name a group of requests and an end user, never one conversation.
    scope: tuple[str, ...] = ()

    @property
    def system(self) -> str:
        """The leading system message's text, the agent's system prompt."""
        return self.messages[0][1] if self.messages and self.messages[0][0] == "system" else ""

    def anonymous_id(self) -> str:
        """The agent a request with no identity goes to: one per scope, system prompt and
        first user message, so that a client that resends its history finds it again."""
        first = next((m for m in self.messages if m[0] == "user"), None)
        key = (*self.scope, self.system, first) if any(self.scope) else (self.system, first)
        h = hashlib.blake2b(repr(key).encode(), digest_size=12)
        return f"anon-{h.hexdigest()}"


def parse_chat(body: Any, default_max_tokens: int) -> ChatCall:
    """The request body as a ChatCall; HTTPError 400 for anything agentkv would not do as
    OpenAI specifies (an unknown field or a refused value is never silently dropped)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in body:
        if not any(name in known for known in (IGNORED, SCOPE, SAMPLING, NEUTRAL)):
            raise invalid(f"unsupported parameter: {name!r}", name, "unsupported_parameter")
    for name, neutral in NEUTRAL.items():
        value = body.get(name)  # null: not given, as OpenAI reads it
        text = name == "response_format" and _text_format(value)
        if value is not None and value != neutral and not text:
            raise invalid(
                f"{name}={value!r} is not supported by agentkv (only {neutral!r})",
                name,
                "unsupported_value",
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: a model id is required", "model")
    _utf8(model, "model")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    call = ChatCall(
        model,
        _messages(body.get("messages")),
        stream,
        bool(_typed(options or {}, "include_usage", bool, False)),
        _sampling(body, default_max_tokens),
        scope=tuple(_typed(body, name, str, "") or "" for name in SCOPE),
    )
    return call


def _text_format(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if (
        value is not None
        and value is not default
        and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
    ):
        raise invalid(f"{name} must be a {kind.__name__}, got {value!r}", name)
    if kind is str and value:
        _utf8(value, name)
    return value


def _utf8(text: str, where: str) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text can hold."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise invalid(f"{where} holds a lone surrogate escape, not valid Unicode", where) from None


def _messages(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty array of messages is required", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(
                f"{where}.role {role!r} is not supported (system, developer, user, assistant)",
                f"{where}.role",
                "unsupported_value",
            )
        if message.get("tool_calls") or message.get("function_call"):
            raise invalid(f"{where}: tool calls are not supported", where, "unsupported_value")
        out.append((ROLES[role], _text(message.get("content"), f"{where}.content")))
    if out[-1][0] == "assistant":
        raise invalid(
            "the last message is the assistant's: agentkv does not continue a partial reply",
            f"messages[{len(out) - 1}]",
            "unsupported_value",
        )
    return out


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts are refused)."""
    if isinstance(content, str):
        _utf8(content, where)
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
        _utf8(text, where)
        return text
    raise invalid(f"{where} must be a string or an array of text parts", where)


def _sampling(body: dict, default_max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 1.0}  # OpenAI's default: sampled
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1)):
        value = body.get(name)
        if value is None:
            continue
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not low <= value <= high
        ):
            raise invalid(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
        out[name] = float(value)
    if out.get("top_p", 1.0) <= 1e-6:  # the worker's 0 turns nucleus off; OpenAI's is greedy
        out["temperature"], out["top_p"] = 0.0, 1.0
    given = _max_tokens(body)
    out["max_tokens"] = given or default_max_tokens
    if given is None:  # as OpenAI: the reply may use what room the context has left
        out["fit_max_tokens"] = True
    stops = _stops(body.get("stop"))
    if stops:
        out["stop"] = stops
    seed = _typed(body, "seed", int, None)
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise invalid(f"seed must be in [-2^63, 2^64), got {seed}", "seed")
        out["seed"] = seed % 2**64  # OpenAI's seeds are signed, the worker's unsigned
    return out


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, name, int, None)
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
        _utf8(s, "stop")
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
    """OpenAI's finish_reason of a turn: "length" when max_tokens cut it, else "stop"."""
    return "length" if usage.finish_reason == "length" else "stop"


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

    def whole(self, text: str, usage: Any, extension: dict[str, Any]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason(usage),
            "logprobs": None,
        }
        return {
            **self._head("chat.completion"),
            "choices": [choice],
            "usage": usage_json(usage),
            "agentkv": extension,
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: Any, extension: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [],
            "usage": usage_json(usage),
            "agentkv": extension,
        }

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
