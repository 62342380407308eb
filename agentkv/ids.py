"""Names and ids a caller sends (namespaces, agent ids, fingerprints, block keys, token
lists, metadata, phases): one check each, every failure naming the offending value; and the
limits of the fields that more than one layer checks (the SDK's scenarios, the worker)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from agentkv.errors import InvalidArgument
from agentkv.keys import KEY_BYTES

NAMESPACE_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
FINGERPRINT_RE = re.compile(r"[A-Za-z0-9:._-]{8,128}")
DEFAULT_NAMESPACE = "default"
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 4096
MAX_METADATA_TOTAL = 96 << 10  # characters of keys and values together, per agent
MAX_PHASE = 256
MAX_TEMPERATURE = 10.0  # the hottest sampling a worker takes
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_STRINGS = 16  # stop strings of one turn (a worker's default max_stop_strings)
AgentId = tuple[str, str]  # (namespace, agent id): an agent, store-wide


def show(value: str, limit: int = 80) -> str:
    """`value` quoted, cut at `limit`: an error message (gRPC metadata) stays small."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def namespace(value: str) -> str:
    value = value or DEFAULT_NAMESPACE
    if not NAMESPACE_RE.fullmatch(value):
        raise InvalidArgument(f"invalid namespace {show(value)}: must match {NAMESPACE_RE.pattern}")
    return value


def agent_id(value: str, field: str = "agent_id") -> str:
    if not AGENT_ID_RE.fullmatch(value):
        raise InvalidArgument(f"invalid {field} {show(value)}: must match {AGENT_ID_RE.pattern}")
    return value


def fingerprint(value: str) -> str:
    if not FINGERPRINT_RE.fullmatch(value):
        raise InvalidArgument(
            f"invalid fingerprint {show(value)}: must match {FINGERPRINT_RE.pattern}"
        )
    return value


def key(value: bytes, field: str = "key", allow_root: bool = False) -> bytes:
    if allow_root and not value:
        return value
    if len(value) != KEY_BYTES:
        raise InvalidArgument(
            f"invalid {field} {show(value.hex())} ({len(value)} bytes): must be {KEY_BYTES} bytes"
        )
    return bytes(value)


def token_ids(values: Sequence[int], limit: int, field: str = "token_ids") -> list[int]:
    if len(values) > limit:
        raise InvalidArgument(f"{field} holds {len(values)} tokens, more than the limit {limit}")
    return list(values)


def metadata(values: Mapping[str, str]) -> dict[str, str]:
    if len(values) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"metadata has {len(values)} entries, limit {MAX_METADATA_ENTRIES}")
    for k, v in values.items():
        if not k or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise InvalidArgument(
                f"metadata entry {show(k)}: keys need 1..{MAX_METADATA_KEY} chars, "
                f"values at most {MAX_METADATA_VALUE}"
            )
    total = sum(len(k) + len(v) for k, v in values.items())
    if total > MAX_METADATA_TOTAL:
        raise InvalidArgument(
            f"metadata holds {total} characters of keys and values, limit {MAX_METADATA_TOTAL}"
        )
    return dict(values)


def phase(value: str) -> str:
    if len(value) > MAX_PHASE:
        raise InvalidArgument(f"phase {show(value)} is {len(value)} characters, limit {MAX_PHASE}")
    return value
