"""The worker end to end: store and worker as separate processes, driven through the stubs.

Greedy continuations match token for token whether the agent stayed hot, was restored by
streaming or by locate, or its worker was killed and restarted; a corrupt block costs a
re-prefill, never a wrong answer; bad input gets a precise status and the worker serves on.
"""

from __future__ import annotations

import os
import urllib.request

import grpc
import pytest

from agentkv.client.worker import WorkerClient
from agentkv.errors import (
    AgentExists,
    AgentNotFound,
    FingerprintMismatch,
    InvalidArgument,
    OutOfRange,
)
from agentkv.v1 import store_pb2
from tests.conftest import ARCHS

SYSTEM = "You are the warden of the prison. " * 12  # about 100 tokens: a full block and more
Q1 = [("user", "Where were you on the night of the fourteenth?")]
Q2 = [("user", "Prove it, prisoner.")]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuations_match_across_evict_restore_and_restart(
    tiny_model_dirs, start_worker, arch
):
    model = tiny_model_dirs[arch]
    locate = WorkerClient(start_worker(model, "--restore-path", "locate", name="locate").address)
    stream = WorkerClient(start_worker(model, "--restore-path", "stream", name="stream").address)
    doomed = start_worker(model, name="doomed")
    workers = {
        "hot": locate,
        "stream": stream,
        "locate": locate,
        "restart": WorkerClient(doomed.address),
    }
    for ns, w in workers.items():
        w.create_agent(ns, "warden", SYSTEM)
        assert len(w.turn(ns, "warden", Q1, max_tokens=8).token_ids) == 8
    stream.evict("stream", "warden")
    locate.evict("locate", "warden")
    workers["restart"].wait_durable("restart", "warden")
    doomed.kill9()
    workers["restart"] = WorkerClient(start_worker(model, name="reborn").address)
    replies = {ns: w.turn(ns, "warden", Q2, max_tokens=32) for ns, w in workers.items()}
    hot = replies["hot"]
    assert hot.usage.cache_state == "hot" and len(hot.token_ids) == 32
    for ns in ("stream", "locate", "restart"):
        r = replies[ns]
        assert r.token_ids == hot.token_ids, ns
        assert r.usage.cache_state == "warm" and not r.usage.restore_failure
        assert r.usage.restore_path == ("stream" if ns == "stream" else "locate")
        assert r.usage.reused_store_tokens == hot.usage.reused_hot_tokens
        assert r.usage.prefilled_tokens == hot.usage.prefilled_tokens
    # Seeded sampling too: the tiny llama's greedy reply repeats one token that hangs on the
    # last few, while a sample at temperature 1 hangs on every logit.
    sampled = {
        ns: w.turn(ns, "warden", Q1, max_tokens=16, temperature=1.0, seed=11).token_ids
        for ns, w in workers.items()
    }
    assert len(set(map(tuple, sampled.values()))) == 1, sampled


@pytest.mark.parametrize("arch", ARCHS)
def test_restored_logits_are_bit_identical(tiny_model_dirs, store_process, arch):
    """In-process engine against the real store: hot and restored next-token logits."""
    import mlx.core as mx

    from agentkv.client.store import StoreClient
    from inference_worker.config import WorkerConfig
    from inference_worker.conversation import ChatMessage
    from inference_worker.engine import Engine
    from inference_worker.metrics import WorkerMetrics
    from inference_worker.runtime import resolve_runtime
    from inference_worker.sampling import Sampling
    from inference_worker.turns import END, TurnJob

    path = tiny_model_dirs[arch]
    config = WorkerConfig(
        str(path),
        store=store_process.address,
        block_tokens=64,
        quantized_query_max=1,
        restore_path="stream",
    )
    client = StoreClient(store_process.address)
    engine = Engine(config, resolve_runtime(config), client, WorkerMetrics())
    try:
        create = TurnJob("default", "a", [], Sampling(max_tokens=0), creates=True)
        start = engine.chat.start(SYSTEM)  # the stable prefix, as Front renders it
        engine.submit(engine.create_agent, create, SYSTEM, {}, start).result()
        job = TurnJob("default", "a", [ChatMessage(*Q1[0])], Sampling(max_tokens=0))
        engine.submit(engine.start_turn, job).result()
        for started in (create, job):
            while started.events.get(timeout=120) is not END:
                pass
        engine.persister.flush()

        def compare():
            hot = engine.hot.get(("default", "a"))
            warm = engine.restorer.restore("default", "a").agent
            assert warm.tokens == hot.tokens and warm.cached == hot.cached
            x = mx.array([[hot.tokens[-1]]])
            for c in hot.caches + warm.caches:
                c.trim(1)
            model = engine.model
            return mx.array_equal(model(x, cache=hot.caches), model(x, cache=warm.caches)).item()

        assert engine.submit(compare).result()
    finally:
        engine.close()
        client.close()


