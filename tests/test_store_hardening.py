"""What the red team broke in the store, replayed against real store processes.

One store per data directory; disk space is reserved as bytes arrive, never for what a header
declares; a full disk collects unreferenced blocks by itself; idle and stalled payload streams
can neither take every RPC thread nor hold big buffers; leases, phases and metadata are
bounded per namespace; a lease is released only by a token of its namespace; risky security
settings are refused or shouted about; the data directory is private by default.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentkv import wire
from agentkv.channels import ClientSecurity
from agentkv.client.blocks import Block, Tensor
from agentkv.client.store import StoreClient, put_messages
from agentkv.errors import (
    AgentNotFound,
    DiskFull,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServerBusy,
    Unavailable,
)
from agentkv.v1 import store_pb2 as pb
from cache_store import leases
from cache_store.service import CacheStoreServicer
from cache_store.store import CacheStore
from cache_store.streams import StreamGuard
from cache_store.uploads import PutHeader
from tests.helpers import (
    FP,
    NS,
    StoreProcess,
    local_store,
    make_chain,
    put_items,
    same_bytes,
    until,
)

MiB = 1 << 20


def one_layer_block(num_bytes: int, token: int, fill: int = 1) -> Block:
    data = bytes([fill]) * num_bytes
    return Block(b"", [token], [Tensor("layers.0.keys", "U8", (num_bytes,), data)])


def header_declaring(ns: str, num_bytes: int, token: int) -> bytes:
    spec = pb.TensorSpec(name="layers.0.keys", dtype="U8", shape=[num_bytes])
    header = pb.PutBlockHeader(namespace=ns, fingerprint=FP, token_ids=[token], tensors=[spec])
    return pb.PutBlocksRequest(header=header).SerializeToString()


class HeldStream:
    """A PutBlocks stream that sends `messages` and then stays open, sending nothing."""

    def __init__(self, client: StoreClient, messages: list[bytes], timeout: float = 300) -> None:
        self.sent = threading.Event()
        self.gate = threading.Event()
        self.future = client._put.future(self._requests(messages), timeout=timeout)

    def _requests(self, messages: list[bytes]) -> Iterator[bytes]:
        yield from messages
        self.sent.set()
        self.gate.wait()

    def close(self) -> None:
        self.gate.set()
        self.future.cancel()


@pytest.fixture
def hold() -> Iterator[Callable[..., HeldStream]]:
    """Opens HeldStreams, and closes every one after the test, failed or not."""
    streams: list[HeldStream] = []

    def open_stream(client: StoreClient, messages: list[bytes]) -> HeldStream:
        streams.append(HeldStream(client, messages))
        return streams[-1]

    yield open_stream
    for stream in streams:
        stream.close()


def part_files(data_dir: Path) -> list[Path]:
    return list((data_dir / "tmp").glob("*.part"))


def agent_intact(client: StoreClient, ns: str, agent_id: str) -> bool:
    manifest = client.get_agent(ns, agent_id)
    return bool(manifest.block_keys) and not manifest.missing_block_keys


def save(client: StoreClient, ns: str, agent_id: str, blocks: list[Block], tokens: list[int]):
    client.save_agent(ns, agent_id, FP, tokens, blocks)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# 1. one store per data dir


def test_a_data_dir_that_is_a_file_is_one_line(tmp_path):
    """--data-dir naming a file (a typo for its folder) says so, not "[Errno 17] File
    exists", and leaves the file as it was."""
    path = tmp_path / "afile"
    path.write_text("mine")
    last = refused_at_start(path)
    assert last == f"agentkv-store: error: --data-dir {path} is a file, not a directory"
    assert path.read_text() == "mine"


