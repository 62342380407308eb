"""Blocks go in and come back bit for bit, over the stream and the same-host locate path."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from agentkv.keys import block_key
from agentkv.v1 import store_pb2 as pb
from tests.helpers import FP, NS, make_chain, same_bytes


@pytest.mark.parametrize("block_tokens", [16, 64, 256])
def test_stream_round_trip_is_bit_exact(store, block_tokens):
    blocks, keys = make_chain(list(range(300)), block_tokens=block_tokens)
    put = store.put_blocks(NS, FP, blocks)
    assert [r.key for r in put.blocks] == keys
    assert not any(r.deduplicated for r in put.blocks)
    got = list(store.get_blocks(NS, FP, keys))
    assert [g.key for g in got] == keys
    for block, back in zip(blocks, got, strict=True):
        assert back.token_ids == block.token_ids
        assert same_bytes(block, back)


def test_locate_read_is_bit_exact_and_files_are_safetensors(store):
    blocks, keys = make_chain(list(range(200)), block_tokens=128)
    store.put_blocks(NS, FP, blocks)
    got = store.read_blocks_local(NS, FP, keys)
    for block, back in zip(blocks, got, strict=True):
        assert same_bytes(block, back)
    loc = store.call(
        "LocateBlocks", pb.LocateBlocksRequest(namespace=NS, fingerprint=FP, keys=keys[:1])
    )
    with safe_open(loc.blocks[0].path, framework="numpy") as f:
        assert f.metadata()["key"] == keys[0].hex()
        for t in blocks[0].tensors:
            assert f.get_tensor(t.name).tobytes() == bytes(t.data)


@pytest.mark.parametrize("path", ["stream", "locate"])
def test_layer_subset_returns_only_those_layers(store, path):
    blocks, keys = make_chain(list(range(100)), block_tokens=100)
    store.put_blocks(NS, FP, blocks)
    read = store.get_blocks if path == "stream" else store.read_blocks_local
    (back,) = list(read(NS, FP, keys, layers=[1, 3]))
    expected = [t for t in blocks[0].tensors if t.name.split(".")[1] in ("1", "3")]
    assert [t.name for t in back.tensors] == [t.name for t in expected]
    assert all(bytes(a.data) == bytes(b.data) for a, b in zip(expected, back.tensors, strict=True))


def test_keys_are_content_addresses(store):
    blocks, keys = make_chain(list(range(64)), block_tokens=64)
    assert keys[0] == block_key(FP, b"", list(range(64)))
    put = store.put_blocks(NS, FP, blocks)
    assert put.blocks[0].key == keys[0]
    assert block_key(FP + "x", b"", list(range(64))) != keys[0]


def test_unix_socket_listener(tmp_path):
    from tests.helpers import StoreProcess

    sock = tmp_path / "store.sock"
    proc = StoreProcess(tmp_path / "data", tmp_path / "log", listen=f"unix:{sock}").start()
    try:
        with proc.client() as client:
            blocks, keys = make_chain(list(range(80)), block_tokens=64)
            client.put_blocks(NS, FP, blocks)
            assert same_bytes(blocks[1], list(client.get_blocks(NS, FP, keys))[1])
    finally:
        proc.stop()


def test_racing_uploads_of_one_block_keep_file_and_index_in_step(store):
    """Two workers upload the same span at once (bytes may differ in the last bit): one wins."""
    from concurrent.futures import ThreadPoolExecutor

    from agentkv.client.store import StoreClient

    tokens = list(range(64))
    versions = [make_chain(tokens, block_tokens=64, seed=seed)[0] for seed in range(8)]

    def upload(blocks):
        with StoreClient(store.address) as c:
            return c.put_blocks(NS, FP, blocks).blocks[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(upload, versions))
    assert sum(not r.deduplicated for r in results) == 1
    verify = store.call("VerifyBlocks", pb.VerifyBlocksRequest())
    assert verify.num_checked == 1 and not verify.corrupt
    (back,) = store.get_blocks(NS, FP, [results[0].key])
    winner = versions[[r.deduplicated for r in results].index(False)][0]
    assert same_bytes(winner, back)


def test_a_direct_read_stuck_past_the_timeout_is_unreadable_and_later_reads_go_on(
    store_process, monkeypatch
):
    """The reviewer's: a direct read on a hung mount (preadv cannot be interrupted) blocked
    its restore for good, and every later direct read queued behind it on the one reader
    thread. It ends at the client's timeout now, FilesUnreadable (stuck), and the next read
    gets a reader of its own."""
    import threading

    from agentkv.client import blocks as blocks_module
    from agentkv.client.blocks import FilesUnreadable

    blocks, keys = make_chain(list(range(200)), block_tokens=128)
    release, read_file = threading.Event(), blocks_module._read_file

    def hung(location, view):
        if location.key == keys[0]:
            release.wait()  # as a read on a hung NFS mount
        read_file(location, view)

    monkeypatch.setattr(blocks_module, "_read_file", hung)
    with store_process.client(timeout=2) as store:
        store.put_blocks(NS, FP, blocks)
        try:
            with pytest.raises(FilesUnreadable, match="was not read within 2 s") as caught:
                store.read_blocks_local(NS, FP, keys)
            assert caught.value.stuck
            got = store.read_blocks_local(NS, FP, keys[1:])  # not behind the stuck one
            assert all(same_bytes(b, g) for b, g in zip(blocks[1:], got, strict=True))
        finally:
            release.set()
