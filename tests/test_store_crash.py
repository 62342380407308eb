"""kill -9 of the store at many points: after restart the index points only at whole files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from agentkv.client.store import put_messages
from agentkv.errors import AgentKVError
from tests.helpers import FP, NS, StoreProcess, assert_store_consistent, make_chain

ROOT = Path(__file__).resolve().parent.parent

SHAPE = {"num_layers": 8, "kv_heads": 4, "head_dim": 128}  # 288 KiB a block: 3 messages


def hooked(messages, on_message):
    """Calls on_message(i) before sending message i of a stream."""
    for i, raw in enumerate(messages):
        on_message(i)
        yield raw


@pytest.fixture
def crash_store(tmp_path):
    proc = StoreProcess(tmp_path / "data", tmp_path / "store.log").start()
    yield proc
    proc.stop()


# 26 points in the stream of 30 messages (10 blocks of 3): before the header, between every
# header and chunk of the first eight blocks, and in the last ones; plus 3 points below.
@pytest.mark.parametrize("kill_at", [*range(24), 25, 28])
def test_kill9_during_streaming_put(crash_store, kill_at):
    tokens = list(range(64 * 12))
    blocks, keys = make_chain(tokens, block_tokens=64, **SHAPE)
    sent = dict(zip(keys, blocks, strict=True))
    with crash_store.client() as c:
        c.save_agent(NS, "before", FP, tokens[:128], blocks[:2])

        def maybe_kill(i: int) -> None:
            if i == kill_at:
                crash_store.kill9()

        with pytest.raises((grpc.RpcError, AgentKVError)):
            c._put(hooked(put_messages(NS, FP, blocks[2:], 256 << 10), maybe_kill), timeout=30)
    crash_store.start()
    with crash_store.client() as c:
        agent = c.get_agent(NS, "before")
        assert list(agent.block_keys) == keys[:2] and not agent.missing_block_keys
        assert_store_consistent(c, crash_store.data_dir, NS, sent)


@pytest.mark.parametrize("after", [1, 5, 9])
def test_kill9_during_commits_and_puts(crash_store, after):
    """A writer thread commits a growing agent while the store is killed under it."""
    tokens = list(range(64 * 20))
    blocks, keys = make_chain(tokens, block_tokens=64, **SHAPE)
    sent = dict(zip(keys, blocks, strict=True))
    progress = threading.Event()

    def writer() -> None:
        with crash_store.client(timeout=10) as c:
            generation = 0
            for n in range(1, len(blocks) + 1):
                try:
                    _, manifest = c.save_agent(
                        NS,
                        "grower",
                        FP,
                        tokens[: 64 * n],
                        blocks[n - 1 : n],
                        expected_generation=generation,
                        stored_keys=keys[: n - 1],
                    )
                    generation = manifest.generation
                except AgentKVError:
                    return
                if n == after:
                    progress.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert progress.wait(60)
    crash_store.kill9()
    thread.join(60)
    crash_store.start()
    with crash_store.client() as c:
        agent = c.get_agent(NS, "grower")
        n = len(agent.block_keys)
        assert n >= after and list(agent.block_keys) == keys[:n] and not agent.missing_block_keys
        assert list(agent.token_ids) == tokens[: 64 * n]
        assert_store_consistent(c, crash_store.data_dir, NS, sent)


def test_startup_sweeps_partial_uploads_and_orphans(crash_store):
    blocks, keys = make_chain(list(range(128)), block_tokens=64)
    with crash_store.client() as c:
        c.put_blocks(NS, FP, blocks)
    crash_store.kill9()
    data = crash_store.data_dir
    (data / "tmp" / "deadbeef.part").write_bytes(b"half a block")
    orphan = data / "blocks" / NS / "ab" / ("ab" * 32 + ".safetensors")
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"renamed, never indexed")
    crash_store.start()
    assert not orphan.exists() and not list((data / "tmp").iterdir())
    with crash_store.client() as c:
        assert [b.key for b in c.get_blocks(NS, FP, keys)] == keys
        assert c.stats().num_blocks == 2


CLIENT_DIES_MIDWAY = """
import sys, time
from agentkv.client.store import StoreClient, put_messages
from tests.helpers import FP, NS, make_chain
from tests.test_store_crash import SHAPE

blocks, _ = make_chain(list(range(64 * 4)), block_tokens=64, **SHAPE)

def stream():
    for i, raw in enumerate(put_messages(NS, FP, blocks, 64 << 10)):
        if i == 14:  # inside the third block (6 messages each), its tmp file half written
            print("midway", flush=True)
            time.sleep(600)
        yield raw

StoreClient(sys.argv[1])._put(stream(), timeout=600)
"""


def test_client_killed_mid_put_leaves_no_partial_block(crash_store, tmp_path):
    script = tmp_path / "dying_client.py"
    script.write_text(CLIENT_DIES_MIDWAY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = subprocess.Popen(
        [sys.executable, str(script), crash_store.address],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert client.stdout.readline().strip() == "midway"
    tmp = crash_store.data_dir / "tmp"
    with crash_store.client() as c:
        deadline = time.monotonic() + 30
        while not (list(tmp.iterdir()) and c.stats().num_blocks == 2):
            assert time.monotonic() < deadline, "the upload never reached its third block"
            time.sleep(0.02)
    client.kill()
    client.wait()
    deadline = time.monotonic() + 30
    while list(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp.iterdir())
    blocks, keys = make_chain(list(range(64 * 4)), block_tokens=64, **SHAPE)
    with crash_store.client() as c:
        assert {b.key for b in c.list_blocks(NS)} == set(keys[:2])
        assert_store_consistent(c, crash_store.data_dir, NS, dict(zip(keys, blocks, strict=True)))
        assert c.stats().num_leases == 0  # the dead upload's lease went with it