def refused_at_start(data_dir: Path) -> str:
    """The last line of a store that refuses to start on `data_dir` (exit 2, no traceback)."""
    run = subprocess.run(
        [sys.executable, "-m", "cache_store", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    return run.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_data_dir_the_store_cannot_write_stops_it_at_start(tmp_path):
    """A data dir whose block folders cannot be written (another user's, read-only; here
    tmp/ is a place no process may create files in) stops the store at start, in one line.
    Before, it served, and every put crashed INTERNAL with a traceback, which workers
    retried every 2 s without end."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "tmp").symlink_to("/proc/self")
    last = refused_at_start(data)
    assert last.startswith("agentkv-store: error:") and ".probe" in last


def test_a_data_dir_deleted_under_a_running_store_fails_writes_unavailable(store_process):
    """A write after the data dir went (deleted behind the store's back) is UNAVAILABLE,
    saying so, with no traceback in the log (it was INTERNAL, logged as a crash); what the
    store holds in its index still reads."""
    with StoreClient(store_process.address) as c:
        blocks, keys = make_chain(list(range(1, 33)), 16, seed=1)
        save(c, NS, "before", blocks, list(range(1, 33)))
        shutil.rmtree(store_process.data_dir)
        again, _ = make_chain(list(range(100, 132)), 16, seed=2)
        with pytest.raises(Unavailable, match="cannot write its data directory while"):
            save(c, NS, "after", again, list(range(100, 132)))
        assert c.get_agent(NS, "before").block_keys == keys
    assert "rpc crashed" not in store_process.log_text()


def test_a_data_dir_moved_from_under_a_running_store_loses_no_block(store_process):
    """Moved away (a folder renamed, a volume unmounted), every block's file reads as missing:
    a read or a verify quarantined every block it met (gone for good, with no object store)
    and stats crashed INTERNAL. Now each is UNAVAILABLE naming the directory, nothing is
    quarantined, and once the directory is back every block reads as it was written. One
    put in its place (another volume mounted there) is not touched: gc deleted its files."""
    data = store_process.data_dir
    moved = data.with_name(f"{data.name}.moved")
    with StoreClient(store_process.address) as c:
        blocks, keys = make_chain(list(range(1, 33)), 16, seed=1)
        save(c, NS, "kept", blocks, list(range(1, 33)))
        data.rename(moved)
        other = data / "blocks" / NS / "ab" / f"{'ab' * 32}.safetensors"  # mounted over it
        other.parent.mkdir(parents=True)
        other.write_bytes(b"another store's block")
        try:
            for call in (
                lambda: list(c.get_blocks(NS, FP, keys)),
                lambda: c.read_blocks_local(NS, FP, keys),  # the same-host path
                lambda: c.call("VerifyBlocks", pb.VerifyBlocksRequest()),
                lambda: c.call("CollectGarbage", pb.CollectGarbageRequest()),  # deletes files
                c.stats,
            ):
                with pytest.raises(Unavailable, match=f"data directory {data} is not the one"):
                    call()
            assert other.read_bytes() == b"another store's block"  # gc deleted nothing there
        finally:
            shutil.rmtree(data, ignore_errors=True)
            moved.rename(data)
        for sent, back in zip(blocks, c.get_blocks(NS, FP, keys), strict=True):
            assert same_bytes(sent, back)
        verified = c.call("VerifyBlocks", pb.VerifyBlocksRequest())
        assert verified.num_checked == 2 and not verified.corrupt
    assert "rpc crashed" not in store_process.log_text()


def test_a_second_store_on_a_data_dir_in_use_refuses_to_start(store_process, hold):
    """Even after a 'stale lock' clean-up deletes LMDB's lock file, a second store on the same
    data dir exits at once with one line naming the holder's pid, and touches nothing: the
    first store's upload in flight completes."""
    data_dir = store_process.data_dir
    block = one_layer_block(3 * MiB, token=5)
    messages = list(put_messages(NS, FP, [block], MiB))
    with store_process.client() as client:
        held = hold(client, messages[:2])  # the header and the first MiB
        until(lambda: part_files(data_dir), "the upload's temporary file")
        (data_dir / "index" / "lock.mdb").unlink()
        second = subprocess.run(
            [sys.executable, "-m", "cache_store", "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0
        assert "Traceback" not in second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"agentkv-store: error: data dir {data_dir} is in use")
        assert f"pid {store_process.proc.pid}" in last
        assert part_files(data_dir)  # its start-up sweep never ran
        held.close()
        done = client.put_blocks(NS, FP, [block])
        (back,) = client.get_blocks(NS, FP, [done.blocks[0].key])
        assert same_bytes(block, back)


# 2. no phantom reservations


@pytest.mark.parametrize("evict_agents", [True, False], ids=["evict-agents", "no-eviction"])
def test_headers_alone_reserve_nothing_and_evict_no_one(tmp_path, evict_agents, launched, hold):
    """Tenant A opens uploads declaring more than the quota and sends no bytes: tenant B loses
    no agent and its 1 MiB put goes in. A's idle uploads are cancelled after the idle time and
    leave no temporary file."""
    flags = ["--quota", "24M", "--stream-idle-seconds", "4"]
    proc = launched(
        StoreProcess(
            tmp_path / "data",
            tmp_path / "store.log",
            flags + (["--evict-agents"] if evict_agents else []),
        )
    )
    with proc.client() as client:
        for i in range(8):
            blocks, _ = make_chain(list(range(i * 100, i * 100 + 64)), seed=i)
            save(client, "tenant-b", f"b{i}", blocks, list(range(i * 100, i * 100 + 64)))
        declared = [20 * MiB, 20 * MiB] if evict_agents else [int(15.5 * MiB)]
        held = [
            hold(client, [header_declaring("tenant-a", size, 900 + i)])
            for i, size in enumerate(declared)
        ]
        until(lambda: len(part_files(proc.data_dir)) == len(declared), "A's headers")
        big = one_layer_block(MiB, token=77)
        put = client.put_blocks("tenant-b", FP, [big])
        assert not put.blocks[0].deduplicated
        assert all(agent_intact(client, "tenant-b", f"b{i}") for i in range(8))
        assert client.stats().num_evicted_agents == 0
        for stream in held:  # cut off for idling, with nothing left behind
            assert stream.future.exception(timeout=120).code() == grpc.StatusCode.CANCELLED
        until(lambda: not part_files(proc.data_dir), "A's temporary files to go")


# 3. a full disk collects by itself


def test_deleting_agents_on_a_full_disk_frees_room_without_collect_garbage(
    small_disk, tmp_path, launched
):
    proc = launched(StoreProcess(small_disk("3m") / "data", tmp_path / "store.log"))
    with proc.client() as client:
        saved = []
        with pytest.raises(DiskFull):
            for i in range(200):
                tokens = list(range(1000 * i, 1000 * i + 64))
                blocks, _ = make_chain(tokens, seed=i)
                save(client, NS, f"agent{i}", blocks, tokens)
                saved.append((tokens, blocks))
        for i in range(0, len(saved), 2):
            client.delete_agent(NS, f"agent{i}")
        tokens = list(range(900_000, 900_064))
        blocks, keys = make_chain(tokens, seed=999)
        save(client, NS, "newcomer", blocks, tokens)  # no CollectGarbage in between
        (back,) = client.get_blocks(NS, FP, keys)
        assert same_bytes(blocks[0], back)
        assert not client.call("VerifyBlocks", pb.VerifyBlocksRequest()).corrupt
        for i in range(1, len(saved), 2):
            tokens, blocks = saved[i]
            assert agent_intact(client, NS, f"agent{i}")
            keys = list(client.get_agent(NS, f"agent{i}").block_keys)
            assert same_bytes(blocks[0], next(client.get_blocks(NS, FP, keys)))


def test_unreferenced_blocks_left_idle_are_collected_without_a_quota(tmp_path, launched):
    # a put's blocks are leased until its commit, which a busy machine may delay: a lease of
    # 5 s (the collector's idle time is at least twice a lease; 1 s and 2 s were tight)
    flags = ["--gc-idle-seconds", "10", "--lease-seconds", "5"]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        chains = {}
        for i, name in enumerate(("kept", "dropped")):
            tokens = list(range(1000 * i, 1000 * i + 64 * 3))
            chains[name] = (tokens, *make_chain(tokens, seed=i, block_tokens=64))
            save(client, NS, name, chains[name][1], tokens)
        assert client.stats().num_blocks == 6
        client.delete_agent(NS, "dropped")  # its 3 blocks are now unreferenced
        until(lambda: client.stats().num_blocks == 3, "the idle collector", timeout=120)
        tokens, blocks, keys = chains["kept"]
        assert agent_intact(client, NS, "kept")
        for sent, back in zip(blocks, client.get_blocks(NS, FP, keys), strict=True):
            assert same_bytes(sent, back)
        assert not client.call("VerifyBlocks", pb.VerifyBlocksRequest()).corrupt
        logged = '"event": "idle blocks collected"'  # after the blocks went
        until(lambda: logged in proc.log_text(), "the collector's log line", timeout=60)


# 8. idle streams take no thread from other calls


def test_idle_streams_cannot_starve_other_calls(tmp_path, launched, hold):
    """Sixteen idle PutBlocks streams on sixteen RPC threads (the red team's setup): six hold
    a slot (--max-streams), the rest are refused at once, and other calls and the health
    check answer meanwhile. The six are cancelled once idle; then uploads go in again."""
    # Idle for 10 s, so that the six are not cancelled before all sixteen are opened and the
    # ten refused, however busy the machine (4 s left it little room).
    flags = ["--workers", "16", "--max-streams", "6", "--stream-idle-seconds", "10"]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        tokens = list(range(64))
        blocks, _ = make_chain(tokens)
        save(client, NS, "busy-bee", blocks, tokens)
        held = [hold(client, []) for _ in range(16)]
        until(lambda: sum(s.future.done() for s in held) >= 10, "the refusals")
        refused = [s for s in held if s.future.done()]
        assert len(refused) == 10
        for stream in refused:
            error = stream.future.exception()
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "PutBlocks streams, its limit" in error.details()
        assert (
            client.call(
                "GetAgent", pb.GetAgentRequest(namespace=NS, agent_id="busy-bee"), timeout=20
            ).agent.generation
            == 1
        )
        health = health_pb2_grpc.HealthStub(client.channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for stream in held:
            if stream not in refused:
                assert stream.future.exception(timeout=120).code() == grpc.StatusCode.CANCELLED
        more, _ = make_chain(list(range(500, 564)), seed=5)
        assert client.put_blocks(NS, FP, more).blocks


def test_one_namespace_never_takes_the_last_stream_slots(tmp_path, launched, hold):
    """The slots were the store's, first come first served: one tenant's stalled uploads
    (or slow readers) took every one, and every other tenant's puts were refused. A
    namespace never takes the last quarter of them (of each kind) now; others put
    meanwhile."""
    flags = ["--workers", "8", "--max-streams", "4", "--stream-idle-seconds", "60"]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        blocks, _ = make_chain(list(range(64)))
        header = next(put_messages("greedy", FP, blocks, wire.DEFAULT_CHUNK_BYTES))
        held = [hold(client, [header]) for _ in range(4)]
        until(lambda: any(s.future.done() for s in held), "a refusal")
        (refused,) = [s for s in held if s.future.done()]
        error = refused.future.exception()
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "namespace 'greedy' holds 3 PutBlocks streams, its share of the store's 4" in (
            error.details()
        )
        assert client.put_blocks("other", FP, blocks).blocks  # another tenant's put goes in


@pytest.mark.parametrize("allows", [["a"], ["a", "b"]], ids=["one-namespace", "two"])
def test_a_token_s_streams_that_never_name_their_namespace_never_take_the_last_slots(
    tmp_path, launched, hold, allows
):
    """The reviewer's: a PutBlocks counted in a namespace's share only at its first header,
    so one tenant's streams that never sent one took every slot, and every other tenant's
    puts were refused. Where tokens are checked, they count from their start now."""
    team, other = "team-token-0123456789abcdef", "other-token-0123456789abcdef"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"name": "team", "token": team, "namespaces": allows},
                    {"name": "other", "token": other, "namespaces": ["other"]},
                ]
            }
        )
    )
    tokens.chmod(0o600)
    flags = ["--workers", "8", "--max-streams", "4", "--stream-idle-seconds", "60"]
    flags += ["--auth-tokens", str(tokens)]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client(security=ClientSecurity(token=team)) as client:
        held = [hold(client, []) for _ in range(4)]
        until(lambda: any(s.future.done() for s in held), "a refusal")
        (refused,) = [s for s in held if s.future.done()]
        error = refused.future.exception()
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        who = "namespace 'a'" if allows == ["a"] else "the token 'team'"
        assert f"{who} holds 3 PutBlocks streams, its share of the store's 4" in error.details()
        with proc.client(security=ClientSecurity(token=other)) as theirs:  # the three held
            blocks, _ = make_chain(list(range(64)))
            assert theirs.put_blocks("other", FP, blocks).blocks  # another tenant's goes in


