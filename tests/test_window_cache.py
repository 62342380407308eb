"""Sliding-window layers kept at window size, on gemma3_text's local layers (window 64 in the
tiny model, 5 of its 6 layers): chunked prefill equals one-shot prefill, the window cache
agrees with an unbounded Q4 cache plus a window mask, a restore that reads only the window
equals a full restore bit for bit, and batched decode over window caches equals decoding
them one by one."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from agentkv.layers import KVFormat
from inference_worker.batch_cache import BatchQuantizedKV
from inference_worker.blocks import block_layers, cache_blocks, caches_from_blocks
from inference_worker.kv_cache import QuantizedKV
from inference_worker.layer_spec import cache_windows

BLOCK = 64
NS = "default"


def tokens(n: int, seed: int = 0) -> list[int]:
    return [5 + (seed * 11 + 7 * i) % 400 for i in range(n)]


def window_caches(model, durable: bool = True) -> list[QuantizedKV]:
    """Window caches; `durable` lets them drop what leaves the window at once (as if every
    token were already in the store)."""
    caches = [QuantizedKV(KVFormat(), 1, w, BLOCK) for w in cache_windows(model)]
    for c in caches:
        c.keep_from = 1 << 40 if durable else 0
    return caches


def full_caches(model) -> list[QuantizedKV]:
    return [QuantizedKV(KVFormat()) for _ in model.layers]


def prefill(model, caches, ids, chunk):
    for i in range(0, len(ids), chunk):
        logits = model(mx.array([ids[i : i + chunk]]), cache=caches)
    return logits[0, -1]


def decode(model, caches, first, n=10):
    out, token = [], first
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
        token = int(mx.argmax(logits).item())
        out.append((token, logits))
    return out


@pytest.fixture(scope="module")
def gemma(tiny_models):
    model, _ = tiny_models["gemma3_text"]
    windows = cache_windows(model)
    assert windows.count(64) == 5 and windows.count(None) == 1
    return model


def test_window_caches_hold_only_the_window(gemma):
    caches = window_caches(gemma)
    prefill(gemma, caches, tokens(400), 50)
    decode(gemma, caches, 9, n=30)
    for cache, window in zip(caches, cache_windows(gemma), strict=True):
        held = cache.offset - cache.start
        assert cache.offset == 430
        if window is None:
            assert cache.start == 0
        else:  # the window (63 tokens before the next) plus less than one block
            assert window - 1 <= held < window - 1 + BLOCK + 50
    full = full_caches(gemma)
    prefill(gemma, full, tokens(400), 50)
    decode(gemma, full, 9, n=30)
    assert sum(c.nbytes for c in caches) < 0.45 * sum(c.nbytes for c in full)


def test_tokens_not_yet_durable_are_kept(gemma):
    caches = window_caches(gemma, durable=False)
    prefill(gemma, caches, tokens(300), 64)
    assert all(c.start == 0 for c in caches)  # nothing is in the store yet: all kept
    for c in caches:
        c.keep_from = 256  # blocks before 256 are now durable
    decode(gemma, caches, 9, n=2)
    assert {c.start for c in caches} == {0, 192}  # the window's start, aligned to a block


class _MaskIgnored(QuantizedKV):
    """The reference implementation's bug: the window mask ignored in chunked prefill."""

    def make_mask(self, n, return_array=False, window_size=None):
        return super().make_mask(n, return_array, None)


@pytest.mark.parametrize("chunk", [1, 37, 64, 128])
def test_chunked_prefill_equals_one_shot_prefill(gemma, chunk):
    """Up to Q4 rounding: K and V computed in matmuls of other shapes differ in their last
    bits, and a value on a rounding edge lands in the next Q4 step (measured here: at most
    0.2 on a logit). A window mask ignored in chunked prefill is off by more than 2."""
    one_shot = window_caches(gemma)
    ref = prefill(gemma, one_shot, tokens(300), 300)
    chunked = window_caches(gemma)
    got = prefill(gemma, chunked, tokens(300), chunk)
    assert mx.abs(got - ref).max().item() < 0.5
    broken = [_MaskIgnored(KVFormat(), 1, None, BLOCK) for _ in gemma.layers]
    assert mx.abs(prefill(gemma, broken, tokens(300), 64) - ref).max().item() > 2.0


