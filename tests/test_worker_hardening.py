"""The worker under attack and bad luck, through real store and worker processes.

- A block that does not fit the model (tensors of another token count or head dim than its
  header and the layer say) is a restore failure, on both restore paths: the agent is
  re-prefilled from its tokens, exactly as one with no blocks is; it never enters a cache.
- One turn's failure inside a batch fails that turn alone, rolled out of its agent's context;
  a failure of the shared step fails every turn with a message of its own; no turn ever sees
  another's error text; a top_k the model cannot take is refused at submit.
- A hung (SIGSTOPped) store does not freeze the worker: a hot agent answers, GetWorkerInfo
  answers, while a turn that needs the store waits for it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from agentkv.client.blocks import Block, StoredBlock, Tensor
from agentkv.client.memory import AgentMemory
from agentkv.client.messages import pb_messages
from agentkv.client.worker import WorkerClient
from agentkv.errors import (
    AgentBusy,
    AgentExists,
    AgentKVError,
    AgentNotFound,
    CorruptRecord,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    TurnTaken,
    Unavailable,
)
from agentkv.keys import ROOT_KEY, block_key
from agentkv.launch import ServiceProcess
from agentkv.worker.v1 import worker_pb2 as pb
from inference_worker.kv_cache import NUMPY_DTYPES
from tests.faulty_worker import (
    BATCH_BYTES_LOG,
    CANCELLED_PREFILL_MARK,
    CANCELLED_PREFILL_SEED,
    FINISHED_LOG,
    HELD_STEP_GATE,
    HELD_STEP_SEED,
    REPLY_LOST_PHASE,
    ROW_FAULT_SEED,
    SECRET,
    SLOW_STEP_SEED,
    STARTED_LOG,
    STEP_FAULT_SEED,
    WRITES_HELD,
)
from tests.helpers import freeze, long_turn, metric, read_tokens
from tests.helpers import until as eventually

SYSTEM = "You are the archivist of the old library, and you index every scroll. " * 6
Q1 = [("user", "Which scrolls came in today?")]
Q2 = [("user", "Index them by century.")]
TALK = [("user", "Talk.")]
# Compared replies are sampled, seeded: greedy replies of the tiny random llama repeat one
# token that hangs on the last few, so only sampling shows the whole context was used.
SAMPLED = {"temperature": 1.0, "seed": 7}


# restored tensors are checked against the model


def arrays(block: StoredBlock) -> dict[str, tuple[str, np.ndarray]]:
    """The block's tensors as (dtype, array) by name, copied out of the read buffer."""
    return {
        t.name: (
            t.dtype,
            np.frombuffer(t.data, NUMPY_DTYPES[t.dtype]).reshape(tuple(t.shape)).copy(),
        )
        for t in block.tensors
    }


def fewer_tokens(i: int, name: str, a: np.ndarray) -> np.ndarray:
    """The first block's tensors hold 50 of its 64 tokens."""
    return a[:, :, :50] if i == 0 else a


def wider_heads(i: int, name: str, a: np.ndarray) -> np.ndarray:
    """Layer 0's keys, in every block, have twice the model's head dim."""
    return np.concatenate([a, a], axis=3) if name.startswith("layers.0.keys.") else a


def plant(store, fp: str, manifest, stored: list[StoredBlock], ns: str, lie) -> None:
    """Commits agent ns/agent with the manifest's context over its blocks altered by `lie`,
    as any writer in a namespace can: each block under the key its tokens give it."""
    blocks, parent = [], ROOT_KEY
    for i, block in enumerate(stored):
        tensors = [
            Tensor(name, dtype, (x := np.ascontiguousarray(lie(i, name, a))).shape, x)
            for name, (dtype, a) in arrays(block).items()
        ]
        blocks.append(Block(parent, list(block.token_ids), tensors))
        parent = block.key
    store.save_agent(
        ns,
        "agent",
        fp,
        list(manifest.token_ids),
        blocks,
        phase="",
        metadata=dict(manifest.metadata),
    )


@pytest.mark.parametrize("path", ["stream", "locate"])
def test_a_block_that_does_not_fit_the_model_is_a_restore_failure(
    tiny_model_dirs, start_worker, store, path
):
    proc = start_worker(
        tiny_model_dirs["llama"], "--restore-path", path, "--metrics-listen", "127.0.0.1:0"
    )
    w = WorkerClient(proc.address, timeout=60)
    fp = w.info().fingerprint
    w.create_agent("ref", "agent", SYSTEM)
    w.turn("ref", "agent", Q1, max_tokens=8, durable=True)
    manifest = store.get_agent("ref", "agent", fingerprint=fp)
    assert len(manifest.block_keys) >= 2 and manifest.block_num_tokens[0] == 64
    stored = list(store.get_blocks("ref", fp, list(manifest.block_keys)))
    plant(store, fp, manifest, stored, "short", fewer_tokens)
    plant(store, fp, manifest, stored, "wide", wider_heads)
    store.commit_agent(  # the same context with no blocks at all: an honest cold restore
        namespace="control",
        agent_id="agent",
        fingerprint=fp,
        token_ids=list(manifest.token_ids),
        metadata=dict(manifest.metadata),
    )

    control = w.turn("control", "agent", Q2, max_tokens=8, **SAMPLED)
    assert control.usage.cache_state == "cold" and not control.usage.restore_failure
    for ns, wrong in (("short", ", 50, "), ("wide", "layers.0.keys.packed is U32")):
        reply = w.turn(ns, "agent", Q2, max_tokens=8, **SAMPLED)
        failure = reply.usage.restore_failure
        assert failure.startswith("CorruptBlock:") and wrong in failure, failure
        assert "this model needs" in failure
        assert reply.usage.cache_state == "cold" and reply.usage.reused_store_tokens == 0
        assert reply.usage.restore_path == path
        # The whole context re-prefilled from its tokens: as the honest cold restore did.
        assert reply.usage.prompt_tokens == control.usage.prompt_tokens
        assert reply.token_ids == control.token_ids
        again = w.turn(ns, "agent", Q1, max_tokens=4)  # not broken: hot from now on
        assert again.usage.cache_state == "hot" and len(again.token_ids) == 4
        # Healed: the worker had the store quarantine the misfit, so its next write stored
        # the right KV under that key (not a dedup onto the planted block).
        w.wait_durable(ns, "agent")
        w.evict(ns, "agent")
        healed = w.turn(ns, "agent", Q2, max_tokens=4)
        assert healed.usage.cache_state == "warm" and not healed.usage.restore_failure
    assert metric(proc, "agentkv_worker_restore_failures_total") == 2
    # The first block of "short" and every block of "wide" (each reported, not only the first).
    assert store.stats().num_quarantined == 1 + len(manifest.block_keys)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # gemma: sliding-window layers