class Context:
    """The part of a grpc.ServicerContext the stream guard uses."""

    def cancel(self) -> None:
        raise AssertionError("no stream here idles long enough to be cancelled")


def test_a_token_of_two_namespaces_never_takes_the_last_slots_across_them():
    """The diff review's: a token's streams left its share once their headers named a
    namespace, so a token of {a, b} held 6 in each, all 12. They stay in it."""
    guard = StreamGuard(limit=12, idle_seconds=60)
    try:
        with ExitStack() as held:
            for i in range(9):
                held.enter_context(guard.open("PutBlocks", Context(), token="t")).tenant(
                    "ab"[i % 2]
                )
            with pytest.raises(ServerBusy, match="the token 't' holds 9 PutBlocks streams"):
                held.enter_context(guard.open("PutBlocks", Context(), token="t"))
            held.enter_context(guard.open("PutBlocks", Context(), namespace="other"))  # room
    finally:
        guard.close()


def test_a_get_holds_its_stream_slot_until_its_last_message_is_taken(tmp_path):
    """A reader that stops before taking the last message still holds its GetBlocks slot and
    idle watch (the watch cancels it), so such readers cannot take RPC threads past
    --max-streams; its read lease is over already."""
    store = local_store(tmp_path / "data", max_streams=1)
    servicer = CacheStoreServicer(store)
    try:
        blocks, keys = make_chain(list(range(64)))
        _, lease_id, _ = store.put_stream(put_items(NS, FP, blocks))
        store.leases.release(lease_id)
        request = pb.GetBlocksRequest(namespace=NS, fingerprint=FP, keys=keys)
        stream = servicer.GetBlocks(request, Context())
        header = wire.decode(next(stream), pb.GetBlocksResponse).header
        received = 0
        while received < header.num_bytes:  # up to and including the last message
            received += len(wire.decode(next(stream), pb.GetBlocksResponse))
        assert len(store.leases) == 0
        with pytest.raises(ResourceExhausted) as err:
            next(servicer.GetBlocks(request, Context()))
        assert "GetBlocks streams, its limit" in err.value.message
        assert list(stream) == []  # the peer takes the last message: the slot is free
        assert next(servicer.GetBlocks(request, Context()))
    finally:
        servicer.streams.close()
        store.close()


