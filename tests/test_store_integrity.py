"""Damaged payloads are caught, quarantined and dropped from the index; the rest stays intact.

Each test stores a three-block chain referenced by one agent, damages the middle block's file
behind the store's back, and reads it through one path: the GetBlocks stream, the same-host
locate path (read_blocks_local) or the VerifyBlocks RPC.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from agentkv.client.blocks import Block
from agentkv.client.store import StoreClient
from agentkv.errors import BlockNotFound, CorruptBlock
from agentkv.v1 import store_pb2 as pb
from tests.helpers import FP, NS, StoreProcess, make_chain, same_bytes, until

AGENT = "victim"
TOKENS = list(range(150))  # blocks of 64, 64 and 22 tokens


@dataclass
class Stored:
    proc: StoreProcess
    client: StoreClient
    blocks: list[Block]
    keys: list[bytes]

    @property
    def victim(self) -> bytes:
        return self.keys[1]

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.proc.data_dir / "blocks" / NS / h[:2] / f"{h}.safetensors"

    def quarantined(self, key: bytes) -> list[Path]:
        return sorted((self.proc.data_dir / "quarantine" / NS).glob(f"{key.hex()}.*.safetensors"))


@pytest.fixture
def stored(store_process, store) -> Stored:
    blocks, keys = make_chain(TOKENS)
    store.save_agent(NS, AGENT, FP, TOKENS, blocks)
    return Stored(store_process, store, blocks, keys)


# damage: each returns the file's bytes afterwards (None once deleted)


def flip(path: Path, offset: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(data)
    return bytes(data)


def flip_data_byte(path: Path) -> bytes:
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return flip(path, (data_start + path.stat().st_size) // 2)


def flip_header_byte(path: Path) -> bytes:
    return flip(path, 20)  # inside the safetensors JSON header


def truncate(path: Path) -> bytes:
    os.truncate(path, path.stat().st_size // 2)
    return path.read_bytes()


def delete(path: Path) -> None:
    path.unlink()


DAMAGE: dict[str, Callable[[Path], bytes | None]] = {
    "data_byte": flip_data_byte,
    "header_byte": flip_header_byte,
    "truncated": truncate,
    "deleted": delete,
}


# read paths: each returns the message that reported the damage


def read_stream(s: Stored) -> str:
    with pytest.raises(CorruptBlock) as info:
        list(s.client.get_blocks(NS, FP, s.keys))
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    return info.value.message


def read_locate(s: Stored) -> str:
    with pytest.raises(CorruptBlock) as info:
        s.client.read_blocks_local(NS, FP, s.keys)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    return info.value.message


def verify(s: Stored) -> str:
    report = s.client.call("VerifyBlocks", pb.VerifyBlocksRequest(namespace=NS))
    assert report.num_checked == len(s.keys)
    assert [(c.namespace, c.key) for c in report.corrupt] == [(NS, s.victim)]
    return report.corrupt[0].reason


READ: dict[str, Callable[[Stored], str]] = {
    "stream": read_stream,
    "locate": read_locate,
    "verify": verify,
}


def assert_gone(s: Stored, moved: bytes | None) -> None:
    """The victim is out of the index, its file in quarantine, and later reads say NOT_FOUND."""
    assert s.victim not in [b.key for b in s.client.list_blocks(NS)]
    assert s.client.stats().num_quarantined == 1
    assert not s.path(s.victim).exists()
    assert [p.read_bytes() for p in s.quarantined(s.victim)] == ([] if moved is None else [moved])
    for read in (
        lambda: list(s.client.get_blocks(NS, FP, [s.victim])),
        lambda: s.client.read_blocks_local(NS, FP, [s.victim]),
    ):
        with pytest.raises(BlockNotFound) as info:
            read()
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        assert s.victim.hex() in info.value.message


def assert_rest_intact(s: Stored) -> None:
    agent = s.client.get_agent(NS, AGENT)
    assert list(agent.block_keys) == s.keys
    assert list(agent.missing_block_keys) == [s.victim]
    others = [(b, k) for b, k in zip(s.blocks, s.keys, strict=True) if k != s.victim]
    for read in (s.client.get_blocks, s.client.read_blocks_local):
        back = list(read(NS, FP, [k for _, k in others]))
        assert [same_bytes(b, got) for (b, _), got in zip(others, back, strict=True)] == [True] * 2
    recheck = s.client.call("VerifyBlocks", pb.VerifyBlocksRequest(namespace=NS))
    assert (recheck.num_checked, list(recheck.corrupt)) == (len(others), [])


CAUGHT = [(d, p) for d in ("data_byte", "truncated", "deleted") for p in READ]
CAUGHT.append(("header_byte", "verify"))


@pytest.mark.parametrize("damage, path", CAUGHT)
def test_damaged_block_is_quarantined(stored, damage, path):
    moved = DAMAGE[damage](stored.path(stored.victim))
    message = READ[path](stored)
    assert stored.victim.hex() in message
    assert_gone(stored, moved)
    assert_rest_intact(stored)


@pytest.mark.parametrize("path", ["stream", "locate"])
def test_flipped_header_byte_is_only_caught_by_verify(stored, path):
    # Stream and locate reads check only the selected layers' checksums, never the safetensors
    # header, so the tensor bytes still come back exact; VerifyBlocks checks the header too.
    moved = flip_header_byte(stored.path(stored.victim))
    read = stored.client.get_blocks if path == "stream" else stored.client.read_blocks_local
    back = list(read(NS, FP, stored.keys))
    assert all(map(same_bytes, stored.blocks, back))
    assert stored.client.stats().num_quarantined == 0
    assert stored.victim.hex() in verify(stored)
    assert_gone(stored, moved)
    assert_rest_intact(stored)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_damage_found_at_start_up_is_quarantined(stored, damage):
    stored.proc.stop()
    moved = DAMAGE[damage](stored.path(stored.victim))
    stored.proc.start()
    with stored.proc.client() as client:
        restarted = dataclasses.replace(stored, client=client)
        assert_gone(restarted, moved)
        assert_rest_intact(restarted)


def test_a_report_s_reason_is_kept_and_logged_cut_short(stored):
    """A reason of megabytes was logged whole: any caller could fill the store's log."""
    before = stored.proc.log_path.stat().st_size
    reply = stored.client.call(
        "ReportCorruptBlock",
        pb.ReportCorruptBlockRequest(namespace=NS, key=stored.victim, reason="x" * (1 << 20)),
    )
    assert reply.quarantined is False
    until(lambda: "corruption report not confirmed" in stored.proc.log_text(), "the log line")
    assert stored.proc.log_path.stat().st_size - before < 10_000


