"""StoreClient: every CacheStore RPC, with typed errors and the raw-chunk fast path."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from agentkv import wire
from agentkv.channels import ClientSecurity, call_timeout
from agentkv.client.blocks import (
    Block,
    CorruptFile,
    FilesUnreadable,
    StoredBlock,
    alloc,
    block_from_header,
    check_chunk_bytes,
    chunk_payloads,
    located_bytes,
    read_locations,
)
from agentkv.errors import (
    AgentKVError,
    CorruptBlock,
    ReplyTooLarge,
    ResourceExhausted,
    Unavailable,
    typed_errors,
)
from agentkv.rpc import message_options
from agentkv.v1 import store_pb2 as pb
from agentkv.v1 import store_pb2_grpc

_METHOD = "/agentkv.v1.CacheStore/"
CLOSED = "the store client was closed (its process is stopping)"


class StoreClient:
    """A connection to one cache store. Thread-safe; close() when done."""

    def __init__(
        self,
        address: str,
        timeout: float = 60.0,
        max_message_bytes: int = 16 << 20,
        security: ClientSecurity | None = None,
    ):
        """`security`: TLS and a bearer token (agentkv.channels); none for plain loopback."""
        self.address = address
        self.timeout = call_timeout(timeout)
        self.channel = (security or ClientSecurity()).channel(
            address, message_options(max_message_bytes)
        )
        self.stub = store_pb2_grpc.CacheStoreStub(self.channel)
        self.closed = False
        self._lock = threading.Lock()
        self._read_pool: ThreadPoolExecutor | None = None
        self._put = self.channel.stream_unary(
            _METHOD + "PutBlocks",
            request_serializer=None,
            response_deserializer=pb.PutBlocksResponse.FromString,
        )
        self._get = self.channel.unary_stream(
            _METHOD + "GetBlocks",
            request_serializer=pb.GetBlocksRequest.SerializeToString,
            response_deserializer=None,
        )

    def close(self) -> None:
        """Ends the calls in flight on every thread; they and later calls raise Unavailable
        (CLOSED). Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.channel.close()
        if self._read_pool is not None:
            self._read_pool.shutdown()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Any unary RPC by name, e.g. call("GetAgent", pb.GetAgentRequest(...))."""
        rpc = getattr(self.stub, method)
        with self._typed():
            return rpc(request, timeout=call_timeout(timeout) or self.timeout)

    @contextlib.contextmanager
    def _typed(self) -> Iterator[None]:
        """Every call's errors: a gRPC error as its typed AgentKVError, from the store; a
        call on the closed client, or one in flight that closing it ended, as Unavailable."""
        try:
            with typed_errors(peer="store"):
                yield
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!"
            if not self.closed:
                raise
            raise _closed() from None
        except AgentKVError as exc:  # gRPC's CANCELLED "Channel closed!", once closed
            if not self.closed or exc.code != grpc.StatusCode.CANCELLED:
                raise
            raise _closed() from None

    # payloads

    def put_blocks(
        self,
        namespace: str,
        fingerprint: str,
        blocks: Iterable[Block],
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
    ) -> pb.PutBlocksResponse:
        """Uploads blocks in one stream; a block's parent must be stored already or precede it."""
        messages = put_messages(namespace, fingerprint, blocks, check_chunk_bytes(chunk_bytes))
        with self._typed():
            return self._put(messages, timeout=self.timeout)

    def get_blocks(
        self, namespace: str, fingerprint: str, keys: Sequence[bytes], layers: Sequence[int] = ()
    ) -> Iterator[StoredBlock]:
        """Streams blocks back; each is yielded once all its bytes have arrived. A read of more
        keys than one request may name goes as several, one after another."""
        for start in range(0, max(len(keys), 1), wire.MAX_KEYS_PER_READ):
            request = pb.GetBlocksRequest(
                namespace=namespace,
                fingerprint=fingerprint,
                keys=keys[start : start + wire.MAX_KEYS_PER_READ],
                layers=layers,
            )
            with self._typed():
                yield from _assemble(self._get(request, timeout=self.timeout))

    def read_blocks_local(
        self,
        namespace: str,
        fingerprint: str,
        keys: Sequence[bytes],
        layers: Sequence[int] = (),
        buffer: memoryview | None = None,
    ) -> list[StoredBlock]:
        """Same-host restore: locate under a lease, read the files directly, release.

        All blocks land back to back in `buffer` (reuse one across restores to skip page
        faults) or in one fresh buffer. A checksum failure is reported to the store, which
        quarantines the file, and raised. Files this process cannot read raise
        FilesUnreadable (get_blocks streams them); one whose read is stuck past the timeout
        leaves its reader thread behind, and `buffer` is no longer the caller's to reuse.
        """
        leases: list[str] = []
        try:
            locations = self._locate(namespace, fingerprint, keys, layers, leases)
            total = sum(located_bytes(loc) for loc in locations)
            view = buffer if buffer is not None and len(buffer) >= total else alloc(total)
            return read_locations(locations, view, self._reader(), self.timeout)
        except CorruptFile as exc:
            self._report(namespace, exc)
            raise
        except FilesUnreadable as exc:
            if exc.stuck:  # its one thread is stuck in the read: later reads get another
                with self._lock:
                    pool, self._read_pool = self._read_pool, None
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            if exc.missing:  # the store checks its own file: lost there too, or not ours
                lost = CorruptFile(str(exc), exc.missing)
                if self._report(namespace, lost):
                    raise lost from None
            raise
        finally:
            # The bytes are read (or the read's own error is on its way): a lease the store
            # cannot take back now expires by itself.
            for lease_id in leases:
                with contextlib.suppress(AgentKVError):
                    self.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    def _locate(
        self,
        namespace: str,
        fingerprint: str,
        keys: Sequence[bytes],
        layers: Sequence[int],
        leases: list[str],
    ) -> list[pb.BlockLocation]:
        """The blocks' locations, in as many LocateBlocks as their replies need, each lease
        added to `leases` as it is taken. A piece whose reply would pass a message limit (the
        store's, refused before it leases anything, or this channel's, whose lease then expires
        by itself) is asked for in halves.
        """
        locations: list[pb.BlockLocation] = []
        start, piece = 0, wire.MAX_KEYS_PER_READ
        while True:
            request = pb.LocateBlocksRequest(
                namespace=namespace,
                fingerprint=fingerprint,
                keys=keys[start : start + piece],
                layers=layers,
            )
            try:
                located = self.call("LocateBlocks", request)
            except ResourceExhausted as exc:
                too_large = isinstance(exc, ReplyTooLarge) or not exc.remote
                if not too_large or len(request.keys) <= 1:
                    raise
                piece = len(request.keys) // 2
                continue
            leases.append(located.lease_id)
            locations += located.blocks
            start += len(request.keys)
            if start >= len(keys):
                return locations

    def _reader(self) -> ThreadPoolExecutor:
        with self._lock:
            if self.closed:  # its pool is shut down
                raise _closed()
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(1, thread_name_prefix="agentkv-read")
            return self._read_pool

    def report_misfit(self, namespace: str, key: bytes, reason: str) -> bool:
        """Tells the store a block's tensors do not fit its model; it quarantines the block."""
        request = pb.ReportCorruptBlockRequest(
            namespace=namespace, key=key, reason=reason, does_not_fit=True
        )
        return self.call("ReportCorruptBlock", request).quarantined

    def _report(self, namespace: str, exc: CorruptFile) -> bool:
        """Whether the store, checking the block's file itself, confirmed the damage (and
        quarantined it)."""
        request = pb.ReportCorruptBlockRequest(namespace=namespace, key=exc.key, reason=exc.message)
        # The store may have quarantined it already; the read failed either way.
        with contextlib.suppress(AgentKVError):
            return self.call("ReportCorruptBlock", request).quarantined
        return False

    def save_agent(
        self,
        namespace: str,
        agent_id: str,
        fingerprint: str,
        token_ids: Sequence[int],
        blocks: Sequence[Block],
        expected_generation: int = 0,
        stored_keys: Sequence[bytes] = (),
        **fields: Any,
    ) -> tuple[pb.PutBlocksResponse, pb.AgentManifest]:
        """Uploads an agent's new blocks and commits its manifest over its whole chain.

        `stored_keys` are the chain's leading blocks the store already holds; `blocks` follow
        them. The new blocks stay leased from upload to commit. Raises GenerationConflict when
        another writer committed first; the uploaded blocks stay (deduplicated on a retry).
        """
        put = self.put_blocks(namespace, fingerprint, blocks)
        manifest = self.commit_agent(
            namespace=namespace,
            agent_id=agent_id,
            fingerprint=fingerprint,
            expected_generation=expected_generation,
            token_ids=token_ids,
            block_keys=[*stored_keys, *(r.key for r in put.blocks)],
            release_lease_id=put.lease_id,
            **fields,
        )
        return put, manifest

    # manifests

    def commit_agent(self, **fields: Any) -> pb.AgentManifest:
        return self.call("CommitAgent", pb.CommitAgentRequest(**fields)).agent

    def get_agent(
        self,
        namespace: str,
        agent_id: str,
        fingerprint: str = "",
        summary_only: bool = False,
        peek: bool = False,
    ) -> pb.AgentManifest:
        """The manifest; `peek`: an inspection, which the store does not count as a use."""
        request = pb.GetAgentRequest(
            namespace=namespace,
            agent_id=agent_id,
            fingerprint=fingerprint,
            summary_only=summary_only,
            peek=peek,
        )
        return self.call("GetAgent", request).agent

    def list_agents(self, namespace: str) -> Iterator[pb.AgentSummary]:
        return self._pages("ListAgents", pb.ListAgentsRequest(namespace=namespace), "agents")

    def _pages(self, method: str, request: Any, items: str) -> Iterator[Any]:
        """Every item of a paged listing, asking for the next page as the last is used up."""
        while True:
            page = self.call(method, request)
            yield from getattr(page, items)
            if not page.next_page_token:
                return
            request.page_token = page.next_page_token

    def delete_agent(self, namespace: str, agent_id: str, expected_generation: int = 0) -> int:
        request = pb.DeleteAgentRequest(
            namespace=namespace, agent_id=agent_id, expected_generation=expected_generation
        )
        return self.call("DeleteAgent", request).num_blocks_released

    def fork_agent(
        self, namespace: str, source: str, new: str, num_tokens: int = 0, phase: str = ""
    ) -> pb.AgentManifest:
        request = pb.ForkAgentRequest(
            namespace=namespace,
            source_agent_id=source,
            new_agent_id=new,
            num_tokens=num_tokens,
            phase=phase,
        )
        return self.call("ForkAgent", request).agent

    def longest_prefix(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> pb.FindLongestPrefixResponse:
        request = pb.FindLongestPrefixRequest(
            namespace=namespace, fingerprint=fingerprint, token_ids=token_ids
        )
        return self.call("FindLongestPrefix", request)

    def list_blocks(self, namespace: str) -> Iterator[pb.BlockSummary]:
        return self._pages("ListBlocks", pb.ListBlocksRequest(namespace=namespace), "blocks")

    def stats(self) -> pb.GetStatsResponse:
        return self.call("GetStats", pb.GetStatsRequest())


def put_messages(
    namespace: str, fingerprint: str, blocks: Iterable[Block], chunk_bytes: int
) -> Iterator[bytes]:
    """The serialized PutBlocks stream: per block, its header, then its bytes as chunks."""
    for block in blocks:
        header = pb.PutBlockHeader(
            namespace=namespace,
            fingerprint=fingerprint,
            parent_key=block.parent_key,
            token_ids=block.token_ids,
            tensors=[
                pb.TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape) for t in block.tensors
            ],
        )
        yield pb.PutBlocksRequest(header=header).SerializeToString()
        for pieces in chunk_payloads(block.tensors, chunk_bytes):
            size = sum(len(p) for p in pieces)
            yield b"".join([wire.chunk_prefix(size), *pieces])


def _assemble(stream: Iterable[bytes]) -> Iterator[StoredBlock]:
    header: pb.BlockHeader | None = None
    buffer = memoryview(b"")
    filled = 0
    for raw in stream:
        item = wire.decode(raw, pb.GetBlocksResponse)
        if isinstance(item, memoryview):
            if header is None or filled + len(item) > len(buffer):
                raise CorruptBlock("GetBlocks stream sent more bytes than its header declared")
            buffer[filled : filled + len(item)] = item
            filled += len(item)
        else:
            header = item.header
            buffer, filled = alloc(header.num_bytes), 0
        if header is not None and filled == len(buffer):
            yield block_from_header(header, buffer)
            header = None
    if header is not None:
        raise CorruptBlock(f"GetBlocks stream ended inside block {header.key.hex()}")


def _closed() -> Unavailable:
    """What a call on a closed client, or one closing it ended, raises."""
    error = Unavailable(CLOSED)
    error.peer = "store"
    return error
