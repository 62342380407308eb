"""Content addresses of KV blocks."""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

KEY_BYTES = 32
ROOT_KEY = b""  # the parent of an agent's first block
_DOMAIN = b"agentkv-block-v1"
_LITTLE_ENDIAN = sys.byteorder == "little"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, the form keys and records hash and store."""
    packed = array("I", token_ids)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def tokens_from_bytes(raw: bytes) -> list[int]:
    packed = array("I")
    packed.frombytes(raw)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tolist()


def block_key(fingerprint: str, parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """key = BLAKE2b-256(domain, fingerprint, parent key, the span's token ids)."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=b"agentkv")
    fp = fingerprint.encode()
    digest.update(_DOMAIN)
    digest.update(struct.pack("<I", len(fp)) + fp)
    digest.update(struct.pack("<I", len(parent_key)) + parent_key)
    digest.update(token_bytes(token_ids))
    return digest.digest()


def chain_keys(fingerprint: str, spans: Sequence[Sequence[int]]) -> list[bytes]:
    """Keys of consecutive blocks whose token spans are `spans`, starting at the root."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    for span in spans:
        parent = block_key(fingerprint, parent, span)
        keys.append(parent)
    return keys
