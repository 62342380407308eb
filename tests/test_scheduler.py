"""The scheduler's policies, fast and without MLX: continuous batching, chunked prefill under a
token budget, batch size, FCFS and priorities, deadlines, cancellation and memory."""

from __future__ import annotations

import contextlib
import random

import pytest

from agentkv.errors import OverBudget, ResourceExhausted
from inference_worker.config import WorkerConfig
from inference_worker.scheduler import Request, Scheduler, State, _lower


def sched(memory_budget: int = 1000, prefill_while_decoding: int = 128, **overrides) -> Scheduler:
    settings = {"max_batch": 4, "step_tokens": 64, "prefill_chunk": 32, "queue_limit": 8}
    config = WorkerConfig(
        "m", store="127.0.0.1:1", hot_budget_bytes=memory_budget, **settings | overrides
    )
    return Scheduler(config, prefill_while_decoding)


def req(name: str, prompt: int = 8, max_tokens: int = 4, memory: int = 100, **kw) -> Request:
    return Request(name, prompt, max_tokens, memory, **kw)


def run_step(s: Scheduler, now: float = 0.0):
    step = s.schedule(now)
    s.complete(step)
    return step


def test_new_requests_join_between_decode_steps():
    s = sched()
    a = req("a", max_tokens=10)
    s.submit(a)
    run_step(s)  # a prefills (8 tokens) and gets its first token
    assert a.state is State.DECODING
    b = req("b")
    s.submit(b)
    step = run_step(s)
    assert step.admitted == [b] and step.decode == [a] and step.prefill == [(b, 8)]


def test_long_prefill_is_chunked_and_never_freezes_decoders():
    s = sched(step_tokens=40, prefill_chunk=32)
    a = req("a", prompt=4, max_tokens=100)
    s.submit(a)
    run_step(s)
    long = req("long", prompt=200)
    s.submit(long)
    chunks = []
    while long.state is State.PREFILLING or long.state is State.WAITING:
        step = run_step(s)
        assert a in step.decode  # a decodes every single step
        assert step.num_tokens <= 40
        chunks += [n for r, n in step.prefill if r is long]
    assert sum(chunks) == 200 and max(chunks) <= 32


def test_batch_size_is_capped_and_the_rest_wait_in_order():
    s = sched(max_batch=2)
    for name in "abc":
        s.submit(req(name))
    step = run_step(s)
    assert [r.request_id for r in step.admitted] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_priority_first_then_first_come_first_served():
    s = sched(max_batch=1)
    for name, priority in [("low1", 0), ("high", 5), ("low2", 0)]:
        s.submit(req(name, priority=priority))
    order = []
    while s.waiting or s.running:
        order += [r.request_id for r in run_step(s).admitted]
    assert order == ["high", "low1", "low2"]


def test_deadlines_expire_waiting_and_running_requests():
    s = sched(max_batch=1)
    running = req("running", max_tokens=100, deadline=5.0)
    waiting = req("waiting", deadline=1.0)
    s.submit(running)
    s.submit(waiting)
    run_step(s, now=0.0)
    step = run_step(s, now=2.0)
    assert step.expired == [waiting] and waiting.state is State.EXPIRED
    step = run_step(s, now=6.0)
    assert step.expired == [running] and not s.running


def test_cancel_frees_the_slot_for_the_next_step():
    s = sched(max_batch=1)
    a, b = req("a", max_tokens=100), req("b")
    s.submit(a)
    s.submit(b)
    run_step(s)
    assert s.cancel("a") is a and a.state is State.CANCELLED
    assert run_step(s).admitted == [b]
    assert s.cancel("nobody") is None