def test_report_of_a_sound_block_is_not_confirmed(stored):
    before = stored.path(stored.victim).read_bytes()
    reply = stored.client.call(
        "ReportCorruptBlock",
        pb.ReportCorruptBlockRequest(namespace=NS, key=stored.victim, reason="checksum mismatch"),
    )
    assert reply.quarantined is False
    assert stored.path(stored.victim).read_bytes() == before
    assert stored.quarantined(stored.victim) == []
    assert stored.client.stats().num_quarantined == 0
    assert list(stored.client.get_agent(NS, AGENT).missing_block_keys) == []
    assert all(map(same_bytes, stored.blocks, stored.client.get_blocks(NS, FP, stored.keys)))


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_reupload_replaces_a_lost_file_no_read_has_found(stored, damage):
    """A file lost behind the store's back is not a dedup hit: the re-upload (a worker's
    re-prefill writes its blocks again) quarantines the index entry, stores the new bytes,
    and the agent's manifest is whole again, with its reference count intact."""
    moved = DAMAGE[damage](stored.path(stored.victim))
    put = stored.client.put_blocks(NS, FP, stored.blocks)
    assert [b.deduplicated for b in put.blocks] == [True, False, True]
    assert [p.read_bytes() for p in stored.quarantined(stored.victim)] == (
        [] if moved is None else [moved]
    )
    agent = stored.client.get_agent(NS, AGENT)
    assert list(agent.block_keys) == stored.keys and not agent.missing_block_keys
    assert {b.key: b.refcount for b in stored.client.list_blocks(NS)}[stored.victim] == 1
    back = stored.client.read_blocks_local(NS, FP, stored.keys)
    assert all(map(same_bytes, stored.blocks, back))
