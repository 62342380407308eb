"""The object-store tier against a real SeaweedFS (`weed server`) and real store processes:
agents restored warm on a store with an empty data dir, demotion under a quota, kill -9
during uploads, the object store stopped mid-work, corrupted objects, and two stores racing
for one namespace."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
import xxhash

from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.errors import (
    AgentKVError,
    AgentLost,
    AgentNotFound,
    BucketUnreachable,
    CorruptBlock,
    CorruptRecord,
    FailedPrecondition,
    GenerationConflict,
    Unavailable,
)
from agentkv.launch import ServiceProcess, gateway_process, worker_process
from tests.helpers import FP, StoreProcess, answers, cli, make_chain, same_bytes
from tests.weed import CREDENTIALS, WeedServer

NS = "ns"
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are the keeper of the lighthouse, and you log every ship that passes. " * 4


@pytest.fixture(scope="module")
def weed(tmp_path_factory) -> Iterator[WeedServer]:
    server = WeedServer(tmp_path_factory.mktemp("weed")).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(autouse=True)
def credentials(monkeypatch) -> None:
    for name, value in CREDENTIALS.items():  # what the store processes inherit
        monkeypatch.setenv(name, value)


BUCKET = "agentkv-test"  # one bucket (a weed collection: each takes volume slots)
_prefixes = iter(range(10**6))


@pytest.fixture
def bucket() -> str:
    """This test's own prefix in the bucket: stores of different tests never meet."""
    return f"t{os.getpid()}-{next(_prefixes)}"


def tier_args(weed: WeedServer, prefix: str, *extra: str) -> list[str]:
    return ["--object-store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", weed.endpoint, *extra]


def start_store(tmp_path: Path, name: str, args: list[str]) -> StoreProcess:
    return StoreProcess(tmp_path / name, tmp_path / f"{name}.log", extra_args=args).start()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    """Waits for a condition the test then relies on (never for a fixed time)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


OBJECT_STORE = "agentkv.v1.CacheStore/object-store"  # its health service name


def health(address: str) -> dict[str, str]:
    """grpc.health.v1 of the store itself and of its object-store tier."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            name: health_pb2.HealthCheckResponse.ServingStatus.Name(
                stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            )
            for name in ("", OBJECT_STORE)
        }


def uploaded(client: StoreClient) -> bool:
    s = client.stats()
    return s.object_queue_depth == 0 and s.object_store_state == "ok"


def bucket_manifests(weed: WeedServer, prefix: str) -> dict[str, dict]:
    s3 = weed.client()
    manifests = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            if "/agents/" in item["Key"]:
                body = s3.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
                manifests[item["Key"]] = json.loads(body)
    return manifests


def bucket_agents(weed: WeedServer, prefix: str) -> set[str]:
    """The ids of the agents the bucket holds a manifest of (listed, not read)."""
    pages = weed.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    names = (item["Key"] for page in pages for item in page.get("Contents", []))
    return {name.rpartition("/agents/")[2] for name in names if "/agents/" in name}


def assert_bucket_whole(weed: WeedServer, prefix: str) -> dict[str, dict]:
    """Every manifest under the prefix names only blocks that are there, byte for byte what
    its checksum says: nothing referenced is not whole."""
    s3 = weed.client()
    manifests = bucket_manifests(weed, prefix)
    for name, m in manifests.items():
        for block in m["blocks"]:
            key = f"{prefix}/{m['namespace']}/blocks/{block['key']}.safetensors"
            body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            assert xxhash.xxh3_64_intdigest(body) == int(block["xxh3"], 16), (name, key)
            assert len(body) == block["num_bytes"]
    return manifests


def save(client: StoreClient, agent: str, tokens: list[int], seed: int = 0, gen: int = 0):
    blocks, keys = make_chain(tokens, seed=seed)
    client.save_agent(NS, agent, FP, tokens, blocks, expected_generation=gen)
    return blocks, keys


def assert_restores(client: StoreClient, agent: str, tokens, blocks, keys) -> None:
    m = client.get_agent(NS, agent, FP)
    assert list(m.token_ids) == tokens and list(m.block_keys) == keys
    assert not m.missing_block_keys
    back = list(client.get_blocks(NS, FP, keys))
    assert all(same_bytes(a, b) for a, b in zip(blocks, back, strict=True))


# moving hosts: a real worker, greedy continuations


def scrape(store) -> str:
    """The store's Prometheus metrics, as text."""
    metrics = store.service._find_event("serving", 0)["metrics"]
    return urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()


def test_agent_restores_warm_on_a_store_with_an_empty_data_dir(
    weed, bucket, tmp_path, tiny_model_dirs
):
    model = str(tiny_model_dirs["llama"])

    def worker(store: StoreProcess, name: str) -> ServiceProcess:
        return worker_process(
            model, store.address, tmp_path / f"{name}.log", extra_args=["--block-tokens", "64"]
        ).start()

    def both_turn(w: WorkerClient, text: str) -> tuple[list, list, object]:
        moved = w.turn(NS, "moved", [("user", text)], max_tokens=12)
        stayed = w.turn(NS, "stayed", [("user", text)], max_tokens=12)
        return list(moved.token_ids), list(stayed.token_ids), moved.usage

    store_a = start_store(tmp_path, "a", tier_args(weed, bucket))
    w1 = worker(store_a, "w1")
    with WorkerClient(w1.address) as w:
        for agent in ("moved", "stayed"):
            w.create_agent(NS, agent, SYSTEM)
            w.turn(NS, agent, [("user", "Which ships came by today?")], max_tokens=8)
            w.wait_durable(NS, agent)
    with store_a.client() as a:
        wait_for("store A's uploads", lambda: uploaded(a))
    w1.stop()
    store_a.stop()

    # Another host: an empty data dir, the same bucket.
    store_b = start_store(tmp_path, "b", tier_args(weed, bucket))
    w2 = worker(store_b, "w2")
    with WorkerClient(w2.address) as w:
        moved, stayed, usage = both_turn(w, "And which one flew a black flag?")
        assert usage.cache_state == "warm" and not usage.restore_failure
        assert usage.reused_store_tokens > 0 and usage.restored_bytes > 0
        assert moved == stayed  # both restored from the bucket's blocks, same history
        for agent in ("moved", "stayed"):
            w.wait_durable(NS, agent)
    with store_b.client() as b:
        assert b.stats().num_rehydrated_blocks > 0
        wait_for("store B's uploads", lambda: uploaded(b))
    w2.stop()
    store_b.stop()

    # Store A again, its data dir deleted outright: everything, B's turn too, from the bucket.
    shutil.rmtree(tmp_path / "a")
    store_a = start_store(tmp_path, "a", tier_args(weed, bucket))
    w3 = worker(store_a, "w3")
    try:
        with WorkerClient(w3.address) as w:
            moved, stayed, usage = both_turn(w, "Write it in the log.")
            assert usage.cache_state == "warm" and not usage.restore_failure
            assert usage.prefilled_tokens < usage.prompt_tokens // 2
            assert moved == stayed
    finally:
        w3.stop()
        store_a.stop()
    assert_bucket_whole(weed, bucket)


# the local quota: demotion, not loss


