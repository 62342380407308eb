"""gRPC plumbing shared by the store and the worker: the error interceptor and channel options."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from agentkv.errors import ERROR_KEY, AgentKVError

log = logging.getLogger("agentkv.rpc")


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns typed errors into statuses, and anything unexpected into a logged INTERNAL."""

    def __init__(self, on_error: Callable[[grpc.StatusCode], None] | None = None) -> None:
        self._on_error = on_error

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._wrap_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, method))
        return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream, method))

    def _wrap_unary(self, behaviour: Callable, method: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return behaviour(request, context)
            except Exception as exc:
                self._abort(exc, context, method)

        return wrapped

    def _wrap_stream(self, behaviour: Callable, method: str) -> Callable:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from behaviour(request, context)
            except Exception as exc:
                self._abort(exc, context, method)

        return wrapped

    def _abort(self, exc: Exception, context: grpc.ServicerContext, method: str) -> None:
        if isinstance(exc, AgentKVError):
            code, message, trailers = exc.code, exc.message, exc.trailing_metadata()
            log.info("rpc failed", extra={"method": method, "code": code.name, "error": message})
        elif isinstance(exc, grpc.RpcError) and not context.is_active():
            raise exc  # the client went away; nothing to answer
        else:
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            trailers = ((ERROR_KEY, "AgentKVError"),)
            log.exception("rpc crashed", extra={"method": method})
        if self._on_error is not None:
            self._on_error(code)
        context.set_trailing_metadata(trailers)
        context.abort(code, message)
