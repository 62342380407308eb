"""The store's replies built from its domain records: the protobuf side of the edge.

Block headers and locations of immutable blocks are built once and kept (MessageCache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from google.protobuf.message import Message

from agentkv.v1 import store_pb2 as pb
from cache_store import manifests
from cache_store.reads import Selection
from cache_store.records import BlockRecord
from cache_store.validation import TensorLayout


class MessageCache:
    """Built reply messages for immutable blocks: a block header carries hundreds of tensor
    entries, and building them again on every restore costs more than reading the bytes.
    Bounded by the bytes of the messages it keeps, least recently used out first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.num_bytes = max_bytes, 0
        self._items: OrderedDict[tuple, tuple[Message, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, key: tuple, build: Callable[[Selection], Message], selection: Selection
    ) -> Message:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key][0]
        message = build(selection)
        size = message.ByteSize()
        with self._lock:
            if key not in self._items and size <= self.max_bytes // 8:
                self._items[key] = (message, size)
                self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                self.num_bytes -= self._items.popitem(last=False)[1][1]
        return message


def tensor_info(t: TensorLayout) -> pb.TensorInfo:
    return pb.TensorInfo(
        name=t.name,
        dtype=t.dtype,
        shape=t.shape,
        layer=t.layer,
        file_offset=t.offset,
        num_bytes=t.num_bytes,
    )


def block_header(s: Selection) -> pb.BlockHeader:
    r = s.record
    return pb.BlockHeader(
        key=r.key,
        parent_key=r.parent_key,
        token_ids=r.token_ids,
        tensors=[tensor_info(t) for t in s.tensors],
        num_bytes=s.num_bytes,
    )


def location(s: Selection, path: str) -> pb.BlockLocation:
    r = s.record
    return pb.BlockLocation(
        key=r.key,
        parent_key=r.parent_key,
        token_ids=r.token_ids,
        path=path,
        tensors=[tensor_info(t) for t in s.tensors],
        segments=[
            pb.Segment(layer=g.layer, offset=g.offset, num_bytes=g.num_bytes, checksum=g.checksum)
            for g in s.segments
        ],
    )


def manifest(view: manifests.AgentView, summary_only: bool = False) -> pb.AgentManifest:
    r = view.record
    return pb.AgentManifest(
        namespace=r.namespace,
        agent_id=r.agent_id,
        fingerprint=r.fingerprint,
        token_ids=() if summary_only else r.token_ids,
        block_keys=() if summary_only else r.block_keys,
        block_num_tokens=() if summary_only else r.block_num_tokens,
        metadata=r.metadata,
        phase=r.phase,
        created_unix_ms=r.created_ms,
        updated_unix_ms=r.updated_ms,
        generation=r.generation,
        missing_block_keys=view.missing_block_keys,
        num_bytes=view.num_bytes,
        remote_block_keys=() if summary_only else view.remote_block_keys,
    )


def agent_summary(view: manifests.AgentView) -> pb.AgentSummary:
    r = view.record
    return pb.AgentSummary(
        agent_id=r.agent_id,
        fingerprint=r.fingerprint,
        num_tokens=len(r.token_ids),
        num_blocks=len(r.block_keys),
        num_bytes=view.num_bytes,
        phase=r.phase,
        updated_unix_ms=r.updated_ms,
        generation=r.generation,
    )


def block_summary(r: BlockRecord, last_access_ms: int) -> pb.BlockSummary:
    return pb.BlockSummary(
        key=r.key,
        parent_key=r.parent_key,
        fingerprint=r.fingerprint,
        num_tokens=len(r.token_ids),
        num_bytes=r.num_bytes,
        refcount=r.refcount,
        last_access_unix_ms=last_access_ms,
    )