def test_multi_turn_context_equals_the_whole_conversation_tokenized(
    tiny_models, tiny_model_dirs, start_worker, store
):
    _, tokenizer = tiny_models["llama"]
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("default", "analyst", "You analyse.")
    conversation = [
        ("user", "First question?"),
        ("assistant", "First answer."),
        ("user", "Second question?"),
        ("assistant", "Second answer."),
    ]
    for i in range(0, 4, 2):
        w.turn("default", "analyst", conversation[i : i + 2], max_tokens=0)
    w.wait_durable("default", "analyst")
    messages = [{"role": "system", "content": "You analyse."}] + [
        {"role": r, "content": c} for r, c in conversation
    ]
    whole = tokenizer.apply_chat_template(messages)
    fp = w.info().fingerprint
    assert list(store.get_agent("default", "analyst", fingerprint=fp).token_ids) == whole
    reply = w.turn("default", "analyst", [("user", "Third?")], max_tokens=5)
    w.wait_durable("default", "analyst")
    asked = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": "Third?"}], add_generation_prompt=True
    )
    stored = list(store.get_agent("default", "analyst").token_ids)
    assert stored == asked + reply.token_ids
    assert stored.count(tokenizer.bos_token_id) == 1


def test_corrupt_block_costs_a_reprefill_not_a_wrong_answer(
    tiny_model_dirs, start_worker, store_process, store
):
    """One agent gets a flipped byte, its twin a truncated file, a third loses every file
    (each in its own namespace, so no shared blocks). All must re-prefill and so answer
    alike; the bad files are quarantined, so the next restore is clean."""
    proc = start_worker(tiny_model_dirs["llama"], "--metrics-listen", "127.0.0.1:0")
    w = WorkerClient(proc.address)
    fp = w.info().fingerprint
    located = {}
    damaged = ("flipped", "truncated", "wiped")
    for ns in damaged:
        w.create_agent(ns, "warden", SYSTEM)
        w.turn(ns, "warden", Q1, max_tokens=8)
        w.evict(ns, "warden")
        keys = store.get_agent(ns, "warden").block_keys
        request = store_pb2.LocateBlocksRequest(namespace=ns, fingerprint=fp, keys=keys)
        located[ns] = store.call("LocateBlocks", request).blocks
    with open(located["flipped"][-1].path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(located["truncated"][0].path, os.path.getsize(located["truncated"][0].path) // 2)
    for location in located["wiped"]:
        os.remove(location.path)
    replies = {ns: w.turn(ns, "warden", Q2, max_tokens=16) for ns in damaged}
    assert replies["flipped"].token_ids == replies["truncated"].token_ids
    assert replies["flipped"].token_ids == replies["wiped"].token_ids
    for reply in replies.values():
        assert reply.usage.cache_state == "cold" and reply.usage.restore_failure
        assert reply.usage.prefilled_tokens == reply.usage.prompt_tokens
    assert "checksum" in replies["flipped"].usage.restore_failure
    assert "missing" in replies["wiped"].usage.restore_failure
    assert store.stats().num_quarantined >= 3
    for ns in damaged:  # the re-prefill wrote the blocks anew: a clean warm restore now
        w.wait_durable(ns, "warden")
        w.evict(ns, "warden")
        again = w.turn(ns, "warden", [("user", "Once more.")], max_tokens=4)
        assert again.usage.cache_state == "warm", (ns, again.usage.restore_failure)
        assert not again.usage.restore_failure
    serving = proc._find_event("serving", 0)
    text = urllib.request.urlopen(f"http://{serving['metrics']}/metrics", timeout=10).read()
    assert b"agentkv_worker_restore_failures_total 3.0" in text


def test_a_worker_that_cannot_see_the_store_s_files_streams_them(
    tiny_model_dirs, store_process, tmp_path
):
    """The reviewer's: under --restore-path auto a store on loopback meant its files were
    readable here, which a worker in another mount namespace (a sidecar, a container on the
    host's network) cannot: every restore failed, "missing", was reported as corruption,
    and re-prefilled. The store reads them instead (GetBlocks), and later restores stream."""
    import subprocess

    from agentkv.launch import worker_process

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespaces here (unshare -m)")
    hidden = f'mount -t tmpfs none {store_process.data_dir} && exec "$@"'
    proc = worker_process(
        str(tiny_model_dirs["llama"]),
        store_process.address,
        tmp_path / "worker.log",
        extra_args=["--block-tokens", "64"],
    )
    proc.prefix = ("unshare", "-m", "sh", "-c", hidden, "sh")
    proc.start()
    try:
        w = WorkerClient(proc.address)
        w.create_agent("ns", "warden", SYSTEM)
        w.turn("ns", "warden", Q1, max_tokens=8)
        for _ in range(2):
            w.wait_durable("ns", "warden")
            w.evict("ns", "warden")
            reply = w.turn("ns", "warden", Q2, max_tokens=4)
            assert reply.usage.cache_state == "warm", reply.usage.restore_failure
            assert reply.usage.restore_path == "stream" and not reply.usage.restore_failure
        assert "restores stream from now on" in proc.log_tail(200_000)
        with store_process.client() as store:  # asked, the store found its files whole
            assert store.stats().num_quarantined == 0
    finally:
        proc.stop()


def test_fit_max_tokens_generates_into_the_room_left(tiny_model_dirs, start_worker):
    """With fit_max_tokens (a gateway request naming no max_tokens), a turn whose prompt plus
    max_tokens passes the model's 4,096 tokens generates into the room left, up to the limit,
    where before it was refused; without it, it still is. A full context is refused."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    w.create_agent("default", "long", SYSTEM)
    w.turn("default", "long", [("user", "tell me more " * 418)], max_tokens=0)
    held = w.describe("default", "long").num_tokens
    assert 3900 < held < 4050, held  # the tiny tokenizer's count for those words
    with pytest.raises(OutOfRange, match="4096"):
        w.turn("default", "long", Q1, max_tokens=500)
    reply = w.turn("default", "long", Q1, max_tokens=500, fit_max_tokens=True)
    u = reply.usage
    assert u.finish_reason == "length" and u.prompt_tokens + u.generated_tokens == 4096, u
    with pytest.raises(OutOfRange, match="4096"):
        w.turn("default", "long", Q1, max_tokens=500, fit_max_tokens=True)


MANY = {f"key{i}": "value" for i in range(60)}  # the store's limit is 64 entries
HUGE = [("user", "x" * 2_000_000)]  # over 4,096 tokens of up to 488 characters each


def test_bad_input_gets_precise_statuses_and_the_worker_serves_on(tiny_model_dirs, start_worker):
    llama = WorkerClient(start_worker(tiny_model_dirs["llama"], name="llama").address)
    gemma = WorkerClient(start_worker(tiny_model_dirs["gemma3_text"], name="gemma").address)
    llama.create_agent("tenant-a", "warden", SYSTEM)
    llama.wait_durable("tenant-a", "warden")  # the gemma worker reads it from the store
    cases = [
        (lambda: llama.turn("tenant-a", "nobody", Q1, max_tokens=4), AgentNotFound, "nobody"),
        (lambda: llama.turn("tenant-b", "warden", Q1, max_tokens=4), AgentNotFound, "tenant-b"),
        (lambda: llama.turn("tenant-a", "warden", Q1, max_tokens=5000), OutOfRange, "4096"),
        # 2 MB of text: refused before it is tokenized, which would stall every decode
        (lambda: llama.turn("tenant-a", "warden", HUGE), OutOfRange, "however they tokenize"),
        (lambda: llama.inject("tenant-a", "warden", HUGE), OutOfRange, "however they tokenize"),
        (lambda: llama.turn("tenant-a", "warden", Q1, temperature=-1), InvalidArgument, "-1"),
        (lambda: llama.turn("tenant-a", "warden", Q1, top_p=2.0), InvalidArgument, "top_p"),
        (lambda: llama.turn("tenant-a", "warden", Q1, stop=[""]), InvalidArgument, "stop"),
        (lambda: llama.turn("tenant-a", "warden", [("robot", "hi")]), InvalidArgument, "robot"),
        (lambda: llama.turn("tenant-a", "bad/id", Q1), InvalidArgument, "bad/id"),
        (lambda: llama.create_agent("tenant-a", "warden"), AgentExists, "warden"),
        # what the store would refuse at every save of the agent, refused before it is made
        (lambda: llama.turn("tenant-a", "warden", Q1, phase="p" * 300), InvalidArgument, "256"),
        (
            lambda: llama.create_agent("tenant-a", "a", SYSTEM, phase="p" * 300),
            InvalidArgument,
            "256",
        ),
        (
            lambda: llama.create_agent("tenant-a", "a", SYSTEM, metadata=MANY),
            InvalidArgument,
            "this worker keeps",
        ),
        (
            lambda: llama.turn("tenant-a", "warden", [], whole_conversation=True),
            InvalidArgument,
            "whole_conversation",
        ),
        (lambda: gemma.turn("tenant-a", "warden", Q1, max_tokens=4), FingerprintMismatch, "llama"),
    ]
    for call, error, named in cases:
        with pytest.raises(error) as info:
            call()
        assert named in info.value.message, info.value.message
        assert info.value.code != grpc.StatusCode.INTERNAL
    reply = llama.turn("tenant-a", "warden", Q1, max_tokens=4)
    assert len(reply.token_ids) == 4 and reply.usage.cache_state == "hot"


def test_an_agent_deleted_in_the_store_is_made_anew_where_a_worker_still_holds_it(
    tiny_model_dirs, start_worker, store_process
):
    """A worker's RAM copy of an agent that was committed, then deleted in the store (by
    another client, or a store that lost it): CreateAgent makes the agent anew, as a turn
    would find it gone, rather than answer that it exists and then fail its first turn."""
    from agentkv.client.store import StoreClient

    w = WorkerClient(start_worker(tiny_model_dirs["llama"], name="holder").address)
    first = w.create_agent("gone", "warden", SYSTEM)
    w.turn("gone", "warden", Q1, max_tokens=4)
    w.wait_durable("gone", "warden")
    assert w.describe("gone", "warden").tier == "hot"
    with StoreClient(store_process.address) as store:
        store.delete_agent("gone", "warden")
    made = w.create_agent("gone", "warden", SYSTEM)
    assert made.num_tokens == first.num_tokens  # the system prompt alone: no earlier turn
    reply = w.turn("gone", "warden", Q2, max_tokens=4)
    assert len(reply.token_ids) == 4 and reply.usage.cache_state == "hot"
    w.wait_durable("gone", "warden")
    with pytest.raises(AgentExists):  # made, and stored: now it exists
        w.create_agent("gone", "warden", SYSTEM)


def test_an_agent_deleted_with_the_cli_is_gone_for_the_worker_holding_it(
    tiny_model_dirs, start_worker, store_process
):
    """`agentkv store delete` while a worker holds the agent hot: its next turn is NOT_FOUND
    (the worker asks the store first), not an answer from the deleted conversation."""
    from tests.helpers import cli

    # the store's answer may be late on a busy machine: within 2 s, the RAM copy would stand
    holder = start_worker(tiny_model_dirs["llama"], "--store-check-timeout", "30", name="holder")
    w = WorkerClient(holder.address)
    w.create_agent("ops", "retired", SYSTEM)
    w.turn("ops", "retired", Q1, max_tokens=4)
    w.wait_durable("ops", "retired")
    assert w.describe("ops", "retired").tier == "hot"
    done = cli("store", "delete", "retired", "-n", "ops", store=store_process.address)
    assert done.returncode == 0 and done.stdout.startswith("deleted ops/retired;"), done.stderr
    with pytest.raises(AgentNotFound, match="retired"):
        w.turn("ops", "retired", Q2, max_tokens=4)


def test_a_worker_holding_a_deleted_agent_never_takes_one_made_anew_for_it(
    tiny_model_dirs, start_worker, store_process
):
    """An agent deleted, then made anew under its id through another worker, while a
    worker still holds the deleted one in RAM: the new agent's generations start past the
    deleted one's, so that worker's next turn of it finds its copy stale and restores the
    new agent. Before, both were at generation 2: the old copy answered "hot" and its
    commit wrote the deleted conversation over the new one's acknowledged durable turns."""
    from agentkv.client.store import StoreClient

    model = tiny_model_dirs["llama"]
    late = ("--store-check-timeout", "30")  # within 2 s, a late answer keeps the RAM copy
    old = WorkerClient(start_worker(model, *late, name="old").address)
    new = WorkerClient(start_worker(model, name="new").address)
    old.create_agent("again", "a", "You are Alice; the password is swordfish. " * 4)
    old.turn("again", "a", Q1, max_tokens=4, durable=True)  # generation 2 there
    with StoreClient(store_process.address) as store:
        deleted = store.get_agent("again", "a").generation
        store.delete_agent("again", "a")
        new.create_agent("again", "a", SYSTEM)
        new.turn("again", "a", Q1, max_tokens=4, durable=True)
        remade = store.get_agent("again", "a")
        assert remade.generation > deleted + 1  # past the deleted agent's generations
        reply = old.turn("again", "a", Q2, max_tokens=4, durable=True)
        assert reply.usage.cache_state == "warm"  # restored: its RAM copy was the old agent
        after = store.get_agent("again", "a")
    assert after.generation == remade.generation + 1
    assert after.token_ids[: len(remade.token_ids)] == remade.token_ids


def test_seeded_sampling_repeats_and_stop_strings_cut(tiny_model_dirs, start_worker):
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address)
    for agent in ("one", "two", "three"):
        w.create_agent("default", agent, SYSTEM)
    sampled = {
        agent: w.turn("default", agent, Q1, max_tokens=24, temperature=1.5, seed=seed).token_ids
        for agent, seed in (("one", 42), ("two", 42), ("three", 43))
    }
    assert sampled["one"] == sampled["two"]
    assert sampled["one"] != sampled["three"]
    zeros = []  # seed 0 crosses the wire as a seed (the proto's field has presence)
    for agent in ("zero-a", "zero-b"):
        w.create_agent("default", agent, SYSTEM)
        zeros.append(w.turn("default", agent, Q1, max_tokens=24, temperature=1.5, seed=0))
    assert zeros[0].token_ids == zeros[1].token_ids
    w.create_agent("default", "stopper", SYSTEM)
    free = w.turn("default", "stopper", Q1, max_tokens=24, temperature=1.5, seed=42)
    stop = free.text[5:8]
    w.create_agent("default", "stopper2", SYSTEM)
    cut = w.turn("default", "stopper2", Q1, max_tokens=24, temperature=1.5, seed=42, stop=[stop])
    assert cut.usage.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text) and len(cut.text) < len(free.text)
    assert cut.usage.stop_sequence == stop  # which one ended it (Anthropic's stop_sequence)
    assert not free.usage.stop_sequence
    # A stop string that never comes holds back its length less one character until the
    # end: a turn cut by max_tokens sends that too.
    w.create_agent("default", "stopper3", SYSTEM)
    held = w.turn("default", "stopper3", Q1, max_tokens=24, temperature=1.5, seed=42,
                  stop=["<never said>"])  # fmt: skip
    assert held.usage.finish_reason == "length" and held.text == free.text