def test_window_cache_equals_an_unbounded_cache_with_a_window_mask(gemma):
    """Same chunks on both: the window cache drops only what the mask hides. Equal up to
    rounding: attention sums over fewer (masked-out) keys, which can change a last bit, and
    a last bit can move a K/V value across a Q4 step in later layers."""
    window, full = window_caches(gemma), full_caches(gemma)
    a = prefill(gemma, window, tokens(333), 64)
    b = prefill(gemma, full, tokens(333), 64)
    assert mx.abs(a - b).max().item() < 0.05
    assert int(mx.argmax(a).item()) == int(mx.argmax(b).item())
    for (t1, l1), (t2, l2) in zip(decode(gemma, window, 3), decode(gemma, full, 3), strict=True):
        assert t1 == t2
        assert mx.abs(l1 - l2).max().item() < 0.05


def test_a_window_restore_equals_a_full_restore_bit_for_bit(gemma, store):
    """Through the real store: the window read fetches local layers only for the blocks that
    reach into the window, and the caches it builds equal those of a full read, and of the
    hot caches they came from."""
    fp = "test-gemma-window:k4v4g64f16:b64"
    ids = tokens(300)
    hot = window_caches(gemma, durable=False)
    first = int(mx.argmax(prefill(gemma, hot, ids, 64)).item())
    blocks, keys = cache_blocks(hot, ids, fp, BLOCK)  # every layer of every block
    store.put_blocks(NS, fp, blocks)
    windows = cache_windows(gemma)
    plan = block_layers([len(b.token_ids) for b in blocks], windows, BLOCK)
    assert plan[:3] == [(5,)] * 3 and plan[3:] == [(), ()]  # blocks 3, 4 reach the window
    full_read = list(store.get_blocks(NS, fp, keys))
    window_read = [
        *store.get_blocks(NS, fp, keys[:3], layers=[5]),
        *store.read_blocks_local(NS, fp, keys[3:]),
    ]
    assert sum(t.num_bytes for b in window_read for t in b.tensors) < 0.5 * sum(
        t.num_bytes for b in full_read for t in b.tensors
    )
    restored = [
        caches_from_blocks(read, len(windows), KVFormat(), 1, windows, BLOCK)
        for read in (full_read, window_read)
    ]
    for c in hot:
        c.keep_from = 1 << 40  # now durable
    runs = [decode(gemma, caches, first) for caches in (hot, *restored)]
    for step in range(len(runs[0])):
        assert runs[0][step][0] == runs[1][step][0] == runs[2][step][0]
        assert mx.array_equal(runs[1][step][1], runs[2][step][1]).item()
        assert mx.array_equal(runs[0][step][1], runs[1][step][1]).item()


def test_batched_window_decode_equals_sequential(gemma):
    """Rows of 300, 70 and 150 tokens (one past its window, two not): batched equals alone,
    logit for logit, across the step where the batch drops a block nobody can reach."""
    lengths = (300, 70, 150)
    singles, firsts = [], []
    for seed, n in enumerate(lengths):
        caches = window_caches(gemma)
        firsts.append(int(mx.argmax(prefill(gemma, caches, tokens(n, seed), 64)).item()))
        singles.append(caches)
    refs = [decode(gemma, c, f, n=40) for c, f in zip(singles, firsts, strict=True)]
    batch_caches = []
    for seed, n in enumerate(lengths):
        caches = window_caches(gemma)
        prefill(gemma, caches, tokens(n, seed), 64)
        batch_caches.append(caches)
    batch = [BatchQuantizedKV.merge(list(layer)) for layer in zip(*batch_caches, strict=True)]
    current = firsts
    widths = set()
    for step in range(40):
        logits = gemma(mx.array([[t] for t in current]), cache=batch)[:, -1]
        current = [int(mx.argmax(logits[i]).item()) for i in range(3)]
        widths.add(batch[0].idx)
        for i, ref in enumerate(refs):
            assert mx.array_equal(logits[i], ref[step][1]).item(), (i, step)
    assert min(widths) < max(widths)  # the batch dropped columns out of everyone's reach
    for i, single in enumerate(singles):  # extracted: what the single cache holds, or more
        for alone, batched in zip(single, batch, strict=True):
            got = batched.extract(i)
            assert got.offset == alone.offset and got.start <= alone.start
            skip = alone.start - got.start
            for a, b in zip(
                (*alone.state[0], *alone.state[1]), (*got.state[0], *got.state[1]), strict=True
            ):
                assert mx.array_equal(a, b[..., skip:, :]).item()