def test_quota_smaller_than_all_agents_demotes_and_loses_nothing(weed, bucket, tmp_path):
    tokens = list(range(1, 257))
    blocks, _ = make_chain(tokens)
    agent_bytes = sum(t.data.nbytes for b in blocks for t in b.tensors)
    quota = str(int(agent_bytes * 2.5))  # two and a half agents of eight
    args = tier_args(weed, bucket, "--quota", quota, "--metrics-listen", "127.0.0.1:0")
    store = start_store(tmp_path, "s", args)
    try:
        with store.client() as c:
            saved = {}
            for i in range(8):
                agent_tokens = [i * 1000 + t for t in tokens]
                saved[f"a{i}"] = (agent_tokens, *save(c, f"a{i}", agent_tokens, seed=i * 10))
            stats = c.stats()
            assert stats.num_bytes <= int(quota)
            assert stats.num_demoted_blocks > 0 and stats.num_evicted_agents == 0
            # verify reads the blocks on this disk, and says how many it did not read
            verified = cli("store", "verify", store=store.address)
            assert verified.returncode == 0, verified.stderr
            said = r"checked (\d+) blocks, .*; 0 corrupt \(quarantined\); (\d+) only in the"
            checked, remote = map(int, re.search(said, verified.stdout).groups())
            assert remote > 0 and checked + remote == len(list(c.list_blocks(NS)))
            # and an agent's blocks say which live only in the object store
            demoted = {
                agent: len(c.get_agent(NS, agent, peek=True).remote_block_keys) for agent in saved
            }
            assert sum(demoted.values()) == remote, demoted
            agent = max(demoted, key=demoted.get)
            shown = cli("store", "agent", agent, "-n", NS, store=store.address).stdout
            assert shown.count("in the object store") == demoted[agent], shown
            for agent, (agent_tokens, agent_blocks, keys) in saved.items():
                assert_restores(c, agent, agent_tokens, agent_blocks, keys)
            assert c.stats().num_rehydrated_blocks > 0
            assert c.stats().num_bytes <= int(quota)
            # The locate path fetches to local disk, then locates.
            agent_tokens, agent_blocks, keys = saved["a0"]
            c.get_agent(NS, "a5")  # a0 now least recently used
            for agent in ("a5", "a6", "a7", "a4"):
                other_keys = saved[agent][2]
                list(c.get_blocks(NS, FP, other_keys))
            located = c.read_blocks_local(NS, FP, keys)
            assert all(same_bytes(a, b) for a, b in zip(agent_blocks, located, strict=True))
            stats = c.stats()
        # What an operator sees: the CLI's table and the Prometheus metrics say the same.
        shown = cli("store", "stats", store=store.address).stdout
        assert f"s3://{BUCKET}/{bucket}/" in shown and "demoted blocks" in shown
        assert re.search(rf"rehydrated blocks\s+{stats.num_rehydrated_blocks}\b", shown)
        text = scrape(store)
        demoted = re.search(r"^agentkv_store_demoted_blocks_total (\S+)$", text, re.M)
        assert demoted and float(demoted.group(1)) == stats.num_demoted_blocks
        assert re.search(r'^agentkv_store_object_bytes_total\{op="get"\} [1-9]', text, re.M)
        assert re.search(r'^agentkv_store_object_seconds_count\{op="put"\} [1-9]', text, re.M)
        assert "agentkv_store_object_queue_depth" in text
        assert re.search(r"^agentkv_store_object_store_up 1\.0$", text, re.M)
    finally:
        store.stop()


@pytest.mark.parametrize("evict_agents", [(), ("--evict-agents",)], ids=["", "evict-agents"])
def test_a_block_gone_from_the_bucket_is_uploaded_again_not_demoted_into_loss(
    weed, bucket, tmp_path, evict_agents
):
    """The index says what was uploaded, not what the bucket still holds: objects deleted
    behind the store's back (an age-based lifecycle rule, a hand) were demoted all the same,
    the local copy deleted, and the agent's blocks lost for good (DATA_LOSS). Each is now
    asked for (HEAD) before its local copy goes: a missing one is uploaded again first. Here
    every block of three agents goes (12, past the 8 one demotion asks for before it gives
    up for the moment), and the fourth agent's write needs room that only they can give.
    With --evict-agents, an agent whose blocks are not all in the bucket is not evicted
    either: its blocks, unreferenced then, were the next to go (the bucket's manifest of it
    named blocks nowhere)."""
    tokens = list(range(1, 257))
    blocks, _ = make_chain(tokens)
    agent_bytes = sum(t.data.nbytes for b in blocks for t in b.tensors)
    args = tier_args(weed, bucket, "--quota", str(int(agent_bytes * 3.5)), *evict_agents)
    store = start_store(tmp_path, "s", args)
    try:
        with store.client() as c:
            saved = {f"a{i}": [t + 1000 * i for t in tokens] for i in range(4)}
            chains = {a: save(c, a, saved[a], seed=i) for i, a in enumerate(list(saved)[:3])}
            wait_for("the uploads", lambda: uploaded(c))
            assert c.stats().num_demoted_blocks == 0  # every block is here, and in the bucket
            s3 = weed.client()
            for _, keys in chains.values():
                for key in keys:
                    name = f"{bucket}/{NS}/blocks/{key.hex()}.safetensors"
                    s3.delete_object(Bucket=BUCKET, Key=name)
            chains["a3"] = save(c, "a3", saved["a3"], seed=3)  # room from the others' blocks
            made_room = c.stats()
            assert made_room.num_demoted_blocks >= 2 or (
                evict_agents and made_room.num_evicted_agents  # once its blocks were back
            )
            for agent, (agent_blocks, keys) in chains.items():
                assert_restores(c, agent, saved[agent], agent_blocks, keys)
            wait_for("the uploads", lambda: uploaded(c))
        assert "block gone from the object store: uploading it again" in store.log_text()
        assert set(assert_bucket_whole(weed, bucket)) == {
            f"{bucket}/{NS}/agents/{agent}" for agent in saved
        }
    finally:
        store.stop()


# crashes and outages


def crashing_store(point: str, argv: list[str]) -> None:
    """The store, killed -9 by itself around its Nth object-store put: 'before:N' or
    'after:N' (the object written, not yet recorded in the index)."""
    from cache_store.__main__ import main
    from cache_store.objects import Bucket

    when, n = point.split(":")
    put, count, lock = Bucket.put, [0], threading.Lock()

    def killing_put(self, key, body, metadata, **conditions):
        if key.endswith("writer.lease"):
            return put(self, key, body, metadata, **conditions)
        with lock:
            count[0] += 1
            here = count[0] == int(n)
        if here and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        etag = put(self, key, body, metadata, **conditions)
        if here:
            os.kill(os.getpid(), signal.SIGKILL)
        return etag

    Bucket.put = killing_put
    main(argv)