def test_a_chain_cut_unlike_a_worker_s_is_written_again_from_its_start(
    tiny_model_dirs, start_worker, store, arch
):
    """A writer in the namespace committed the agent's own KV, cut at other places: a
    short block, then full ones ([50, 64, ...] tokens), as a worker never cuts. The restore
    kept the full blocks after the short one as the chain's leading full blocks, so each
    write cut its blocks on from the wrong position: its commit was refused (the chain's
    parents did not follow), again on every retry, and the agent never durable. A restore
    now reads a chain to its first short block, where a worker's ends (the rest is
    prefilled again), and the next write cuts its blocks again from the start."""
    w = WorkerClient(start_worker(tiny_model_dirs[arch]).address, timeout=60)
    fp = w.info().fingerprint
    w.create_agent("ref", "agent", SYSTEM)
    w.turn("ref", "agent", Q1, max_tokens=8, durable=True)
    manifest = store.get_agent("ref", "agent", fingerprint=fp)
    stored = list(store.get_blocks("ref", fp, list(manifest.block_keys)))
    tokens = [t for block in stored for t in block.token_ids]
    assert len(tokens) >= 50 + 64  # a short block and a full one at least
    layers = {  # every tensor of the chain, its positions (axis 2) end to end
        name: (dtype, np.concatenate([arrays(b)[name][1] for b in stored], axis=2))
        for name, (dtype, _) in arrays(stored[0]).items()
    }
    cuts = [0, *range(50, len(tokens) + 1, 64)]  # ends with a full block: the rest a tail
    blocks, parent = [], ROOT_KEY
    for start, end in itertools.pairwise(cuts):
        tensors = [
            Tensor(name, dtype, (x := np.ascontiguousarray(a[:, :, start:end])).shape, x)
            for name, (dtype, a) in layers.items()
        ]
        blocks.append(Block(parent, tokens[start:end], tensors))
        parent = block_key(fp, parent, tokens[start:end])
    store.save_agent(
        "recut", "agent", fp, list(manifest.token_ids), blocks, metadata=dict(manifest.metadata)
    )
    reply = w.turn("recut", "agent", Q2, max_tokens=4, durable=True)  # ends once committed
    assert reply.usage.cache_state == "warm" and not reply.usage.restore_failure
    assert reply.usage.reused_store_tokens == 50  # the chain to its short block
    written = store.get_agent("recut", "agent", fingerprint=fp)
    assert list(written.block_num_tokens[:2]) == [64, 64]  # cut again as a worker cuts


def test_a_manifest_no_worker_of_this_model_wrote_fails_its_agent_alone(
    tiny_model_dirs, start_worker, store
):
    """The red team's case: a namespace's writer committed straight to the store a manifest
    whose token ids pass the model's vocabulary; the shared worker's next turn on it read
    past the embedding table: a segmentation fault (every tenant's turns gone, again on
    each restart) for an id of 2^32-1, garbage read for one just past the vocabulary. Marks
    that are no numbers were an INTERNAL error with a traceback. Each is now DATA_LOSS naming
    the agent, and the worker serves on."""
    proc = start_worker(tiny_model_dirs["llama"])
    w = WorkerClient(proc.address, timeout=60)
    info = w.info()
    w.create_agent("ref", "agent", SYSTEM)
    w.turn("ref", "agent", Q1, max_tokens=4, durable=True)
    good = store.get_agent("ref", "agent", fingerprint=info.fingerprint)
    tokens, metadata = list(good.token_ids), dict(good.metadata)
    marks = metadata["agentkv.marks"]
    planted = {
        "huge": (tokens[:-1] + [2**32 - 1], metadata, "tokens hold id 4294967295"),
        "past": (tokens[:-1] + [512], metadata, "tokens hold id 512, past this model's"),
        "words": (tokens, metadata | {"agentkv.marks": "zz,notanint,,,"}, "resume points"),
        "short": (tokens, metadata | {"agentkv.marks": "zz,3"}, "resume points cannot"),
    }
    for agent, (ids, meta, _) in planted.items():
        store.commit_agent(
            namespace="bad", agent_id=agent, fingerprint=info.fingerprint,
            token_ids=ids, metadata=meta,
        )  # fmt: skip
    for agent, (_, _, said) in planted.items():
        with pytest.raises(CorruptRecord, match=f"agent '{agent}' in namespace 'bad'") as bad:
            w.turn("bad", agent, Q2, max_tokens=4)
        assert said in bad.value.message and "Traceback" not in bad.value.message
    # Points past its tokens (a store-level fork cut short keeps its source's) are dropped,
    # not its agent: a resend cannot resume at them.
    far = metadata | {"agentkv.marks": marks.replace(",", f",{10**6}0", 1)}
    store.commit_agent(
        namespace="bad", agent_id="far", fingerprint=info.fingerprint, token_ids=tokens,
        metadata=far,
    )  # fmt: skip
    assert len(w.turn("bad", "far", Q2, max_tokens=4).token_ids) == 4
    reply = w.turn("ref", "agent", Q2, max_tokens=4)  # the worker serves on
    assert len(reply.token_ids) == 4 and proc.running
    w.evict("ref", "agent")
    assert w.turn("ref", "agent", Q1, max_tokens=4).usage.cache_state == "warm"
    assert "rpc crashed" not in proc.log_tail(10**7)


# one bad turn does not hurt the others


def faulty_process(
    launched, model, store_process, tmp_path, *extra: str, env: dict | None = None
) -> ServiceProcess:
    """A started worker process with tests.faulty_worker's injected faults."""
    args = ["--model", str(model), "--store", store_process.address, "--listen", "127.0.0.1:0"]
    args += ["--block-tokens", "64", *extra]
    proc = ServiceProcess("tests.faulty_worker", args, tmp_path / "faulty.log", env=env)
    return launched(proc)


def faulty_worker(launched, model, store_process, tmp_path) -> WorkerClient:
    """A client of a worker process with tests.faulty_worker's injected faults."""
    return WorkerClient(
        faulty_process(launched, model, store_process, tmp_path).address, timeout=60
    )


def create(w: WorkerClient, *agents: tuple[str, str]) -> None:
    for ns, agent in agents:
        w.create_agent(ns, agent, SYSTEM)


@pytest.mark.parametrize("max_tokens", [8, 1], ids=["cut", "whole-in-that-step"])
def test_a_turn_whose_caller_left_before_a_token_reached_it_leaves_no_trace(
    tiny_model_dirs, store_process, launched, tmp_path, max_tokens
):
    """A short prompt is prefilled and given its first token in one step, and a cancel is
    read between steps. So a caller gone during that step (a 10 ms timeout, a client that
    hung up) was told DEADLINE_EXCEEDED or CANCELLED, yet the agent kept its message and a
    token that no one saw, and a retry said the message twice (the red team's case, at
    every timeout from 0.01 to 0.3 s). Until a token has gone out on its stream, a
    cancelled turn now goes back as a failed one does: the retry finds the agent as it was,
    and is answered as its twin is. So does one whose whole reply (one token) came in that
    step: it ended, but nothing of it went out."""
    mark, model = tmp_path / "in-prefill", tiny_model_dirs["llama"]
    env = {CANCELLED_PREFILL_MARK: str(mark)}
    w = WorkerClient(faulty_process(launched, model, store_process, tmp_path, env=env).address)
    create(w, ("ns", "left"), ("ns", "twin"))
    before = w.describe("ns", "left").num_tokens
    sampling = pb.SamplingParams(max_tokens=max_tokens, seed=CANCELLED_PREFILL_SEED)
    request = pb.TurnRequest(
        namespace="ns", agent_id="left", messages=pb_messages(Q1), sampling=sampling
    )
    call = w.stub.Turn(request, timeout=120)
    eventually(mark.exists, "the turn's prefill is under way", timeout=120)
    call.cancel()  # the prefill runs once the worker has seen it, then the first token

    def retried():
        try:
            return w.turn("ns", "left", Q1, max_tokens=8)
        except AgentBusy:
            return None  # the cancelled turn leaves at the next step

    retry = eventually(retried, "the cancelled turn leaves the batch", timeout=120)
    twin = w.turn("ns", "twin", Q1, max_tokens=8)
    assert retry.usage.prompt_tokens - retry.usage.prefilled_tokens == before
    assert retry.usage.prompt_tokens == twin.usage.prompt_tokens
    assert retry.token_ids == twin.token_ids


