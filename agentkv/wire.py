"""Fast path for payload streams: `chunk` messages encoded and decoded without protobuf objects.

PutBlocksRequest and GetBlocksResponse are `oneof item { Header header = 1; bytes chunk = 2; }`.
A message holding only `chunk` is, on the wire, the tag byte 0x12, a varint length, then the
bytes. Building that directly and slicing it on receipt avoids two copies per MiB, which makes
streaming several times faster in Python (DESIGN.md, "Restore paths"). The bytes are exactly
what any protobuf library produces and parses, so stubs in other languages interoperate.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

CHUNK_TAG = 0x12  # field 2, wire type 2 (length-delimited)
MAX_CHUNK_BYTES = 4 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
# Keys one GetBlocks or LocateBlocks may name: a worker reads one agent's chain, and this is
# 1M tokens of 64-token blocks. The store refuses more, or a key named twice, before anything is
# looked up (a small request must not make it build a huge reply); the SDK splits longer reads.
MAX_KEYS_PER_READ = 16_384

M = TypeVar("M", bound=Message)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def chunk_prefix(num_bytes: int) -> bytes:
    """Wire bytes that precede `num_bytes` of chunk data in a chunk-only message."""
    return bytes((CHUNK_TAG,)) + _varint(num_bytes)


def encode_chunk(data: bytes | memoryview) -> bytes:
    """Serializes a message whose oneof holds `chunk = data`."""
    return chunk_prefix(len(data)) + data


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(raw) and shift < 64:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def decode(raw: bytes, message_type: type[M]) -> M | memoryview:
    """Returns a chunk's bytes as a zero-copy view, or the parsed message for anything else.

    Raises DecodeError for bytes that are not a valid `message_type`.
    """
    if raw and raw[0] == CHUNK_TAG:
        length, start = _read_varint(raw, 1)
        if start + length == len(raw):
            return memoryview(raw)[start:]
    message = message_type()
    message.ParseFromString(raw)
    if message.WhichOneof("item") == "chunk":
        return memoryview(message.chunk)
    return message


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_KEYS_PER_READ",
    "DecodeError",
    "decode",
    "encode_chunk",
]