@pytest.mark.parametrize("point", ["before:2", "after:2", "after:5", "before:9"])
def test_kill9_during_uploads_loses_nothing_and_resumes(weed, bucket, tmp_path, point):
    args = ["--data-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", *tier_args(weed, bucket)]
    env = {"PYTHONPATH": str(ROOT), "CRASH_AT": point}
    crashing = ServiceProcess(__name__, args, tmp_path / "crash.log", env).start()
    saved = {}
    with StoreClient(crashing.address) as c:
        try:
            for i in range(3):
                agent_tokens = [i * 1000 + t for t in range(1, 150)]
                saved[f"a{i}"] = (agent_tokens, *save(c, f"a{i}", agent_tokens, seed=i * 10))
        except AgentKVError:
            pass  # killed during a commit: that agent is not acknowledged
    try:
        wait_for("the kill", lambda: crashing.proc.poll() is not None)
    finally:
        if crashing.proc.poll() is None:  # it never reached its point: no process left over
            crashing.kill9()
    assert crashing.proc.returncode == -signal.SIGKILL
    assert_bucket_whole(weed, bucket)  # whatever got there is whole

    store = start_store(tmp_path, "s", tier_args(weed, bucket))  # the same data dir
    with store.client() as c:
        for agent, (agent_tokens, agent_blocks, keys) in saved.items():
            assert_restores(c, agent, agent_tokens, agent_blocks, keys)
        wait_for("the resumed uploads", lambda: uploaded(c))
    store.stop()
    manifests = assert_bucket_whole(weed, bucket)
    assert {m["agent_id"] for m in manifests.values()} >= set(saved)

    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            for agent, (agent_tokens, agent_blocks, keys) in saved.items():
                assert_restores(c, agent, agent_tokens, agent_blocks, keys)
    finally:
        fresh.stop()


def test_object_store_down_keeps_the_local_tier_and_catches_up(bucket, tmp_path, tiny_model_dirs):
    weed = WeedServer(tmp_path / "weed").start()  # its own: this test stops it
    args = tier_args(weed, bucket, "--writer-lease-seconds", "6", "--object-queue-max", "4")
    args += ["--metrics-listen", "127.0.0.1:0"]
    store = start_store(tmp_path, "s", args)  # a queue of 4: the rest waits in the index
    saved = {}
    try:
        with store.client() as c:
            saved["a0"] = ([1, 2, 3] * 50, *save(c, "a0", [1, 2, 3] * 50, seed=1))
            wait_for("the first uploads", lambda: uploaded(c))
            weed.stop(kill=True)  # an outage: kill -9
            for i in range(1, 4):  # turns go on while the object store is down
                agent_tokens = [i * 1000 + t for t in range(1, 150)]
                saved[f"a{i}"] = (agent_tokens, *save(c, f"a{i}", agent_tokens, seed=i * 10))
            tokens = saved["a0"][0] + [7] * 70  # and an agent grows
            blocks, keys = make_chain(tokens, seed=1)
            c.save_agent(NS, "a0", FP, tokens, blocks[2:], 1, stored_keys=saved["a0"][2][:2])
            saved["a0"] = (tokens, blocks, keys)
            wait_for("'unreachable'", lambda: c.stats().object_store_state == "unreachable")
            depth = c.stats().object_queue_depth  # queued, the 4 uploaders', 1 for the index
            assert 0 < depth <= 4 + 4 + 1
            assert health(store.address) == {"": "SERVING", OBJECT_STORE: "NOT_SERVING"}
            assert re.search(r"^agentkv_store_object_store_up 0\.0$", scrape(store), re.M)
            for agent, (agent_tokens, agent_blocks, keys) in saved.items():
                assert_restores(c, agent, agent_tokens, agent_blocks, keys)
            with pytest.raises(Unavailable, match="object store"):
                c.get_agent(NS, "never-seen")  # it may be in the bucket: not a NOT_FOUND
            # A worker still makes a new agent (the store writes it locally), whose turn
            # commits here and is uploaded once the bucket is back.
            worker = worker_process(
                str(tiny_model_dirs["llama"]), store.address, tmp_path / "worker.log"
            ).start()
            try:
                with WorkerClient(worker.address) as w:
                    w.create_agent(NS, "made-meanwhile", SYSTEM)
                    w.turn(NS, "made-meanwhile", [("user", "Any ships?")], max_tokens=4)
                    w.wait_durable(NS, "made-meanwhile")
                    made = c.get_agent(NS, "made-meanwhile")
                    assert made.generation >= 1 and len(made.token_ids) > 0
                # So does a gateway, for a conversation an agent id names (X-Agent-Id).
                log = tmp_path / "gateway.log"
                gateway = gateway_process([worker.address], log, store.address).start()
                try:
                    base = f"http://{gateway.address}/v1"
                    http = openai.OpenAI(base_url=base, api_key="-", max_retries=0)
                    named = http.chat.completions.create(
                        model=Path(str(tiny_model_dirs["llama"])).name,
                        messages=[{"role": "user", "content": "Any ships?"}],
                        max_tokens=4,
                        extra_headers={"X-Agent-Id": "named-meanwhile"},
                    )
                    assert named.usage.completion_tokens > 0
                    WorkerClient(worker.address).wait_durable("default", "named-meanwhile")
                finally:
                    gateway.stop()
            finally:
                worker.stop()
            weed.start()
            wait_for("the catch-up", lambda: uploaded(c))
            assert health(store.address)[OBJECT_STORE] == "SERVING"
            assert re.search(r"^agentkv_store_object_store_up 1\.0$", scrape(store), re.M)
        store.stop()
        manifests = assert_bucket_whole(weed, bucket)
        generations = {m["agent_id"]: m["generation"] for m in manifests.values()}
        assert generations["a0"] == 2
        assert generations["made-meanwhile"] == made.generation
        fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
        with fresh.client() as c:
            for agent, (agent_tokens, agent_blocks, keys) in saved.items():
                assert_restores(c, agent, agent_tokens, agent_blocks, keys)
        fresh.stop()
    finally:
        store.stop()
        weed.stop(kill=True)


def test_corrupted_objects_are_never_served(weed, bucket, tmp_path):
    tokens = list(range(1, 257))
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    with store.client() as c:
        blocks, keys = save(c, "a", tokens)
        wait_for("the uploads", lambda: uploaded(c))
    store.stop()
    s3 = weed.client()
    name = f"{bucket}/{NS}/blocks/{keys[2].hex()}.safetensors"
    got = s3.get_object(Bucket=BUCKET, Key=name)
    body = bytearray(got["Body"].read())
    body[-100] ^= 0xFF  # a flipped bit in layer 3's values, the metadata kept as it was
    s3.put_object(Bucket=BUCKET, Key=name, Body=bytes(body), Metadata=got["Metadata"])

    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            m = c.get_agent(NS, "a", FP)
            assert list(m.token_ids) == tokens  # the conversation is whole
            assert list(m.block_keys) == keys[:2]  # the chain ends before the bad block
            back = list(c.get_blocks(NS, FP, keys[:2]))
            assert all(same_bytes(a, b) for a, b in zip(blocks, back, strict=False))
            with pytest.raises(AgentKVError):
                list(c.get_blocks(NS, FP, [keys[2]]))
    finally:
        fresh.stop()

    # A block demoted after its object was corrupted: DATA_LOSS and quarantine, never its
    # bytes. Another agent's blocks push every one of a's out of a quota of 1.2 agents.
    agent_bytes = sum(t.data.nbytes for b in blocks for t in b.tensors)
    quota = str(int(agent_bytes * 1.2))
    store = start_store(tmp_path, "a", tier_args(weed, bucket, "--quota", quota))
    try:
        with store.client() as c:
            save(c, "b", [t + 5000 for t in tokens], seed=50)
            assert c.stats().num_demoted_blocks >= 4
            wait_for("b's uploads", lambda: uploaded(c))
            back = list(c.get_blocks(NS, FP, keys[:2]))  # sound ones come back
            assert all(same_bytes(a, b) for a, b in zip(blocks, back, strict=False))
            with pytest.raises(CorruptBlock, match="object store"):
                list(c.get_blocks(NS, FP, [keys[2]]))
            assert keys[2] in c.get_agent(NS, "a", FP).missing_block_keys
    finally:
        store.stop()


