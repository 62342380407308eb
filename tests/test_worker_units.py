"""Fast unit tests of the worker's pure parts: sampling checks, stop strings, the hot tier;
and that a process whose MLX threads ended exits cleanly."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from agentkv.errors import InvalidArgument, Unavailable
from inference_worker.agents import Agent, HotTier
from inference_worker.batching import ends_inside_a_character, gpt2_bytes
from inference_worker.sampling import Sampling, StopMatcher


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"temperature": -0.5}, "temperature -0.5"),
        ({"temperature": float("nan")}, "temperature nan"),
        ({"temperature": 11.0}, "temperature 11.0"),
        ({"top_p": 1.5}, "top_p 1.5"),
        ({"top_k": -1}, "top_k -1"),
        ({"stop": [""]}, "stop string"),
        ({"stop": ["x" * 300]}, "stop string"),
        ({"stop": ["a"] * 17}, "17 stop strings"),
    ],
)
def test_bad_sampling_is_refused_naming_the_value(fields, named):
    with pytest.raises(InvalidArgument, match=named):
        Sampling(**fields).validate(max_stop_strings=16)


def test_good_sampling_passes():
    Sampling(temperature=0.7, top_p=0.9, top_k=40, stop=["\n\n"]).validate(16)


def test_top_k_is_checked_against_the_vocabulary():
    import mlx.core as mx

    with pytest.raises(InvalidArgument, match="top_k 513 is over the model's vocabulary of 512"):
        Sampling(top_k=513).validate(16, vocab_size=512)
    whole = Sampling(temperature=1.0, top_k=512, seed=3).validate(16, vocab_size=512)
    assert 0 <= whole.sampler()(mx.log(mx.softmax(mx.arange(512.0)))) < 512


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_tiny_temperature_samples_as_greedy_does(dtype):
    import mlx.core as mx

    logprobs = mx.log(mx.softmax(mx.array([1.0, 3.0, 2.0, 0.5]))).astype(getattr(mx, dtype))
    assert Sampling(temperature=1e-39, seed=1).sampler() is None  # greedy
    for temperature in (2e-6, 1e-5):  # 1 / t past float16's range
        sample = Sampling(temperature=temperature, seed=1).sampler()
        assert {sample(logprobs) for _ in range(40)} == {1}, temperature
    sample = Sampling(temperature=1.0, seed=1).sampler()
    assert len({sample(logprobs) for _ in range(40)}) > 1  # still sampled at 1


def test_seed_0_is_a_seed_like_any_other():
    """OpenAI's seed 0 repeats its draws, as every seed does (it was taken as "no seed", so
    each turn drew afresh); no seed draws from a random key."""
    import mlx.core as mx

    uniform = mx.log(mx.full((512,), 1 / 512))

    def draws(seed: int | None) -> list[int]:
        sample = Sampling(temperature=1.0, seed=seed).sampler()
        return [sample(uniform) for _ in range(20)]

    assert draws(0) == draws(0) != draws(1)
    assert draws(None) != draws(None)  # 512^-20 to fail by chance


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["Hello", " wor", "ld"], [], ("Hello world", False)),
        (["Hello", " END", " more"], ["END"], ("Hello ", True)),
        (["Hel", "lo E", "N", "D!"], ["END"], ("Hello ", True)),  # split across tokens
        (["abc"], ["c", "bc"], ("a", True)),  # the earliest stop wins
        (["E", "N", "X"], ["END"], ("ENX", False)),  # a near miss is sent in full
    ],
)
def test_stop_strings_are_never_sent(pieces, stops, expected):
    matcher = StopMatcher(stops)
    assert feed_all(matcher, pieces) == expected
    reached = expected[1] and min(stops, key=lambda s: "".join(pieces).find(s))
    assert matcher.matched == (reached or "")


@dataclass
class FakeCache:
    """Stands in for a layer cache: the hot tier only reads offset and nbytes."""

    offset: int
    nbytes: int
    keep_from: int = 0

    def release(self) -> None:
        pass


def agent(name: str, nbytes: int, durable: bool = True) -> Agent:
    a = Agent("ns", name, list(range(10)), [FakeCache(10, nbytes)])
    a.persisted_tokens = 10 if durable else 0
    return a


def test_hot_tier_evicts_least_recently_used_durable_agents():
    tier = HotTier(budget_bytes=250)
    for name in ("a", "b", "c"):
        tier.put(agent(name, 100))
    tier.get(("ns", "a"))  # a is now the most recent; b is the oldest
    evicted = tier.enforce()
    assert [a.agent_id for a in evicted] == ["b"] and tier.nbytes == 200


def test_a_write_landing_is_not_a_use_of_the_agent():
    """HotTier.release runs after each write of a windowed model: the agent written last
    is not thereby the most recently used."""
    tier = HotTier(budget_bytes=250)
    old, new, newest = agent("old", 100), agent("new", 100), agent("newest", 100)
    for a in (old, new, newest):
        tier.put(a)
    tier.release(old, lambda a: False)
    assert [a.agent_id for a in tier.enforce()] == ["old"]


def test_hot_tier_never_evicts_what_is_not_durable():
    tier = HotTier(budget_bytes=100)
    tier.put(agent("unsaved", 100, durable=False))
    tier.put(agent("saved", 100))
    tier.put(agent("current", 100, durable=False))
    evicted = tier.enforce(keep={("ns", "current")})
    assert [a.agent_id for a in evicted] == ["saved"]
    assert tier.nbytes == 200  # over budget until the others are written, never lost


def test_hot_tier_keeps_an_agent_whose_last_write_failed():
    """Its tokens may all be in the store while its last write (a new phase, an injection's
    key) is not: it stays until that write is done, as make_room already keeps it."""
    tier = HotTier(budget_bytes=100)
    failed, saved = agent("failed", 100), agent("saved", 100)
    failed.persist_error = Unavailable("the store is down")
    tier.put(failed)
    tier.put(saved)
    assert [a.agent_id for a in tier.enforce()] == ["saved"]


@pytest.mark.parametrize(
    "failure",
    [
        ValueError("positions before 256 left this layer's window"),
        RuntimeError("[malloc] Attempting to allocate 8589934592 bytes"),  # MLX evaluating
    ],
)
def test_a_write_that_cannot_even_be_cut_fails_the_durable_turn_waiting_on_it(monkeypatch, failure):
    """Should the snapshot fail (a window cache lost blocks it would rewrite, or evaluating
    them failed), the write fails at once: the turn that waits for it is not told it was
    committed, as it was when only the earlier, finished write was there to wait on. (An
    error other than ValueError escaped: the turn never ended, and the whole batch failed.)"""
    from inference_worker import persistence
    from inference_worker.metrics import WorkerMetrics

    def lost(*args):
        raise failure

    monkeypatch.setattr(persistence, "snapshot", lost)
    writes = persistence.Persister(None, "fp", 64, WorkerMetrics(), lambda agent: None)
    a = agent("a", 100)
    a.pending = Future()
    a.pending.set_result(None)  # the last turn's write, committed
    writes.persist(a)
    error = persistence.turn_not_durable(a, a.pending.result())
    assert error is not None and str(failure) in error.message
    # tried again after a while, not at every catch-up (it was every 2 s, with a traceback)
    assert a.refusals == 1 and a.retry_at > time.monotonic() + 1
    tier = HotTier(budget_bytes=1000)
    tier.put(a)
    assert tier.failed_writes(lambda agent: False) == []


def test_work_handed_to_a_closed_mlx_thread_fails_at_once():
    """An RPC thread still running after the server's stop (its call cancelled, its store
    read done) hands the MLX thread more work: it is refused at once. It was queued behind
    close()'s end, never run, and the process's exit waited forever on that RPC thread."""
    from inference_worker.runtime import MLXThread

    mlx = MLXThread()
    assert mlx.submit(lambda: 1).result(timeout=60) == 1
    mlx.close()
    with pytest.raises(Unavailable, match="stopping"):
        mlx.submit(lambda: 2).result(timeout=5)


def test_jobs_that_came_during_a_step_run_before_the_next_one_for_as_long_as_it_took(
    monkeypatch,
):
    """A burst of turns handed over while a step runs joins the batch in one step: the jobs
    waiting run before the next tick, for as long as the last tick took. It used to be one
    job a tick, so the 16th turn of a burst waited for 15 model steps before the scheduler
    saw it. Past that time a tick runs between jobs: a flood of calls does not stall the
    turns in flight. The thread's clock is the test's: no timing is involved."""
    import threading

    from inference_worker import runtime
    from tests.helpers import until

    clock = SimpleNamespace(now=0.0)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(runtime, "time", clock)
    monkeypatch.setattr(runtime, "JOBS_SLICE_SECONDS", 0.0)  # the last tick's time alone
    monkeypatch.setattr(runtime, "TICK_SECONDS", 3600.0)  # no tick of an idle thread
    mlx = runtime.MLXThread()
    ticks: list[int] = []
    stepping, queued = threading.Event(), threading.Event()

    def tick() -> bool:
        ticks.append(1)
        if len(ticks) == 2:  # a long step, the burst coming meanwhile
            stepping.set()
            queued.wait(60)
            clock.now += 1.0
        return False

    mlx.on_tick = tick
    try:
        assert mlx.submit(len, ticks).result(timeout=60) == 0  # then the first tick
        assert mlx.submit(len, ticks).result(timeout=60) == 1  # then the long one
        assert stepping.wait(60)
        burst = [mlx.submit(len, ticks) for _ in range(16)]
        queued.set()
        assert [job.result(timeout=60) for job in burst] == [2] * 16  # no tick among them
        until(lambda: len(ticks) == 3, "the tick after the burst")  # it took no time
        hold = threading.Event()
        held = mlx.submit(hold.wait, 60)
        flood = [mlx.submit(len, ticks) for _ in range(2)]
        hold.set()
        assert held.result(timeout=60)
        assert [job.result(timeout=60) for job in flood] == [4, 5]  # a tick after each
    finally:
        mlx.close()


def test_writes_to_a_hung_store_are_given_up_at_stop(monkeypatch):
    """At stop, queued writes to a store that never answers are waited for up to the bound;
    then the one in flight is cut (the store client closed), the queued ones never reach the
    store, and each agent counts as unwritten."""
    import threading

    from inference_worker import persistence
    from inference_worker.metrics import WorkerMetrics

    class HungStore:
        def __init__(self) -> None:
            self.closed, self.entered, self.saves = threading.Event(), threading.Event(), 0

        def save_agent(self, *args, **fields):
            self.saves += 1
            self.entered.set()
            self.closed.wait()  # a SIGSTOPped store answers nothing until the channel closes
            raise Unavailable("the store client was closed")

        def close(self) -> None:
            self.closed.set()

    snap = persistence.Snapshot([], [], [], [], [], 0, "", {})
    monkeypatch.setattr(persistence, "snapshot", lambda *args: snap)
    store = HungStore()
    writes = persistence.Persister(store, "fp", 64, WorkerMetrics(), lambda agent: None)
    agents = [agent(name, 100, durable=False) for name in ("a", "b", "c")]
    for a in agents:
        writes.persist(a)
    assert store.entered.wait(60)  # the first write is in flight (its thread ran)
    assert not writes.close(timeout=0.2)  # the first write hangs: never done in time
    store.close()
    writes.join()
    assert store.saves == 1
    assert all(a.persist_failed and not a.writing for a in agents)
    assert "stopped before writing agent 'c'" in agents[2].persist_error.message
    tier = HotTier(budget_bytes=1000)
    for a in agents:
        tier.put(a)
    assert [a.agent_id for a in tier.unwritten()] == ["a", "b", "c"]


def test_worker_flags_are_checked_and_blas_threads_reach_openblas(monkeypatch, capsys):
    from inference_worker.__main__ import build_config

    # set, then deleted: monkeypatch puts back what was there before, so the "1" that
    # build_config writes does not leak into later tests' worker processes (it made their
    # BLAS single-threaded, and their greedy replies differ with the summation order)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    base = ["--model", "m", "--store", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        build_config([*base, "--blas-threads", "-1"])
    assert "--blas-threads -1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_config([*base, "--drain-seconds", "nan"])
    assert "--drain-seconds: not a finite number: 'nan'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_config([*base, "--stop-write-seconds", "-1"])
    assert "--stop-write-seconds -1.0 must be >= 0" in capsys.readouterr().err
    build_config([*base, "--blas-threads", "1"])
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"


# Many MLX threads that end together make the exit race of ml-explore/mlx#3126 likely: before
# MLXThread cleared its streams, 16 of 40 such processes aborted here; 10 in a row show it.
MLX_THREADS_THEN_EXIT = """
from inference_worker.blas import load_optimized_blas
load_optimized_blas()
import mlx.core as mx
from inference_worker.runtime import MLXThread
threads = [MLXThread() for _ in range(32)]
done = [t.submit(lambda: mx.eval(mx.random.normal((64, 64)) @ mx.ones((64, 64)))) for t in threads]
[f.result() for f in done]
for t in threads:
    t._jobs.put(None)  # all end at once
