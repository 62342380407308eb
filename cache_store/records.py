"""What the LMDB index holds about a block and an agent, and how it is encoded.

Every value in the index is sealed: `xxh3_64(key + payload)` (8 bytes) then the payload
(msgpack for records), so a flipped byte, or a value found under another key, fails on read
with CorruptRecord naming the table and key.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field

import msgpack
import xxhash

from agentkv.errors import CorruptRecord
from agentkv.keys import token_bytes, tokens_from_bytes
from cache_store.validation import TensorLayout

HEADER_LAYER = -1  # segment id of the safetensors header
CHECKSUM_BYTES = 8
_U64 = struct.Struct("<Q")
# What a payload that passed its checksum but is not this version's record raises on decode.
DECODE_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    OverflowError,
    msgpack.UnpackException,
)


def seal(key: bytes, payload: bytes) -> bytes:
    """The stored form of a value: its checksum over key and payload, then the payload."""
    return _digest(key, payload) + payload


def unseal(table: str, key: bytes, raw: bytes) -> memoryview:
    """The payload of a stored value, or CorruptRecord if its checksum fails."""
    view = memoryview(raw)
    payload = view[CHECKSUM_BYTES:]
    if len(raw) < CHECKSUM_BYTES or view[:CHECKSUM_BYTES] != _digest(key, payload):
        raise corrupt(table, key, "failed its checksum")
    return payload


def corrupt(table: str, key: bytes, what: str) -> CorruptRecord:
    return CorruptRecord(f"the index record of {record_name(table, key)} {what}", table, key)


def record_name(table: str, key: bytes) -> str:
    """'agent 'a1' in namespace 'default'' and the like, for messages and reports."""
    ns, sep, ident = key.partition(b"\x00")
    if table == "agents" and sep:
        return f"agent {ident.decode(errors='replace')!r} in namespace {_text(ns)!r}"
    if table == "blocks" and sep:
        return f"block {ident.hex()} in namespace {_text(ns)!r}"
    return f"{table} entry {_text(key)!r}"


def _text(raw: bytes) -> str:
    return raw.decode(errors="replace")


def _digest(key: bytes, payload: bytes | memoryview) -> bytes:
    hasher = xxhash.xxh3_64(key)
    hasher.update(payload)
    return hasher.digest()


def decode_value(table: str, key: bytes, raw: bytes, decode):
    """decode(payload) of a stored value; any failure is CorruptRecord naming table and key."""
    payload = unseal(table, key, raw)
    try:
        return decode(payload)
    except DECODE_ERRORS as exc:
        raise corrupt(table, key, f"does not decode ({type(exc).__name__}: {exc})") from exc


def encode_u64(key: bytes, value: int) -> bytes:
    return seal(key, _U64.pack(value))


def decode_u64(table: str, key: bytes, raw: bytes) -> int:
    return decode_value(table, key, raw, lambda p: _U64.unpack(p)[0])


def encode_uploaded_id(key: bytes, generation: int, created_ms: int) -> bytes:
    return seal(key, msgpack.packb([generation, created_ms]))


def decode_uploaded_id(table: str, key: bytes, raw: bytes) -> tuple[int, int]:
    """(generation, created_ms) of a manifest in the object store, as encode_uploaded_id."""
    return decode_value(table, key, raw, _uploaded_id)


def _uploaded_id(payload: memoryview) -> tuple[int, int]:
    generation, created_ms = msgpack.unpackb(payload)
    return int(generation), int(created_ms)


def encode_usage(key: bytes, usage: dict[str, int]) -> bytes:
    return seal(key, msgpack.packb(usage))


def decode_usage(table: str, key: bytes, raw: bytes) -> dict[str, int]:
    return decode_value(table, key, raw, _usage)


def _usage(payload: memoryview) -> dict[str, int]:
    d = msgpack.unpackb(payload)
    return {
        "agents": int(d["agents"]),
        "blocks": int(d["blocks"]),
        "bytes": int(d["bytes"]),
        "records": int(d.get("records", 0)),  # absent from an index written before it
    }


@dataclass(frozen=True, slots=True)
class Segment:
    """A checksummed byte range of a payload file: one layer's tensors, or the header."""

    layer: int
    offset: int
    num_bytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class BlockRecord:
    namespace: str
    key: bytes
    parent_key: bytes
    fingerprint: str
    token_ids: list[int]
    tensors: list[TensorLayout]  # offsets are absolute within the file
    segments: list[Segment]  # header first, then one per layer in order
    num_bytes: int  # file size
    relpath: str  # under the data directory
    created_ms: int
    refcount: int = 0
    local: bool = True  # False: demoted, its payload only in the object store

    @property
    def local_bytes(self) -> int:
        """What the payload takes on local disk (what the quotas count)."""
        return self.num_bytes if self.local else 0

    @property
    def layers(self) -> list[int]:
        return [s.layer for s in self.segments if s.layer != HEADER_LAYER]

    def encode(self, key: bytes) -> bytes:
        """The sealed value stored under `key` (namespace NUL block key)."""
        return seal(key, self._pack())

    def _pack(self) -> bytes:
        return msgpack.packb(
            {
                "ns": self.namespace,
                "k": self.key,
                "p": self.parent_key,
                "fp": self.fingerprint,
                "t": token_bytes(self.token_ids),
                "tn": [
                    [t.name, t.dtype, list(t.shape), t.layer, t.offset, t.num_bytes]
                    for t in self.tensors
                ],
                "sg": [[s.layer, s.offset, s.num_bytes, s.checksum] for s in self.segments],
                "n": self.num_bytes,
                "path": self.relpath,
                "c": self.created_ms,
                "rc": self.refcount,
                "lc": self.local,
            }
        )

    @staticmethod
    def decode(key: bytes, raw: bytes) -> BlockRecord:
        """The record stored under `key`, or CorruptRecord. Memoized on the exact bytes (so
        the checksum is verified once per value): records are immutable and read often."""
        return _decode_block(key, raw)

    @classmethod
    def _unpack(cls, payload: memoryview) -> BlockRecord:
        d = msgpack.unpackb(payload)
        return cls(
            namespace=d["ns"],
            key=d["k"],
            parent_key=d["p"],
            fingerprint=d["fp"],
            token_ids=tokens_from_bytes(d["t"]),
            tensors=[TensorLayout(n, dt, tuple(sh), ly, o, nb) for n, dt, sh, ly, o, nb in d["tn"]],
            segments=[Segment(*s) for s in d["sg"]],
            num_bytes=d["n"],
            relpath=d["path"],
            created_ms=d["c"],
            refcount=d["rc"],
            local=d.get("lc", True),
        )