def cut_short(weed: WeedServer, key: str) -> None:
    """Cuts the object at `key` to half its length, its metadata kept."""
    s3 = weed.client()
    got = s3.get_object(Bucket=BUCKET, Key=key)
    body = got["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=body[: len(body) // 2], Metadata=got["Metadata"])


def test_an_unreadable_manifest_in_the_bucket_is_a_lost_agent_deleted_or_made_anew(
    weed, bucket, tmp_path
):
    """The red team's case: a manifest cut short in the bucket (its metadata kept), or
    replaced by junk with none, left an agent no read could use and no delete could remove
    (DATA_LOSS for both; only a hand in the bucket helped). A read still says it is lost,
    and how to go on; a commit expecting a generation of it too. A delete, or a commit
    anew, drops the unreadable manifest there, and a new agent's generations pass the lost
    one's."""
    tokens = list(range(1, 150))
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    with store.client() as c:
        for i, agent in enumerate(("cut", "junk")):
            save(c, agent, tokens, seed=i)
        save(c, "cut", tokens + [3] * 70, seed=0, gen=1)  # generation 2
        wait_for("the uploads", lambda: uploaded(c))
    store.stop()
    cut_short(weed, f"{bucket}/{NS}/agents/cut")
    weed.client().put_object(Bucket=BUCKET, Key=f"{bucket}/{NS}/agents/junk", Body=b"\0" * 1000)

    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            for agent in ("cut", "junk"):
                with pytest.raises(AgentLost, match=r"is lost \(delete it, or commit it anew"):
                    c.get_agent(NS, agent)
            with pytest.raises(AgentLost, match="is lost"):
                save(c, "cut", [9] * 70, seed=9, gen=2)  # a turn on a worker's copy of it
            assert c.delete_agent(NS, "cut") == 0
            with pytest.raises(AgentNotFound):
                c.get_agent(NS, "cut")
            blocks, keys = save(c, "junk", [5] * 70, seed=5)  # made anew over the junk
            assert_restores(c, "junk", [5] * 70, blocks, keys)
            save(c, "cut", [6] * 70, seed=6)
            assert c.get_agent(NS, "cut").generation > 2  # past the lost one's
            wait_for("the uploads", lambda: uploaded(c))
    finally:
        fresh.stop()
    third = start_store(tmp_path, "third", tier_args(weed, bucket))  # an empty data dir
    try:
        with third.client() as c:
            assert_restores(c, "junk", [5] * 70, blocks, keys)  # the new one, from the bucket
            assert list(c.get_agent(NS, "cut").token_ids) == [6] * 70
    finally:
        third.stop()
    assert "unreadable manifest dropped" in fresh.log_text()


def test_a_lost_agent_a_store_holds_an_older_copy_of_can_be_deleted(weed, bucket, tmp_path):
    """A store holding generation 1 of an agent whose generation 2, written by another store,
    became unreadable in the bucket: reads are DATA_LOSS (the older copy is not served as
    current), and a delete drops both (review: it was DATA_LOSS too, so the gateway's
    delete-and-make-anew answered 500 on every try); a new agent passes generation 2."""
    tokens = list(range(1, 150))
    for name, said in (("a", tokens), ("b", tokens + [4] * 70)):  # generation 1, then 2
        store = start_store(tmp_path, name, tier_args(weed, bucket))
        with store.client() as c:
            gen = c.get_agent(NS, "old").generation if name == "b" else 0
            save(c, "old", said, seed=0, gen=gen)
            wait_for("the upload", lambda: uploaded(c))
        store.stop()
    cut_short(weed, f"{bucket}/{NS}/agents/old")
    again = start_store(tmp_path, "a", tier_args(weed, bucket))  # generation 1 on its disk
    try:
        with again.client() as c:
            with pytest.raises(AgentLost, match="is lost"):
                c.get_agent(NS, "old")
            c.delete_agent(NS, "old")
            with pytest.raises(AgentNotFound):
                c.get_agent(NS, "old")
            save(c, "old", [8] * 70, seed=8)
            assert c.get_agent(NS, "old").generation > 2
    finally:
        again.stop()


def agent_in_the_bucket(weed, bucket: str, tmp_path: Path, num_blocks: int):
    """Agent "a" of `num_blocks` blocks, uploaded by a store now stopped: its tokens,
    blocks and keys, and one block's payload bytes."""
    tokens = list(range(1, 64 * num_blocks + 1))
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    with store.client() as c:
        blocks, keys = save(c, "a", tokens)
        wait_for("the uploads", lambda: uploaded(c))
    store.stop()
    return tokens, blocks, keys, sum(t.data.nbytes for t in blocks[0].tensors)


def assert_reads_what_fits(store: StoreProcess, said: str, tokens, blocks, keys) -> None:
    """`store` reads the conversation whole, and a leading part of its chain, the blocks as
    stored, its log saying that the chain ended there, `said` why; then it stops."""
    try:
        with store.client() as c:
            m = c.get_agent(NS, "a", FP)
            assert list(m.token_ids) == tokens
            kept = len(m.block_keys)
            assert 0 < kept < len(keys) and list(m.block_keys) == keys[:kept]
            back = list(c.get_blocks(NS, FP, keys[:kept]))
            assert all(same_bytes(a, b) for a, b in zip(blocks, back, strict=False))
        ended = [ln for ln in store.log_text().splitlines() if "block unusable" in ln]
        assert any(said in line for line in ended), ended
    finally:
        store.stop()


def test_a_store_whose_disk_is_full_reads_what_fits_of_an_agent_in_the_bucket(
    weed, bucket, tmp_path, small_disk
):
    """The red team's case: a store on a full disk, the agent in the bucket. A block that
    found no room failed the whole read (RESOURCE_EXHAUSTED, which the gateway answered
    429), as did the manifest's own index write. Now the chain ends before the block that
    does not fit (the conversation is whole; its tail is re-prefilled), after the disk gave
    up what it could."""
    tokens, blocks, keys, block = agent_in_the_bucket(weed, bucket, tmp_path, 48)  # > the disk
    # the index, the 1 MiB a store keeps free beyond a block, and a few blocks
    disk = small_disk(f"{(1280 << 10) // 1024 + (8 * block) // 1024}k")
    args = tier_args(weed, bucket)
    full = StoreProcess(disk / "data", tmp_path / "full.log", extra_args=args).start()
    assert_reads_what_fits(full, "no room for it on the store's disk", tokens, blocks, keys)


def test_a_store_at_its_quota_reads_what_fits_of_an_agent_in_the_bucket(weed, bucket, tmp_path):
    """As a full disk, a quota that a fetched chain would pass: the block that did not fit
    failed the whole read (RESOURCE_EXHAUSTED, the gateway's 429). Now the chain ends
    before it, and the rest is re-prefilled."""
    tokens, blocks, keys, block = agent_in_the_bucket(weed, bucket, tmp_path, 24)  # > the quota
    small = start_store(tmp_path, "small", tier_args(weed, bucket, "--quota", str(8 * block)))
    assert_reads_what_fits(small, "store quota of", tokens, blocks, keys)


@contextlib.contextmanager
def gateway_stack(weed, bucket: str, tmp_path: Path, model: str, name: str) -> Iterator:
    """A store on the bucket (data dir `name`), a worker and a gateway; the openai client of
    the gateway. At the end, the store's uploads are waited for before it stops."""
    store = start_store(tmp_path, name, tier_args(weed, bucket))
    worker = worker_process(model, store.address, tmp_path / f"{name}-worker.log").start()
    log = tmp_path / f"{name}-gateway.log"
    gateway = gateway_process([worker.address], log, store.address).start()
    try:
        base = f"http://{gateway.address}/v1"
        yield openai.OpenAI(base_url=base, api_key="-", max_retries=0)
    finally:
        gateway.stop()
        worker.stop()
        with store.client() as c:
            wait_for("the uploads", lambda: uploaded(c))
        store.stop()


def test_a_conversation_whose_agent_the_bucket_lost_goes_on_through_the_gateway(
    weed, bucket, tmp_path, tiny_model_dirs
):
    """A conversation's agent whose manifest in the bucket became unreadable, named
    (X-Agent-Id) or not: the call brings the whole conversation, so the gateway deletes the
    lost agent and makes it anew from it (before: 500, on every try)."""
    model = str(tiny_model_dirs["llama"])
    first = [{"role": "user", "content": "Any ships?"}]
    names = {"named": {"X-Agent-Id": "named"}, "anonymous": {}}

    stack = partial(gateway_stack, weed, bucket, tmp_path, model)

    replies = {}
    with stack("before") as http:
        for name, headers in names.items():
            reply = http.chat.completions.create(
                model=Path(model).name, messages=first, max_tokens=4, extra_headers=headers
            )
            replies[name] = reply.choices[0].message.content
    s3 = weed.client()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{bucket}/default/agents/")
    agents = [o["Key"] for o in listed["Contents"]]
    assert len(agents) == 2
    for key in agents:
        cut_short(weed, key)
    with stack("after") as http:  # an empty data dir: the bucket is all there is
        for name, headers in names.items():
            messages = [*first, {"role": "assistant", "content": replies[name]}]
            messages.append({"role": "user", "content": "How many?"})
            reply = http.chat.completions.create(
                model=Path(model).name, messages=messages, max_tokens=4, extra_headers=headers
            )
            assert reply.usage.completion_tokens > 0, name
    assert "agent lost in the store" in (tmp_path / "after-gateway.log").read_text()


def test_a_conversation_whose_branch_the_bucket_lost_goes_on_in_a_branch_forked_anew(
    weed, bucket, tmp_path, tiny_model_dirs
):
    """A conversation resent whole goes on in a `-c` branch of the agent another one's
    response ids hold (gateway/turns.py). That branch's manifest unreadable in the bucket:
    every call of the conversation computed the same branch and got DATA_LOSS (a 500), for
    ever. The gateway now deletes the lost branch and forks it anew from the agent."""
    model = str(tiny_model_dirs["llama"])
    opener = {"role": "user", "content": "Which scrolls are the most fragile?"}

    @contextlib.contextmanager
    def stack(name: str) -> Iterator[Callable]:
        with gateway_stack(weed, bucket, tmp_path, model, name) as http:
            yield lambda items: http.responses.create(
                model=Path(model).name, instructions="You index scrolls.", input=items,
                max_output_tokens=6, temperature=0,
            )  # fmt: skip

    def said(reply: Any) -> list[dict]:
        return [item.model_dump(exclude_none=True) for item in reply.output]

    with stack("before") as ask:
        first = ask([opener])
        ask([opener, *said(first), {"role": "user", "content": "Index them."}])  # names points
        other = [opener, *said(first), {"role": "user", "content": "Burn them."}]
        other += [*said(ask(other)), {"role": "user", "content": "Now?"}]  # its own branch
        on_branch = ask(other)
        branch = on_branch.model_extra["agentkv"]["agent_id"]
        assert "-c" in branch, branch
    cut_short(weed, f"{bucket}/default/agents/{branch}")
    other += [*said(on_branch), {"role": "user", "content": "And then?"}]
    with stack("after") as ask:  # an empty data dir: the bucket is all there is
        again = ask(other)
        assert again.model_extra["agentkv"]["agent_id"] == branch  # its branch, made anew
        assert again.usage.output_tokens > 0
    assert "branch lost in the store" in (tmp_path / "after-gateway.log").read_text()


def test_an_agent_deleted_and_made_anew_while_the_bucket_is_down_is_the_one_uploaded(
    bucket, tmp_path
):
    weed = WeedServer(tmp_path / "weed").start()  # its own: this test stops it
    store = start_store(tmp_path, "s", tier_args(weed, bucket))
    try:
        with store.client() as c:
            save(c, "a", list(range(1, 100)))
            wait_for("the upload", lambda: uploaded(c))
            weed.stop(kill=True)
            c.delete_agent(NS, "a")  # its deletion there waits for the bucket...
            anew = [7] * 80
            blocks, keys = save(c, "a", anew, seed=7)  # ...and it is made anew: generation 2,
            # past the deleted agent's (a store never gives a new agent one a deleted had)
            weed.start()
            wait_for("the catch-up", lambda: uploaded(c))
        store.stop()
        (m,) = bucket_manifests(weed, bucket).values()
        assert m["generation"] == 2 and m["token_ids"] == anew  # not the deleted agent's
        fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
        with fresh.client() as c:
            assert_restores(c, "a", anew, blocks, keys)
        fresh.stop()
    finally:
        store.stop()
        weed.stop(kill=True)


def test_a_manifest_whose_fields_are_bad_is_data_loss_and_hides_no_other_agent(
    weed, bucket, tmp_path
):
    """A field missing, or a number its wire field cannot hold (written whole, its checksum
    made anew, by another store's version or any bucket writer): that agent is DATA_LOSS,
    and the namespace's listing still shows every other one."""

    def setter(field: str, value: object) -> Callable:
        return lambda m: m.__setitem__(field, value)

    out_of_range = {
        "negative": setter("generation", -5),
        "huge": setter("generation", 2**70),
        "infinite": setter("generation", float("inf")),  # JSON's Infinity
        "overflowing": setter("created_unix_ms", 1e400),
        "wide-token": lambda m: m["token_ids"].__setitem__(0, 2**40),
    }
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    with store.client() as c:
        save(c, "good", list(range(1, 100)))
        save(c, "bad", list(range(1, 100)) + [3] * 20)
        for i, name in enumerate(out_of_range):
            save(c, name, list(range(1, 100)) + [4 + i] * 20)
        wait_for("the uploads", lambda: uploaded(c))
    store.stop()
    rewrite_manifest(weed, bucket, "bad", lambda m: m["blocks"][0].pop("num_bytes"))
    for name, change in out_of_range.items():
        rewrite_manifest(weed, bucket, name, change)
    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            assert [a.agent_id for a in c.list_agents(NS)] == ["good"]
            with pytest.raises(CorruptRecord, match="does not decode"):
                c.get_agent(NS, "bad")
            for name in out_of_range:
                with pytest.raises(CorruptRecord, match=r"does not decode|out of range"):
                    c.get_agent(NS, name)
            assert c.get_agent(NS, "good").generation == 1
    finally:
        fresh.stop()


def rewrite_manifest(weed: WeedServer, prefix: str, agent: str, change: Callable) -> None:
    """Changes an agent's manifest in the bucket, its checksum made anew: whole as bytes."""
    s3, name = weed.client(), f"{prefix}/{NS}/agents/{agent}"
    got = s3.get_object(Bucket=BUCKET, Key=name)
    m = json.loads(got["Body"].read())
    change(m)
    body = json.dumps(m).encode()
    meta = {**got["Metadata"], "agentkv-xxh3": f"{xxhash.xxh3_64_intdigest(body):016x}"}
    s3.put_object(Bucket=BUCKET, Key=name, Body=body, Metadata=meta)


def test_a_manifest_whose_tokens_are_not_its_blocks_restores_no_block(weed, bucket, tmp_path):
    tokens = list(range(1, 200))
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    with store.client() as c:
        save(c, "a", tokens)
        wait_for("the upload", lambda: uploaded(c))
    store.stop()
    other = [9] * 10 + tokens[10:]  # the first block's tokens changed, its key kept

    def swap(m: dict) -> None:
        m["token_ids"] = other

    rewrite_manifest(weed, bucket, "a", swap)
    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            m = c.get_agent(NS, "a", FP)
            assert list(m.token_ids) == other and list(m.block_keys) == []  # all re-prefilled
    finally:
        fresh.stop()


# races and states a process cannot be steered into: the store in this process, the real bucket


def in_process_store(weed: WeedServer, prefix: str, data_dir: Path, **options):
    from cache_store.config import StoreConfig
    from cache_store.store import CacheStore

    location = f"s3://{BUCKET}/{prefix}"
    config = StoreConfig(data_dir=data_dir, object_store=location, s3_endpoint=weed.endpoint)
    return CacheStore(replace(config, gc_idle_seconds=0, **options))


def put_blocks(store, blocks) -> None:
    from cache_store.uploads import PutHeader

    items = []
    for b in blocks:
        tensors = [(t.name, t.dtype, list(t.shape)) for t in b.tensors]
        items.append(PutHeader(NS, FP, b.parent_key, b.token_ids, tensors))
        items += [memoryview(bytes(t.data)) for t in b.tensors]
    _, lease, _ = store.put_stream(iter(items))
    store.leases.release(lease)


def commit(store, agent: str, tokens: list[int], keys: list[bytes], gen: int):
    from cache_store.manifests import Commit

    return store.commit_agent(Commit(NS, agent, FP, gen, tokens, keys))


def settled(store) -> bool:
    return store.tier.state == "ok" and store.tier.pending() == 0


def test_a_write_of_an_agent_evicted_here_waits_for_the_bucket(bucket, tmp_path):
    weed = WeedServer(tmp_path / "weed").start()  # its own: this test stops it
    store = in_process_store(weed, bucket, tmp_path / "s", evict_agents=True)
    try:
        tokens = list(range(1, 130))
        blocks, keys = make_chain(tokens)
        put_blocks(store, blocks)
        commit(store, "a", tokens, keys, 0)
        wait_for("the upload", lambda: settled(store))
        with store.capacity._lock:  # what a full disk does: a's blocks are safe in the bucket
            assert store.capacity._evict_one_agent(None)
        weed.stop(kill=True)
        # Not a new agent "a" at generation 1, whose upload would replace the bucket's.
        with pytest.raises(Unavailable, match="cannot be asked"):
            commit(store, "a", tokens[:64], keys[:1], 0)
        with pytest.raises(Unavailable, match="cannot be asked"):
            store.delete_agent(NS, "a")
        # Known to be in the bucket: not "may be new", which a worker's CreateAgent would
        # take as leave to make it again; one this store never saw may be.
        with pytest.raises(Unavailable, match="cannot be asked") as known:
            store.get_agent(NS, "a")
        assert not isinstance(known.value, BucketUnreachable)
        with pytest.raises(BucketUnreachable):
            store.get_agent(NS, "never-seen")
        # No upload waits, yet the reads that got no answer say the state: a probe then
        # finds the bucket back, as no upload would.
        assert store.tier.state == "unreachable"
        weed.start()
        wait_for("the probe to find the bucket", lambda: store.tier.state == "ok")
        wait_for("the bucket to answer", lambda: answers(lambda: store.get_agent(NS, "a")))
        assert store.get_agent(NS, "a").record.token_ids == tokens
        commit(store, "a", tokens[:64], keys[:1], 1)
        wait_for("the upload", lambda: settled(store))
        (m,) = bucket_manifests(weed, bucket).values()
        assert m["generation"] == 2 and m["token_ids"] == tokens[:64]
    finally:
        store.close()
        weed.stop(kill=True)


def test_a_block_collected_and_put_anew_during_its_upload_is_uploaded_itself(
    weed, bucket, tmp_path
):
    store = in_process_store(weed, bucket, tmp_path / "s")
    try:
        (old,), (key,) = make_chain(list(range(1, 50)), seed=1)
        (new,), _ = make_chain(list(range(1, 50)), seed=2)  # the same key, other bytes
        put_in_flight = store.tier.bucket.put

        def put(name: str, body: bytes, *args, **kwargs):
            if name.endswith(f"{key.hex()}.safetensors") and put.body is None:
                put.body = body
                assert store.collect_garbage(NS)[0] == 1  # unreferenced: collected mid-upload
                put_blocks(store, [new])
            return put_in_flight(name, body, *args, **kwargs)

        put.body = None
        store.tier.bucket.put = put
        put_blocks(store, [old])
        wait_for("the uploads", lambda: settled(store) and put.body is not None)
        s3 = weed.client()
        there = s3.get_object(Bucket=BUCKET, Key=f"{bucket}/{NS}/blocks/{key.hex()}.safetensors")
        with store.index.read() as txn:
            record = store.index.find_block(txn, NS, key)
        here = b"".join(store.parts.payloads.read(record, record.segments, record.num_bytes))
        assert there["Body"].read() == here != put.body  # the new block's bytes
    finally:
        store.close()


# several stores, one bucket


def test_two_stores_racing_for_a_namespace_one_writes(weed, bucket, tmp_path):
    stores = [start_store(tmp_path, n, tier_args(weed, bucket)) for n in ("a", "b")]
    outcomes: list[object] = [None, None]
    barrier = threading.Barrier(2)

    def commit(i: int) -> None:
        with stores[i].client() as c:
            barrier.wait()
            try:
                save(c, "shared", list(range(1, 100)), seed=i)
                outcomes[i] = "committed"
            except AgentKVError as exc:
                outcomes[i] = exc

    try:
        threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(map(str, outcomes)).count("committed") == 1, outcomes
        winner = outcomes.index("committed")
        loser = outcomes[1 - winner]
        assert isinstance(loser, FailedPrecondition) and "is written by store" in loser.message
        with stores[winner].client() as c:
            wait_for("the winner's uploads", lambda: uploaded(c))
        (m,) = bucket_manifests(weed, bucket).values()
        assert m["generation"] == 1
        with stores[1 - winner].client() as c:
            assert c.get_agent(NS, "shared").generation == 1  # the loser reads it
        stores[winner].stop()  # a clean stop hands the lease back
        with stores[1 - winner].client() as c:
            tokens = list(range(1, 100)) + [5] * 40
            blocks, _ = make_chain(tokens, seed=winner)
            c.save_agent(NS, "shared", FP, tokens, blocks, expected_generation=1)
            wait_for("the new writer's uploads", lambda: uploaded(c))
        (m,) = bucket_manifests(weed, bucket).values()
        assert m["generation"] == 2 and len(m["token_ids"]) == len(tokens)
    finally:
        for s in stores:
            s.stop()


def test_an_agent_the_writer_deleted_is_gone_from_a_store_that_read_it(weed, bucket, tmp_path):
    """A store that only reads a namespace (another store holds its writer lease) keeps a
    copy of each agent it reads. The writer deleted one, in the bucket too; the reader
    served its copy on (its bucket check found no newer generation, and no manifest at
    all), and listed it, and once it took the namespace over the agent came back. It is
    gone there too now: the bucket held it at that generation, and holds it no longer."""
    writer = start_store(tmp_path, "writer", tier_args(weed, bucket))
    reader = start_store(tmp_path, "reader", tier_args(weed, bucket))
    try:
        with writer.client() as w, reader.client() as r:
            for agent in ("gone", "kept"):
                save(w, agent, list(range(1, 100)))
            wait_for("the uploads", lambda: uploaded(w))
            assert r.get_agent(NS, "gone").generation == 1  # a copy on the reader now
            w.delete_agent(NS, "gone")
            wait_for("the deletion's upload", lambda: uploaded(w))
            assert [a.agent_id for a in r.list_agents(NS)] == ["kept"]  # it listed "gone"
            with pytest.raises(AgentNotFound):
                r.get_agent(NS, "gone")
            assert r.get_agent(NS, "kept").generation == 1
        writer.stop()  # a clean stop hands the lease back: the reader may write
        with reader.client() as r:
            with pytest.raises(AgentNotFound):
                r.get_agent(NS, "gone")
            save(r, "kept", list(range(1, 150)), gen=1)  # it writes the namespace now
            wait_for("the reader's uploads", lambda: uploaded(r))
        assert set(bucket_manifests(weed, bucket)) == {f"{bucket}/{NS}/agents/kept"}
        assert "agent deleted in the object store: dropped here" in reader.log_text()
    finally:
        writer.stop()
        reader.stop()


def test_a_worker_on_a_store_that_only_reads_the_namespace_says_so_and_keeps_the_turn(
    weed, bucket, tmp_path, tiny_model_dirs
):
    """A worker whose store only reads the namespace (another store holds its writer lease):
    a durable call was UNAVAILABLE (NotCommitted), which a retry never clears while that
    store writes, and its write was tried again every 2 s. Now FAILED_PRECONDITION with the
    store's words; the agent stays in the worker's RAM, and its writes back off."""
    writer = start_store(tmp_path, "writer", tier_args(weed, bucket))
    reader = start_store(tmp_path, "reader", tier_args(weed, bucket))
    model = str(tiny_model_dirs["llama"])
    worker = worker_process(model, reader.address, tmp_path / "w.log").start()
    try:
        with writer.client() as c:
            save(c, "held", list(range(1, 100)))  # the writer lease is the writer's now
        with WorkerClient(worker.address) as w:
            w.create_agent(NS, "kept", SYSTEM)
            ask = [("user", "Which ships came by?")]
            with pytest.raises(FailedPrecondition, match="is written by store") as refused:
                w.turn(NS, "kept", ask, max_tokens=4, durable=True)
            assert "stays in this worker's RAM" in refused.value.message
            turn = w.turn(NS, "kept", [("user", "And then?")], max_tokens=4)
            assert turn.usage.cache_state == "hot"  # kept, and its turns go on
            state = w.describe(NS, "kept")
            assert state.persisted_tokens < state.num_tokens
    finally:
        worker.stop()
        reader.stop()
        writer.stop()


def test_a_store_that_takes_a_namespace_over_writes_on_the_buckets_latest(weed, bucket, tmp_path):
    a, b = (start_store(tmp_path, n, tier_args(weed, bucket)) for n in ("a", "b"))
    try:
        tokens = list(range(1, 100))
        with a.client() as c:
            save(c, "x", tokens)  # a writes the namespace
            wait_for("a's upload", lambda: uploaded(c))
        with b.client() as c:
            assert c.get_agent(NS, "x").generation == 1  # b reads it: its copy, generation 1
        with a.client() as c:
            tokens = tokens + [5] * 40
            c.save_agent(NS, "x", FP, tokens, make_chain(tokens)[0], expected_generation=1)
            wait_for("a's second upload", lambda: uploaded(c))
        a.stop()  # a clean stop hands the lease back
        with b.client() as c:
            grown = tokens + [6] * 30
            blocks, keys = make_chain(grown)
            c.save_agent(NS, "x", FP, grown, blocks, expected_generation=2)
            assert_restores(c, "x", grown, blocks, keys)
            assert c.get_agent(NS, "x").generation == 3
            wait_for("b's upload", lambda: uploaded(c))
        (m,) = bucket_manifests(weed, bucket).values()
        assert m["generation"] == 3 and m["token_ids"] == grown
    finally:
        a.stop()
        b.stop()


def test_deletes_reach_the_bucket_and_its_history_is_never_overwritten(weed, bucket, tmp_path):
    store = start_store(tmp_path, "a", tier_args(weed, bucket))
    try:
        with store.client() as c:
            save(c, "gone", list(range(1, 100)))
            save(c, "kept", list(range(1, 100)) + [9] * 10)
            wait_for("the uploads", lambda: uploaded(c))
            c.delete_agent(NS, "gone")
            with pytest.raises(AgentNotFound):
                c.get_agent(NS, "gone")  # not fetched back while its deletion is queued
            wait_for("the deletion", lambda: uploaded(c))
            assert [m["agent_id"] for m in bucket_manifests(weed, bucket).values()] == ["kept"]
            assert [a.agent_id for a in c.list_agents(NS)] == ["kept"]
    finally:
        store.stop()
    fresh = start_store(tmp_path, "fresh", tier_args(weed, bucket))
    try:
        with fresh.client() as c:
            with pytest.raises(AgentNotFound):
                c.get_agent(NS, "gone")
            # A create of an agent only the bucket holds meets its generation, not 0.
            with pytest.raises(GenerationConflict):
                save(c, "kept", [5] * 70, seed=3)
            assert c.get_agent(NS, "kept").generation == 1
    finally:
        fresh.stop()
    (m,) = bucket_manifests(weed, bucket).values()
    assert m["agent_id"] == "kept" and len(m["token_ids"]) == 109


def written(call: Callable) -> bool:
    """Whether a write got through: refused while another store's writer lease is live."""
    try:
        call()
        return True
    except FailedPrecondition:
        return False


def test_a_deletion_queued_while_the_bucket_was_down_spares_what_another_store_wrote_since(
    bucket, tmp_path
):
    """a deletes w (b's, read here), x, y and z while the bucket is down; b then grows x and
    makes z anew; a's deletions, carried out later, delete w and y only."""
    weed = WeedServer(tmp_path / "weed").start()  # its own: this test stops it
    args = tier_args(weed, bucket, "--writer-lease-seconds", "6")
    tokens = {name: [i * 1000 + t for t in range(1, 100)] for i, name in enumerate("wxyz", 1)}
    seeds = {name: i * 10 for i, name in enumerate("wxyz", 1)}
    a = b = None
    try:
        b = start_store(tmp_path, "b", args)
        with b.client() as c:
            save(c, "w", tokens["w"], seed=seeds["w"])
            wait_for("b's upload", lambda: uploaded(c))
        b.stop()  # a clean stop hands the lease back
        a = start_store(tmp_path, "a", args)
        with a.client() as c:
            assert c.get_agent(NS, "w").generation == 1  # b's, fetched here
            for name in "xyz":
                save(c, name, tokens[name], seed=seeds[name])
            wait_for("a's uploads", lambda: uploaded(c))
            weed.stop(kill=True)
            for name in "wxyz":
                c.delete_agent(NS, name)  # their deletions there wait for the bucket
            wait_for("'unreachable'", lambda: c.stats().object_store_state == "unreachable")
        a.stop()  # the deletions stay queued in its index
        weed.start()
        b = start_store(tmp_path, "b", args)
        grown, anew = tokens["x"] + [5] * 40, [7] * 80
        with b.client() as c:  # once a's lease lapses, b writes: x grown, z deleted and made anew
            wait_for("the bucket to answer", lambda: answers(lambda: c.get_agent(NS, "x")))
            x_blocks = make_chain(grown, seed=seeds["x"])[0]
            grow = partial(c.save_agent, NS, "x", FP, grown, x_blocks, expected_generation=1)
            wait_for("a's lease to lapse", lambda: written(grow))
            assert c.get_agent(NS, "z").generation == 1
            c.delete_agent(NS, "z")
            wait_for("b's deletion", lambda: uploaded(c))
            z_blocks, z_keys = save(c, "z", anew, seed=99)
            wait_for("b's uploads", lambda: uploaded(c))
        b.stop()
        a = start_store(tmp_path, "a", args)  # its queued deletions go out now
        with a.client() as c:
            wait_for("a's deletions", lambda: not {"w", "y"} & bucket_agents(weed, bucket))
            wait_for("a's uploads", lambda: uploaded(c))
            manifests = {m["agent_id"]: m for m in bucket_manifests(weed, bucket).values()}
            assert sorted(manifests) == ["x", "z"]  # b's versions stand
            assert manifests["x"]["generation"] == 2 and manifests["x"]["token_ids"] == grown
            assert manifests["z"]["generation"] == 2 and manifests["z"]["token_ids"] == anew
            assert c.get_agent(NS, "x").generation == 2  # and a reads them
            assert_restores(c, "z", anew, z_blocks, z_keys)
            for name in "wy":
                with pytest.raises(AgentNotFound):
                    c.get_agent(NS, name)
    finally:
        for store in (a, b):
            if store is not None:
                store.stop()
        weed.stop(kill=True)


def test_an_index_from_before_uploaded_ids_still_deletes_another_stores_agent_it_read(
    weed, bucket, tmp_path
):
    b = start_store(tmp_path, "b", tier_args(weed, bucket))
    with b.client() as c:
        save(c, "w", list(range(1, 100)))
        wait_for("b's upload", lambda: uploaded(c))
    b.stop()  # a clean stop hands the lease back
    store = in_process_store(weed, bucket, tmp_path / "a")
    try:
        assert store.get_agent(NS, "w").record.generation == 1  # b's, fetched here
        with store.index.write() as txn:  # as an index written before the table holds it
            txn.drop(store.index.dbs["uploaded_ids"], delete=False)
        store.delete_agent(NS, "w")
        wait_for("the deletion", lambda: settled(store))
        assert bucket_agents(weed, bucket) == set()
    finally:
        store.close()


def test_no_credentials_is_a_refusal_not_a_bucket_that_did_not_answer(monkeypatch, tmp_path):
    """botocore refuses to send a request it cannot sign: Refused, naming what to check,
    and the bucket is not taken for down (its other requests are not failed unsent)."""
    from cache_store import objects
    from cache_store.metrics import StoreMetrics

    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):  # every provider botocore would ask
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    with socket.create_server(("127.0.0.1", 0)) as nobody:  # nothing is ever sent to it
        location = objects.Location.parse(f"s3://{BUCKET}/p")
        endpoint = f"http://127.0.0.1:{nobody.getsockname()[1]}"
        bucket = objects.Bucket(location, endpoint, StoreMetrics(), timeout_seconds=0.5)
        for _ in range(2):
            with pytest.raises(objects.Refused, match=r"NoCredentialsError.*check the store's S3"):
                bucket.head("a")
            assert not bucket.down


