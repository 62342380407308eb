"""What the LMDB index holds about a block and an agent, and how it is encoded (msgpack)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import msgpack

from agentkv.keys import token_bytes, tokens_from_bytes
from cache_store.validation import TensorLayout

HEADER_LAYER = -1  # segment id of the safetensors header


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

    @property
    def layers(self) -> list[int]:
        return [s.layer for s in self.segments if s.layer != HEADER_LAYER]

    def encode(self) -> bytes:
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
            }
        )

    @staticmethod
    def decode(raw: bytes) -> BlockRecord:
        """Decoding is memoized on the exact bytes: records are immutable and read often."""
        return _decode_block(raw)

    @classmethod
    def _decode(cls, raw: bytes) -> BlockRecord:
        d = msgpack.unpackb(raw)
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
        )


@functools.lru_cache(maxsize=1024)
def _decode_block(raw: bytes) -> BlockRecord:
    return BlockRecord._decode(raw)


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

    def encode(self) -> bytes:
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
    def decode(cls, raw: bytes) -> AgentRecord:
        d = msgpack.unpackb(raw)
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