def test_a_turn_whose_caller_read_a_token_and_left_at_once_keeps_its_reply_so_far(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A turn's stream marked a token as sent only once gRPC asked for the next message, so
    a caller that read the first token and closed at once could find the turn undone (the
    red team: 3 of 13), though its SDK said the worker keeps it. The mark is now set before
    the token goes: every such turn keeps its message and the reply so far."""
    model = tiny_model_dirs["llama"]
    w = WorkerClient(faulty_process(launched, model, store_process, tmp_path).address)
    create(w, ("ns", "reader"))
    for _ in range(8):
        before = w.describe("ns", "reader").num_tokens
        request = pb.TurnRequest(
            namespace="ns",
            agent_id="reader",
            messages=pb_messages(Q1),
            sampling=pb.SamplingParams(max_tokens=64),
        )
        call = w.stub.Turn(request, timeout=120)
        assert any(response.HasField("tokens") for response in call)  # stops at the first
        call.cancel()

        def left() -> bool:
            try:
                w.turn("ns", "reader", [], max_tokens=0)  # adds nothing; busy while it runs
            except AgentBusy:
                return False
            return True

        eventually(left, "the cancelled turn leaves the batch", timeout=120)
        assert w.describe("ns", "reader").num_tokens > before


def test_a_turn_that_fails_alone_leaves_no_trace_and_the_batch_goes_on(
    tiny_model_dirs, store_process, launched, tmp_path
):
    model = tiny_model_dirs["llama"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    w = faulty_worker(launched, model, store_process, tmp_path)
    create(w, ("a", "agent"), ("a", "twin"), ("a", "whole"), ("b", "agent"), ("b", "twin"))
    before = w.describe("a", "agent")
    b = long_turn(w, "b", "agent")
    b_tokens, b_texts = [], []
    read_tokens(b, 1, b_tokens, b_texts)  # b is decoding

    with pytest.raises(InvalidArgument, match=f"top_k {vocab + 1} is over .* {vocab} tokens"):
        w.turn("a", "agent", Q1, max_tokens=4, temperature=1.0, top_k=vocab + 1)
    every = w.turn("a", "whole", Q1, max_tokens=4, temperature=1.0, top_k=vocab)
    assert len(every.token_ids) == 4  # a top_k of the whole vocabulary keeps every token
    with pytest.raises(AgentKVError) as failed:
        w.turn("a", "agent", Q1, max_tokens=8, temperature=1.0, seed=ROW_FAULT_SEED)
    assert failed.value.code == grpc.StatusCode.INTERNAL
    assert "injected fault in this turn's sampling" in failed.value.message
    read_tokens(b, len(b_tokens) + 16, b_tokens, b_texts)  # b went on meanwhile
    b.cancel()
    assert SECRET not in "".join(b_texts)

    # a's failed turn left no trace: its retry says Q1 once, as its twin does.
    assert w.describe("a", "agent").num_tokens == before.num_tokens
    retry = w.turn("a", "agent", Q1, max_tokens=8, **SAMPLED)
    twin = w.turn("a", "twin", Q1, max_tokens=8, **SAMPLED)
    assert retry.usage.cache_state == "hot"
    assert retry.usage.prompt_tokens == twin.usage.prompt_tokens
    assert retry.token_ids == twin.token_ids
    # b's tokens are those it says alone.
    alone = w.turn("b", "twin", TALK, max_tokens=len(b_tokens), stop=["\x00"])
    assert alone.token_ids == b_tokens


def test_a_failed_batched_step_fails_every_turn_with_a_message_of_its_own(
    tiny_model_dirs, store_process, launched, tmp_path
):
    w = faulty_worker(launched, tiny_model_dirs["llama"], store_process, tmp_path)
    create(w, ("a", "agent"), ("b", "agent"), ("b", "twin"))
    before = {ns: w.describe(ns, "agent").num_tokens for ns in ("a", "b")}
    b = long_turn(w, "b", "agent")
    read_tokens(b, 1, [], [])  # b is decoding, and has tokens to roll back

    with pytest.raises(AgentKVError) as a_failed:
        w.turn("a", "agent", Q1, max_tokens=8, temperature=1.0, seed=STEP_FAULT_SEED)
    with pytest.raises(grpc.RpcError) as b_failed:
        for _ in b:
            pass
    assert b_failed.value.code() == grpc.StatusCode.INTERNAL
    for message in (a_failed.value.message, b_failed.value.details()):
        assert SECRET not in message and "batched model step failed" in message

    # Both turns were rolled out of their agents; b's retry is what its twin says.
    assert {ns: w.describe(ns, "agent").num_tokens for ns in ("a", "b")} == before
    retry = w.turn("b", "agent", Q1, max_tokens=8, **SAMPLED)
    twin = w.turn("b", "twin", Q1, max_tokens=8, **SAMPLED)
    assert retry.usage.cache_state == "hot"
    assert (retry.usage.prompt_tokens, retry.token_ids) == (
        twin.usage.prompt_tokens,
        twin.token_ids,
    )
    assert len(w.turn("a", "agent", Q1, max_tokens=4).token_ids) == 4


# a hung store


def test_a_hung_store_freezes_no_hot_agent_and_no_unrelated_rpc(
    tiny_model_dirs, start_worker, store_process
):
    """The store is SIGSTOPped (hung, not dead): a hot agent's turn and GetWorkerInfo answer
    while another agent's turn, which needs the store to restore, waits for it."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address, timeout=20)
    create(w, ("ns", "keeper"), ("ns", "twin"), ("ns", "sleeper"))
    for agent in ("keeper", "twin", "sleeper"):
        w.turn("ns", agent, Q1, max_tokens=4, durable=True)
    w.evict("ns", "sleeper")  # only the store holds it now
    info = w.info()
    waiting = WorkerClient(w.address, timeout=120)
    result: dict = {}

    def restore_sleeper() -> None:
        result["turn"] = waiting.turn("ns", "sleeper", Q2, max_tokens=4)

    sleeper = threading.Thread(target=restore_sleeper)
    freeze(store_process.proc.pid)
    try:
        sleeper.start()
        hot = w.turn("ns", "keeper", Q2, max_tokens=6, **SAMPLED)
        assert hot.usage.cache_state == "hot" and len(hot.token_ids) == 6
        during = w.info()
        assert (during.fingerprint, during.num_hot_agents) == (info.fingerprint, 2)
        assert w.describe("ns", "keeper").tier == "hot"
        with pytest.raises(DeadlineExceeded, match="within its deadline"):
            w.turn("ns", "twin", Q2, max_tokens=6, deadline_ms=500)  # the 2 s store check counts
        assert sleeper.is_alive()  # it needs the store
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)
    sleeper.join(120)
    assert result["turn"].usage.cache_state == "warm" and len(result["turn"].token_ids) == 4
    twin = w.turn("ns", "twin", Q2, max_tokens=6, **SAMPLED)
    assert hot.token_ids == twin.token_ids  # the hot copy answered in full


def test_a_point_a_stale_hot_copy_lacks_is_unavailable_while_the_store_cannot_be_asked(
    tiny_model_dirs, start_worker, store_process
):
    """Another worker went on with the agent, naming a point (after_mark) this worker's hot
    copy lacks; while the store hangs, its copy cannot be checked: UNAVAILABLE, send it
    again (before: NOT_FOUND, which the gateway answers 400 for a response id that is
    sound). Once the store answers, the same turn restores the newer copy and goes on."""
    model = tiny_model_dirs["llama"]
    old = WorkerClient(start_worker(model, name="old").address, timeout=60)
    new = WorkerClient(start_worker(model, name="new").address, timeout=60)
    create(old, ("ns", "moved"))
    old.turn("ns", "moved", Q1, max_tokens=4, durable=True)
    point = new.turn("ns", "moved", Q2, max_tokens=4, durable=True).usage.mark
    freeze(store_process.proc.pid)
    try:
        with pytest.raises(Unavailable, match="could not be asked: send it again"):
            old.turn("ns", "moved", TALK, max_tokens=4, after_mark=point)
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)

    def goes_on() -> object:  # the store, just resumed, may answer after the 2 s check
        try:
            return old.turn("ns", "moved", TALK, max_tokens=4, after_mark=point)
        except Unavailable:
            return None

    went_on = eventually(goes_on, "the resumed store's answer to the check", timeout=120)
    assert went_on.usage.cache_state == "warm" and len(went_on.token_ids) == 4