def test_a_hung_object_store_holds_one_request_at_a_time(monkeypatch):
    """An endpoint that takes connections and never answers: a request gives up after two
    tries; until one gets an answer, one request at a time tries and the others fail at once
    (an RPC thread of the store is not held while its local tier could answer)."""
    from cache_store import objects
    from cache_store.metrics import StoreMetrics

    monkeypatch.setattr(objects, "BREAK_SECONDS", 0.0)  # the next request tries at once
    taken: list[socket.socket] = []  # held open: never answered

    def connections() -> int:
        with contextlib.suppress(BlockingIOError):
            while True:
                taken.append(hung.accept()[0])
        return len(taken)

    with socket.create_server(("127.0.0.1", 0), backlog=64) as hung:
        hung.setblocking(False)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        location = objects.Location.parse(f"s3://{BUCKET}/p")
        # 2 s a try: the probe below waits 4 s in all, the window for a request meanwhile
        bucket = objects.Bucket(location, endpoint, StoreMetrics(), timeout_seconds=2.0)
        with pytest.raises(objects.ObjectStoreDown, match="Read timeout"):
            bucket.head("a")
        assert connections() == 2  # two tries, not three
        failed: list[objects.ObjectStoreDown] = []

        def head() -> None:
            try:
                bucket.head("a")
            except objects.ObjectStoreDown as exc:
                failed.append(exc)

        probe = threading.Thread(target=head)
        probe.start()
        wait_for("the probe's first try", lambda: connections() >= 3)
        assert probe.is_alive()  # still trying
        with pytest.raises(objects.ObjectStoreDown, match="not tried again"):
            bucket.get("b")  # while the probe waits: at once, untried
        probe.join()
        assert connections() == 4  # the probe's two tries, none of the request's
        assert len(failed) == 1 and "Read timeout" in failed[0].message
        for conn in taken:
            conn.close()


