"""Per-namespace bearer tokens on a server, for the store and the worker alike.

A server given a token table (`--auth-tokens FILE`) answers UNAUTHENTICATED to any call
without a valid `authorization: Bearer TOKEN`, except health checks and reflection. Each
token names the namespaces it may touch (or "*" for all); a call for another namespace gets
PERMISSION_DENIED before any of that namespace's data is read, so nothing about it leaks,
not even through timing. The table file holds each token's SHA-256 (or the token itself):

    {"tokens": [{"name": "team-a", "sha256": "9f86d0...", "namespaces": ["team-a"]},
                {"name": "ops", "token": "s3cret", "namespaces": ["*"]}]}
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from agentkv import ids
from agentkv.errors import PermissionDenied, Unauthenticated
from agentkv.rpc import OPEN_PREFIXES, guarded

ALL = "*"
TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: what a header carries


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
    """Raises InvalidArgument for a malformed name ("" is the default namespace), then
    PermissionDenied unless the caller may touch it: before any of its data is read."""
    namespace = ids.namespace(namespace)
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
        """The table in a JSON file; ValueError naming the file and entry for anything a
        server could not honour as written."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ValueError(f"auth tokens file {path}: {exc}") from None
        items = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            raise ValueError(f"auth tokens file {path}: needs a non-empty list under 'tokens'")
        entries: dict[bytes, Principal] = {}
        for i, item in enumerate(items):
            where = f"auth tokens file {path}, tokens[{i}]"
            digest, who = _entry(item, i, where)
            if digest in entries:  # else the later entry would silently replace the earlier
                raise ValueError(f"{where}: the same token as {entries[digest].name!r}")
            entries[digest] = who
        return cls(entries)

    def principal(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, who in self._by_digest.items():  # every entry: no early exit to time
            if hmac.compare_digest(known, digest):
                found = who
        return found


ENTRY_KEYS = frozenset({"name", "sha256", "token", "namespaces"})


def _entry(item: Any, i: int, where: str) -> tuple[bytes, Principal]:
    """One table entry: its token's SHA-256 and who it is."""
    if not isinstance(item, dict) or ("sha256" in item) == ("token" in item):
        raise ValueError(f"{where}: give exactly one of 'sha256' or 'token'")
    if unknown := sorted(set(item) - ENTRY_KEYS):  # a misspelt field, or one not kept here
        raise ValueError(f"{where}: unknown field(s) {unknown}: an entry has {sorted(ENTRY_KEYS)}")
    name = str(item.get("name") or f"token {i}")
    spaces = item.get("namespaces")
    if not isinstance(spaces, list) or not spaces:
        raise ValueError(f"{where}: 'namespaces' must list namespaces, or '*'")
    for space in spaces:  # a name no call can carry would never match
        if space != ALL and not (isinstance(space, str) and ids.NAMESPACE_RE.fullmatch(space)):
            raise ValueError(
                f"{where}: namespace {space!r} must be '*' or match {ids.NAMESPACE_RE.pattern}"
            )
    return _digest(item, where), Principal(name, None if ALL in spaces else frozenset(spaces))


def _digest(item: dict, where: str) -> bytes:
    """The SHA-256 of an entry's token, given as the token or as its hex digest."""
    if "sha256" in item:
        try:
            digest = bytes.fromhex(item["sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: sha256 must be 64 hex digits")
        return digest
    token = item["token"]
    if not isinstance(token, str):
        raise ValueError(f"{where}: a token is a string, not {type(token).__name__}")
    if len(token) < 16:
        raise ValueError(f"{where}: a token needs at least 16 characters")
    if not TOKEN_RE.fullmatch(token):  # an authorization header carries no other
        raise ValueError(f"{where}: a token is printable ASCII with no spaces")
    return hashlib.sha256(token.encode()).digest()


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
            return guarded(handler, partial(_refused, reason))
        return guarded(handler, partial(_running_as, who))


@contextmanager
def _running_as(who: Principal, _context: grpc.ServicerContext) -> Iterator[None]:
    token = _principal.set(who)
    try:
        yield
    finally:
        _principal.reset(token)


@contextmanager
def _refused(reason: str, context: grpc.ServicerContext) -> Iterator[None]:
    error = Unauthenticated(f"unauthenticated: {reason}")
    context.set_trailing_metadata(error.trailing_metadata())
    context.abort(error.code, error.message)  # raises: the call never runs
    yield