# 9. memory and CPU bounded per tenant


def test_stalled_readers_of_a_huge_layer_hold_no_big_buffers(tmp_path, launched):
    """Three readers of one 128 MiB layer stop reading after their first chunk: the store
    holds a bounded read buffer each (not the layer), and cuts them off once idle."""
    flags = ["--stream-idle-seconds", "4"]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        block = one_layer_block(128 * MiB, token=3, fill=7)
        put = client.put_blocks(NS, FP, [block])
        client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
        before = rss_bytes(proc.proc.pid)
        request = pb.GetBlocksRequest(namespace=NS, fingerprint=FP, keys=[put.blocks[0].key])
        readers = [client._get(request, timeout=300) for _ in range(3)]
        for reader in readers:
            next(reader)  # the block header
            chunk = wire.decode(next(reader), pb.GetBlocksResponse)
            assert bytes(chunk[:4]) == b"\x07" * 4
        grown = rss_bytes(proc.proc.pid) - before
        assert grown < 64 * MiB, f"store RSS grew {grown / MiB:.0f} MiB for 3 stalled readers"
        until(lambda: client.stats().num_leases == 0, "the stalled reads to be cut off")
        for reader in readers:
            reader.cancel()


def test_leases_are_bounded_per_namespace(tmp_path, launched):
    flags = ["--max-leases-per-namespace", "20"]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        tokens = list(range(64))
        blocks, keys = make_chain(tokens)
        save(client, "greedy", "g", blocks, tokens)
        save(client, "modest", "m", blocks, tokens)

        def locate(ns: str) -> pb.LocateBlocksResponse:
            return client.call(
                "LocateBlocks",
                pb.LocateBlocksRequest(namespace=ns, fingerprint=FP, keys=keys),
            )

        leases = [locate("greedy").lease_id for _ in range(20)]
        with pytest.raises(ResourceExhausted) as err:
            locate("greedy")
        assert "namespace 'greedy' holds 20 leases, the limit" in err.value.message
        assert locate("modest").lease_id  # another tenant is not hurt
        client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=leases[0]))
        assert locate("greedy").lease_id