def test_memory_budget_counts_the_hot_tier_and_the_live_batch():
    s = sched(memory_budget=600)
    s.hot_bytes = 250
    s.submit(req("a", memory=200))
    s.submit(req("b", memory=200))  # 250 hot + 200 a + 200 b > 600: b waits
    s.submit(req("c", memory=10))  # fits, but may not overtake b
    assert [r.request_id for r in run_step(s).admitted] == ["a"]
    s.hot_bytes = 0  # the engine evicted hot agents to the store
    assert [r.request_id for r in run_step(s).admitted] == ["b", "c"]


def test_the_hot_room_is_the_head_of_the_lines():
    """Idle agents must give way down to what the head of the line needs: sized for a
    smaller request behind it (the old rule), nothing is ever admitted."""
    s = sched(memory_budget=1000)
    s.hot_bytes = 900
    s.submit(req("head", memory=600))
    s.submit(req("small", memory=400))
    s.submit(req("urgent", memory=700, priority=1))  # first in line: it outranks both
    assert s.hot_room() == 300
    s.hot_bytes = 400  # room for "small" only: the line does not move
    assert run_step(s).admitted == []
    s.hot_bytes = s.hot_room()
    assert [r.request_id for r in run_step(s).admitted] == ["urgent"]
    assert s.hot_room() == 1000 - 700 - 700  # head's row in the batch is as long as urgent's


def test_the_live_batch_pads_each_row_to_the_longest_and_own_caches_count_too():
    """Rows in the live batch are left-padded to the longest, and each agent keeps its own
    caches beside it, to undo its turn: a short turn beside a long one claims as much as
    it does. A turn asking for no tokens never joins the batch. (The claim was the sum of
    the turns' sizes: a batch could hold many times what the budget allowed.)"""
    s = sched(memory_budget=1000)
    s.submit(req("long", memory=400, own_bytes=100))
    s.submit(req("short", memory=50, own_bytes=10))
    s.submit(req("append", memory=30, max_tokens=0))
    s.submit(req("short2", memory=50, own_bytes=10))  # 3 * 400 + 120 + 30 > 1000: it waits
    assert [r.request_id for r in s.schedule(0.0).admitted] == ["long", "short", "append"]
    assert s.reserved_bytes == 2 * 400 + 110 + 30
    with pytest.raises(OverBudget, match=r"needs 1010 bytes .* and its context again to undo"):
        s.submit(req("huge", memory=900, own_bytes=110))
    with pytest.raises(OverBudget, match=r"needs 1100 bytes of KV cache \(its context\), more"):
        s.submit(req("inject", memory=1100, own_bytes=1100, max_tokens=0))  # never in the batch


def test_a_full_queue_and_an_impossible_request_are_refused():
    s = sched(max_batch=1, queue_limit=2, memory_budget=500)
    with pytest.raises(OverBudget, match=r"1000 bytes.*budget of 500"):
        s.submit(req("huge", memory=1000))
    s.submit(req("a"))
    s.submit(req("b"))
    with pytest.raises(ResourceExhausted, match="queue limit 2"):
        s.submit(req("c"))


def test_an_impossible_request_names_what_to_cut():
    """A turn asks for fewer tokens; a new agent's prefix alone (no tokens asked for) for a
    shorter context."""
    s = sched(memory_budget=500)
    with pytest.raises(
        OverBudget, match=r"\(its context and max_tokens\).*fewer tokens or a shorter context$"
    ):
        s.submit(req("turn", memory=1000, max_tokens=8))
    with pytest.raises(OverBudget, match=r"\(its context\).*a shorter context$"):
        s.submit(req("create", memory=1000, max_tokens=0))


def test_requests_finish_at_max_tokens_and_append_only_turns_at_prefill():
    s = sched()
    gen, append = req("gen", max_tokens=3), req("append", max_tokens=0)
    s.submit(gen)
    s.submit(append)
    run_step(s)
    assert append.state is State.FINISHED and gen.generated == 1
    run_step(s)
    run_step(s)
    assert gen.state is State.FINISHED and gen.generated == 3 and not s.running


