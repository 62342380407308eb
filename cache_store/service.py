"""The CacheStore gRPC servicer: parse, call the domain, build the reply.

PutBlocks and GetBlocks carry payload chunks through the raw fast path in agentkv.wire; every
other method uses the generated message classes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from agentkv import auth, ids, wire
from agentkv.errors import InvalidArgument, ReplyTooLarge
from agentkv.rpc import service_handlers
from agentkv.v1 import store_pb2 as pb
from cache_store import manifests, replies
from cache_store.reads import Selection
from cache_store.store import CacheStore
from cache_store.streams import Beat, StreamGuard
from cache_store.uploads import PutHeader

SERVICE_NAME = "agentkv.v1.CacheStore"
REPLY_ROOM = 256  # a LocateBlocksResponse's fields but its locations, with room to spare
LOCATION_FRAMING = 6  # each location's field tag and length


class CacheStoreServicer:
    def __init__(self, store: CacheStore) -> None:
        self.store = store
        config = store.config
        self._messages = replies.MessageCache(config.max_header_cache_bytes)
        self.streams = StreamGuard(
            config.max_streams,
            config.stream_idle_seconds,
            lambda method: store.metrics.idle_streams.labels(method).inc(),
        )

    def _location(self, selection: Selection) -> pb.BlockLocation:
        return replies.location(selection, self.store.path_of(selection.record))

    def _located(self, selection: Selection) -> pb.BlockLocation:
        return self._messages.get(("location", *selection.identity), self._location, selection)

    def _check_reply_size(self, selections: list[Selection]) -> None:
        """Refuses a LocateBlocks whose reply would pass the message limit before anything is
        leased or fetched (gRPC would refuse it only once built, the lease left behind)."""
        limit = self.store.config.max_message_bytes
        size = REPLY_ROOM
        for s in selections:
            size += self._located(s).ByteSize() + LOCATION_FRAMING
            if size > limit:
                raise ReplyTooLarge(
                    f"the locations of {len(selections)} blocks exceed the reply limit of "
                    f"{limit} bytes: locate fewer blocks or layers per request"
                )

    def PutBlocks(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.PutBlocksResponse:
        start = time.perf_counter()
        with self.streams.open("PutBlocks", context, **_put_share()) as beat:
            results, lease_id, expires = self.store.put_stream(_put_items(request_iterator, beat))
        self.store.metrics.put_seconds.observe(time.perf_counter() - start)
        return pb.PutBlocksResponse(
            blocks=[
                pb.PutBlockResult(
                    key=r.key,
                    num_tokens=r.num_tokens,
                    num_bytes=r.num_bytes,
                    deduplicated=r.deduplicated,
                )
                for r in results
            ],
            lease_id=lease_id,
            lease_expires_unix_ms=expires,
        )

    def GetBlocks(
        self, request: pb.GetBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        auth.check_namespace(request.namespace)
        start = time.perf_counter()
        selections = self.store.select(
            request.namespace, request.fingerprint, request.keys, request.layers
        )
        last = None
        with self.streams.open("GetBlocks", context, selections[0].record.namespace) as beat:
            with self.store.reading(selections) as moved:
                for message in self._stream(selections):
                    if last is not None:
                        yield last
                        beat()  # the peer took it
                        moved()
                    last = message
            # The lease ends before the last message goes out (its bytes are already copied),
            # so a client that has everything never sees the read's lease still held; the
            # stream's slot and idle watch last until the peer takes it.
            if last is not None:
                yield last
        self.store.metrics.get_seconds.observe(time.perf_counter() - start)

    def _stream(self, selections: list[Selection]) -> Iterator[bytes]:
        chunk = wire.DEFAULT_CHUNK_BYTES
        for selection in selections:
            header = self._messages.get(
                ("header", *selection.identity), replies.block_header, selection
            )
            yield pb.GetBlocksResponse(header=header).SerializeToString()
            for run in self.store.read(selection, max_run=4 * chunk):
                for offset in range(0, len(run), chunk):
                    yield wire.encode_chunk(run[offset : offset + chunk])

    def LocateBlocks(
        self, request: pb.LocateBlocksRequest, context: grpc.ServicerContext
    ) -> pb.LocateBlocksResponse:
        auth.check_namespace(request.namespace)
        lease_id, expires, selections = self.store.locate(
            request.namespace,
            request.fingerprint,
            request.keys,
            request.layers,
            request.lease_seconds,
            self._check_reply_size,
        )
        return pb.LocateBlocksResponse(
            lease_id=lease_id,
            lease_expires_unix_ms=expires,
            checksum_algorithm="xxh3_64",
            blocks=[self._located(s) for s in selections],
        )

    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        self._check_lease(request.lease_id)
        return pb.ReleaseLeaseResponse(released=self.store.leases.release(request.lease_id))

    def _check_lease(self, lease_id: str) -> None:
        """Another tenant's lease is not the caller's to end, by ReleaseLease or a commit."""
        for namespace in self.store.leases.namespaces(lease_id):
            auth.check_namespace(namespace)

    def ReportCorruptBlock(
        self, request: pb.ReportCorruptBlockRequest, context: grpc.ServicerContext
    ) -> pb.ReportCorruptBlockResponse:
        auth.check_namespace(request.namespace)
        done = self.store.report_corrupt(
            request.namespace, request.key, request.reason, request.does_not_fit
        )
        return pb.ReportCorruptBlockResponse(quarantined=done)

    def FindLongestPrefix(
        self, request: pb.FindLongestPrefixRequest, context: grpc.ServicerContext
    ) -> pb.FindLongestPrefixResponse:
        auth.check_namespace(request.namespace)
        chain = self.store.longest_prefix(request.namespace, request.fingerprint, request.token_ids)
        counts = [len(b.token_ids) for b in chain]
        return pb.FindLongestPrefixResponse(
            num_tokens=sum(counts), keys=[b.key for b in chain], block_num_tokens=counts
        )

    def CommitAgent(
        self, request: pb.CommitAgentRequest, context: grpc.ServicerContext
    ) -> pb.CommitAgentResponse:
        auth.check_namespace(request.namespace)
        commit = manifests.Commit(
            namespace=request.namespace,
            agent_id=request.agent_id,
            fingerprint=request.fingerprint,
            expected_generation=request.expected_generation,
            token_ids=list(request.token_ids),
            block_keys=list(request.block_keys),
            metadata=dict(request.metadata),
            phase=request.phase,
        )
        self._check_lease(request.release_lease_id)
        view = self.store.commit_agent(commit, request.release_lease_id)
        return pb.CommitAgentResponse(agent=replies.manifest(view))

    def GetAgent(
        self, request: pb.GetAgentRequest, context: grpc.ServicerContext
    ) -> pb.GetAgentResponse:
        auth.check_namespace(request.namespace)
        view = self.store.get_agent(
            request.namespace, request.agent_id, request.fingerprint, request.peek
        )
        return pb.GetAgentResponse(agent=replies.manifest(view, request.summary_only))

    def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.ServicerContext
    ) -> pb.ListAgentsResponse:
        auth.check_namespace(request.namespace)
        views, after = self.store.list_agents(
            request.namespace, request.page_token, request.page_size
        )
        return pb.ListAgentsResponse(
            agents=[replies.agent_summary(v) for v in views], next_page_token=after
        )

    def DeleteAgent(
        self, request: pb.DeleteAgentRequest, context: grpc.ServicerContext
    ) -> pb.DeleteAgentResponse:
        auth.check_namespace(request.namespace)
        released = self.store.delete_agent(
            request.namespace, request.agent_id, request.expected_generation
        )
        return pb.DeleteAgentResponse(num_blocks_released=released)

    def ForkAgent(
        self, request: pb.ForkAgentRequest, context: grpc.ServicerContext
    ) -> pb.ForkAgentResponse:
        auth.check_namespace(request.namespace)
        view = self.store.fork_agent(
            request.namespace,
            request.source_agent_id,
            request.new_agent_id,
            request.num_tokens,
            request.phase,
            dict(request.metadata),
        )
        return pb.ForkAgentResponse(agent=replies.manifest(view))

    def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.ServicerContext
    ) -> pb.ListNamespacesResponse:
        return pb.ListNamespacesResponse(
            namespaces=[
                pb.NamespaceInfo(
                    name=name,
                    num_agents=u["agents"],
                    num_blocks=u["blocks"],
                    num_bytes=u["bytes"],
                    num_record_bytes=u["records"],
                    quota_bytes=u["quota"],
                    agent_idle_seconds=u["agent_idle"],
                )
                for name, u in sorted(auth.visible(self.store.list_namespaces()).items())
            ]
        )

    def ListBlocks(
        self, request: pb.ListBlocksRequest, context: grpc.ServicerContext
    ) -> pb.ListBlocksResponse:
        auth.check_namespace(request.namespace)
        try:
            after = bytes.fromhex(request.page_token)
        except ValueError as exc:
            raise InvalidArgument(f"invalid page_token {ids.show(request.page_token)}") from exc
        records, after = self.store.list_blocks(request.namespace, after, request.page_size)
        return pb.ListBlocksResponse(
            blocks=[replies.block_summary(r, self.store.last_access_ms(r)) for r in records],
            next_page_token=after.hex(),
        )

    def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.ServicerContext
    ) -> pb.GetStatsResponse:
        auth.check_all_namespaces("read the whole store's stats")
        return pb.GetStatsResponse(**self.store.stats())

    def VerifyBlocks(
        self, request: pb.VerifyBlocksRequest, context: grpc.ServicerContext
    ) -> pb.VerifyBlocksResponse:
        _allowed_or_all(request.namespace, "verify every namespace")
        checked, num_bytes, corrupt, remote = self.store.verify(request.namespace)
        return pb.VerifyBlocksResponse(
            num_checked=checked,
            num_bytes=num_bytes,
            num_remote=remote,
            corrupt=[
                pb.CorruptBlockInfo(namespace=r.namespace, key=r.key, reason=reason)
                for r, reason in corrupt
            ],
            corrupt_records=[
                pb.CorruptRecordInfo(
                    table=b.table, namespace=b.namespace, id=b.ident, reason=b.reason
                )
                for b in self.store.bad_records(request.namespace)
            ],
        )

    def CollectGarbage(
        self, request: pb.CollectGarbageRequest, context: grpc.ServicerContext
    ) -> pb.CollectGarbageResponse:
        _allowed_or_all(request.namespace, "collect garbage in every namespace")
        deleted, freed, orphans = self.store.collect_garbage(request.namespace)
        return pb.CollectGarbageResponse(
            num_blocks_deleted=deleted, num_bytes_freed=freed, num_orphans_removed=orphans
        )


def _allowed_or_all(namespace: str, what: str) -> None:
    if namespace:
        auth.check_namespace(namespace)
    else:
        auth.check_all_namespaces(what)


def _put_items(raw_messages: Iterator[bytes], beat: Beat) -> Iterator[PutHeader | memoryview]:
    for raw in raw_messages:
        beat()
        try:
            item = wire.decode(raw, pb.PutBlocksRequest)
        except wire.DecodeError as exc:
            raise InvalidArgument(f"malformed PutBlocksRequest: {exc}") from exc
        if isinstance(item, memoryview):
            yield item
        elif item.WhichOneof("item") == "header":
            h = item.header
            auth.check_namespace(h.namespace)
            beat.tenant(ids.namespace(h.namespace))  # its share of streams: its first block's
            yield PutHeader(
                h.namespace,
                h.fingerprint,
                h.parent_key,
                list(h.token_ids),
                [(t.name, t.dtype, list(t.shape)) for t in h.tensors],
            )
        else:
            raise InvalidArgument("PutBlocksRequest holds neither a header nor a chunk")


def rpc_handlers(servicer: CacheStoreServicer) -> grpc.GenericRpcHandler:
    """Method handlers for every RPC in the proto; the two payload streams skip protobuf."""
    return service_handlers(
        pb.DESCRIPTOR.services_by_name["CacheStore"],
        pb,
        servicer,
        raw_requests=frozenset({"PutBlocks"}),
        raw_responses=frozenset({"GetBlocks"}),
    )


def _put_share() -> dict[str, str]:
    """Where a PutBlocks counts before its first header names its namespace: in the one its
    token allows, or among the token's streams; nowhere, where tokens are not checked (any
    caller may name any namespace there) or its token allows every namespace (the workers')."""
    caller = auth.current()
    if caller is None or caller.namespaces is None:
        return {}
    if len(caller.namespaces) == 1:
        (namespace,) = caller.namespaces
        return {"namespace": namespace}
    return {"token": caller.name}