class Clock:
    """Stands in for the time module in cache_store.leases: time moves when a test moves it."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(leases, "time", clock)
    return clock


@pytest.fixture
def domain(tmp_path) -> Iterator[CacheStore]:
    """The store's domain in this process, its leases 10 s long."""
    store = local_store(tmp_path / "data", lease_seconds=10)
    yield store
    store.close()


def paced(items: Iterator, before_block: Callable[[int], None]) -> Iterator:
    """A PutBlocks stream's items, calling before_block(i) before block i's header."""
    block = 0
    for item in items:
        if isinstance(item, PutHeader):
            before_block(block)
            block += 1
        yield item


def two_roots() -> tuple[list[Block], list[bytes]]:
    (a,), (ka,) = make_chain(list(range(64)), seed=1)
    (b,), (kb,) = make_chain(list(range(100, 164)), seed=2)
    return [a, b], [ka, kb]


def test_an_upload_longer_than_its_lease_ends_with_a_live_lease(domain, clock):
    """Four blocks, 6 s apart, under 10 s leases: the reply's lease holds every block for
    10 s from the stream's end."""
    blocks, keys = make_chain(list(range(4 * 64)))
    items = paced(put_items(NS, FP, blocks), lambda i: setattr(clock, "now", clock.now + 6))
    _, lease_id, expires = domain.put_stream(items)
    assert expires == int((clock.now + 10) * 1000)
    assert all(domain.leases.is_held((NS, k)) for k in keys)
    assert domain.leases.namespaces(lease_id) == {NS}
    assert domain.collect_garbage(NS)[:2] == (0, 0)