def test_the_scheduler_imports_no_mlx():
    import subprocess
    import sys

    code = "import sys, inference_worker.scheduler; sys.exit('mlx.core' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prefill_shrinks_while_others_decode_to_bound_their_gaps():
    s = sched(step_tokens=512, prefill_chunk=512, prefill_while_decoding=128)
    alone = req("alone", prompt=1000)
    s.submit(alone)
    assert run_step(s).prefill == [(alone, 512)]  # nobody decodes: the whole budget
    s.cancel("alone")
    a = req("a", prompt=4, max_tokens=50)
    s.submit(a)
    run_step(s)
    b = req("b", prompt=1000)
    s.submit(b)
    assert run_step(s).prefill == [(b, 128)]  # a decodes: b's chunk is capped


def test_one_namespace_may_fill_the_queue_but_a_full_queue_is_shared():
    """A lone tenant may queue up to --queue-limit turns. Once the queue is full, a turn of
    a namespace holding at least two places fewer than the biggest holder takes the place of
    that holder's last in line (returned, to be refused); one that would not is refused."""
    s = sched(max_batch=1, queue_limit=4)
    s.submit(req("a0", namespace="a"))
    run_step(s)  # a0 runs; the line is empty
    assert [s.submit(req(f"a{i}", namespace="a")) for i in (1, 2, 3, 4)] == [None] * 4
    with pytest.raises(ResourceExhausted, match="namespace 'a' holds 4 of those places"):
        s.submit(req("a5", namespace="a"))
    pushed = [s.submit(req(name, namespace="b")) for name in ("b1", "b2")]
    assert [p.request_id for p in pushed] == ["a4", "a3"]
    assert all(p.state is State.CANCELLED for p in pushed)
    with pytest.raises(ResourceExhausted, match="namespace 'b' holds 2 of those places"):
        s.submit(req("b3", namespace="b"))
    assert sorted(r.request_id for r in s.waiting) == ["a1", "a2", "b1", "b2"]


def test_the_queue_is_bounded_in_bytes_and_admission_counts_the_agents_waiting():
    """A waiting turn's agent is in RAM already (restored or hot), so the queue holds turns
    while their agents, and the most any one claims on top once running, fit the budget;
    past that a turn is refused (RESOURCE_EXHAUSTED). Admission counts the agents still
    waiting. (Before, the queue was bounded by count alone: --queue-limit agents in RAM
    outside the budget.)"""
    s = sched(max_batch=2, queue_limit=8, memory_budget=1000)
    s.submit(req("run", memory=100, own_bytes=50))
    run_step(s)  # run: 150 claimed
    for name in ("a", "b", "c"):
        s.submit(req(name, memory=200, own_bytes=200))  # each holds 200, claims 400 running
    assert not s.full()  # 3 x 200 + 200 = 800
    with pytest.raises(ResourceExhausted, match=r"3 turns queued hold 600 bytes .* 1000"):
        s.submit(req("d", memory=300, own_bytes=200))  # 800 + 300 > 1000
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    s.submit(req("e", memory=400, own_bytes=0))  # a new agent's: nothing held yet
    assert s.full()  # 600 + 0 + 400 = 1000: nothing more fits
    with pytest.raises(ResourceExhausted, match="turns queued hold 600 bytes"):
        s.submit(req("f", memory=10, own_bytes=10))
    # a: claim(run, a) = 200 + 2 x 200 + 50 = 650, and b and c wait with 400: > 1000
    assert run_step(s).admitted == []
    assert s.hot_room() == 1000 - 650 - 400 < 0  # no idle agent may stay
    s.finish(s.running[0])  # run ends: a (400) fits beside b and c (400); then a and b
    assert [r.request_id for r in run_step(s).admitted] == ["a", "b"]  # (800) beside c


