"""What the object store holds, and how each object is written and read back, checked.

Objects under the location's prefix:
  <ns>/blocks/<key hex>.safetensors   a block's payload file, byte for byte; metadata: format,
                                      namespace, fingerprint, key, parent, num-tokens, xxh3
  <ns>/agents/<agent id>              a manifest (JSON): the agent record, per block its key,
                                      token count, size and payload xxh3; metadata: format,
                                      namespace, agent, fingerprint, generation, writer, xxh3
                                      (of the JSON)
  <ns>/writer.lease                   which store writes the namespace, and until when
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from agentkv.errors import CorruptBlock, CorruptRecord, InvalidArgument
from cache_store import validation
from cache_store.capacity import now_ms
from cache_store.payloads import Payloads
from cache_store.records import AgentRecord, BlockRecord

BLOCK_FORMAT = "agentkv-block-v1"
AGENT_FORMAT = "agentkv-agent-v1"
Manifest = dict[str, Any]


def block_object(namespace: str, key: bytes) -> str:
    return f"{namespace}/blocks/{key.hex()}.safetensors"


def agent_object(namespace: str, agent_id: str) -> str:
    """No suffix: the bucket lists manifests in agent-id order, as the index does (pages of
    ListAgents merge the two)."""
    return f"{namespace}/agents/{agent_id}"


def xxh3(body: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(body):016x}"


def block_metadata(record: BlockRecord, checksum: int) -> dict[str, str]:
    return {
        "agentkv-format": BLOCK_FORMAT,
        "agentkv-namespace": record.namespace,
        "agentkv-fingerprint": record.fingerprint,
        "agentkv-key": record.key.hex(),
        "agentkv-parent": record.parent_key.hex(),
        "agentkv-num-tokens": str(len(record.token_ids)),
        "agentkv-xxh3": f"{checksum:016x}",
    }


def manifest(record: AgentRecord, blocks: list[dict], writer: str) -> tuple[bytes, dict[str, str]]:
    """A manifest's body and metadata: the record, and the blocks in the bucket it names."""
    body = json.dumps(
        {
            "format": AGENT_FORMAT,
            "namespace": record.namespace,
            "agent_id": record.agent_id,
            "fingerprint": record.fingerprint,
            "generation": record.generation,
            "token_ids": record.token_ids,
            "blocks": blocks,
            "metadata": record.metadata,
            "phase": record.phase,
            "created_unix_ms": record.created_ms,
            "updated_unix_ms": record.updated_ms,
            "writer": writer,
        },
        separators=(",", ":"),
    ).encode()
    meta = {
        "agentkv-format": AGENT_FORMAT,
        "agentkv-namespace": record.namespace,
        "agentkv-agent": record.agent_id,
        "agentkv-fingerprint": record.fingerprint,
        "agentkv-generation": str(record.generation),
        "agentkv-writer": writer,
        "agentkv-xxh3": xxh3(body),
    }
    return body, meta


def generation_named(metadata: dict[str, str]) -> int | None:
    """The generation an object's metadata names (0: none named); None where it is no
    number a store writes (edited by hand, or garbled)."""
    given = metadata.get("agentkv-generation") or "0"
    return int(given) if given.isascii() and given.isdigit() and len(given) < 20 else None


def read_manifest(body: bytes, metadata: dict[str, str], namespace: str, agent_id: str) -> Manifest:
    """A manifest from the bucket, checked; CorruptRecord (DATA_LOSS) if it is not whole."""
    where = f"the object store's manifest of agent {agent_id!r} in namespace {namespace!r}"
    if metadata.get("agentkv-xxh3") != xxh3(body):
        raise CorruptRecord(f"{where} failed its checksum")
    try:
        m = json.loads(body)
        ok = (
            m["format"] == AGENT_FORMAT
            and m["namespace"] == namespace
            and m["agent_id"] == agent_id
            and all(0 <= int(b["num_bytes"]) < 2**63 for b in m["blocks"])
            and all(int(b["xxh3"], 16) >= 0 for b in m["blocks"])
        )
        record = manifest_record(m)  # every field the record takes, of its type
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise CorruptRecord(f"{where} does not decode: {exc!r}") from exc
    if not _fits_the_wire(record):
        raise CorruptRecord(f"{where} holds a number out of range")
    if not ok:
        raise CorruptRecord(f"{where} names another agent or format")
    return m


def _fits_the_wire(r: AgentRecord) -> bool:
    """Whether a record's numbers fit the fields they are sent in: token ids and counts are
    uint32, times and generations 64-bit (and none is negative)."""
    small = (*r.token_ids, *r.block_num_tokens)
    return all(0 <= n < 2**32 for n in small) and all(
        0 <= n < 2**63 for n in (r.created_ms, r.updated_ms, r.generation)
    )


def manifest_record(m: Manifest, keys: list[bytes] | None = None) -> AgentRecord:
    """The agent record a manifest describes, naming `keys` (default: all its blocks)."""
    entries = m["blocks"] if keys is None else m["blocks"][: len(keys)]
    return AgentRecord(
        namespace=m["namespace"],
        agent_id=m["agent_id"],
        fingerprint=m["fingerprint"],
        token_ids=[int(t) for t in m["token_ids"]],
        block_keys=[bytes.fromhex(b["key"]) for b in entries],
        block_num_tokens=[int(b["num_tokens"]) for b in entries],
        metadata={str(k): str(v) for k, v in m["metadata"].items()},
        phase=str(m["phase"]),
        created_ms=int(m["created_unix_ms"]),
        updated_ms=int(m["updated_unix_ms"]),
        generation=int(m["generation"]),
    )


def draft_block(m: Manifest, key: bytes, parent: bytes, pos: int, count: int) -> BlockRecord:
    """What a manifest says of one of its blocks, before its payload is read."""
    namespace = m["namespace"]
    tokens = [int(t) for t in m["token_ids"][pos : pos + count]]
    relpath = Payloads.relpath(namespace, key)
    return BlockRecord(
        namespace, key, parent, m["fingerprint"], tokens, [], [], 0, relpath, now_ms()
    )


def parse_payload(
    body: bytes, base: BlockRecord, max_block_bytes: int
) -> tuple[int, list[validation.TensorLayout]]:
    """The header length and tensor layout of a payload file from the bucket, checked to be
    the block `base` names (key, fingerprint, namespace, token count) and laid out as ours."""
    where = f"the object store's copy of block {base.key.hex()}"
    try:
        n = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + n])
        meta = header.pop("__metadata__")
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        specs = [(name, e["dtype"], e["shape"]) for name, e in entries]
        offsets = [tuple(e["data_offsets"]) for _, e in entries]
        claimed = tuple(meta.get(k) for k in ("key", "fingerprint", "namespace", "num_tokens"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptBlock(f"{where} has no readable header") from exc
    if claimed != (base.key.hex(), base.fingerprint, base.namespace, str(len(base.token_ids))):
        raise CorruptBlock(f"{where} names another block")
    try:
        layout = validation.tensor_layout(specs, max_block_bytes)
    except InvalidArgument as exc:
        raise CorruptBlock(f"{where}: {exc.message}") from exc
    except (TypeError, ValueError) as exc:  # JSON's types where ours belong: "shape": 5
        raise CorruptBlock(f"{where} has no readable header: {exc!r}") from exc
    spans = [(t.offset, t.offset + t.num_bytes) for t in layout]
    if spans != offsets or len(body) != 8 + n + sum(t.num_bytes for t in layout):
        raise CorruptBlock(f"{where} is not laid out as its header says")
    return 8 + n, layout