def test_a_bad_object_store_flag_is_a_clear_error(tmp_path):
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "cache_store", "--data-dir", str(tmp_path / "d")]
        + ["--object-store", "https://bucket/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "s3://BUCKET" in done.stderr
    for name in ("a!b", "a b", "x" * 256):  # botocore refuses to send these
        done = subprocess.run(
            [sys.executable, "-m", "cache_store", "--data-dir", str(tmp_path / "d")]
            + ["--object-store", f"s3://{name}/p"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1].endswith(
            f"error: --object-store s3://{name}/p: {name!r} is no bucket name: one is up to "
            "255 letters, digits, dots, hyphens and underscores"
        ), done.stderr


def test_a_data_dir_written_through_one_bucket_refuses_another(weed, bucket, tmp_path):
    import subprocess

    store = start_store(tmp_path, "s", tier_args(weed, bucket))
    with store.client() as c:
        blocks, keys = save(c, "a", list(range(1, 100)))
        wait_for("the upload", lambda: uploaded(c))
    store.stop()
    done = subprocess.run(
        [sys.executable, "-m", "cache_store", "--data-dir", str(tmp_path / "s")]
        + tier_args(weed, bucket + "-elsewhere"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"written through --object-store s3://{BUCKET}/{bucket}/, not" in done.stderr
    store = start_store(tmp_path, "s", tier_args(weed, bucket))  # its own bucket: as before
    with store.client() as c:
        assert_restores(c, "a", list(range(1, 100)), blocks, keys)
    store.stop()


if __name__ == "__main__":  # the crashing store of test_kill9_during_uploads_...
    crashing_store(os.environ["CRASH_AT"], sys.argv[1:])