def test_a_ceiling_waits_at_its_least_and_is_lowered_to_what_the_budget_holds_alone():
    """A turn whose max_tokens is a ceiling (fit_max_tokens: the gateway's, when a call
    gives none) is sized to the whole budget alone, so it could never wait beside another
    agent's turn (the review's case). It now waits at its least, one token, and once the
    batch is empty it takes what the budget holds beside the agents still waiting."""
    s = sched(max_batch=4, queue_limit=8, memory_budget=1000)
    s.submit(req("run", memory=100))
    run_step(s)  # run: 200 claimed
    big = req("big", max_tokens=160, memory=100 + 160 * 5, own_bytes=100)  # alone: 1000
    big.token_bytes = 5
    s.submit(big)  # waits at its least: 100 + (100 + 5)
    s.submit(req("w", memory=320, own_bytes=300))  # 400 + max(105, 320) = 720: it waits too
    assert run_step(s).admitted == []  # big waits for the batch, and no one overtakes it
    s.finish(s.running[0])
    assert run_step(s).admitted == [big]  # alone, beside w's 300: 700 for big
    assert (big.max_tokens, big.memory_bytes) == (100, 600)  # 160 - 60 tokens of 5 bytes
    assert s.reserved_bytes + sum(r.own_bytes for r in s.waiting) == 1000
    s.finish(big)
    assert [r.request_id for r in run_step(s).admitted] == ["w"]
    s.finish(s.running[0])
    again = req("again", max_tokens=160, memory=100 + 160 * 5, own_bytes=100)
    again.token_bytes = 5
    s.submit(again)
    s.submit(req("w2", memory=320, own_bytes=300))
    s.hot_bytes = 200  # an idle agent whose write is in flight: it cannot give way yet
    assert run_step(s).admitted == []  # it waits for that write, lowered for w2 alone
    assert again.max_tokens == 100
    s.hot_bytes = 0
    assert run_step(s).admitted == [again] and again.max_tokens == 100
    fills = req("fills", max_tokens=0, memory=300)  # asks for no tokens: nothing to lower
    fills.token_bytes = 5
    _lower(fills, 10)
    assert (fills.max_tokens, fills.memory_bytes) == (0, 300)


def test_a_queue_full_of_bytes_is_shared_between_namespaces():
    """A namespace whose turns hold the queue's bytes gives a place to another that holds
    at least two fewer, as with a queue full by count; one whose pushed-out turn would not
    free enough is refused, and pushes no one out."""
    s = sched(max_batch=1, queue_limit=8, memory_budget=1000)
    s.submit(req("run", memory=100))
    run_step(s)
    for i in range(4):
        s.submit(req(f"a{i}", memory=100, own_bytes=200, namespace="a"))  # 4 x 200 + 100
    with pytest.raises(ResourceExhausted, match="turns queued hold 800 bytes"):
        s.submit(req("a4", memory=100, own_bytes=200, namespace="a"))
    with pytest.raises(ResourceExhausted, match="turns queued hold 800 bytes"):
        s.submit(req("big", memory=100, own_bytes=400, namespace="b"))  # a3 frees only 200
    assert len(s.waiting) == 4
    pushed = s.submit(req("b0", memory=100, own_bytes=150, namespace="b"))
    assert pushed is not None and pushed.request_id == "a3"
    assert [r.request_id for r in s.waiting] == ["a0", "a1", "a2", "b0"]