@pytest.mark.parametrize("arch", ARCHS)
def test_a_first_turn_that_renders_the_start_differently_is_exact(
    tiny_model_dirs, start_worker, store, arch
):
    """An agent created without a system prompt holds the stable prefix of a user-first
    conversation; a first turn that starts with a system message renders another start, so
    the worker keeps only the tokens that match, in every layer, and prefills the rest. Its
    context is then exactly that of an agent created with the system prompt. (Their replies
    may differ by Q4 rounding: one attended the system prompt within its turn, in full
    precision, the other as stored.)"""
    w = WorkerClient(start_worker(tiny_model_dirs[arch]).address)
    w.create_agent("default", "late", "")
    w.create_agent("default", "early", SYSTEM)
    held = w.describe("default", "late").num_tokens
    late = w.turn("default", "late", [("system", SYSTEM), *Q1], max_tokens=12)
    early = w.turn("default", "early", Q1, max_tokens=12)
    assert late.usage.prompt_tokens == early.usage.prompt_tokens
    assert late.usage.cache_state == "hot" and 0 < late.usage.reused_hot_tokens < held
    assert late.usage.prefilled_tokens == late.usage.prompt_tokens - late.usage.reused_hot_tokens
    for agent in ("late", "early"):
        w.wait_durable("default", agent)
    fp = w.info().fingerprint
    stored = {
        a: list(store.get_agent("default", a, fingerprint=fp).token_ids) for a in ("late", "early")
    }
    n = early.usage.prompt_tokens
    assert stored["late"][:n] == stored["early"][:n]
    assert stored["late"][n:] == late.token_ids and stored["early"][n:] == early.token_ids