def test_a_restore_from_a_hung_store_fails_once_a_keepalive_ping_goes_unanswered(
    tiny_model_dirs, start_worker, store_process
):
    """A turn that needs a hung store (SIGSTOP) waits until the worker's keepalive ping
    goes unanswered, not its caller's whole timeout, and says why (before: gRPC's "Stream
    removed (ping timeout)", or with no keepalive the caller's DeadlineExceeded); the next
    one waits for the connect timeout, and says which server did not answer, as gRPC's
    "failed to connect ... SETTINGS frame" does not."""
    worker = start_worker(tiny_model_dirs["llama"])
    w = WorkerClient(worker.address, timeout=300)
    create(w, ("ns", "sleeper"))
    w.turn("ns", "sleeper", Q1, max_tokens=4, durable=True)
    w.evict("ns", "sleeper")  # only the store holds it now
    freeze(store_process.proc.pid)
    try:
        said = r"^the store did not answer: no answer to a keepalive ping.*hung, or its link is"
        with pytest.raises(Unavailable, match=said):
            w.turn("ns", "sleeper", Q2, max_tokens=4)
        with pytest.raises(Unavailable, match=r"^the store did not answer: "):  # dialled again
            w.turn("ns", "sleeper", Q2, max_tokens=4)
    finally:
        os.kill(store_process.proc.pid, signal.SIGCONT)

    def store_answers() -> bool:  # the worker's own watch of its store, as its log says
        events = r'"event": "(store answers|store does not answer)'
        return re.findall(events, worker.log_tail(10**7))[-1] == "store answers"

    # Its channel to the store may still be backing off from the dials the freeze failed.
    eventually(store_answers, "the worker to find its store again", timeout=120)
    again = w.turn("ns", "sleeper", Q2, max_tokens=4)  # nothing was lost
    assert again.usage.cache_state == "warm" and len(again.token_ids) == 4


def test_a_worker_stopped_mid_turn_ends_the_stream_and_exits(
    tiny_model_dirs, store_process, tmp_path, launched
):
    """SIGTERM with no time to drain, while a turn's decode step is in progress (a slow
    step, as a big model's): the stream ends with an error, and the process exits by itself.
    (A worker was once seen waiting forever at exit, its turn's RPC thread in Queue.get for an
    end the stopped MLX thread never sent; this checks the behaviour, it does not replay that
    race every time.)"""
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, "--drain-seconds", "0")
    worker = WorkerClient(proc.address)
    worker.create_agent("ns", "long")
    stream = worker.stream_turn(
        "ns", "long", [("user", "Talk.")], max_tokens=100, seed=SLOW_STEP_SEED
    )
    next(stream)  # its first token: now every decode step is slow
    proc.proc.send_signal(signal.SIGTERM)
    exited = proc.proc.wait(timeout=120)
    assert exited == 0, proc.log_tail()  # by itself: stop() would SIGKILL at 30 s
    with pytest.raises(AgentKVError):
        for _ in stream:
            pass
    worker.close()


def routed(mem: AgentMemory, prefix: str, worker: str) -> str:
    """The first agent id PREFIX-N that the memory routes to `worker`."""
    return next(a for a in map(f"{prefix}-{{}}".format, range(99)) if mem.worker_for(a) == worker)


@pytest.fixture
def reply_lost(tiny_model_dirs, store_process, launched, start_worker, tmp_path):
    """(faulty, healthy, mem): a worker that dies once it has taken a call into
    REPLY_LOST_PHASE, a healthy one, and a durable AgentMemory over both."""
    model = tiny_model_dirs["llama"]
    faulty = faulty_process(launched, model, store_process, tmp_path)
    healthy = start_worker(model)
    workers = [faulty.address, healthy.address]
    with AgentMemory(workers, store=store_process.address, durable=True, backoff=0.05) as mem:
        yield faulty, healthy, mem


def test_an_injection_whose_reply_was_lost_is_not_taken_twice(reply_lost, store_process):
    """The agent's worker takes a durable injection, commits it and dies before replying: the
    SDK retries on the next worker, which restores the agent with the injection in it and
    adds nothing (the call's request_id), rather than the message a second time."""
    faulty, healthy, mem = reply_lost
    agent_id = routed(mem, "agent", faulty.address)
    twin_id = routed(mem, "twin", healthy.address)
    agent, twin = mem.agent(agent_id, SYSTEM), mem.agent(twin_id, SYSTEM)
    twin.inject("Luca said: the numbers are final.")
    result = agent.inject("Luca said: the numbers are final.", phase=REPLY_LOST_PHASE)
    assert faulty.proc.wait(timeout=60) == 1  # it died after taking the injection
    assert result.usage.cache_state == "warm" and result.usage.prefilled_tokens == 0
    assert result.agent.num_tokens == twin.describe().num_tokens
    assert agent.describe().tier == "hot"  # on the worker it moved to
    stored = store_process.client().get_agent("default", agent_id)
    assert len(stored.token_ids) == result.agent.num_tokens
    w = WorkerClient(healthy.address, timeout=60)
    with pytest.raises(InvalidArgument, match="request_id of 65 characters is over 64"):
        w.inject("default", agent_id, [("user", "Hi.")], request_id="k" * 65)


def test_a_turn_whose_reply_was_lost_is_not_taken_twice(reply_lost):
    """The agent's worker runs a durable turn, commits it and dies before its first response:
    the SDK retries on the next worker, which restores the agent with the turn in it and does
    not run it again (the say's request_id), but says the turn was taken and its reply lost;
    a new say runs as any does."""
    faulty, healthy, mem = reply_lost
    agent_id = routed(mem, "agent", faulty.address)
    twin_id = routed(mem, "twin", healthy.address)
    agent, twin = mem.agent(agent_id, SYSTEM), mem.agent(twin_id, SYSTEM)
    twin.say(Q1, max_tokens=4).wait()
    with pytest.raises(TurnTaken, match="whose reply was lost: describe\\(\\) the agent"):
        agent.say(Q1, max_tokens=4, phase=REPLY_LOST_PHASE)
    assert faulty.proc.wait(timeout=60) == 1  # it died after committing the turn
    state = agent.describe()
    assert state.tier == "hot" and state.phase == REPLY_LOST_PHASE  # restored, once
    assert state.num_tokens == twin.describe().num_tokens
    again = agent.say(Q2, max_tokens=4).wait()  # another say: its own request_id
    assert again.usage.generated_tokens == 4 and again.cache_state == "hot"
    assert agent.describe().num_tokens > state.num_tokens


def test_a_turn_retried_with_its_request_id_is_not_run_again(start_worker, tiny_model_dirs):
    """A turn resent with the key of the one the agent took last (its reply lost) is refused
    and changes nothing; a turn with another key, or none, runs; a key over 64 characters is
    refused."""
    w = WorkerClient(start_worker(tiny_model_dirs["llama"]).address, timeout=60)
    w.create_agent("ns", "a", SYSTEM)
    first = w.turn("ns", "a", Q1, max_tokens=4, request_id="k1")
    taken = w.describe("ns", "a").num_tokens
    with pytest.raises(TurnTaken, match="'a' already took the turn k1"):
        w.turn("ns", "a", Q1, max_tokens=4, request_id="k1")
    assert w.describe("ns", "a").num_tokens == taken
    assert w.turn("ns", "a", Q2, max_tokens=4, request_id="k2").usage.generated_tokens == 4
    assert w.turn("ns", "a", Q2, max_tokens=4).usage.generated_tokens == 4
    assert w.describe("ns", "a").num_tokens > taken + 2 * len(first.token_ids)
    with pytest.raises(InvalidArgument, match="request_id of 65 characters is over 64"):
        w.turn("ns", "a", Q2, max_tokens=4, request_id="k" * 65)


