"""How a client reaches a server: TLS (and mTLS) channels with a bearer token, sync and
asyncio, redialled quickly after a restart."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agentkv.addresses import is_loopback
from agentkv.flags import flag
from agentkv.rpc import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from agentkv.security import check_tls_files

log = logging.getLogger("agentkv.client")

# A server that restarts is dialled again within two seconds, not after gRPC's default
# backoff (which grows to 120 s): a worker resumes writing soon after its store is back.
# gRPC takes grpc.min_reconnect_backoff_ms as its connect timeout: at 100 ms no store across
# a WAN link (or TLS at 30 ms each way) answered in time; at gRPC's 20 s, the SDK waited
# that long on a host that is down before it moved an agent to the next worker.
CONNECT_TIMEOUT_MS = 5000
# gRPC counts a deadline in nanoseconds on its clock: one of ~7e9 s or more overflows and has
# passed at once (DEADLINE_EXCEEDED before the call leaves). Longer timeouts, inf included,
# are this long (31 years): no deadline, as asked.
LONGEST_TIMEOUT = 1e9
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    # a server silent past KEEPALIVE_TIMEOUT_MS fails the call UNAVAILABLE (agentkv/rpc.py)
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # else a ping waits 60 s for its ack
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long quiet call
]


def read_token(path: str) -> str:
    """A bearer token from a file (a mounted secret), stripped; "" for no file."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:  # named as its flag is, or its variable (flags._from_environment)
        raise ValueError(f"--token-file {path}: {(exc.strerror or str(exc)).lower()}") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return header_token(token, f"--token-file {path}")


def header_token(token: str, where: str) -> str:
    """The token, if an authorization header can carry it (printable ASCII, no spaces, as
    servers' token tables require); else ValueError naming `where`. gRPC would refuse it
    on every call, as "Invalid metadata"."""
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError(f"{where} holds a token with characters a header cannot carry")
    return token


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client reaches a server: TLS (trusting `tls_ca`; mTLS with cert and key) and a
    bearer token. All empty: plaintext, no token (loopback)."""

    token: str = flag(
        "", "file holding a bearer token", name="token-file", convert=read_token, env=True
    )
    tls_ca: str = flag("", "PEM CA the server's certificate chains to: connect with TLS", env=True)
    tls_cert: str = flag("", "PEM client certificate (mTLS)", env=True)
    tls_key: str = flag("", "PEM private key of the client certificate", env=True)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both, or neither")
        check_tls_files(self, "tls_cert", "tls_key", "tls_ca")

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        options = [*CHANNEL_OPTIONS, *(options or [])]
        creds = self._tls(address)
        if creds is not None:
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _BearerToken(self.token))
        return channel

    def aio_channel(self, address: str, options: list[tuple[str, Any]] | None = None):
        """The same, as a grpc.aio channel."""
        options = [*CHANNEL_OPTIONS, *(options or [])]
        interceptors = _aio_bearer_token(self.token) if self.token else None
        creds = self._tls(address)
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options, interceptors=interceptors)

    def _tls(self, address: str) -> grpc.ChannelCredentials | None:
        """TLS credentials from the PEM files, or None for plaintext (with a warning where a
        token would cross the network in clear: a server allows that only when told to)."""
        if not (self.tls_ca or self.tls_cert):
            if self.token and not _stays_here(address):
                log.warning(
                    "bearer token sent in clear text to %s: anyone on the path can read it "
                    "(--tls-ca connects with TLS)",
                    address,
                )
            return None
        return grpc.ssl_channel_credentials(
            Path(self.tls_ca).read_bytes() if self.tls_ca else None,
            Path(self.tls_key).read_bytes() if self.tls_key else None,
            Path(self.tls_cert).read_bytes() if self.tls_cert else None,
        )


def _stays_here(address: str) -> bool:
    """Whether a client address is a unix socket or a loopback host."""
    try:
        return is_loopback(address.removeprefix("ipv4:").removeprefix("ipv6:"))
    except ValueError:  # another gRPC target form (dns:///...): assume it leaves the machine
        return False


class _AioBearerToken:
    """Adds `authorization: Bearer TOKEN` to a grpc.aio call (a subclass per call kind)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    async def _proceed(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self.header)
        details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )
        return await continuation(details, request)


class _AioUnaryUnary(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioBearerToken._proceed


class _AioUnaryStream(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioBearerToken._proceed


class _AioStreamUnary(_AioBearerToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioBearerToken._proceed


class _AioStreamStream(_AioBearerToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioBearerToken._proceed


def _aio_bearer_token(token: str) -> list[_AioBearerToken]:
    """One interceptor per call kind: grpc.aio files an interceptor under the first kind it
    subclasses only, so one class of all four would carry the token on unary calls alone."""
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    return [kind(token) for kind in kinds]


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer TOKEN` to every call (works with and without TLS)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _Details(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self.header],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def call_timeout(seconds: float | None) -> float | None:
    """A call's timeout as gRPC takes it: one past LONGEST_TIMEOUT (inf) is that long."""
    return None if seconds is None else min(seconds, LONGEST_TIMEOUT)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any
