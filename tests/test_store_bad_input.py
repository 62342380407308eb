"""Bad input gets the precise status and a message naming the bad value, and changes nothing.

Every test here runs against one seeded store process and compares a snapshot of everything it
holds (counters, manifests, block summaries, payload and temp files, bytes read back) before
and after the refused call.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest

from agentkv import wire
from agentkv.client.blocks import Block, Tensor, chunk_payloads
from agentkv.client.store import StoreClient
from agentkv.errors import (
    AgentExists,
    AgentKVError,
    AgentNotFound,
    BlockNotFound,
    FailedPrecondition,
    FingerprintMismatch,
    GenerationConflict,
    InvalidArgument,
    ResourceExhausted,
    from_rpc_error,
)
from agentkv.keys import block_key
from agentkv.v1 import store_pb2 as pb
from cache_store.reads import MAX_KEYS_PER_READ
from cache_store.validation import DTYPE_SIZES
from tests.helpers import FP, NS, StoreProcess, make_chain, same_bytes

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
AGENT = "alpha"
TOKENS = list(range(100))  # two blocks: 64 + 36 tokens
OTHER_FP = "other-model:q4g64:v2"
OTHER_NS = "other"
UNKNOWN_KEY = bytes(range(32))
NEW_KEY = block_key(FP, b"", [7])  # the key of the one-token block the raw puts below declare


@dataclass
class Seeded:
    """A store holding agent AGENT over a two-block chain, plus one block under OTHER_FP."""

    proc: StoreProcess
    client: StoreClient
    keys: list[bytes]
    other_key: bytes

    def snapshot(self) -> tuple:
        stats = self.client.stats()
        stats.ClearField("disk_free_bytes")
        namespaces = self.client.call("ListNamespaces", pb.ListNamespacesRequest())
        agents = [self.client.get_agent(NS, a.agent_id) for a in self.client.list_agents(NS)]
        blocks = [
            (b.key, b.parent_key, b.fingerprint, b.num_tokens, b.num_bytes, b.refcount)
            for b in self.client.list_blocks(NS)
        ]
        read_back = [
            (t.name, bytes(t.data))
            for b in self.client.get_blocks(NS, FP, self.keys)
            for t in b.tensors
        ]
        return stats, namespaces, agents, blocks, read_back, self.files()

    def files(self) -> dict[str, str]:
        """Every payload, temp and quarantined file with a hash of its bytes."""
        root = self.proc.data_dir
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in ("blocks", "tmp", "quarantine")
            for p in (root / d).rglob("*")
            if p.is_file()
        }


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> Iterator[Seeded]:
    root = tmp_path_factory.mktemp("bad-input")
    proc = StoreProcess(root / "data", root / "store.log").start()
    client = proc.client()
    blocks, keys = make_chain(TOKENS)
    client.save_agent(NS, AGENT, FP, TOKENS, blocks)
    other_blocks, (other_key,) = make_chain([1, 2, 3], fingerprint=OTHER_FP, num_layers=1)
    other = client.put_blocks(NS, OTHER_FP, other_blocks)
    client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=other.lease_id))
    assert all(map(same_bytes, blocks, client.get_blocks(NS, FP, keys)))
    yield Seeded(proc, client, keys, other_key)
    client.close()
    proc.stop()


def label(value: str) -> str:
    return repr(value) if len(value) <= 20 else f"{len(value)}-chars"


def shown(value: str) -> str:
    """A prefix of the repr the store quotes a value with (it cuts values after 80 chars)."""
    return repr(value)[:60]


@contextmanager
def refused(
    seeded: Seeded, cls: type[AgentKVError], code: grpc.StatusCode, *named: str
) -> Iterator[pytest.ExceptionInfo]:
    """Expects an error of exactly `cls` and `code` naming every value in `named`, and no change."""
    before = seeded.snapshot()
    with pytest.raises(cls) as info:
        yield info
    assert type(info.value) is cls
    assert info.value.code == code
    for value in named:
        assert value in info.value.message
    assert seeded.snapshot() == before


def put_raw(client: StoreClient, *messages: bytes) -> pb.PutBlocksResponse:
    try:
        return client._put(iter(messages), timeout=30)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def header(
    tensors: tuple = (("layers.0.keys", "U8", (4,)),),
    token_ids: tuple = (7,),
    parent_key: bytes = b"",
) -> bytes:
    spec = [pb.TensorSpec(name=n, dtype=d, shape=s) for n, d, s in tensors]
    h = pb.PutBlockHeader(
        namespace=NS, fingerprint=FP, parent_key=parent_key, token_ids=token_ids, tensors=spec
    )
    return pb.PutBlocksRequest(header=h).SerializeToString()


def chunk(num_bytes: int) -> bytes:
    return wire.encode_chunk(bytes(num_bytes))


# ids, namespaces, fingerprints and keys

BAD_IDS = ["", "a" * 129, "../etc", "a/b", ".hidden", "has space", "nul\x00byte", "agent-\u00e9"]
AGENT_ID_CALLS: dict[str, tuple[str, Callable[[StoreClient, str], object]]] = {
    "GetAgent": ("agent_id", lambda c, bad: c.get_agent(NS, bad)),
    "CommitAgent": (
        "agent_id",
        lambda c, bad: c.commit_agent(namespace=NS, agent_id=bad, fingerprint=FP, token_ids=[1]),
    ),
    "DeleteAgent": ("agent_id", lambda c, bad: c.delete_agent(NS, bad)),
    "ForkAgent.source": ("source_agent_id", lambda c, bad: c.fork_agent(NS, bad, "fresh")),
    "ForkAgent.new": ("new_agent_id", lambda c, bad: c.fork_agent(NS, AGENT, bad)),
}


@pytest.mark.parametrize("rpc", AGENT_ID_CALLS)
@pytest.mark.parametrize("bad", BAD_IDS, ids=label)
def test_invalid_agent_id(seeded, rpc, bad):
    field, call = AGENT_ID_CALLS[rpc]
    with refused(seeded, InvalidArgument, INVALID, f"invalid {field} {shown(bad)}"):
        call(seeded.client, bad)


BAD_NAMESPACES = ["UPPER", "a/b", "..", "n" * 64, "-dash", "sp ace"]
NAMESPACE_CALLS: dict[str, Callable[[Seeded, str], object]] = {
    "GetAgent": lambda s, ns: s.client.get_agent(ns, AGENT),
    "ListAgents": lambda s, ns: list(s.client.list_agents(ns)),
    "GetBlocks": lambda s, ns: list(s.client.get_blocks(ns, FP, s.keys)),
    "PutBlocks": lambda s, ns: s.client.put_blocks(ns, FP, make_chain([7])[0]),
    "CommitAgent": lambda s, ns: s.client.commit_agent(
        namespace=ns, agent_id=AGENT, fingerprint=FP, token_ids=[1]
    ),
}


@pytest.mark.parametrize("rpc", NAMESPACE_CALLS)
@pytest.mark.parametrize("bad", BAD_NAMESPACES, ids=label)
def test_invalid_namespace(seeded, rpc, bad):
    with refused(seeded, InvalidArgument, INVALID, f"invalid namespace {shown(bad)}"):
        NAMESPACE_CALLS[rpc](seeded, bad)


BAD_FINGERPRINTS = ["short", "has space!", "fp/with/slash", "x" * 129, "tiny-llama\u00e9:q4"]
FINGERPRINT_CALLS: dict[str, Callable[[Seeded, str], object]] = {
    "PutBlocks": lambda s, fp: s.client.put_blocks(NS, fp, make_chain([7])[0]),
    "GetBlocks": lambda s, fp: list(s.client.get_blocks(NS, fp, s.keys)),
    "LocateBlocks": lambda s, fp: s.client.read_blocks_local(NS, fp, s.keys),
    "CommitAgent": lambda s, fp: s.client.commit_agent(
        namespace=NS, agent_id="beta", fingerprint=fp, token_ids=[1]
    ),
    "FindLongestPrefix": lambda s, fp: s.client.longest_prefix(NS, fp, TOKENS),
    "GetAgent": lambda s, fp: s.client.get_agent(NS, AGENT, fingerprint=fp),
}


@pytest.mark.parametrize("rpc", list(FINGERPRINT_CALLS))
@pytest.mark.parametrize("bad", BAD_FINGERPRINTS, ids=label)
def test_invalid_fingerprint(seeded, rpc, bad):
    with refused(seeded, InvalidArgument, INVALID, f"invalid fingerprint {shown(bad)}"):
        FINGERPRINT_CALLS[rpc](seeded, bad)


SHORT_KEY, LONG_KEY = b"\x01" * 5, b"\x02" * 33
KEY_CALLS: dict[str, tuple[str, Callable[[Seeded, bytes], object]]] = {
    "GetBlocks": ("key", lambda s, k: list(s.client.get_blocks(NS, FP, [s.keys[0], k]))),
    "LocateBlocks": ("key", lambda s, k: s.client.read_blocks_local(NS, FP, [k])),
    "CommitAgent": (
        "block_keys[1]",
        lambda s, k: s.client.commit_agent(
            namespace=NS,
            agent_id="beta",
            fingerprint=FP,
            token_ids=TOKENS,
            block_keys=[s.keys[0], k],
        ),
    ),
    "PutBlocks.parent_key": ("parent_key", lambda s, k: put_raw(s.client, header(parent_key=k))),
    "ReportCorruptBlock": (
        "key",
        lambda s, k: s.client.call(
            "ReportCorruptBlock", pb.ReportCorruptBlockRequest(namespace=NS, key=k)
        ),
    ),
}


@pytest.mark.parametrize("rpc", KEY_CALLS)
@pytest.mark.parametrize(
    "bad", [SHORT_KEY, LONG_KEY, b"x" * 100_000], ids=["5-bytes", "33-bytes", "100-KB"]
)
def test_key_of_wrong_length(seeded, rpc, bad):
    """Even a huge key is INVALID_ARGUMENT: the message quotes only its start (the whole key
    in hex would pass gRPC's metadata limit and come back RESOURCE_EXHAUSTED)."""
    field, call = KEY_CALLS[rpc]
    with refused(seeded, InvalidArgument, INVALID, f"invalid {field} {shown(bad.hex())}") as info:
        call(seeded, bad)
    assert "32 bytes" in info.value.message and len(info.value.message) < 300


@pytest.mark.timeout(30)  # before the fix, 0 made empty chunks forever
@pytest.mark.parametrize("chunk_bytes", [0, -1, wire.MAX_CHUNK_BYTES + 1])
def test_a_chunk_size_out_of_range_is_refused_before_the_stream(seeded, chunk_bytes):
    blocks, _ = make_chain([5, 6, 7])
    message = f"chunk_bytes must be in 1..{wire.MAX_CHUNK_BYTES}, got {chunk_bytes}"
    with pytest.raises(ValueError, match=message):
        chunk_payloads(blocks[0].tensors, chunk_bytes)  # at the call, not at the first chunk
    before = seeded.snapshot()
    with pytest.raises(ValueError, match=message):
        seeded.client.put_blocks(NS, FP, blocks, chunk_bytes=chunk_bytes)
    assert seeded.snapshot() == before
    assert len(list(chunk_payloads(blocks[0].tensors, wire.MAX_CHUNK_BYTES))) == 1


# unknown agents and blocks

UNKNOWN_AGENT_CALLS: dict[str, Callable[[StoreClient], object]] = {
    "GetAgent": lambda c: c.get_agent(NS, "ghost"),
    "DeleteAgent": lambda c: c.delete_agent(NS, "ghost"),
    "ForkAgent": lambda c: c.fork_agent(NS, "ghost", "fresh"),
}


@pytest.mark.parametrize("rpc", UNKNOWN_AGENT_CALLS)
def test_unknown_agent_is_not_found(seeded, rpc):
    with refused(seeded, AgentNotFound, NOT_FOUND, "'ghost'", f"namespace {NS!r}"):
        UNKNOWN_AGENT_CALLS[rpc](seeded.client)


UNKNOWN_BLOCK_CALLS: dict[str, Callable[[Seeded], object]] = {
    "GetBlocks": lambda s: list(s.client.get_blocks(NS, FP, [s.keys[0], UNKNOWN_KEY])),
    "LocateBlocks": lambda s: s.client.read_blocks_local(NS, FP, [s.keys[0], UNKNOWN_KEY]),
    "ReportCorruptBlock": lambda s: s.client.call(
        "ReportCorruptBlock", pb.ReportCorruptBlockRequest(namespace=NS, key=UNKNOWN_KEY)
    ),
    "CommitAgent": lambda s: s.client.commit_agent(
        namespace=NS, agent_id="beta", fingerprint=FP, token_ids=[1], block_keys=[UNKNOWN_KEY]
    ),
}


@pytest.mark.parametrize("rpc", UNKNOWN_BLOCK_CALLS)
def test_unknown_block_is_not_found(seeded, rpc):
    with refused(seeded, BlockNotFound, NOT_FOUND, UNKNOWN_KEY.hex(), f"namespace {NS!r}"):
        UNKNOWN_BLOCK_CALLS[rpc](seeded)


# PutBlocks

LAYER0 = ("layers.0.keys", "U8", (4,))
BAD_PUTS: dict[str, tuple[list[bytes], type[AgentKVError], list[str]]] = {
    "too-few-bytes": (
        [header(), chunk(3)],
        InvalidArgument,
        [NEW_KEY.hex(), "received 3 bytes", "declare 4"],
    ),
    "too-many-bytes": (
        [header(), chunk(5)],
        InvalidArgument,
        [NEW_KEY.hex(), "sent 5+ bytes", "declare 4"],
    ),
    "too-many-bytes-over-two-chunks": (
        [header(), chunk(3), chunk(3)],
        InvalidArgument,
        [NEW_KEY.hex(), "sent 6+ bytes", "declare 4"],
    ),
    "too-few-bytes-then-next-block": (
        [header(), chunk(2), header(token_ids=(8,)), chunk(4)],
        InvalidArgument,
        [NEW_KEY.hex(), "received 2 bytes"],
    ),
    "unknown-dtype": (
        [header(tensors=(("layers.0.keys", "F8", (4,)),)), chunk(4)],
        InvalidArgument,
        ["'layers.0.keys'", "unknown dtype 'F8'"],
    ),
    "shape-larger-than-sent": (
        [header(tensors=(("layers.0.keys", "U32", (2, 3)),)), chunk(6)],
        InvalidArgument,
        [NEW_KEY.hex(), "received 6 bytes", "declare 24"],
    ),
    "bad-tensor-name": (
        [header(tensors=(("layer0.keys", "U8", (4,)),)), chunk(4)],
        InvalidArgument,
        ["invalid tensor name 'layer0.keys'"],
    ),
    "non-numeric-layer": (
        [header(tensors=(("layers.x.keys", "U8", (4,)),)), chunk(4)],
        InvalidArgument,
        ["invalid tensor name 'layers.x.keys'"],
    ),
    "non-ascii-layer": (  # Python's \d takes "٣" as 3, beside layers.3: not in any other language
        [header(tensors=(("layers.\u0663.keys", "U8", (4,)),)), chunk(4)],
        InvalidArgument,
        ["invalid tensor name 'layers.\u0663.keys'"],
    ),
    "layers-out-of-order": (
        [header(tensors=(("layers.1.keys", "U8", (4,)), LAYER0)), chunk(8)],
        InvalidArgument,
        ["'layers.0.keys'", "ascending order"],
    ),
    "duplicate-tensor": (
        [header(tensors=(LAYER0, LAYER0)), chunk(8)],
        InvalidArgument,
        ["'layers.0.keys' declared twice"],
    ),
    "no-tensors": ([header(tensors=())], InvalidArgument, ["at least one tensor"]),
    "block-too-big": (
        [header(tensors=(("layers.0.keys", "U8", (1 << 31,)),))],
        InvalidArgument,
        ["2147483648", "limit 1073741824"],
    ),
    "zero-tokens": ([header(token_ids=()), chunk(4)], InvalidArgument, ["at least one token"]),
    "too-many-tokens": (
        [header(token_ids=tuple(range(65537))), chunk(4)],
        InvalidArgument,
        ["65537 tokens", "limit 65536"],
    ),
    "chunk-before-header": ([chunk(4)], InvalidArgument, ["no block open: send a header first"]),
    "empty-message": (
        [header(), pb.PutBlocksRequest().SerializeToString()],
        InvalidArgument,
        ["neither a header nor a chunk"],
    ),
    "malformed-protobuf": ([b"\x0a\xff\xff"], InvalidArgument, ["malformed PutBlocksRequest"]),
    "malformed-after-header": (
        [header(), b"\x12\x05ab"],
        InvalidArgument,
        ["malformed PutBlocksRequest"],
    ),
    "oversized-chunk": (
        [header(), chunk(5 << 20)],
        InvalidArgument,
        ["chunk of 5242880 bytes", "limit 4194304"],
    ),
    "parent-not-stored": (
        [header(parent_key=UNKNOWN_KEY), chunk(4)],
        FailedPrecondition,  # store.proto: a missing parent is a precondition, not NOT_FOUND
        [f"parent_key {UNKNOWN_KEY.hex()} not found", "put the parent block first"],
    ),
}


@pytest.mark.parametrize("case", BAD_PUTS)
def test_bad_put_is_refused_and_leaves_nothing(seeded, case):
    messages, cls, named = BAD_PUTS[case]
    with refused(seeded, cls, cls.code, *named):
        put_raw(seeded.client, *messages)


def stored_specs() -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensor specs of the seeded chain's first block, as the store holds them."""
    blocks, _ = make_chain(TOKENS)
    return [(t.name, t.dtype, tuple(t.shape)) for t in blocks[0].tensors]


def test_bad_put_of_a_block_the_store_already_holds(seeded):
    dedup = header(tensors=tuple(stored_specs()), token_ids=tuple(TOKENS[:64]))
    with refused(seeded, InvalidArgument, INVALID, seeded.keys[0].hex(), "received 3 bytes"):
        put_raw(seeded.client, dedup, chunk(3))


@pytest.mark.parametrize("change", ["shape", "dtype", "name", "one-tensor-less"])
def test_a_dedup_hit_with_other_tensors_is_refused(seeded, change):
    """A put under a stored block's key must declare the stored tensors: first writer does
    not win by planting other shapes, and the stored block is untouched."""
    specs = stored_specs()
    name, dtype, shape = specs[1]
    specs[1] = {
        "shape": (name, dtype, (*shape[:-1], shape[-1] // 2)),
        "dtype": (name, "U8" if dtype != "U8" else "I8", shape),
        "name": (name + "x", dtype, shape),
        "one-tensor-less": None,
    }[change]
    specs = [t for t in specs if t is not None]
    size = sum(math.prod(sh) * DTYPE_SIZES[dt] for _, dt, sh in specs)
    named = [seeded.keys[0].hex(), "the same key must hold the same tensors"]
    with refused(seeded, FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, *named):
        put_raw(
            seeded.client,
            header(tensors=tuple(specs), token_ids=tuple(TOKENS[:64])),
            *[chunk(min(1 << 20, size - i)) for i in range(0, size, 1 << 20)],
        )


def test_message_above_the_transport_limit_is_resource_exhausted(seeded):
    before = seeded.snapshot()
    big = StoreClient(seeded.proc.address, max_message_bytes=64 << 20)
    with big, pytest.raises(AgentKVError) as info:
        put_raw(big, header(tensors=(("layers.0.keys", "U8", (20 << 20,)),)), chunk(20 << 20))
    assert type(info.value) is ResourceExhausted  # not a quota: gRPC's own size limit
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.message and "16777216" in info.value.message
    # grpc ends the call on the transport; the handler thread may clean up just after
    deadline = time.monotonic() + 60
    while seeded.snapshot() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seeded.snapshot() == before


# fingerprints

FOREIGN_CALLS: dict[str, Callable[[Seeded], object]] = {
    "GetBlocks": lambda s: list(s.client.get_blocks(NS, OTHER_FP, s.keys)),
    "LocateBlocks": lambda s: s.client.read_blocks_local(NS, OTHER_FP, s.keys),
}


@pytest.mark.parametrize("rpc", FOREIGN_CALLS)
def test_block_read_under_another_fingerprint(seeded, rpc):
    named = (seeded.keys[0].hex(), repr(FP), repr(OTHER_FP))
    with refused(seeded, FingerprintMismatch, PRECONDITION, *named):
        FOREIGN_CALLS[rpc](seeded)


def test_agent_read_under_another_fingerprint(seeded):
    with refused(seeded, FingerprintMismatch, PRECONDITION, repr(AGENT), repr(FP), repr(OTHER_FP)):
        seeded.client.get_agent(NS, AGENT, fingerprint=OTHER_FP)


def test_commit_naming_blocks_of_another_fingerprint(seeded):
    named = (f"block_keys[0] {seeded.other_key.hex()}", repr(OTHER_FP), repr(FP))
    with refused(seeded, FingerprintMismatch, PRECONDITION, *named):
        seeded.client.commit_agent(
            namespace=NS,
            agent_id="beta",
            fingerprint=FP,
            token_ids=[1, 2, 3],
            block_keys=[seeded.other_key],
        )


# CommitAgent


def commit_alpha(seeded: Seeded, **fields) -> pb.AgentManifest:
    defaults = dict(
        namespace=NS,
        agent_id=AGENT,
        fingerprint=FP,
        expected_generation=1,
        token_ids=TOKENS,
        block_keys=seeded.keys,
    )
    return seeded.client.commit_agent(**{**defaults, **fields})


def test_commit_of_blocks_not_chained(seeded):
    k0 = seeded.keys[0]
    with refused(
        seeded, InvalidArgument, INVALID, f"block_keys[1] {k0.hex()}", "should follow block_keys[0]"
    ):
        commit_alpha(seeded, token_ids=TOKENS[:64] * 2, block_keys=[k0, k0])


def test_commit_starting_mid_chain(seeded):
    k0, k1 = seeded.keys
    with refused(
        seeded, InvalidArgument, INVALID, f"block_keys[0] {k1.hex()}", "be a first block", k0.hex()
    ):
        commit_alpha(seeded, token_ids=TOKENS[64:], block_keys=[k1])


@pytest.mark.parametrize(
    "token_ids, named",
    [
        (list(range(1, 101)), "block_keys[0]"),
        (TOKENS[:64] + [0] * 36, "block_keys[1]"),
        (TOKENS[:80], "block_keys[1]"),
    ],
    ids=["first-block-differs", "second-block-differs", "too-few-tokens"],
)
def test_commit_with_tokens_not_matching_the_blocks(seeded, token_ids, named):
    with refused(seeded, InvalidArgument, INVALID, named, "differ from token_ids"):
        commit_alpha(seeded, token_ids=token_ids)


@pytest.mark.parametrize("expected", [0, 2, 99])
def test_commit_at_the_wrong_generation(seeded, expected):
    named = ("generation 1", f"expected generation {expected}")
    with refused(seeded, GenerationConflict, grpc.StatusCode.ABORTED, *named) as info:
        commit_alpha(seeded, expected_generation=expected)
    assert info.value.current_generation == 1


def test_delete_at_the_wrong_generation(seeded):
    with refused(seeded, GenerationConflict, grpc.StatusCode.ABORTED, "generation 1", "7"):
        seeded.client.delete_agent(NS, AGENT, expected_generation=7)


@pytest.mark.parametrize(
    "metadata, named",
    [
        ({f"k{i}": "v" for i in range(65)}, "65 entries"),
        ({"": "v"}, "metadata entry ''"),
        ({"k" * 65: "v"}, "k" * 60),
        ({"big": "v" * 4097}, "metadata entry 'big'"),
    ],
    ids=["65-entries", "empty-key", "long-key", "long-value"],
)
def test_commit_with_bad_metadata(seeded, metadata, named):
    with refused(seeded, InvalidArgument, INVALID, named):
        commit_alpha(seeded, metadata=metadata)


# ForkAgent and layers


def test_fork_to_an_existing_id(seeded):
    with refused(seeded, AgentExists, grpc.StatusCode.ALREADY_EXISTS, repr(AGENT), "exists"):
        seeded.client.fork_agent(NS, AGENT, AGENT)


def test_fork_of_more_tokens_than_the_source_has(seeded):
    with refused(seeded, InvalidArgument, INVALID, "101 tokens", repr(AGENT), "has 100"):
        seeded.client.fork_agent(NS, AGENT, "fresh", num_tokens=101)


LAYER_CALLS: dict[str, Callable[[Seeded, list[int]], object]] = {
    "GetBlocks": lambda s, layers: list(s.client.get_blocks(NS, FP, s.keys, layers)),
    "LocateBlocks": lambda s, layers: s.client.read_blocks_local(NS, FP, s.keys, layers),
}


@pytest.mark.parametrize("rpc", LAYER_CALLS)
def test_read_of_a_layer_the_block_lacks(seeded, rpc):
    with refused(seeded, InvalidArgument, INVALID, seeded.keys[0].hex(), "no layer [4, 9]"):
        LAYER_CALLS[rpc](seeded, [0, 4, 9])


HUGE = "z" * (3 << 20)
MISC_CALLS: dict[str, tuple[Callable[[StoreClient], object], list[str]]] = {
    "GetBlocks-no-keys": (lambda c: list(c.get_blocks(NS, FP, [])), ["no keys"]),
    "LocateBlocks-lease-too-long": (
        lambda c: c.call(
            "LocateBlocks",
            pb.LocateBlocksRequest(
                namespace=NS, fingerprint=FP, keys=[UNKNOWN_KEY], lease_seconds=601
            ),
        ),
        ["lease_seconds 601", "limit 600"],
    ),
    "ListBlocks-bad-page-token": (
        lambda c: c.call("ListBlocks", pb.ListBlocksRequest(namespace=NS, page_token="zz")),
        ["invalid page_token 'zz'"],
    ),
    "ListBlocks-huge-page-token": (  # the reviewer's: echoed whole, a 3 MB log line, and
        # RESOURCE_EXHAUSTED at the client (its metadata past gRPC's 16 KiB)
        lambda c: c.call("ListBlocks", pb.ListBlocksRequest(namespace=NS, page_token=HUGE)),
        ["invalid page_token 'zzzz", "zzz...'"],
    ),
    "ListAgents-bad-page-token": (  # the red team's: an empty page, as if the last
        lambda c: c.call("ListAgents", pb.ListAgentsRequest(namespace=NS, page_token="\xff x")),
        ["invalid page_token", "must match"],
    ),
}


@pytest.mark.parametrize("case", MISC_CALLS)
def test_other_malformed_requests(seeded, case):
    call, named = MISC_CALLS[case]
    with refused(seeded, InvalidArgument, INVALID, *named):
        call(seeded.client)


READ_CALLS: dict[str, Callable[[StoreClient, list[bytes]], object]] = {
    "GetBlocks": lambda c, keys: list(c.get_blocks(NS, FP, keys)),
    "LocateBlocks": lambda c, keys: c.read_blocks_local(NS, FP, keys),
}


@pytest.mark.parametrize("rpc", READ_CALLS)
def test_a_read_naming_a_key_twice(seeded, rpc):
    k0, k1 = seeded.keys
    named = (f"key {k0.hex()} requested twice", "keys[0] and keys[2]")
    with refused(seeded, InvalidArgument, INVALID, *named):
        READ_CALLS[rpc](seeded.client, [k0, k1, k0])


# The store's own limits, asked of it in one request each (the SDK splits longer reads).
RAW_READS: dict[str, Callable[[StoreClient, list[bytes]], object]] = {
    "GetBlocks": lambda c, keys: list(
        c._get(pb.GetBlocksRequest(namespace=NS, fingerprint=FP, keys=keys))
    ),
    "LocateBlocks": lambda c, keys: c.call(
        "LocateBlocks", pb.LocateBlocksRequest(namespace=NS, fingerprint=FP, keys=keys)
    ),
}


@pytest.mark.parametrize("rpc", RAW_READS)
def test_a_read_of_more_keys_than_its_limit(seeded, rpc):
    """200,000 copies of one key made the store build a 2.3 GB reply; now a read names at
    most MAX_KEYS_PER_READ keys (all distinct here, none stored)."""
    keys = [i.to_bytes(32, "big") for i in range(MAX_KEYS_PER_READ + 1)]
    named = (f"{MAX_KEYS_PER_READ + 1} keys requested", f"limit {MAX_KEYS_PER_READ}")
    with refused(seeded, InvalidArgument, INVALID, *named):
        try:
            RAW_READS[rpc](seeded.client, keys)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None


@pytest.mark.parametrize("rpc", READ_CALLS)
def test_the_sdk_reads_more_keys_than_one_request_may_name(seeded, rpc, monkeypatch):
    """The SDK splits a read past MAX_KEYS_PER_READ into requests the store takes (the limit
    made 2 here): all five blocks of the chain come back, in order, and no lease is left."""
    tokens = list(range(7000, 7000 + 5 * 64))  # no block of the seeded chain
    blocks, keys = make_chain(tokens, seed=5)
    seeded.client.save_agent(NS, f"long-chain-{rpc.lower()}", FP, tokens, blocks)
    monkeypatch.setattr(wire, "MAX_KEYS_PER_READ", 2)
    asked: list[int] = []  # the keys each request named
    client = seeded.client
    for name in ("call", "_get"):
        sent = getattr(client, name)

        def spy(*args, sent=sent, **kwargs):
            asked.extend(len(a.keys) for a in args if hasattr(a, "keys"))
            return sent(*args, **kwargs)

        monkeypatch.setattr(client, name, spy)
    read = READ_CALLS[rpc](client, keys)
    assert asked == [2, 2, 1]
    assert [b.key for b in read] == keys
    assert all(same_bytes(a, b) for a, b in zip(blocks, read, strict=True))
    assert seeded.client.stats().num_leases == 0


def huge_locations(store: StoreClient, n: int) -> list[bytes]:
    """Blocks of 65,536 large token ids, whose locations are ~330 KB each: 56 of them pass
    the 16 MiB reply limit."""
    blocks = [
        Block(b"", [(1 << 31) + i] * 65536, [Tensor("layers.0.keys", "U8", (4,), bytes([i]) * 4)])
        for i in range(n)
    ]
    put = store.put_blocks(NS, FP, blocks)
    store.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
    return [b.key for b in put.blocks]


def test_a_locate_whose_reply_would_pass_the_message_limit(store):
    """56 such locations are refused before any lease; 40 are answered."""
    keys = huge_locations(store, 56)
    with pytest.raises(ResourceExhausted) as err:
        RAW_READS["LocateBlocks"](store, keys)
    assert "exceed the reply limit of 16777216 bytes" in err.value.message
    assert store.stats().num_leases == 0
    assert len(store.read_blocks_local(NS, FP, keys[:40])) == 40


def test_the_sdk_locates_in_pieces_whose_replies_fit(store):
    """A same-host read of 56 such blocks, past the reply limit, used to fail; the SDK now
    asks for it in pieces: every block, in order, each the bytes the stream gives, and no lease
    is left."""
    keys = huge_locations(store, 56)
    located = store.read_blocks_local(NS, FP, keys)
    assert [b.key for b in located] == keys
    streamed = list(store.get_blocks(NS, FP, keys))
    assert all(same_bytes(a, b) for a, b in zip(streamed, located, strict=True))
    assert [bytes(b.tensors[0].data) for b in located] == [bytes([i]) * 4 for i in range(56)]
    assert store.stats().num_leases == 0


# namespaces are tenants

FOREIGN_NS_CALLS: dict[str, tuple[type[AgentKVError], Callable[[Seeded], object]]] = {
    "GetAgent": (AgentNotFound, lambda s: s.client.get_agent(OTHER_NS, AGENT)),
    "ForkAgent": (AgentNotFound, lambda s: s.client.fork_agent(OTHER_NS, AGENT, "fresh")),
    "DeleteAgent": (AgentNotFound, lambda s: s.client.delete_agent(OTHER_NS, AGENT)),
    "GetBlocks": (BlockNotFound, lambda s: list(s.client.get_blocks(OTHER_NS, FP, s.keys))),
    "LocateBlocks": (BlockNotFound, lambda s: s.client.read_blocks_local(OTHER_NS, FP, s.keys)),
    "CommitAgent": (
        BlockNotFound,
        lambda s: s.client.commit_agent(
            namespace=OTHER_NS, agent_id=AGENT, fingerprint=FP, token_ids=TOKENS, block_keys=s.keys
        ),
    ),
}


@pytest.mark.parametrize("rpc", FOREIGN_NS_CALLS)
def test_another_namespace_sees_nothing(seeded, rpc):
    cls, call = FOREIGN_NS_CALLS[rpc]
    with refused(seeded, cls, NOT_FOUND, f"namespace {OTHER_NS!r}"):
        call(seeded)


def test_another_namespace_finds_no_prefix(seeded):
    before = seeded.snapshot()
    assert seeded.client.longest_prefix(NS, FP, TOKENS).num_tokens == 100
    assert seeded.client.longest_prefix(OTHER_NS, FP, TOKENS).num_tokens == 0
    assert list(seeded.client.list_blocks(OTHER_NS)) == []
    assert seeded.snapshot() == before


def test_dedup_never_crosses_namespaces(store, store_process):
    blocks, keys = make_chain(TOKENS)
    put_a = store.put_blocks("a", FP, blocks)
    put_b = store.put_blocks("b", FP, blocks)
    assert [r.deduplicated for r in [*put_a.blocks, *put_b.blocks]] == [False] * 4
    assert store.stats().num_blocks == 4
    assert [r.deduplicated for r in store.put_blocks("a", FP, blocks).blocks] == [True, True]
    files = sorted(
        p.relative_to(store_process.data_dir) for p in store_process.data_dir.glob("blocks/*/*/*")
    )
    assert [p.parts[1] for p in files] == ["a", "a", "b", "b"]
    assert [b.key for b in store.list_blocks("b")] == sorted(keys)


def test_every_store_call_says_its_error_came_from_the_store_and_a_closed_client_is_unavailable(
    store,
):
    """Unary calls, PutBlocks and the GetBlocks stream alike: the CLI names the store in the
    error it prints from `peer`."""
    from agentkv.errors import AgentKVError, Unavailable

    missing = [block_key(FP, b"", [1, 2])]
    calls = {
        "GetAgent": lambda c: c.get_agent(NS, "nobody", fingerprint=FP),
        "GetBlocks": lambda c: list(c.get_blocks(NS, FP, missing)),
    }
    for name, call in calls.items():
        with pytest.raises(AgentKVError) as caught:
            call(store)
        assert caught.value.peer == "store", name
    store.close()
    for call in calls.values():
        with pytest.raises(Unavailable, match="store client was closed"):
            call(store)


def test_a_status_message_is_cut_to_what_grpc_metadata_carries():
    """Whatever an error's message echoes, its status details stay within gRPC's 16 KiB of
    metadata once percent-encoded (3 bytes a byte at most): cut at a character's edge."""
    from agentkv.rpc import MAX_DETAILS_BYTES, _bounded

    assert _bounded("short") == "short"
    cut = _bounded("invalid: " + "é" * 100_000)
    assert len(cut.encode()) <= MAX_DETAILS_BYTES and 3 * MAX_DETAILS_BYTES < 16 << 10
    assert cut.startswith("invalid: éé") and cut.endswith("bytes more, cut)")