@pytest.mark.parametrize("collected", [False, True], ids=["kept", "collected"])
def test_an_upload_paused_past_its_lease(domain, clock, collected):
    """The stream stops for 15 s between two blocks and its 10 s lease lapses (another call
    sweeps it). Nothing collected meanwhile: the lease is taken anew on both blocks. The first
    block collected meanwhile: the stream fails naming it, and holds nothing."""
    blocks, keys = two_roots()

    def pause(i: int) -> None:
        if i == 1:
            clock.now += 15
            if collected:
                assert domain.collect_garbage(NS)[0] == 1
            else:
                assert len(domain.leases) == 0  # lapsed, and swept

    if not collected:
        _, lease_id, expires = domain.put_stream(paced(put_items(NS, FP, blocks), pause))
        assert expires == int((clock.now + 10) * 1000)
        assert all(domain.leases.is_held((NS, k)) for k in keys)
        assert domain.leases.namespaces(lease_id) == {NS}
        return
    with pytest.raises(FailedPrecondition) as err:
        domain.put_stream(paced(put_items(NS, FP, blocks), pause))
    assert keys[0].hex() in err.value.message and "paused past its lease" in err.value.message
    assert len(domain.leases) == 0


def test_a_dedup_hit_is_leased_from_its_header(store_process):
    """A re-upload of a stored, unreferenced block is leased from its header on: a collection
    while its bytes arrive keeps the block, so 'deduplicated' holds and the commit naming
    the block finds it."""
    with store_process.client() as client:
        block = one_layer_block(MiB, token=9)
        first = client.put_blocks(NS, FP, [block])
        key = first.blocks[0].key
        client.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=first.lease_id))
        messages = list(put_messages(NS, FP, [block], 256 * 1024))
        gate = threading.Event()

        def requests() -> Iterator[bytes]:
            yield from messages[:2]  # the header and a first chunk
            gate.wait()
            yield from messages[2:]

        def last_access() -> int:
            return next(b.last_access_unix_ms for b in client.list_blocks(NS) if b.key == key)

        before = last_access()
        until(lambda: time.time() * 1000 > before + 1, "a later millisecond")
        put = client._put.future(requests(), timeout=120)
        try:
            until(lambda: last_access() > before, "the re-upload's header (it touches the block)")
            collected = client.call("CollectGarbage", pb.CollectGarbageRequest(namespace=NS))
        finally:
            gate.set()
        reply = put.result(timeout=120)
        assert collected.num_blocks_deleted == 0
        assert reply.blocks[0].deduplicated
        client.commit_agent(
            namespace=NS,
            agent_id="a",
            fingerprint=FP,
            token_ids=[9],
            block_keys=[key],
            release_lease_id=reply.lease_id,
        )
        (back,) = client.get_blocks(NS, FP, [key])
        assert same_bytes(block, back)


