"""gRPC plumbing shared by the store and the worker: errors, limits, health, binding, metrics."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from agentkv.addresses import bound_socket
from agentkv.errors import ERROR_KEY, AgentKVError, InvalidArgument

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"

log = logging.getLogger("agentkv.rpc")


# gRPC sets SO_REUSEPORT on Linux, so a second server on a port in use would start and take
# a share of its connections (unauthenticated, were the first one not): one server a port.
ONE_SERVER_PER_PORT = [("grpc.so_reuseport", 0)]
# While a call is open a client pings every KEEPALIVE_TIME_MS (agentkv/channels.py); a
# server that does not answer a ping within KEEPALIVE_TIMEOUT_MS (hung, or its link dropping
# packets: the kernel keeps the connection open) fails the call UNAVAILABLE, so the SDK
# moves the agent on instead of waiting out the call's timeout. The timeout is generous: a
# server busy computing still answers pings (gRPC's own threads do), and a live one taken
# for dead would see its turn run elsewhere too.
KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 20000
# gRPC's server counts a ping within 5 min of the last as a strike while it sends nothing, and
# after two it ends the connection ("too_many_pings"): every call quiet for 25 s (a long
# prefill, a slow restore) failed UNAVAILABLE. Pings that far apart are allowed.
ALLOW_KEEPALIVE = [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2)]


def _answers(path: str) -> bool:
    """Whether something listens on the unix socket `path` (gRPC would replace its file)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
            return True
        except OSError:
            return False


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


HEALTH = "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection."
OPEN_PREFIXES = (HEALTH, REFLECTION)  # what anyone may call, with no token


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns typed errors into statuses, and anything unexpected into a logged INTERNAL.
    grpc's health service is left as it is: wrapped, its Watch lost grpc's non-blocking
    mark and held an RPC thread while its client kept it open."""

    def __init__(self, on_error: Callable[[grpc.StatusCode], None] | None = None) -> None:
        self._on_error = on_error

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH):
            return handler
        return guarded(handler, partial(self._answering, details.method))

    @contextmanager
    def _answering(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self._abort(exc, context, method)

    def _abort(self, exc: Exception, context: grpc.ServicerContext, method: str) -> None:
        if isinstance(exc, AgentKVError):
            code, message, trailers = exc.code, _bounded(from_peer(exc)), exc.trailing_metadata()
            log.info("rpc failed", extra={"method": method, "code": code.name, "error": message})
        elif isinstance(exc, grpc.RpcError) and not context.is_active():
            raise exc  # the client went away; nothing to answer
        else:
            code = grpc.StatusCode.INTERNAL
            message = _bounded(f"internal error: {type(exc).__name__}: {exc}")
            trailers = ((ERROR_KEY, "AgentKVError"),)
            log.exception("rpc crashed", extra={"method": method})
        if self._on_error is not None:
            self._on_error(code)
        context.set_trailing_metadata(trailers)
        context.abort(code, message)


MAX_DETAILS_BYTES = 4000  # UTF-8 bytes of a status message: percent-encoded, within gRPC's
# 16 KiB of metadata (a caller's 3 MB page_token, echoed whole, was RESOURCE_EXHAUSTED there)


def _bounded(message: str) -> str:
    """`message`, cut to MAX_DETAILS_BYTES (a value a caller sent may be in it)."""
    raw = message.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return message
    cut = raw[: MAX_DETAILS_BYTES - 40].decode(errors="ignore")
    return f"{cut}... ({len(raw) - len(cut.encode())} bytes more, cut)"


def from_peer(exc: AgentKVError) -> str:
    """The error's message, saying which server it came from when it is the transport's
    (gRPC's "failed to connect ... SETTINGS frame") on a call this server made to another
    (a worker's to its store), not this server's own."""
    if not exc.peer or exc.remote or exc.message.startswith(f"the {exc.peer}"):  # named it
        return exc.message
    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"the {exc.peer} did not answer: {exc.message}"
    return f"a call to the {exc.peer} failed: {exc.message}"


def guarded(
    handler: grpc.RpcMethodHandler,
    guard: Callable[[grpc.ServicerContext], AbstractContextManager],
) -> grpc.RpcMethodHandler:
    """`handler` with each call run inside the context manager `guard(context)`; a stream's
    whole run is inside it."""

    def unary(behaviour: Callable) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            with guard(context):
                return behaviour(request, context)

        return run

    def stream(behaviour: Callable) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with guard(context):
                yield from behaviour(request, context)

        return run

    if handler.unary_unary:
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.stream_unary:
        return handler._replace(stream_unary=unary(handler.stream_unary))
    if handler.unary_stream:
        return handler._replace(unary_stream=stream(handler.unary_stream))
    return handler._replace(stream_stream=stream(handler.stream_stream))


class ReflectionLimit(grpc.ServerInterceptor):
    """At most `limit` reflection streams at once, each of which holds an RPC thread while
    its client keeps it open: they need no token, and unbounded they could hold them all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(REFLECTION):
            return handler
        return guarded(handler, self._slot)

    @contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limit} reflection streams are open, the server's limit; retry shortly",
            )
        try:
            yield
        finally:
            self._slots.release()