def held_bytes(w, ns: str, agent_id: str) -> int:
    """The agent's hot bytes once settled: a window cache lets go of its committed past on
    the worker's MLX thread, just after the commit."""
    for _ in range(200):
        before = w.describe(ns, agent_id).num_bytes
        time.sleep(0.01)
        if w.describe(ns, agent_id).num_bytes == before:
            return before
    raise AssertionError("hot bytes never settled")


def test_worker_restores_only_the_window_and_answers_the_same(tiny_model_dirs, start_worker):
    """Two workers on gemma3_text, one keeping local layers at full length. The window-aware
    one restores an agent past its window bit for bit like a twin that stayed hot, holding
    and reading a fraction of the bytes; against full-length layers it agrees up to rounding
    (attention sums over fewer, masked-out keys: ~1e-4 on a logit here, which can flip a
    random Gemma's near-tied argmax many tokens later), so there only the first token is
    compared."""
    from agentkv.client.worker import WorkerClient

    model = tiny_model_dirs["gemma3_text"]
    window = WorkerClient(start_worker(model, name="window").address)
    full = WorkerClient(start_worker(model, "--full-window-layers", name="full").address)
    system = "You are the warden of the prison, and you keep order. " * 30  # ~400 tokens
    replies = {}
    for ns, w in (("window", window), ("full", full)):  # one store: a namespace each
        for agent in ("a", "twin"):
            w.create_agent(ns, agent, system)
            first = w.turn(ns, agent, [("user", "Who are you?")], max_tokens=80)
        w.wait_durable(ns, "a")
        hot = held_bytes(w, ns, "a")
        w.evict(ns, "a")
        second = w.turn(ns, "a", [("user", "And now?")], max_tokens=8)
        twin = w.turn(ns, "twin", [("user", "And now?")], max_tokens=8)
        assert second.token_ids == twin.token_ids  # restored == never evicted
        assert twin.usage.cache_state == "hot"
        replies[ns] = (first, second, hot)
    (wf, ws, whot), (ff, fs, fhot) = replies["window"], replies["full"]
    assert wf.token_ids[0] == ff.token_ids[0]
    assert ws.usage.cache_state == fs.usage.cache_state == "warm"
    assert not ws.usage.restore_failure and ws.usage.reused_store_tokens > 400
    assert ws.usage.restored_bytes < 0.5 * fs.usage.restored_bytes
    assert whot < 0.5 * fhot


def test_a_failed_turn_rewinds_unless_its_window_moved_on(gemma):
    """QuantizedKV.rewind puts a cache back as before a turn (same logits as one that never
    saw it), and says so when a sliding window already dropped what that needs."""
    caches, reference = window_caches(gemma, durable=False), window_caches(gemma, durable=False)
    prefill(gemma, caches, tokens(100), 50)
    prefill(gemma, reference, tokens(100), 50)
    for c in caches:
        c.begin_turn()
    prefill(gemma, caches, tokens(20, seed=1), 20)
    assert all([c.rewind(100) for c in caches]) and {c.offset for c in caches} == {100}
    x = mx.array([[9]])
    assert mx.array_equal(gemma(x, cache=caches), gemma(x, cache=reference)).item()

    for c in caches:  # a long turn over durable tokens: the windows move on and drop
        c.keep_from = 1 << 40
        c.begin_turn()
    prefill(gemma, caches, tokens(300, seed=2), 64)
    assert [c.rewind(101) for c in caches] == [w is None for w in cache_windows(gemma)]