def test_phase_and_metadata_are_bounded(store):
    tokens = list(range(64))
    blocks, keys = make_chain(tokens)
    put = store.put_blocks(NS, FP, blocks)
    commit = dict(namespace=NS, agent_id="a", fingerprint=FP, token_ids=tokens, block_keys=keys)
    with pytest.raises(InvalidArgument) as err:
        store.commit_agent(**commit, phase="x" * (4 * MiB // 4))
    assert "phase 'xxx" in err.value.message and "limit 256" in err.value.message
    many = {f"k{i}": "v" * 4000 for i in range(30)}
    with pytest.raises(InvalidArgument) as err:
        store.commit_agent(**commit, metadata=many)
    assert "limit 98304" in err.value.message
    store.commit_agent(**commit, phase="p" * 256, release_lease_id=put.lease_id)
    assert [a.phase for a in store.list_agents(NS)] == ["p" * 256]


# 10. leases are namespaced


def test_a_lease_is_released_only_by_its_namespace(tmp_path, launched):
    a_token, b_token, ops = "tenant-a-token-0123456789", "tenant-b-token-0123456789", "o" * 24
    table = tmp_path / "tokens.json"
    table.write_text(
        json.dumps(
            {
                "tokens": [
                    {"name": "a", "token": a_token, "namespaces": ["a"]},
                    {"name": "b", "token": b_token, "namespaces": ["b"]},
                    {"name": "ops", "token": ops, "namespaces": ["*"]},
                ]
            }
        )
    )
    table.chmod(0o600)
    flags = ["--auth-tokens", str(table)]
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    a = StoreClient(proc.address, security=ClientSecurity(token=a_token))
    b = StoreClient(proc.address, security=ClientSecurity(token=b_token))
    admin = StoreClient(proc.address, security=ClientSecurity(token=ops))
    blocks, _ = make_chain(list(range(64)))
    put = a.put_blocks("a", FP, blocks)
    with pytest.raises(PermissionDenied) as err:
        b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id))
    assert "may not use namespace 'a'" in err.value.message
    with pytest.raises(PermissionDenied) as err:  # nor by a commit of another namespace
        b.commit_agent(
            namespace="b",
            agent_id="b1",
            fingerprint=FP,
            token_ids=[1],
            release_lease_id=put.lease_id,
        )
    assert "may not use namespace 'a'" in err.value.message
    with pytest.raises(AgentNotFound):
        b.get_agent("b", "b1")
    assert admin.stats().num_leases == 1
    collected = a.call("CollectGarbage", pb.CollectGarbageRequest(namespace="a"))
    assert collected.num_blocks_deleted == 0  # still leased, so still there
    assert a.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=put.lease_id)).released
    for c in (a, b, admin):
        c.close()


