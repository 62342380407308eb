"""agentkv's errors as the HTTP APIs answer them: an HTTPError carries the status, the
error's type, the parameter at fault and a code; the gRPC code of an agentkv error picks its
status (OpenAI's error JSON; the Anthropic route writes its own from the same fields)."""

from __future__ import annotations

from typing import Any

import grpc

from agentkv.client.worker_core import ReplyCutOff, tokens
from agentkv.errors import (
    AgentBusy,
    AgentKVError,
    DiskFull,
    ModelLacks,
    OverBudget,
    ServerBusy,
)

STATUS = {  # gRPC code -> HTTP status, OpenAI error type
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
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
# Worth sending again, once the reply's retry-after has passed: a busy worker, an agent
# mid-turn, a writer's race, a service out of reach. Any other 409, 429 or 5xx stays so.
PASSING = (ServerBusy, AgentBusy)
PASSING_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
RETRY_AFTER_SECONDS = 1


class HTTPError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry: bool = False,
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
        self.retry = retry  # a retry would help: the service's passing state, not the call's

    @classmethod
    def of(cls, exc: AgentKVError) -> HTTPError:
        error = cls._of(exc)
        error.retry = isinstance(exc, PASSING) or exc.code in PASSING_CODES
        return error

    @classmethod
    def _of(cls, exc: AgentKVError) -> HTTPError:
        status, kind = STATUS.get(exc.code, (500, "server_error"))
        if isinstance(exc, ModelLacks):  # a request this model cannot serve, not a conflict
            return cls(400, exc.message, code="unsupported_value")
        if isinstance(exc, DiskFull):  # the service's trouble, not this caller's rate (429)
            return cls(503, exc.message, "service_unavailable", code="disk_full")
        if exc.code == grpc.StatusCode.UNAUTHENTICATED:  # the gateway's or its worker's own
            # token, never this caller's key, which the gateway checks itself (a 401 there)
            message = f"a service behind the gateway refused its credentials ({exc.message})"
            return cls(502, message, "server_error", code="upstream_unauthenticated")
        if exc.code == grpc.StatusCode.UNIMPLEMENTED:  # a --worker or --store of another kind
            return cls(502, exc.message, "server_error", code="upstream_unimplemented")
        too_long = exc.code == grpc.StatusCode.OUT_OF_RANGE and not isinstance(exc, OverBudget)
        code = "context_length_exceeded" if too_long else None
        return cls(status, http_message(exc), kind, code=code or exc.code.name.lower())

    def headers(self) -> dict[str, str]:
        """What OpenAI's and Anthropic's clients read before they send a call again, which
        by its status alone they do for every 408, 409, 429 and 5xx: `x-should-retry: true`
        and `retry-after` where the trouble passes, `x-should-retry: false` where it stays
        (a quota reached, a full disk, an agent made with another system prompt, a bug)."""
        if self.retry:
            return {"x-should-retry": "true", "retry-after": str(RETRY_AFTER_SECONDS)}
        if self.status in (408, 409, 429) or self.status >= 500:
            return {"x-should-retry": "false"}
        return {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


def http_message(exc: AgentKVError) -> str:
    """The error's message in an HTTP client's terms where the SDK's own speaks of its
    methods or gRPC's of its deadline: a reply cut off by its worker's end is simply sent
    again (a whole conversation resumes from its last complete turn; a previous response's
    point is still there); the SDK's deadline is the gateway's --timeout."""
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and not exc.remote:  # the SDK's deadline
        peer = exc.peer or "worker"
        return f"the call to the {peer} did not end within the gateway's --timeout ({exc.message})"
    if isinstance(exc, ReplyCutOff):
        said = tokens(exc.num_tokens)
        return f"the worker went away after {said} of the reply; send the request again"
    return exc.message


def escaped(text: str) -> str:
    """Text with any lone surrogate written as its escape, so that it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param, code=code)