def test_a_queue_within_its_bytes_always_admits_its_head_once_the_batch_empties():
    """Whatever turns the byte bound lets wait, once the batch has emptied and idle agents
    have given way (hot_bytes down to hot_room()), the first in line is admitted: counting
    the waiting agents at admission never leaves the queue stuck."""
    rng = random.Random(7)
    for _ in range(300):
        s = sched(max_batch=4, queue_limit=16, memory_budget=rng.randint(500, 5000))
        for i in range(rng.randint(1, 30)):
            memory = rng.randint(1, 800)
            own = rng.choice([0, rng.randint(0, memory)])
            tokens = rng.choice([0, 4])
            ceiling = rng.choice([0, rng.randint(1, memory // 8 + 1)]) if tokens else 0
            request = req(f"r{i}", max_tokens=tokens, memory=memory, own_bytes=own)
            request.token_bytes, request.memory_bytes = ceiling, memory + 3 * ceiling
            with contextlib.suppress(OverBudget, ResourceExhausted):
                s.submit(request)
        while s.waiting:
            s.running.clear()  # the batch empties
            s.hot_bytes = max(0, s.hot_room())  # idle agents give way, all of them if need be
            assert run_step(s).admitted, [(r.memory_bytes, r.own_bytes) for r in s.waiting]
            assert s.reserved_bytes + sum(r.own_bytes for r in s.waiting) <= s.memory_budget


def test_a_higher_priority_turn_of_a_namespace_prefills_first():
    """Among running turns, each namespace's by priority: a priority-9 turn admitted after
    a priority-0 one still prefilling gets the step's prefill budget first."""
    s = sched(max_batch=2, step_tokens=32, prefill_chunk=32)
    s.submit(req("low", prompt=200))
    run_step(s)
    s.submit(req("high", prompt=200, priority=9))
    steps = [run_step(s) for _ in range(3)]
    assert [[(r.request_id, n) for r, n in step.prefill] for step in steps[1:]] == [
        [("high", 32)],
        [("high", 32)],
    ]


def test_a_namespace_never_takes_the_last_batch_slot_while_another_was_active_lately():
    """The red team's case: eight long turns of one tenant held all eight slots, and another
    tenant's 10-token turn waited 16.5 s for the first of them to end. While another
    namespace had a turn within SHARED_SECONDS, the last slot stays free for it: its turn
    starts at the next step. A lone tenant (and one alone for longer) takes every slot."""
    from inference_worker.scheduler import SHARED_SECONDS

    s = sched(max_batch=4, queue_limit=16)
    for i in range(6):
        s.submit(req(f"lone{i}", namespace="a", max_tokens=1000))
    run_step(s, now=0.0)
    assert [r.request_id for r in s.running] == ["lone0", "lone1", "lone2", "lone3"]
    s = sched(max_batch=4, queue_limit=16)
    s.submit(req("calm0", namespace="b", max_tokens=1))
    run_step(s, now=0.0)  # b had a turn; it ends
    assert not s.running
    for i in range(6):
        s.submit(req(f"flood{i}", namespace="a", max_tokens=1000))
    run_step(s, now=1.0)
    assert [r.request_id for r in s.running] == ["flood0", "flood1", "flood2"]
    calm = req("calm1", namespace="b", max_tokens=1)
    s.submit(calm)
    assert run_step(s, now=2.0).admitted == [calm]
    run_step(s, now=3.0)  # calm1 ends: a's fourth waits while b was active lately
    assert len(s.running) == 3
    assert [r.request_id for r in run_step(s, now=3.0 + SHARED_SECONDS + 1).admitted] == ["flood3"]


def test_namespaces_take_turns_in_line_and_priority_counts_within_one():
    """The line serves each namespace's first turn, then each one's second, ...: a tenant
    that queued many turns (or gave them all a high priority) delays another's by one turn
    of its own, not all of them. Within a namespace, priority first, then arrival."""
    s = sched(max_batch=1, queue_limit=16)
    s.submit(req("running", namespace="a", max_tokens=1))
    run_step(s)
    for name, priority in [("a1", 9), ("a2", 9), ("a3", 9), ("a-low", 0)]:
        s.submit(req(name, namespace="a", priority=priority))
    s.submit(req("b1", namespace="b"))
    s.submit(req("c-low", namespace="c"))
    s.submit(req("c-high", namespace="c", priority=1))
    served = []
    while s.waiting or s.running:
        step = run_step(s)
        served += [r.request_id for r in step.admitted]
    # "a" took round 0 with its running turn: b and c take theirs first
    assert served == ["c-high", "b1", "a1", "c-low", "a2", "a3", "a-low"]