@functools.lru_cache(maxsize=1024)
def _decode_block(key: bytes, raw: bytes) -> BlockRecord:
    return decode_value("blocks", key, raw, BlockRecord._unpack)


@dataclass(slots=True)
class AgentRecord:
    namespace: str
    agent_id: str
    fingerprint: str
    token_ids: list[int]
    block_keys: list[bytes]
    block_num_tokens: list[int]
    metadata: dict[str, str] = field(default_factory=dict)
    phase: str = ""
    created_ms: int = 0
    updated_ms: int = 0
    generation: int = 0

    def encode(self, key: bytes) -> bytes:
        """The sealed value stored under `key` (namespace NUL agent id)."""
        return seal(key, self._pack())

    def _pack(self) -> bytes:
        return msgpack.packb(
            {
                "ns": self.namespace,
                "id": self.agent_id,
                "fp": self.fingerprint,
                "t": token_bytes(self.token_ids),
                "bk": self.block_keys,
                "bn": self.block_num_tokens,
                "md": self.metadata,
                "ph": self.phase,
                "c": self.created_ms,
                "u": self.updated_ms,
                "g": self.generation,
            }
        )

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> AgentRecord:
        """The record stored under `key`, or CorruptRecord."""
        return decode_value("agents", key, raw, cls._unpack)

    @classmethod
    def _unpack(cls, payload: memoryview) -> AgentRecord:
        d = msgpack.unpackb(payload)
        return cls(
            namespace=d["ns"],
            agent_id=d["id"],
            fingerprint=d["fp"],
            token_ids=tokens_from_bytes(d["t"]),
            block_keys=list(d["bk"]),
            block_num_tokens=list(d["bn"]),
            metadata=dict(d["md"]),
            phase=d["ph"],
            created_ms=d["c"],
            updated_ms=d["u"],
            generation=d["g"],
        )
