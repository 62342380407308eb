"""A request body's fields checked, each refusal a 400 naming the field: types, UTF-8 text,
numbers within a range, and fields agentkv does not know (refused, never dropped). Shared by
the chat, Responses and Anthropic routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentkv.gateway.errors import invalid

# Python's types as a JSON body's caller names them
JSON_KINDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def typed(body: dict, name: str, kind: type, default: Any, where: str = "") -> Any:
    """body[name] when it is a `kind` (null or absent: `default`); `where`: the object's
    place in the request, when not the body."""
    value, param = body.get(name, default), f"{where}.{name}" if where else name
    if (
        value is not None
        and value is not default
        and (not isinstance(value, kind) or (kind is int and isinstance(value, bool)))
    ):
        said = JSON_KINDS.get(kind, kind.__name__)
        raise invalid(f"{param} must be {said}, got {value!r}", param)
    if kind is str and value:
        utf8(value, param)
    return value


def utf8(text: str, where: str) -> None:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text can hold."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise invalid(f"{where} holds a lone surrogate escape, not valid Unicode", where) from None


def checked_body(
    body: Any, known: set[str], neutral: dict[str, tuple], why: dict[str, str] | None = None
) -> dict:
    """The request body: a JSON object of `known` fields only, each field of `neutral` null
    or one of its values (else a 400 naming it, with `why` it is refused, when given)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    known_only(body, known)
    for name, values in neutral.items():
        if body.get(name) not in (None, *values):
            allowed = " or ".join(map(repr, (None, *values)))
            reason = (why or {}).get(name, "")
            raise invalid(f"{name}: only {allowed} is supported{reason}", name, "unsupported_value")
    return body


def metadata(body: dict) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 pairs of strings, keys of 64 characters at most and
    values of 512 (it is stored with the response, and echoed)."""
    pairs = typed(body, "metadata", dict, None) or {}
    if len(pairs) > 16:
        raise invalid(f"metadata holds {len(pairs)} pairs; at most 16 are taken", "metadata")
    for key, value in pairs.items():
        if len(key) > 64:
            raise invalid("metadata keys are 64 characters at most", f"metadata.{key[:64]}")
        if not isinstance(value, str) or len(value) > 512:
            raise invalid(
                f"metadata.{key} must be a string of 512 characters at most", f"metadata.{key}"
            )
        utf8(key, "metadata")
        utf8(value, f"metadata.{key}")
    return pairs


def known_only(obj: dict, known: set[str], where: str = "") -> None:
    """Refuses a field of `obj` (at `where`; "": the body) that is not `known`, as an unknown
    parameter: one is never silently dropped. The first, by name, is named. A null one is
    one left out, as OpenAI reads it (an SDK's model_dump() writes every field it knows)."""
    extra = sorted(name for name, value in obj.items() if name not in known and value is not None)
    if extra:
        param = f"{where}.{extra[0]}" if where else extra[0]
        raise invalid(f"unsupported parameter: {param}", param, "unsupported_parameter")


def numbers(body: dict, ranges: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    """The fields of `ranges` (name, lowest, highest) that the body gives, each a number
    within its range; a top_p of 0 as greedy (both APIs' reading; the worker's 0 is off)."""
    out = {}
    for name, low, high in ranges:
        value = body.get(name)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not low <= value <= high:
            raise invalid(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
        out[name] = float(value)
    if out.get("top_p", 1.0) <= 1e-6:  # the worker's 0 turns nucleus off; the APIs' is greedy
        out["temperature"], out["top_p"] = 0.0, 1.0
    return out
