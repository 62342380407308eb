"""TLS and per-namespace bearer tokens, for the store and the worker alike.

A server given a token table (`--auth-tokens FILE`) answers UNAUTHENTICATED to any call
without a valid `authorization: Bearer TOKEN`, except health checks and reflection. Each
token names the namespaces it may touch (or "*" for all); a call for another namespace gets
PERMISSION_DENIED before any of that namespace's data is read, so nothing about it leaks,
not even through timing. The table file holds each token's SHA-256 (or the token itself):

    {"tokens": [{"name": "team-a", "sha256": "9f86d0...", "namespaces": ["team-a"]},
                {"name": "ops", "token": "s3cret", "namespaces": ["*"]}]}

TLS: `--tls-cert` and `--tls-key` serve TLS; `--tls-client-ca` also requires client
certificates signed by that CA (mTLS). Clients pass `tls_ca` (and `tls_cert`/`tls_key` for
mTLS) and `token`.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agentkv.addresses import is_loopback_host
from agentkv.errors import PermissionDenied, Unauthenticated

ALL = "*"
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a token is: its name and the namespaces it may touch (None: every one)."""

    name: str
    namespaces: frozenset[str] | None

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "agentkv_principal", default=None
)


def current() -> Principal | None:
    """The caller of the RPC being served; None when the server has no token table."""
    return _principal.get()


def check_namespace(namespace: str) -> None:
    """Raises PermissionDenied unless the caller may touch `namespace`."""
    who = _principal.get()
    if who is not None and not who.allows(namespace):
        raise PermissionDenied(f"token {who.name!r} may not use namespace {namespace!r}")


def check_all_namespaces(what: str) -> None:
    """Raises PermissionDenied unless the caller may touch every namespace."""
    who = _principal.get()
    if who is not None and who.namespaces is not None:
        raise PermissionDenied(f"token {who.name!r} may not {what}: it needs every namespace")


def visible(namespaces: dict[str, Any]) -> dict[str, Any]:
    """The entries of a namespace-keyed mapping that the caller may see."""
    who = _principal.get()
    return {k: v for k, v in namespaces.items() if who is None or who.allows(k)}


class TokenTable:
    """Bearer tokens and their namespaces, compared in constant time by SHA-256."""

    def __init__(self, entries: dict[bytes, Principal]) -> None:
        self._by_digest = entries

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"auth tokens file {path}: {exc}") from None
        items = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            raise ValueError(f"auth tokens file {path}: needs a non-empty list under 'tokens'")
        entries: dict[bytes, Principal] = {}
        for i, item in enumerate(items):
            where = f"auth tokens file {path}, tokens[{i}]"
            if not isinstance(item, dict) or ("sha256" in item) == ("token" in item):
                raise ValueError(f"{where}: give exactly one of 'sha256' or 'token'")
            if "token" in item:
                if not isinstance(item["token"], str) or len(item["token"]) < 16:
                    raise ValueError(f"{where}: a token needs at least 16 characters")
                digest = hashlib.sha256(item["token"].encode()).digest()
            else:
                try:
                    digest = bytes.fromhex(item["sha256"])
                except (TypeError, ValueError):
                    digest = b""
                if len(digest) != 32:
                    raise ValueError(f"{where}: sha256 must be 64 hex digits")
            spaces = item.get("namespaces")
            if (
                not isinstance(spaces, list)
                or not spaces
                or not all(isinstance(s, str) and s for s in spaces)
            ):
                raise ValueError(f"{where}: 'namespaces' must list namespaces, or '*'")
            name = str(item.get("name") or f"token {i}")
            entries[digest] = Principal(name, None if ALL in spaces else frozenset(spaces))
        return cls(entries)

    def principal(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, who in self._by_digest.items():  # every entry: no early exit to time
            if hmac.compare_digest(known, digest):
                found = who
        return found


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call but health and reflection; the handler runs as its caller."""

    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        scheme, _, token = header.partition(" ")
        who = self.tokens.principal(token) if scheme.lower() == "bearer" and token else None
        if who is None:
            reason = "no bearer token" if not header else "the bearer token is not valid"
            return _refusal(handler, reason)
        return _as(handler, who)


def _as(handler: grpc.RpcMethodHandler, who: Principal) -> grpc.RpcMethodHandler:
    def unary(behaviour: Callable) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            token = _principal.set(who)
            try:
                return behaviour(request, context)
            finally:
                _principal.reset(token)

        return run

    def stream(behaviour: Callable) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            token = _principal.set(who)
            try:
                yield from behaviour(request, context)
            finally:
                _principal.reset(token)

        return run

    return _replace(handler, unary, stream)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    def deny(_behaviour: Callable) -> Callable:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            error = Unauthenticated(f"unauthenticated: {reason}")
            context.set_trailing_metadata(error.trailing_metadata())
            context.abort(error.code, error.message)

        return run

    return _replace(handler, deny, deny)


def _replace(handler: grpc.RpcMethodHandler, unary: Callable, stream: Callable):
    if handler.unary_unary:
        return handler._replace(unary_unary=unary(handler.unary_unary))
    if handler.stream_unary:
        return handler._replace(stream_unary=unary(handler.stream_unary))
    if handler.unary_stream:
        return handler._replace(unary_stream=stream(handler.unary_stream))
    return handler._replace(stream_stream=stream(handler.stream_stream))


def server_credentials(cert: str, key: str, client_ca: str | None = None):
    """TLS for a server; with `client_ca`, clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=bool(ca))