for t in threads:
    t.close()
"""


def test_a_process_whose_mlx_threads_ended_exits_cleanly():
    """MLX's thread-local streams, freed by C++ after join() returns, once raced the process's
    exit ("terminate called without an active exception", SIGABRT): a stopped worker aborted."""
    import subprocess
    import sys

    for _ in range(10):  # one at a time: run side by side, they hid the race
        run = subprocess.run(
            [sys.executable, "-c", MLX_THREADS_THEN_EXIT], stderr=subprocess.PIPE, text=True
        )
        assert run.returncode == 0, run.stderr[-1000:]


def _bpe(text: bytes) -> str:
    """`text` as byte-level BPE writes it, one character per byte."""
    back = {b: c for c, b in gpt2_bytes().items()}
    return "".join(back[b] for b in text)


@pytest.mark.parametrize(
    "held, inside",
    [
        (b"ab\xf0\x9f\x99", True),  # the first 3 of an emoji's 4 bytes
        (b" \xe2\x80", True),
        (b"\xff\xf0\x9f", True),  # an invalid byte, then a character begun
        (b"ab\x80\x80", False),  # invalid bytes: they stay U+FFFD
        (b"\xff", False),
        (b"ab\xf0\x9f\x99\x82", False),  # whole
        (b"", False),
    ],
)
def test_a_cut_drops_only_a_character_begun(held, inside):
    """What a reply cut short drops: the U+FFFD of a character its last bytes began, read
    from what the detokenizer holds: bytes (SentencePiece) or byte-level BPE's characters."""
    for unflushed in (held, _bpe(held)):
        assert ends_inside_a_character(SimpleNamespace(_unflushed=unflushed)) is inside
    assert not ends_inside_a_character(SimpleNamespace())  # the naive one holds tokens