def turn_on(model, agent, ids: list[int], usage=None, limit: int | None = None) -> mx.array:
    """One turn as the engine runs it: what the caches keep, then the rest prefilled in
    blocks, with window caches told what is not yet durable before each chunk."""
    from inference_worker.turns import UsageEvent

    reuse = agent.reusable(ids, True, usage or UsageEvent(), limit)
    agent.begin_turn(ids, agent.chat, "", reuse, BLOCK)
    for i in range(reuse, len(ids), BLOCK):
        agent.keep_undurable()
        logits = model(mx.array([ids[i : i + BLOCK]]), cache=agent.caches)
        mx.eval(logits)
    for c in agent.caches:
        c.end_turn()
    return logits[0, -1]


def committed(agent) -> None:
    """As after the store took every token: the windows let go of what they may."""
    agent.persisted_tokens = agent.cached
    agent.committed_full_keys = list(agent.queued_full_keys)
    agent.keep_undurable()
    for c in agent.caches:
        c.release()


def test_a_resume_from_before_the_windows_start_prefills_again_and_answers_as_fresh(gemma):
    """A whole conversation resumed from an earlier point (a regenerated reply) after a
    commit: the windows dropped what the resumed turn attends over, so it is prefilled whole,
    and answers bit for bit as a new agent given that context does."""
    from inference_worker.agents import Agent
    from inference_worker.turns import UsageEvent

    context = tokens(200)
    agent = Agent(NS, "a", [], window_caches(gemma, durable=False))
    turn_on(gemma, agent, context)
    committed(agent)
    assert max(c.start for c in agent.caches) == 128  # the windows kept 128 on
    resumed, usage = context[:150] + tokens(30, seed=3), UsageEvent(reused_hot_tokens=200)
    got = turn_on(gemma, agent, resumed, usage, limit=150)
    fresh = Agent(NS, "fresh", [], window_caches(gemma, durable=False))
    assert mx.array_equal(got, turn_on(gemma, fresh, resumed)).item()
    assert usage.reused_hot_tokens == 0 and agent.cached == len(resumed)


def test_a_resumed_turn_is_not_durable_until_written_and_can_be_written(gemma):
    """A turn that cuts the context back: what the store held past the cut is another
    context's, so the agent is not durable (may not be evicted) until its new tokens are
    written, and the windows keep them for that write."""
    from inference_worker.agents import Agent
    from inference_worker.persistence import snapshot

    context = tokens(300)
    agent = Agent(NS, "a", [], window_caches(gemma, durable=False))
    turn_on(gemma, agent, context)
    snapshot(agent, "fp", BLOCK)
    committed(agent)
    assert agent.durable
    resumed = context[:200] + tokens(300, seed=5)
    turn_on(gemma, agent, resumed, limit=200)
    assert agent.persisted_tokens == 200 and not agent.durable
    snap = snapshot(agent, "fp", BLOCK)  # the window caches still hold every new token
    assert snap.tokens == resumed and len(snap.stored_keys) == 200 // BLOCK


def test_an_undone_resume_leaves_the_agent_writable_as_before(gemma):
    """A turn that resumes the conversation from an earlier point (a regenerated reply)
    fails before its first token and is undone; the next turn goes on from the context as
    it was. Its write cuts blocks from where the store's copy ends, which the windows still
    hold. Before, the undo left the lists of stored block keys cut back to the resume
    point, and every write after it failed ("positions before ... left this layer's
    window"): the agent could never be evicted or written again."""
    from inference_worker.agents import Agent
    from inference_worker.persistence import snapshot
    from inference_worker.turns import UsageEvent

    context = tokens(300)
    agent = Agent(NS, "a", [], window_caches(gemma, durable=False))
    turn_on(gemma, agent, context)
    snapshot(agent, "fp", BLOCK)
    committed(agent)
    resumed = context[:40] + tokens(30, seed=6)
    keep = agent.reusable(resumed, True, UsageEvent())
    undo = agent.begin_turn(resumed, agent.chat, "", keep, BLOCK)
    assert undo.restore(agent) and agent.tokens == context and agent.durable

    grown = context + tokens(20, seed=7)
    turn_on(gemma, agent, grown)
    snap = snapshot(agent, "fp", BLOCK)
    assert snap.tokens == grown and len(snap.stored_keys) == 300 // BLOCK