def new_server(
    workers: int,
    max_message_bytes: int,
    on_error: Callable[[grpc.StatusCode], None],
    interceptors: list[grpc.ServerInterceptor] | None = None,
) -> grpc.Server:
    """A gRPC server with our error interceptor and message limits; `interceptors` (auth)
    run first, outside it."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        interceptors=[
            ReflectionLimit(max(1, workers // 8)),
            *(interceptors or []),
            ErrorInterceptor(on_error),
        ],
        options=[*message_options(max_message_bytes), *ONE_SERVER_PER_PORT, *ALLOW_KEEPALIVE],
    )


def add_health_and_reflection(server: grpc.Server, service: str) -> health.HealthServicer:
    """grpc.health.v1 (SERVING for "" and `service`) and server reflection, both
    grpc.reflection.v1 and v1alpha."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    names = (service, health_name, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    # grpc.reflection.v1's messages are v1alpha's field for field under another package
    # (grpcio-reflection ships only v1alpha), so the same servicer answers v1 clients.
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )
    return health_servicer


def start_health(
    listen: str | None, servicer: health.HealthServicer
) -> tuple[grpc.Server | None, str | None]:
    """Serves grpc.health.v1 alone, in plaintext and without tokens, on HOST:PORT (port 0
    picks one): for probes that cannot speak TLS, such as kubelet's grpc probe. It shares
    `servicer`, so a graceful shutdown shows NOT_SERVING here too. Returns (server, address)."""
    if not listen:
        return None, None
    pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")
    server = grpc.server(pool, options=ONE_SERVER_PER_PORT)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = bind(server, listen)
    server.start()
    return server, address


def check_bindable(listen: str) -> None:
    """OSError "could not bind LISTEN: WHY" when `listen` cannot be bound now: a server
    checks before it opens its data dir or loads its model, so a taken port costs nothing."""
    if listen.startswith("unix:") and _answers(listen[len("unix:") :]):
        raise OSError(f"could not bind {listen}: a server is listening there")
    folder = Path(listen[len("unix:") :]).parent if listen.startswith("unix:") else None
    if folder is not None and not folder.is_dir():  # gRPC would say only that it failed
        raise OSError(f"could not bind {listen}: no directory {folder}")
    if not listen.startswith("unix:") and not listen.endswith(":0"):
        bound_socket(listen).close()  # why it cannot be bound, before gRPC's own log line


def bind(server: grpc.Server, listen: str, credentials: Any = None) -> str:
    """Binds `listen` (port 0 picks one), with TLS when given `credentials`; returns the
    address clients dial. Raises OSError when it is taken, or not an address of this host."""
    check_bindable(listen)
    try:
        if credentials is not None:
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:  # grpcio raises where it once returned 0
        port = 0
    if not port:
        raise OSError(f"could not bind {listen}: in use, or not an address of this host")
    if listen.startswith("unix:"):
        return listen
    return f"{listen.rpartition(':')[0]}:{port}"


class MetricSet:
    """One service's metrics, in a registry of its own (so tests can run several), each made
    in one line: its name is the set's prefix and `name`, with `labels`."""

    prefix = "agentkv_"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_errors = self.counter("rpc_errors", "RPCs that failed", "code")

    def counter(self, name: str, what: str, *labels: str) -> Counter:
        return Counter(self.prefix + name, what, labels, registry=self.registry)

    def gauge(self, name: str, what: str, *labels: str) -> Gauge:
        return Gauge(self.prefix + name, what, labels, registry=self.registry)

    def histogram(self, name: str, what: str, buckets: tuple, *labels: str) -> Histogram:
        return Histogram(self.prefix + name, what, labels, buckets=buckets, registry=self.registry)


def start_metrics(listen: str | None, registry: CollectorRegistry) -> str | None:
    """Serves Prometheus metrics on HOST:PORT (port 0 picks one); returns the bound address."""
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    try:
        httpd, _ = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as exc:  # the port taken, or not an address of this host
        why = exc.strerror or str(exc)
        raise OSError(f"could not serve metrics on {listen} (--metrics-listen): {why}") from None
    return f"{host}:{httpd.server_port}"  # an IPv6 host keeps its brackets


STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class StopSignals:
    """Catches SIGTERM and SIGINT from when it is made (in the main thread); `wait()` returns
    once one has come. CPython's own handler writes the signal's number to a socket that
    `wait()` reads, and the Python handler does nothing, so no lock is taken in a handler: one
    that set a threading.Event deadlocked whenever it ran inside that Event's `wait()`, and a
    store then ignored SIGTERM until it was killed."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno())
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda *_: None)  # not the default, which would end the process

    def wait(self) -> None:
        while not STOP_SIGNALS.intersection(self._reader.recv(64)):
            pass


_HANDLER_KINDS = {  # (client streaming, server streaming): the handler it needs
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handlers(
    service: Any,
    messages: Any,
    servicer: Any,
    raw_requests: frozenset[str] = frozenset(),
    raw_responses: frozenset[str] = frozenset(),
) -> grpc.GenericRpcHandler:
    """Handlers for every method of `service` (a ServiceDescriptor) that parse requests inside
    the call, so a malformed message gets INVALID_ARGUMENT naming it (gRPC's own parsing
    answers INTERNAL). `raw_requests` methods get the request bytes as they came;
    `raw_responses` methods yield bytes already encoded."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        if method.name not in raw_requests:
            if method.client_streaming:
                raise ValueError(f"{method.name}: client streams are parsed by their servicer")
            behaviour = _parsing(behaviour, getattr(messages, method.input_type.name))
        response = getattr(messages, method.output_type.name)
        serialize = None if method.name in raw_responses else response.SerializeToString
        kind = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = kind(behaviour, None, serialize)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _parsing(behaviour: Callable, message: Any) -> Callable:
    """`behaviour` called with the request parsed from its bytes (a stream's, when it is
    called, before its first reply)."""

    def run(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = message.FromString(raw)
        except DecodeError as exc:
            raise InvalidArgument(f"malformed {message.DESCRIPTOR.name}: {exc}") from None
        return behaviour(request, context)

    return run