def test_a_fork_whose_reply_was_lost_is_answered_by_its_retry(reply_lost):
    """The source's worker commits a fork and dies before replying: the SDK's retry on the
    next worker is answered with the fork it made (the call's request_id), not told that the
    new agent exists; a fork onto an agent made otherwise is still refused."""
    faulty, _, mem = reply_lost
    source_id = routed(mem, "source", faulty.address)
    source, other = mem.agent(source_id, SYSTEM), mem.agent("other", SYSTEM)
    source.say("Which scrolls came in today?", max_tokens=4).wait()
    fork = source.fork("what-if", phase=REPLY_LOST_PHASE)
    assert faulty.proc.wait(timeout=60) == 1  # it died after committing the fork
    assert fork.created and fork.state.phase == REPLY_LOST_PHASE
    assert fork.state.num_tokens == source.describe().num_tokens
    assert fork.state.generation == 1  # forked once, not twice
    with pytest.raises(AgentExists):
        source.fork(other.id)
    with pytest.raises(AgentExists):
        source.fork("what-if")  # another call: its own request_id
    reply = fork.say("Index them by century.", max_tokens=4)
    assert reply.wait().cache_state == "warm"


def test_a_group_size_the_head_dims_do_not_fit_is_refused_at_start(tiny_model_dirs, tmp_path):
    """The tiny llama's heads are 64 wide: groups of 128 would fail every prefill with
    MLX's error; the worker refuses to start instead, in one line that says what fits."""
    model = tiny_model_dirs["llama"]
    args = ["--model", str(model), "--store", "127.0.0.1:1", "--group-size", "128"]
    proc = subprocess.run(
        [sys.executable, "-m", "inference_worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "agentkv-worker: error: the model's head dims [64] are not multiples of "
        "--group-size 128; use 32 or 64"
    )
    assert "Traceback" not in proc.stderr


def test_logits_wider_than_the_tokenizer_never_give_a_token_it_lacks(
    tiny_model_dirs, start_worker, tmp_path
):
    """A model whose logits have 64 padded ids past its tokenizer's 512 (as Qwen2.5 and Gemma
    3 pad theirs): a turn sampled at the hottest temperature allowed (10) draws only real ids."""
    from tests.model_kit import TINY_CONFIGS, random_model, save_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    real = tokenizer.get_vocab_size()
    config = {**TINY_CONFIGS["llama"], "vocab_size": real + 64}
    path = save_model(tmp_path / "padded", random_model(config), config, tokenizer)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "vocab_size": real + 64}))
    w = WorkerClient(start_worker(path, name="padded").address, timeout=120)
    w.create_agent("default", "wide", SYSTEM)
    reply = w.turn("default", "wide", TALK, max_tokens=60, temperature=10.0, seed=7)
    assert max(reply.token_ids) < real  # before: 563 among them, sent as "!"
    assert len(reply.token_ids) >= 20  # enough draws that one would have been padding


def test_a_turn_still_queued_when_its_worker_stops_moves_to_another(
    tiny_model_dirs, store_process, launched, start_worker, tmp_path
):
    """SIGTERM with no time to drain while one turn decodes (slow steps) and another waits
    for the only place in the batch: the server's stop cuts both calls (UNAVAILABLE from the
    transport); the waiting one had said nothing, so the SDK takes it to the next worker,
    which answers it; the decoding one, cut off, is the caller's to send again."""
    model = tiny_model_dirs["llama"]
    extra = ("--max-batch", "1", "--drain-seconds", "0", "--metrics-listen", "127.0.0.1:0")
    stopping = faulty_process(launched, model, store_process, tmp_path, *extra)
    other = start_worker(model)
    workers = [stopping.address, other.address]
    with AgentMemory(workers, store=store_process.address, backoff=0.05) as mem:
        hog, waiter = (
            next(
                a for a in map(f"{name}-{{}}".format, range(99)) if mem.worker_for(a) == workers[0]
            )
            for name in ("hog", "waiter")
        )
        mem.agent(hog, SYSTEM)
        waiting = mem.agent(waiter, SYSTEM)
        decoding = mem.agent(hog).say("Talk.", max_tokens=100, seed=SLOW_STEP_SEED)
        next(iter(decoding))  # its first token: every step now takes seconds
        replies: list = []
        asked = threading.Thread(target=lambda: replies.append(waiting.say("Hi.", max_tokens=3)))
        asked.start()
        deadline = time.monotonic() + 60
        while metric(stopping, "agentkv_worker_turns_waiting") < 1:
            assert time.monotonic() < deadline, "the turn never queued"
            time.sleep(0.05)
        stopping.proc.send_signal(signal.SIGTERM)
        asked.join(timeout=120)
        assert replies and replies[0].worker == workers[1]
        assert len(replies[0].token_ids) == 3 and replies[0].usage.cache_state == "warm"
        with pytest.raises(Unavailable, match=r"(say|send) it again"):
            decoding.wait()


# one tenant's flood


def flood_on(launched, model, store_process, tmp_path, extra, size: int, timeout: float) -> tuple:
    """A worker (flags `extra`; its FINISHED_LOG in tmp_path) whose one slot namespace a's
    slow turn (the hog) holds, with a's `size` flood agents and b's guest made: (the worker,
    flood agents, the hog's stream, answered, turn), where turn(namespace, agent) records the
    agent's answer, or its error, in `answered`."""
    env = {FINISHED_LOG: str(tmp_path / "finished")}
    proc = faulty_process(launched, model, store_process, tmp_path, *extra, env=env)
    w = WorkerClient(proc.address, timeout=timeout)
    agents = [f"w{i}" for i in range(size)]
    create(w, ("a", "hog"), *(("a", agent) for agent in agents), ("b", "guest"))
    hog = w.stream_turn("a", "hog", TALK, max_tokens=100, seed=SLOW_STEP_SEED)
    next(hog)  # a holds the only slot; every step now takes seconds
    answered: list[tuple[str, object]] = []

    def turn(namespace: str, agent: str) -> None:
        try:
            answered.append((agent, w.turn(namespace, agent, TALK, max_tokens=2)))
        except AgentKVError as exc:
            answered.append((agent, exc))

    return proc, agents, hog, answered, turn


def served(answered: list, tmp_path) -> list[str]:
    """The agents answered, in the order the worker served them (its FINISHED_LOG, written
    by the MLX thread), not the order client threads woke in; the clients' answers match."""
    order = (tmp_path / "finished").read_text().split()
    answers = [agent for agent, result in answered if not isinstance(result, Exception)]
    assert sorted(answers) == sorted(order)
    return order


def test_worker_info_answers_while_a_model_step_holds_the_mlx_thread(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """GetWorkerInfo reads the hot tier's figures as of its last change. It used to wait for
    the MLX thread, which a flood keeps in long steps: the gateway's /health gave up on it
    after 5 s during the red team's flood (503). Here a step holds that thread until the
    test lets it go; the worker answers meanwhile, twice (the second call would have waited
    for the step after the first one's), and the held turn then ends whole."""
    gate = tmp_path / "gate"
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, env={HELD_STEP_GATE: str(gate)})
    w = WorkerClient(proc.address, timeout=120)
    create(w, ("a", "held"))
    held = w.stream_turn("a", "held", TALK, max_tokens=4, seed=HELD_STEP_SEED)
    items = [next(held)]
    eventually(gate.with_suffix(".held").exists, "a step holds the MLX thread", timeout=120)
    assert all(w.info().num_hot_agents == 1 for _ in range(2))
    gate.touch()
    items += list(held)
    generated = sum(len(item.tokens.token_ids) for item in items if item.HasField("tokens"))
    assert items[-1].usage.generated_tokens == generated >= 2  # past the held step