def test_mlx_lm_detokenizers_hold_their_bytes_where_a_cut_reads_them():
    """The private names ends_inside_a_character reads: an mlx-lm upgrade that renames them
    fails here, not in a reply."""
    from mlx_lm import tokenizer_utils

    assert gpt2_bytes() == tokenizer_utils._byte_decoder()
    for kind in (tokenizer_utils.BPEStreamingDetokenizer, tokenizer_utils.SPMStreamingDetokenizer):
        detok = object.__new__(kind)
        detok.reset()
        assert detok._unflushed in ("", b""), kind


def test_hot_tier_lets_go_of_an_agent_another_worker_committed_since():
    """A stale agent lost its write to another worker's commit: the store keeps that one,
    and this copy is never written. It gives way like a durable one (before, it never did:
    neither durable nor failed, it held its RAM for good), but not while its write is
    still in flight."""
    tier = HotTier(budget_bytes=100)
    stale, writing, saved = (agent(n, 100, durable=False) for n in ("stale", "writing", "saved"))
    saved.persisted_tokens = 10
    stale.stale = writing.stale = True
    writing.pending = Future()
    for a in (stale, writing, saved):
        tier.put(a)
    assert [a.agent_id for a in tier.enforce(keep={saved.id})] == ["stale"]
    assert tier.make_room(busy=set(), room=0) == 100  # saved went; the writing one stays


