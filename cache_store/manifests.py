"""Agent manifests: compare-and-swap commits, forks and deletes, each inside one LMDB write.

LMDB serializes write transactions, so reading the generation and writing the new manifest
in the same transaction makes the compare-and-swap atomic across threads and processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lmdb

from agentkv.errors import (
    AgentExists,
    AgentNotFound,
    CorruptRecord,
    GenerationConflict,
    InvalidArgument,
)
from agentkv.keys import ROOT_KEY
from cache_store.index import Index, ns_key
from cache_store.records import AgentRecord, BlockRecord


@dataclass(slots=True)
class Commit:
    namespace: str
    agent_id: str
    fingerprint: str
    expected_generation: int
    token_ids: list[int]
    block_keys: list[bytes]
    metadata: dict[str, str] = field(default_factory=dict)
    phase: str = ""


@dataclass(slots=True)
class AgentView:
    """A manifest plus what the store knows about its blocks now."""

    record: AgentRecord
    missing_block_keys: list[bytes]
    num_bytes: int
    remote_block_keys: list[bytes] = field(default_factory=list)  # in the object store only


@dataclass
class Chain:
    """A commit's chain, checked in a read transaction, before the write: each block's
    record as read (`raw`), so that the write only confirms it unchanged (decoding and
    checking a long chain held the write, which every other tenant's put waits for)."""

    blocks: list[BlockRecord]
    raw: list[bytes]


def checked_chain(index: Index, txn: lmdb.Transaction, c: Commit) -> Chain:
    """The commit's chain, its generation, parents and tokens checked (GenerationConflict
    first, then InvalidArgument, BlockNotFound, FingerprintMismatch naming the block)."""
    _expected(index, txn, c)
    blocks = _chain(index, txn, c.namespace, c.fingerprint, c.block_keys)
    _check_tokens(blocks, c.token_ids)
    raw = [index.block_bytes(txn, c.namespace, b.key) or b"" for b in blocks]
    return Chain(blocks, raw)


def unchanged(index: Index, txn: lmdb.Transaction, namespace: str, chain: Chain) -> bool:
    """Whether every block of `chain` is stored as it was when checked."""
    return all(
        index.block_bytes(txn, namespace, b.key) == raw
        for b, raw in zip(chain.blocks, chain.raw, strict=True)
    )


def commit(
    index: Index, txn: lmdb.Transaction, c: Commit, now_ms: int, blocks: list[BlockRecord]
) -> AgentRecord:
    """Writes the agent's manifest over `blocks`, its chain as checked_chain checked it."""
    old = _expected(index, txn, c)
    record = AgentRecord(
        namespace=c.namespace,
        agent_id=c.agent_id,
        fingerprint=c.fingerprint,
        token_ids=c.token_ids,
        block_keys=[b.key for b in blocks],
        block_num_tokens=[len(b.token_ids) for b in blocks],
        metadata=c.metadata,
        phase=c.phase,
        created_ms=old.created_ms if old else now_ms,
        updated_ms=now_ms,
        generation=old.generation + 1 if old else index.first_generation(txn),
    )
    _move_refs(index, txn, c.namespace, old.block_keys if old else [], record.block_keys)
    index.put_agent(txn, record, created=old is None)
    return record


def _expected(index: Index, txn: lmdb.Transaction, c: Commit) -> AgentRecord | None:
    """The manifest the commit replaces (None: none, or a quarantined one), when it is at
    the generation the commit expects; else GenerationConflict."""
    old, lost = _for_update(index, txn, c.namespace, c.agent_id)
    current = old.generation if old else 0
    if c.expected_generation != current:
        state = f"is at generation {current}" if old else "does not exist (generation 0)"
        if lost:
            state = "is lost, its manifest quarantined (generation 0)"
        raise GenerationConflict(
            f"agent {c.agent_id!r} in namespace {c.namespace!r} {state}; "
            f"the commit expected generation {c.expected_generation}",
            current,
        )
    return old


def install(
    index: Index, txn: lmdb.Transaction, record: AgentRecord, old: AgentRecord | None
) -> None:
    """Puts a manifest read from the object store in place of `old` (its blocks are here)."""
    _move_refs(index, txn, record.namespace, old.block_keys if old else [], record.block_keys)
    index.put_agent(txn, record, created=old is None, checked=False)


def fork(
    index: Index,
    txn: lmdb.Transaction,
    namespace: str,
    source_id: str,
    new_id: str,
    num_tokens: int,
    phase: str,
    metadata: dict[str, str],
    now_ms: int,
) -> AgentRecord:
    source = get(index, txn, namespace, source_id)
    if index.get_agent(txn, namespace, new_id) is not None:
        raise AgentExists(f"agent {new_id!r} already exists in namespace {namespace!r}")
    keep = num_tokens or len(source.token_ids)
    if keep > len(source.token_ids):
        raise InvalidArgument(
            f"cannot fork {keep} tokens: agent {source_id!r} has {len(source.token_ids)}"
        )
    keys, counts, covered = [], [], 0
    for key, n in zip(source.block_keys, source.block_num_tokens, strict=True):
        if covered + n > keep or index.find_block(txn, namespace, key) is None:
            break  # a block past the cut, or one lost to quarantine, ends the shared chain
        keys.append(key)
        counts.append(n)
        covered += n
    record = AgentRecord(
        namespace=namespace,
        agent_id=new_id,
        fingerprint=source.fingerprint,
        token_ids=source.token_ids[:keep],
        block_keys=keys,
        block_num_tokens=counts,
        metadata=metadata or dict(source.metadata),
        phase=phase or source.phase,
        created_ms=now_ms,
        updated_ms=now_ms,
        generation=index.first_generation(txn),
    )
    _move_refs(index, txn, namespace, [], keys)
    index.put_agent(txn, record, created=True)
    return record


def delete(
    index: Index, txn: lmdb.Transaction, namespace: str, agent_id: str, expected_generation: int
) -> int:
    try:
        record = get(index, txn, namespace, agent_id)
    except CorruptRecord:
        if index.forget_lost_agent(txn, namespace, agent_id):
            return 0  # a quarantined manifest: its references were recounted without it
        raise
    if expected_generation and expected_generation != record.generation:
        raise GenerationConflict(
            f"agent {agent_id!r} is at generation {record.generation}; "
            f"the delete expected generation {expected_generation}",
            record.generation,
        )
    _move_refs(index, txn, namespace, record.block_keys, [])
    index.delete_agent(txn, record)
    return len(record.block_keys)


def get(index: Index, txn: lmdb.Transaction, namespace: str, agent_id: str) -> AgentRecord:
    """The manifest; AgentNotFound, or CorruptRecord (DATA_LOSS) for a lost one."""
    record = index.get_agent(txn, namespace, agent_id)
    if record is None:
        raise AgentNotFound(f"agent {agent_id!r} not found in namespace {namespace!r}")
    return record


def view_of(record: AgentRecord, blocks: list[BlockRecord]) -> AgentView:
    """The view of a manifest just committed over `blocks` (all there, as committed)."""
    remote = [b.key for b in blocks if not b.local]
    return AgentView(record, [], sum(b.num_bytes for b in blocks), remote)


def view(index: Index, txn: lmdb.Transaction, record: AgentRecord) -> AgentView:
    """A block whose record is bad counts as missing: the reader restores cold from there."""
    missing: list[bytes] = []
    remote: list[bytes] = []
    num_bytes = 0
    for key in record.block_keys:
        block = index.find_block(txn, record.namespace, key)
        if block is None:
            missing.append(key)
        else:
            num_bytes += block.num_bytes
            if not block.local:
                remote.append(key)
    return AgentView(record, missing, num_bytes, remote)


def _for_update(
    index: Index, txn: lmdb.Transaction, namespace: str, agent_id: str
) -> tuple[AgentRecord | None, bool]:
    """The manifest a commit replaces, and whether it is a quarantined one (which counts as
    absent: generation 0). A bad manifest not yet quarantined fails the commit (DATA_LOSS)."""
    try:
        return index.get_agent(txn, namespace, agent_id), False
    except CorruptRecord:
        if index.quarantined(txn, "agents", ns_key(namespace, agent_id)) is None:
            raise
        return None, True


def _chain(
    index: Index, txn: lmdb.Transaction, namespace: str, fingerprint: str, keys: list[bytes]
) -> list[BlockRecord]:
    blocks: list[BlockRecord] = []
    parent = ROOT_KEY
    for i, key in enumerate(keys):
        block = index.require_block(txn, namespace, fingerprint, key, f"block_keys[{i}]")
        if block.parent_key != parent:
            expected = f"follow block_keys[{i - 1}]" if i else "be a first block"
            raise InvalidArgument(
                f"block_keys[{i}] {key.hex()} should {expected}, but its parent is "
                f"{block.parent_key.hex() or 'the root'}"
            )
        blocks.append(block)
        parent = key
    return blocks


def _check_tokens(blocks: list[BlockRecord], token_ids: list[int]) -> None:
    pos = 0
    for i, block in enumerate(blocks):
        end = pos + len(block.token_ids)
        if token_ids[pos:end] != block.token_ids:
            raise InvalidArgument(
                f"block_keys[{i}] {block.key.hex()} holds tokens that differ from "
                f"token_ids[{pos}:{end}]"
            )
        pos = end


def _move_refs(
    index: Index, txn: lmdb.Transaction, namespace: str, old: list[bytes], new: list[bytes]
) -> None:
    old_set, new_set = set(old), set(new)
    for key in new_set - old_set:
        index.add_ref(txn, namespace, key, +1)
    for key in old_set - new_set:
        index.add_ref(txn, namespace, key, -1)