def test_one_namespace_flooding_a_worker_leaves_room_and_turns_for_another(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """Namespace a holds the only slot (a slow turn) and fills the whole queue; its next turn
    is refused. Namespace b's turn then takes the place of a's last in line, which is
    refused saying so (before, b got 'worker busy'), and is answered before a's waiting
    turns, a having had its turn."""
    extra = ("--max-batch", "1", "--queue-limit", "4", "--metrics-listen", "127.0.0.1:0")
    model = tiny_model_dirs["llama"]
    proc, flood, hog, answered, turn = flood_on(
        launched, model, store_process, tmp_path, extra, 5, timeout=120
    )
    threads = []
    # each turn in order, once it waits (so many turns queued) or an answer came (its own
    # refusal, or the refusal of the turn whose place it took)
    steps = [("a", agent, i + 1) for i, agent in enumerate(flood[:4])]
    steps += [("a", "w4", "w4"), ("b", "guest", "w3")]
    for namespace, agent, until in steps:
        threads.append(threading.Thread(target=turn, args=(namespace, agent)))
        threads[-1].start()
        deadline = time.monotonic() + 60
        while (
            until not in dict(answered)
            if isinstance(until, str)
            else metric(proc, "agentkv_worker_turns_waiting") < until
        ):
            assert time.monotonic() < deadline, f"{agent}'s turn neither queued nor was answered"
            time.sleep(0.05)
    hog.close()  # the slot frees: the line goes on
    for thread in threads:
        thread.join(120)
    results = dict(answered)
    assert isinstance(results["w4"], ResourceExhausted)
    assert "namespace 'a' holds 4 of those places" in str(results["w4"])
    assert isinstance(results["w3"], ResourceExhausted)
    assert "place in the queue went to a turn of another namespace" in str(results["w3"])
    assert served(answered, tmp_path) == ["guest", "w0", "w1", "w2"]


def test_a_flood_past_the_rpc_threads_still_meets_the_fair_queue(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """The red team's case: a turn holds an RPC thread to its end, and the worker had 16;
    a flood of more turns waited in gRPC's own first-come line, ahead of another tenant's
    turn, which never reached the queue's fair order. Now the worker has a thread for every
    turn it runs or queues (--max-batch + --queue-limit + 16), so b's turn takes the place
    of a's last in line and is answered first once the slot frees."""
    extra = ("--max-batch", "1", "--queue-limit", "15", "--metrics-listen", "127.0.0.1:0")
    model = tiny_model_dirs["llama"]
    # with the hog's, as many turns as 16 threads held
    proc, flood, hog, answered, turn = flood_on(
        launched, model, store_process, tmp_path, extra, 15, timeout=300
    )
    threads = [threading.Thread(target=turn, args=("a", agent)) for agent in flood]
    for thread in threads:
        thread.start()
    # queued between the hog's model steps (seconds each), those that came during one at once
    eventually(
        lambda: metric(proc, "agentkv_worker_turns_waiting") >= len(flood),
        "a's turns queued",
        timeout=300,
    )
    threads.append(threading.Thread(target=turn, args=("b", "guest")))
    threads[-1].start()
    eventually(lambda: len(answered) == 1, "b's turn took a place in the queue", timeout=60)
    hog.close()  # the slot frees: the line goes on
    for thread in threads:
        thread.join(300)
    pushed = [(agent, r) for agent, r in answered if isinstance(r, Exception)]
    assert len(pushed) == 1 and pushed[0][0] in flood  # a's last in line
    assert "place in the queue went to a turn of another namespace" in str(pushed[0][1])
    order = served(answered, tmp_path)
    assert order[0] == "guest" and len(order) == len(flood)


def during_a_held_step(gate, started, agents: list[str], turn) -> None:
    """Once a step holds the MLX thread (HELD_STEP_GATE is `gate`), hands it each agent's
    turn(agent), on a thread of its own, and waits until all are handed (STARTED_LOG is
    `started`); then lets the step go and waits for every turn to end."""
    eventually(gate.with_suffix(".held").exists, "a step holds the MLX thread", timeout=120)
    threads = [threading.Thread(target=turn, args=(agent,)) for agent in agents]
    for thread in threads:
        thread.start()

    def handed() -> bool:
        return started.exists() and set(agents) <= set(started.read_text().split())

    eventually(handed, "the turns are handed to the MLX thread", timeout=120)
    gate.touch()
    for thread in threads:
        thread.join(300)


def answering(w: WorkerClient, max_tokens: int) -> tuple[dict[str, object], Callable]:
    """A turn(agent) for during_a_held_step, and where it puts each agent's reply or error."""
    answered: dict[str, object] = {}

    def turn(agent: str) -> None:
        try:
            answered[agent] = w.turn("ns", agent, TALK, max_tokens=max_tokens)
        except AgentKVError as exc:
            answered[agent] = exc

    return answered, turn


def test_a_burst_that_comes_during_a_step_fills_the_free_slots_before_the_queue(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """Turns handed over during a step now run back to back before the next one. They all
    queued before any was admitted, so a burst that the batch's free slots and the queue
    held together was refused past the queue's limit, slots free (a review's case). Once
    the queue is full, the next turn waits for a step, which admits some: every turn of a
    burst of (free slots + queue limit) is answered, as when each had a step of its own."""
    gate, started = tmp_path / "gate", tmp_path / "started"
    env = {HELD_STEP_GATE: str(gate), STARTED_LOG: str(started)}
    extra = ("--max-batch", "4", "--queue-limit", "2")
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, *extra, env=env)
    w = WorkerClient(proc.address, timeout=120)
    burst = [f"b{i}" for i in range(5)]  # 3 free slots beside the held turn, 2 places
    create(w, ("ns", "held"), *(("ns", agent) for agent in burst))
    held = w.stream_turn("ns", "held", TALK, max_tokens=4, seed=HELD_STEP_SEED)
    items = [next(held)]
    answered, turn = answering(w, max_tokens=2)

    during_a_held_step(gate, started, burst, turn)
    items += list(held)
    assert items[-1].usage.generated_tokens == 4
    refused = {agent: r for agent, r in answered.items() if isinstance(r, Exception)}
    assert not refused, refused
    assert sorted(answered) == burst


def test_turns_waiting_for_the_batch_keep_their_agents_within_the_hot_budget(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A waiting turn's agent is in RAM, and no longer one the hot tier may evict, so the
    queue is bounded in bytes as well as in count, and admission counts the agents waiting.
    Three long agents, hot, get a turn each during a held step: the third would not fit
    beside the two waiting once its turn came, and is refused (RESOURCE_EXHAUSTED, which a
    client retries); the other two are answered. At every decode step the batch and every
    agent with a turn in flight, running or waiting, stay within the budget. Before, all
    three waited (up to --queue-limit, 64), one joined the held turn's batch beside the
    others, and the worker held 1.37 times its --hot-budget."""
    budget, log, gate, started = 1024 * 1024, *logged_paths(tmp_path)
    w = logged_1m_worker(tiny_model_dirs, store_process, launched, tmp_path)
    long = ["l1", "l2", "l3"]
    create(w, ("ns", "held"), *(("ns", agent) for agent in long))
    for agent in long:
        w.turn("ns", agent, [("user", "tell me more " * 75)], max_tokens=0)
    sizes = [w.describe("ns", agent).num_bytes for agent in long]
    # The case: all four agents fit the budget idle, but two long turns waiting, and a third
    # once running (its row in the batch beside its own caches), do not.
    assert sum(sizes) + w.describe("ns", "held").num_bytes < 0.95 * budget, sizes
    assert all(0.25 * budget < size < 0.3 * budget for size in sizes), sizes
    answered, turn = answering(w, max_tokens=8)

    first = w.stream_turn("ns", "held", TALK, max_tokens=32, seed=HELD_STEP_SEED)
    items = [next(first)]
    during_a_held_step(gate, started, long, turn)
    items += list(first)
    assert items[-1].usage.generated_tokens == 32
    refused = {agent: r for agent, r in answered.items() if isinstance(r, Exception)}
    assert len(refused) == 1, answered
    (error,) = refused.values()
    assert isinstance(error, ResourceExhausted)
    assert re.search(r"2 turns queued hold \d+ bytes .* budget of 1048576", str(error))
    replies = [r for r in answered.values() if not isinstance(r, Exception)]
    assert all(len(r.token_ids) == 8 and r.usage.cache_state == "hot" for r in replies)
    steps = logged_steps(log)
    assert max(held for _, held in steps) <= budget, steps


def test_a_turn_that_fits_its_max_tokens_waits_beside_others_and_runs_within_the_budget(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A turn that lets the worker fit its max_tokens (the gateway's, for a call that gives
    none) is sized to the whole budget, alone. So, with the queue bounded in bytes, it was
    refused whenever another turn waited (the review's case). It now waits at its least and
    takes, once the batch is empty, what the budget holds beside the agents still waiting:
    both turns handed over during a held step are answered, within the budget."""
    budget, log, gate, started = 1024 * 1024, *logged_paths(tmp_path)
    w = logged_1m_worker(tiny_model_dirs, store_process, launched, tmp_path)
    create(w, ("ns", "held"), ("ns", "long"), ("ns", "fit"))
    w.turn("ns", "long", [("user", "tell me more " * 75)], max_tokens=0)
    replies: dict[str, object] = {}

    def turn(agent: str) -> None:
        fit = {"max_tokens": 4096, "fit_max_tokens": True} if agent == "fit" else {}
        try:
            replies[agent] = w.turn("ns", agent, TALK, **({"max_tokens": 8} | fit))
        except AgentKVError as exc:
            replies[agent] = exc

    first = w.stream_turn("ns", "held", TALK, max_tokens=32, seed=HELD_STEP_SEED)
    items = [next(first)]
    during_a_held_step(gate, started, ["fit", "long"], turn)
    items += list(first)
    assert items[-1].usage.generated_tokens == 32
    assert not [r for r in replies.values() if isinstance(r, Exception)], replies
    assert len(replies["long"].token_ids) == 8 and replies["fit"].token_ids
    assert max(held for _, held in logged_steps(log)) <= budget


def test_agents_made_at_once_from_the_store_stay_within_the_hot_budget(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """An agent whose whole system prompt is in the store (another agent's) is made at once
    from its blocks: no step admits it, and it went into RAM unchecked. While its write was
    in flight it could not be evicted, so concurrent creates took the worker past its
    --hot-budget (a red team: 69 MB on 48). Now idle agents give way for it as for a
    waiting turn, and when they cannot, the create is refused (RESOURCE_EXHAUSTED, which a
    client retries); once the writes land, it goes through."""
    held = tmp_path / "writes-held"
    model = tiny_model_dirs["llama"]
    proc = faulty_process(
        launched, model, store_process, tmp_path, "--hot-budget", "1M", env={WRITES_HELD: str(held)}
    )
    w = WorkerClient(proc.address, timeout=120)
    system = "tell me more " * 110
    w.create_agent("ns", "seed", system)
    w.wait_durable("ns", "seed")
    size = w.describe("ns", "seed").num_bytes
    assert 0.25 * (1 << 20) < size < 0.33 * (1 << 20), size  # three fit the budget, four not
    held.touch()  # from now on the writes wait: the agents made stay in RAM
    made, refused = [], []
    for n in range(4):
        try:
            w.create_agent("ns", f"c{n}", system)
            made.append(n)
        except ResourceExhausted as exc:
            refused.append(str(exc))
    info = w.info()
    assert info.hot_bytes <= info.hot_budget_bytes, (info.hot_bytes, made)
    assert made == [0, 1, 2] and len(refused) == 1, refused
    assert "worker busy: agent 'c3' holds" in refused[0]
    held.unlink()  # the writes land: c0-c2 may give way
    eventually(lambda: w.describe("ns", "c2").persisted_tokens, "c2's write", timeout=120)
    w.create_agent("ns", "c3", system)
    assert w.describe("ns", "c3").num_tokens == w.describe("ns", "seed").num_tokens


def test_a_turn_that_comes_while_its_agent_is_deleted_is_refused_not_run_on_a_lost_copy(
    launched, tiny_model_dirs, store_process, tmp_path
):
    """The red team's race: a delete drops the agent from RAM, then waits for its write in
    flight and deletes it in the store; a turn in between read the store's copy back into
    RAM and ran on it. The delete said done, the turn's reply was lost (its write found no
    agent), and the worker held a copy the store had not. The write is held here, so the
    turn comes in that window every time: it is now refused (AgentBusy), and the agent is
    gone everywhere once the delete ends."""
    held = tmp_path / "writes-held"
    model = tiny_model_dirs["llama"]
    env = {WRITES_HELD: str(held)}
    proc = faulty_process(launched, model, store_process, tmp_path, env=env)
    w = WorkerClient(proc.address, timeout=120)
    w.create_agent("ns", "z", SYSTEM)
    w.turn("ns", "z", Q1, max_tokens=4, durable=True)
    held.touch()  # from now on the writes wait
    w.turn("ns", "z", Q2, max_tokens=4)  # its write waits: the delete waits for it
    deleted = {}
    deleting = threading.Thread(target=lambda: deleted.update(done=w.delete("ns", "z")))
    deleting.start()
    eventually(lambda: w.describe("ns", "z").tier != "hot", "the delete's drop from RAM")
    with pytest.raises(AgentBusy, match="agent 'z' is being deleted"):
        w.turn("ns", "z", TALK, max_tokens=4)
    held.unlink()
    deleting.join(timeout=120)
    assert deleted == {"done": True}
    for call in (w.describe, lambda ns, a: w.turn(ns, a, TALK, max_tokens=4)):
        with pytest.raises(AgentNotFound):
            call("ns", "z")


def test_a_durable_memory_s_new_agent_is_in_the_store_when_it_is_returned(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """AgentMemory(durable=True).agent(id, system=...) returned once the system prompt was
    prefilled, its commit still on its way: a worker lost then lost the agent, and the next
    call (through another worker) said AgentNotFound. Now the create is durable as a turn is:
    here its write is held, and it does not return until the write lands."""
    held = tmp_path / "writes-held"
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, env={WRITES_HELD: str(held)})
    w = WorkerClient(proc.address, timeout=120)
    held.touch()
    w.create_agent("ns", "quick", SYSTEM)  # not durable: back at once, its write waiting
    assert w.describe("ns", "quick").persisted_tokens == 0
    made: list = []
    with AgentMemory(proc.address, namespace="ns", durable=True) as mem:
        creating = threading.Thread(target=lambda: made.append(mem.agent("kept", SYSTEM)))
        creating.start()

        def in_ram() -> bool:
            try:
                return w.describe("ns", "kept").num_tokens > 0
            except AgentNotFound:  # not made yet
                return False

        eventually(in_ram, "the agent, made in RAM")
        assert creating.is_alive() and not made  # its write is held: it waits for it
        held.unlink()
        creating.join(timeout=120)
        assert made and made[0].created
    with store_process.client() as store:
        stored = store.get_agent("ns", "kept")
        assert len(stored.token_ids) == w.describe("ns", "kept").num_tokens


def test_a_durable_create_of_an_agent_made_but_not_stored_waits_for_its_write(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A durable CreateAgent of an agent this worker made already, its write still on its
    way (or failed), was answered AgentExists at once, which the SDK takes for "made": a
    retry of a durable create (its first call lost, or refused NotCommitted) returned an
    agent the store did not hold. It now waits for that write, as a durable turn does."""
    held = tmp_path / "writes-held"
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, env={WRITES_HELD: str(held)})
    w = WorkerClient(proc.address, timeout=120)
    held.touch()
    w.create_agent("ns", "quick", SYSTEM)  # made, its write held
    with pytest.raises(DeadlineExceeded):  # the write it waits for is held
        WorkerClient(proc.address, timeout=2).create_agent("ns", "quick", SYSTEM, durable=True)
    held.unlink()
    with pytest.raises(AgentExists):  # once the write has landed
        w.create_agent("ns", "quick", SYSTEM, durable=True)
    with store_process.client() as store:
        assert list(store.get_agent("ns", "quick").token_ids)


def test_an_agent_another_worker_committed_meanwhile_leaves_ram_when_asked(
    tiny_model_dirs, store_process, launched, start_worker, tmp_path
):
    """Worker b's turn is held mid-decode while worker a commits the same agent, so b's
    write of that turn loses to a's commit: b's copy is stale, never to be written. b now
    lets it go when asked (and for its budget). Before, it held it for good: every
    EvictAgent wrote it again, lost again, and answered ABORTED; neither durable nor
    failed, the hot tier never let it go either."""
    gate, model = tmp_path / "gate", tiny_model_dirs["llama"]
    env = {HELD_STEP_GATE: str(gate)}
    b_proc = faulty_process(launched, model, store_process, tmp_path, env=env)
    b = WorkerClient(b_proc.address, timeout=120)
    a = WorkerClient(start_worker(model, name="a").address, timeout=120)
    create(b, ("ns", "x"))
    b.turn("ns", "x", TALK, max_tokens=2, durable=True)
    held = b.stream_turn("ns", "x", [("user", "Go on.")], max_tokens=4, seed=HELD_STEP_SEED)
    items = [next(held)]  # past its check with the store
    eventually(gate.with_suffix(".held").exists, "a step holds b's turn", timeout=120)
    a.turn("ns", "x", [("user", "Hello from a.")], max_tokens=0, durable=True)
    gate.touch()
    items += list(held)
    log = tmp_path / "faulty.log"
    eventually(lambda: "agent committed elsewhere" in log.read_text(), "b's write loses")

    assert b.evict("ns", "x").evicted
    assert b.info().num_hot_agents == 0
    back = b.turn("ns", "x", [("user", "And now?")], max_tokens=2)
    assert back.usage.cache_state == "warm"  # a's commit, from the store
    assert b.describe("ns", "x").generation == a.describe("ns", "x").generation


def test_a_turn_on_an_agent_mid_turn_here_is_busy_though_another_worker_committed_it(
    tiny_model_dirs, store_process, launched, start_worker, tmp_path
):
    """Worker b's turn is in its batch (slow steps) when worker a commits the same agent. A
    second turn on b then found b's copy behind the store's and dropped it from RAM, though
    the first turn still ran on it: it restored a's commit and ran beside the first, two
    turns of one agent at once (each agent's one turn at a time bypassed). It is now told
    the agent is busy, as any turn beside a running one is."""
    model = tiny_model_dirs["llama"]
    b = WorkerClient(faulty_process(launched, model, store_process, tmp_path).address)
    a = WorkerClient(start_worker(model, name="a").address, timeout=120)
    create(b, ("ns", "x"))
    b.turn("ns", "x", TALK, max_tokens=2, durable=True)
    first = b.stream_turn("ns", "x", [("user", "Go on.")], max_tokens=64, seed=SLOW_STEP_SEED)
    next(first)  # in b's batch
    a.turn("ns", "x", [("user", "Hello from a.")], max_tokens=0, durable=True)
    with pytest.raises(AgentBusy, match="already has a turn in progress"):
        b.turn("ns", "x", [("user", "Meanwhile?")], max_tokens=2)
    first.close()


def test_a_retry_of_a_turn_still_running_is_told_the_agent_is_busy(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """A turn resent with its request_id while the first is still running (its client
    thought it lost) is told the agent is busy, to send it again once the turn ends; then it
    learns the turn was taken. Before, it was told at once that the turn was taken, though
    the first could still be undone (cut before its first token) and so never be taken."""
    model = tiny_model_dirs["llama"]
    w = WorkerClient(faulty_process(launched, model, store_process, tmp_path).address)
    create(w, ("ns", "x"))
    # slow steps: the MLX thread answers the retry between two of them
    first = w.stream_turn("ns", "x", TALK, max_tokens=64, seed=SLOW_STEP_SEED, request_id="r1")
    next(first)
    with pytest.raises(AgentBusy, match="already has a turn in progress"):
        w.turn("ns", "x", TALK, max_tokens=4, request_id="r1")
    first.close()  # cut after its first token: the turn is taken
    answers = []

    def answered() -> bool:
        try:
            w.turn("ns", "x", TALK, max_tokens=4, request_id="r1")
        except AgentBusy:
            return False  # the cut turn has not left the batch yet
        except TurnTaken as exc:
            answers.append(exc)
        return True

    eventually(answered, "the cut turn leaves the batch", timeout=120)
    assert answers and "'x' already took the turn r1" in str(answers[0])


def logged_paths(tmp_path) -> tuple:
    """BATCH_BYTES_LOG's, HELD_STEP_GATE's and STARTED_LOG's files for a test's worker."""
    return tmp_path / "batch-bytes", tmp_path / "gate", tmp_path / "started"


def logged_1m_worker(tiny_model_dirs, store_process, launched, tmp_path) -> WorkerClient:
    """A faulty worker with a --hot-budget of 1M that writes logged_paths(tmp_path)."""
    log, gate, started = logged_paths(tmp_path)
    env = {BATCH_BYTES_LOG: str(log), HELD_STEP_GATE: str(gate), STARTED_LOG: str(started)}
    model = tiny_model_dirs["llama"]
    proc = faulty_process(launched, model, store_process, tmp_path, "--hot-budget", "1M", env=env)
    return WorkerClient(proc.address, timeout=120)


def logged_steps(log) -> list[tuple[int, ...]]:
    """Each decode step's (rows in the batch, KV bytes held), from BATCH_BYTES_LOG."""
    return [tuple(map(int, line.split())) for line in log.read_text().splitlines()]


def test_a_long_turn_batched_with_short_ones_stays_within_the_hot_budget(
    tiny_model_dirs, store_process, launched, tmp_path
):
    """The live batch pads every row to its longest, and each agent keeps its own caches
    beside it, to undo its turn: short turns beside a long one hold about as much as it
    does. Admission counts that now. It counted each turn's own size, so three short turns
    joined a long one, and the worker held far more KV than its --hot-budget (a review
    measured 7.8 times the caches' own bytes with eight rows). At every decode step, the
    batch and the caches beside it stay within the budget; short turns still join the long
    one, and every turn is answered."""
    budget, log, gate, started = 1024 * 1024, *logged_paths(tmp_path)
    w = logged_1m_worker(tiny_model_dirs, store_process, launched, tmp_path)
    short = ["s1", "s2", "s3"]
    create(w, ("ns", "long"), *(("ns", agent) for agent in short))
    w.turn("ns", "long", [("user", "tell me more " * 70)], max_tokens=0)
    long_bytes = w.describe("ns", "long").num_bytes
    # The case: a short turn's row is padded to the long one's, over three times its size.
    # Two rows and the caches beside them fit the budget, four do not.
    assert 0.2 * budget < long_bytes < 0.3 * budget, long_bytes
    assert all(w.describe("ns", agent).num_bytes < long_bytes / 3 for agent in short)
    replies = {}

    def turn(agent: str) -> None:
        replies[agent] = w.turn("ns", agent, TALK, max_tokens=8)

    # The long turn's step holds the MLX thread until the short turns are handed to it;
    # the thread then takes them all before its next step.
    first = w.stream_turn("ns", "long", TALK, max_tokens=32, seed=HELD_STEP_SEED)
    items = [next(first)]
    during_a_held_step(gate, started, short, turn)
    items += list(first)
    assert items[-1].usage.generated_tokens == 32
    assert sorted(replies) == short and all(len(r.token_ids) == 8 for r in replies.values())
    steps = logged_steps(log)
    assert max(held for _, held in steps) <= budget, steps
    assert max(rows for rows, _ in steps) >= 2  # the short turns join it, as they fit
