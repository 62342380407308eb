"""Who calls the gateway and what they send: the bearer token's principal (with a token
table), the namespace the call may use, and the request body as JSON within its limit."""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

from starlette.requests import Request

from agentkv.auth import Principal, TokenTable
from agentkv.gateway.errors import HTTPError


class Callers:
    """The token table (None: no authentication), the namespace of a call that names none,
    and the largest body taken."""

    def __init__(self, tokens: TokenTable | None, namespace: str, max_body_bytes: int) -> None:
        self.tokens, self.default_namespace = tokens, namespace
        self.max_body_bytes = max_body_bytes

    def namespace(self, request: Request) -> str:
        """The caller's namespace: X-Namespace, else its token's only namespace, else the
        gateway's --namespace; with a token table, one the bearer token may use."""
        asked = request.headers.get("x-namespace", "")
        who = self.principal(request)
        if not asked and who is not None and who.namespaces and len(who.namespaces) == 1:
            asked = next(iter(who.namespaces))
        namespace = asked or self.default_namespace
        if who is not None and not who.allows(namespace):
            raise HTTPError(
                403,
                f"token {who.name!r} may not use namespace {namespace!r}",
                "permission_error",
                code="permission_denied",
            )
        return namespace

    def principal(self, request: Request) -> Principal | None:
        """Who the bearer token (Authorization: Bearer, or Anthropic's X-Api-Key) names."""
        if self.tokens is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        given = (bearer, request.headers.get("x-api-key", "").strip())  # either may be valid
        who = next(filter(None, (self.tokens.principal(t) for t in given if t)), None)
        if who is None:
            raise HTTPError(
                401,
                "a valid bearer token is required (Authorization: Bearer ..., or X-Api-Key)",
                "authentication_error",
                code="invalid_api_key",
            )
        return who

    async def body(self, request: Request) -> Any:
        limit, chunks, size = self.max_body_bytes, [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body over {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        data = b"".join(chunks)
        try:
            text = data.decode("utf-8-sig")  # RFC 8259: UTF-8 (a BOM let by)
        except UnicodeDecodeError as exc:  # json.loads(bytes) would let surrogates' bytes by
            at = exc.start + 3 * data.startswith(codecs.BOM_UTF8)  # counted after the BOM
            raise HTTPError(
                400, f"the request body is not UTF-8 text: {exc.reason} at byte {at}"
            ) from None
        try:
            return json.loads(text, parse_float=_finite, parse_constant=_not_a_number)
        except ValueError as exc:  # Python's advice for long integers is not the caller's
            said = str(exc).split("; use sys.set_int_max_str_digits()")[0]
            raise HTTPError(400, f"the request body is not JSON: {said}") from None
        except RecursionError:
            raise HTTPError(400, "the request body is nested too deeply") from None


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent, refused past a double's range: a reply
    that echoes it (a tool's schema) could not be JSON again."""
    value = float(text)
    if not math.isfinite(value):
        raise HTTPError(
            400, f"the request body holds the number {text[:40]}, past a double's range"
        )
    return value


def _not_a_number(text: str) -> float:
    """NaN, Infinity, -Infinity: Python's JSON takes them, JSON does not."""
    raise HTTPError(400, f"the request body is not JSON: {text} is no JSON value")