# A server that restarts is dialled again within two seconds, not after gRPC's default
# backoff (which grows to 120 s): a worker resumes writing soon after its store is back.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client reaches a server: TLS (trusting `tls_ca`; mTLS with cert and key) and a
    bearer token. All empty: plaintext, no token (loopback)."""

    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        options = [*RECONNECT_OPTIONS, *(options or [])]
        creds = self._tls()
        if creds is not None:
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _BearerToken(self.token))
        return channel

    def aio_channel(self, address: str, options: list[tuple[str, Any]] | None = None):
        """The same, as a grpc.aio channel."""
        options = [*RECONNECT_OPTIONS, *(options or [])]
        interceptors = [_AioBearerToken(self.token)] if self.token else None
        creds = self._tls()
        if creds is not None:
            return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options, interceptors=interceptors)

    def _tls(self) -> grpc.ChannelCredentials | None:
        """TLS credentials from the PEM files, or None for plaintext."""
        if not (self.tls_ca or self.tls_cert):
            return None
        return grpc.ssl_channel_credentials(
            Path(self.tls_ca).read_bytes() if self.tls_ca else None,
            Path(self.tls_key).read_bytes() if self.tls_key else None,
            Path(self.tls_cert).read_bytes() if self.tls_cert else None,
        )


class _AioBearerToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every grpc.aio call."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self.header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


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
        metadata = [*(details.metadata or ()), self.header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                getattr(details, "wait_for_ready", None),
                getattr(details, "compression", None),
            )
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """A server's TLS files and token table, from its flags (add_server_flags)."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    allow_unauthenticated: bool = False
    allow_plaintext_tokens: bool = False

    def check(self, listen: str, loopback: bool) -> None:
        """Safe defaults: no authentication only on loopback, and bearer tokens beyond
        loopback only over TLS, unless asked for loudly."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        if not loopback and not self.auth_tokens and not self.allow_unauthenticated:
            raise ValueError(
                f"listening on {listen} (beyond loopback) needs --auth-tokens FILE; "
                "--allow-unauthenticated serves anyone who can reach it"
            )
        plaintext = not loopback and self.auth_tokens and not self.tls_cert
        if plaintext and not self.allow_plaintext_tokens:
            raise ValueError(
                f"listening on {listen} (beyond loopback) with bearer tokens needs TLS "
                "(--tls-cert, --tls-key): without it every token crosses the network in "
                "clear; --allow-plaintext-tokens serves them anyway"
            )

    def warnings(self, listen: str, loopback: bool, metrics_listen: str | None) -> list[str]:
        """What a start-up log should shout about: settings that are allowed but exposed."""
        found = []
        if not loopback and not self.auth_tokens:
            found.append(
                f"LISTENING BEYOND LOOPBACK WITH NO AUTHENTICATION: anyone who can reach {listen} "
                "can read and write every namespace"
            )
        if not loopback and self.auth_tokens and not self.tls_cert:
            found.append(f"BEARER TOKENS IN CLEAR TEXT: {listen} serves tokens without TLS")
        if metrics_listen and not is_loopback_host(metrics_listen.rpartition(":")[0]):
            found.append(
                f"METRICS BEYOND LOOPBACK: {metrics_listen} serves unauthenticated HTTP "
                "(counts, sizes and timings) to anyone who can reach it"
            )
        if self.auth_tokens:
            mode = Path(self.auth_tokens).stat().st_mode & 0o777
            if mode & 0o077:
                found.append(
                    f"TOKEN FILE READABLE BY OTHERS: {self.auth_tokens} has mode {mode:o}; "
                    f"chmod 600 it"
                )
        return found

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [AuthInterceptor(TokenTable.load(self.auth_tokens))] if self.auth_tokens else []

    def credentials(self):
        if not self.tls_cert:
            return None
        return server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca or None)


def add_server_flags(p) -> None:
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="PEM CA: require client certificates")
    p.add_argument(
        "--auth-tokens", default="", help="JSON token table: bearer tokens and their namespaces"
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve beyond loopback with no tokens (logged as a warning at start)",
    )
    p.add_argument(
        "--allow-plaintext-tokens",
        action="store_true",
        help="accept bearer tokens beyond loopback without TLS (logged as a warning at start)",
    )


def server_security(a) -> ServerSecurity:
    return ServerSecurity(
        a.tls_cert,
        a.tls_key,
        a.tls_client_ca,
        a.auth_tokens,
        a.allow_unauthenticated,
        a.allow_plaintext_tokens,
    )


def read_token(path: str) -> str:
    """A bearer token from a file (a mounted secret), stripped; "" for no file."""
    if not path:
        return ""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token