# 11. risky settings refused or shouted about


def start_output(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """Starts a store that is expected to refuse its flags; its output."""
    return subprocess.run(
        [sys.executable, "-m", "cache_store", "--data-dir", str(tmp_path / "d"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_tokens_beyond_loopback_need_tls_and_exposures_are_shouted(tmp_path, launched):
    table = tmp_path / "tokens.json"
    table.write_text(json.dumps({"tokens": [{"token": "t" * 20, "namespaces": ["*"]}]}))
    table.chmod(0o644)
    refused = start_output(tmp_path, "--listen", "0.0.0.0:0", "--auth-tokens", str(table))
    assert refused.returncode == 2
    assert "with bearer tokens needs TLS" in refused.stderr
    assert "--allow-plaintext-tokens" in refused.stderr
    proc = launched(
        StoreProcess(
            tmp_path / "data",
            tmp_path / "store.log",
            [
                "--auth-tokens",
                str(table),
                "--allow-plaintext-tokens",
                "--metrics-listen",
                "0.0.0.0:0",
            ],
            listen="0.0.0.0:0",
        )
    )
    log = proc.log_text()
    assert "BEARER TOKENS IN CLEAR TEXT" in log
    assert "METRICS BEYOND LOOPBACK" in log
    assert f"TOKEN FILE READABLE BY OTHERS: {table} has mode 644" in log


# 12. private by default


@pytest.mark.parametrize("umask", [None, "027"])
def test_the_data_dir_is_private_by_default(tmp_path, launched, umask):
    flags = ["--umask", umask] if umask else []
    proc = launched(StoreProcess(tmp_path / "data", tmp_path / "store.log", flags))
    with proc.client() as client:
        tokens = list(range(64))
        blocks, _ = make_chain(tokens)
        save(client, NS, "private", blocks, tokens)
    hidden = 0o077 if umask is None else 0o007
    paths = [proc.data_dir, proc.data_dir / "index" / "data.mdb"]
    paths += list((proc.data_dir / "blocks").rglob("*"))
    assert len(paths) > 4
    for path in paths:
        assert os.stat(path).st_mode & hidden == 0, f"{path} is {os.stat(path).st_mode:o}"
    if umask:
        payload = next((proc.data_dir / "blocks").rglob("*.safetensors"))
        assert os.stat(payload).st_mode & 0o040  # its group may read it in place


def test_the_reply_header_cache_is_bounded_by_bytes():
    """Headers of an 8192-layer block, one per layer subset: the cache keeps what fits its
    byte bound, however many distinct subsets are asked for."""
    from cache_store.replies import MessageCache

    def build(layers: int) -> pb.BlockHeader:
        infos = [
            pb.TensorInfo(name=f"layers.{i}.keys", dtype="U8", shape=[4]) for i in range(layers)
        ]
        return pb.BlockHeader(key=bytes(32), tensors=infos)

    cache = MessageCache(max_bytes=4 * MiB)
    for subset in range(400):
        message = cache.get(("header", subset), lambda n: build(n), 4000 + subset)
        assert len(message.tensors) == 4000 + subset
    assert 3 * MiB < cache.num_bytes <= 4 * MiB
    assert cache.get(("header", 399), lambda n: build(1), 0).tensors[-1].name == "layers.4398.keys"