def test_a_queue_limit_of_0_is_refused_at_start(capsys):
    """Every turn waits in the queue for the next step to admit it: with no place there, a
    worker refused every turn ("0 running, 0 queued ... retry later"), and said so only then."""
    from inference_worker.__main__ import build_config

    with pytest.raises(SystemExit):
        build_config(["--model", "m", "--store", "127.0.0.1:1", "--queue-limit", "0"])
    assert "--max-batch, --step-tokens and --queue-limit must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("live", [True, False], ids=["live-call", "call-over"])
def test_a_token_is_marked_sent_before_it_goes_and_only_on_a_live_call(live):
    """A turn whose caller left before any of it was sent is undone; one whose caller read a
    token is kept. The stream marked a token sent only once gRPC asked for the next message,
    so a caller that read the first token and left at once found its turn undone (a red
    team: 3 of 13). It is marked as it is handed over, unless the call is already over."""
    from inference_worker.service import InferenceWorkerServicer
    from inference_worker.turns import END, TokenEvent, TurnJob

    job = TurnJob("ns", "a", [], Sampling(max_tokens=4))
    context = SimpleNamespace(add_callback=lambda _: True, is_active=lambda: live)

    def start(job: TurnJob) -> None:
        job.events.put(TokenEvent("The", [1]))
        job.events.put(END)

    stream = InferenceWorkerServicer._run(
        object.__new__(InferenceWorkerServicer), job, context, start
    )
    assert next(stream).tokens.text == "The"  # handed to gRPC; the stream not yet resumed
    assert job.streamed is live


def test_an_evict_or_fork_meeting_a_write_begun_since_it_waited_is_busy_not_unreachable():
    """Evict and Fork wait for the agent's write (write_pending), then take the agent idle
    and committed (durable_agent). A turn that ended in between queued a write: that is
    AgentBusy, to send again, where it was NotCommitted "the store is unreachable"."""
    from agentkv.errors import AgentBusy
    from inference_worker.hot_agents import HotAgents

    tier = HotTier(budget_bytes=1000)
    a = agent("a", 100, durable=False)  # its last turn's tokens, not yet committed
    a.pending = Future()  # ... their write in flight
    tier.put(a)
    agents = HotAgents(tier, SimpleNamespace(holds=lambda agent: False), None)
    for what in ("evict", "fork"):
        with pytest.raises(AgentBusy, match=f"write is in flight; {what} it once"):
            agents.durable_agent("ns", "a", what)
    a.pending.set_result(None)
    a.persisted_tokens = 10  # the write landed
    assert agents.evict("ns", "a") == (True, 100)


def test_one_namespace_pinning_its_most_leaves_other_namespaces_room_to_pin():
    """PinAgent's limit was one for the worker: one tenant's 1,024 pins refused every
    other tenant's. It is per namespace now, under a larger one for all."""
    from agentkv.errors import ResourceExhausted
    from inference_worker.agents import MAX_PINNED

    tier = HotTier(budget_bytes=1000)
    for i in range(MAX_PINNED):
        tier.pin(("greedy", f"a{i}"), True)
    with pytest.raises(ResourceExhausted, match="agents of namespace 'greedy' are pinned"):
        tier.pin(("greedy", "one-more"), True)
    tier.pin(("greedy", "a0"), True)  # pinned already: not one more
    tier.pin(("other", "a0"), True)
    tier.pin(("greedy", "a1"), False)
    tier.pin(("greedy", "one-more"), True)  # room again once one is unpinned
    assert len(tier.pinned) == MAX_PINNED + 1


def test_a_turn_s_fp16_copy_of_its_own_tokens_goes_once_it_decodes(tiny_model_dirs):
    """A turn's prefill keeps its own K/V in fp16 beside the Q4 (kv_cache.py): working
    memory that the hot budget leaves out, "while it prefills". It was held until the turn
    ended, all its decode long: 3.6x the Q4 bytes of every token prefilled that turn, past
    --hot-budget with a batch of long prompts. It goes as the turn joins the batch."""
    from mlx_lm import load

    from agentkv.layers import KVFormat
    from inference_worker.batching import ActiveTurn, Batcher
    from inference_worker.config import WorkerConfig
    from inference_worker.kv_cache import QuantizedKV
    from inference_worker.layer_spec import cache_windows
    from inference_worker.scheduler import Request, Scheduler
    from inference_worker.turns import TokenEvent, TurnJob, UsageEvent

    model, tokenizer = load(str(tiny_model_dirs["llama"]))
    scheduler = Scheduler(WorkerConfig(store="127.0.0.1:1"))
    done = []
    batcher = Batcher(model, set(), scheduler, 1, done.append, lambda *failed: None)
    prompt = [5 + (7 * i) % 400 for i in range(300)]
    caches = [QuantizedKV(KVFormat(), 1, w, 256) for w in cache_windows(model)]
    for cache in caches:
        cache.begin_turn()
    agent = Agent("ns", "long", list(prompt), caches)
    job = TurnJob("ns", "long", [], Sampling(max_tokens=6))
    turn = ActiveTurn(
        job, agent, UsageEvent(), Request("1", len(prompt), 6, 1), prompt, tokenizer.detokenizer
    )
    batcher.add(turn)
    while not batcher.rows:  # prefilling
        step = batcher.schedule()
        batcher.run(step)
        scheduler.complete(step)
    assert all(cache._turn is None for cache in caches)  # 300 tokens' fp16 K/V, before
    while batcher.active:
        step = batcher.schedule()
        batcher.run(step)
        scheduler.complete(step)
    tokens = []
    while not job.events.empty():
        if isinstance(event := job.events.get(), TokenEvent):
            tokens += event.token_ids
    assert done == [turn] and len(tokens) == 6
