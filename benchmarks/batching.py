"""Batching benchmark: system throughput and stream smoothness of continuous batching.

SysTPS of B hot agents sent at once against one after another (B = 1, 2, 4, 8), two cold
agents staggered by 2 s (Figure 3), and the model step in process; benchmarks/README.md
explains the method. --quick: 512 only, batch 1,2,4, 16 tokens, one pass.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import describe_model, load_tokenizer, model_dir
from harness import (
    NEVER,
    fastest,
    fmt,
    label,
    machine,
    median,
    parser,
    percentile,
    plot,
    ratio,
    report,
    say,
    services,
    source_slices,
    table,
    usage_dict,
)
from paper import FIGURE3, TABLE4

from inference_worker.blas import load_optimized_blas

NS = "batching"
BATCHES = (1, 2, 4, 8)
PROMPT = "Explain the code above in detail, line by line."  # answered at length
STAGGER_S = 2.0
STAGGER_TOKENS = 32
TARGET_BATCH, TARGET_RATIO = 4, 2.5
MAX_SLICES = 32  # source slices tried for base agents whose replies run to max_tokens
PREFILL_CHUNK = 512  # the worker's default --prefill-chunk, for the in-process prefill
STEP_REPEATS = 8  # in-process decode steps timed per pass (the fastest is kept)

# what one client saw


@dataclass(slots=True)
class Stream:
    """One Turn as this client saw it: when it was sent, each token chunk's arrival, usage."""

    agent: str
    sent: float
    arrivals: list[float] = field(default_factory=list)
    num_tokens: int = 0
    ended: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    def gaps_ms(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Gaps between consecutive chunks, those whose later chunk arrived in [start, end]."""
        pairs = zip(self.arrivals[:-1], self.arrivals[1:], strict=True)
        return [(b - a) * 1e3 for a, b in pairs if start <= b <= end]

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0] - self.sent) * 1e3 if self.arrivals else float("nan")

    def summary(self, origin: float) -> dict[str, Any]:
        gaps = self.gaps_ms()
        return {
            "agent": self.agent,
            "tokens": self.num_tokens,
            "sent_s": self.sent - origin,
            "ended_s": self.ended - origin,
            "client_ttft_ms": self.ttft_ms,
            "gap_ms": {q: percentile(gaps, q) for q in (50, 99, 100)},
            "usage": self.usage,
        }


@dataclass(slots=True)
class Run:
    """B Turns sent together (batched) or one after another (sequential)."""

    context: int
    batch: int
    mode: str
    streams: list[Stream]

    @property
    def tokens(self) -> int:
        return sum(s.num_tokens for s in self.streams)

    @property
    def sys_tps(self) -> float:
        wall = max(s.ended for s in self.streams) - min(s.sent for s in self.streams)
        return self.tokens / wall

    @property
    def decode_tps(self) -> float:
        spans = sorted((s.arrivals[0], s.arrivals[-1]) for s in self.streams if s.arrivals)
        covered, reach = 0.0, float("-inf")
        for start, end in spans:  # the union of the spans
            covered += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return sum(max(0, s.num_tokens - 1) for s in self.streams) / max(covered, 1e-9)

    def agent_gaps(self, q: float) -> list[float]:
        return [g for s in self.streams if (g := percentile(s.gaps_ms(), q)) is not None]

    def as_dict(self) -> dict[str, Any]:
        origin = min(s.sent for s in self.streams)
        return {
            "mode": self.mode,
            "sys_tps": self.sys_tps,
            "decode_tps": self.decode_tps,
            "tokens": self.tokens,
            "streams": [s.summary(origin) for s in self.streams],
        }


@dataclass(slots=True)
class Cell:
    """Every pass of one (context, batch)."""

    context: int
    batch: int
    tokens: int  # max_tokens of every measured turn
    runs: dict[str, list[Run]] = field(default_factory=lambda: {"batched": [], "sequential": []})
    step_ms: dict[str, float] = field(default_factory=dict)  # medians of step_passes, + ops
    step_passes: list[dict[str, float]] = field(default_factory=list)  # by STEP_ROWS key

    def sys_tps(self, mode: str, decode: bool = False) -> float | None:
        return median([r.decode_tps if decode else r.sys_tps for r in self.runs[mode]])

    def streams(self, mode: str) -> list[Stream]:
        return [s for r in self.runs[mode] for s in r.streams]

    def gap(self, q: float, mode: str = "batched") -> float | None:
        return median([g for r in self.runs[mode] for g in r.agent_gaps(q)])

    def per_agent(self, mode: str = "batched") -> float | None:
        return median([s.usage["decode_tokens_per_second"] for s in self.streams(mode)])

    def early_stops(self) -> int:
        """Turns that ended before max_tokens (an EOS as the last token is not early)."""
        every = self.streams("batched") + self.streams("sequential")
        return sum(s.num_tokens < self.tokens for s in every)


# agents and turns


def stream_turn(
    worker: Any, agent: str, messages: list[tuple[str, str]], max_tokens: int
) -> Stream:
    """One greedy Turn, every chunk's arrival timed."""
    stream = Stream(agent, time.perf_counter())
    responses = worker.stream_turn(NS, agent, messages, max_tokens=max_tokens, stop=[NEVER])
    for response in responses:
        if response.HasField("tokens"):
            stream.arrivals.append(time.perf_counter())
            stream.num_tokens += len(response.tokens.token_ids)
        else:
            stream.usage = usage_dict(response.usage)
    stream.ended = time.perf_counter()
    if not stream.usage:
        raise RuntimeError(f"turn of {agent!r} ended without a usage")
    return stream


def new_base(worker: Any, name: str, system: str) -> str:
    """An agent with this system prompt, evicted once durable (only measured copies are hot)."""
    worker.create_agent(NS, name, system)
    worker.evict(NS, name)  # waits for its store write
    return name


def make_bases(
    svc: Any, worker: Any, tokenizer: Any, context: int, count: int, tokens: int, tag: str
) -> list[str]:
    """The first `count` agents, over successive source slices, whose greedy reply to PROMPT
    runs to `tokens` tokens (probed once on a fork, untimed): this model often answers a chat
    question in a few tokens and then emits EOS, and the API has no way to ignore EOS."""
    bases = []
    for i, text in enumerate(source_slices(tokenizer, context, MAX_SLICES)):
        name = new_base(worker, f"{tag}-base{i}", text)
        probe = hot_copies(svc, worker, [name], "probe")[0]
        if stream_turn(worker, probe, [], tokens).num_tokens == tokens:
            bases.append(name)
        worker.delete(NS, probe)
        if len(bases) == count:
            return bases
    raise RuntimeError(f"only {len(bases)} of {MAX_SLICES} slices ran to {tokens} tokens")


def hot_copies(svc: Any, worker: Any, bases: list[str], tag: str) -> list[str]:
    """Forks of the bases, loaded hot by an append-only Turn with the user message."""
    names = [f"{base}-{tag}" for base in bases]
    for base, name in zip(bases, names, strict=True):
        svc.store.fork_agent(NS, base, name)
        worker.turn(NS, name, [("user", PROMPT)], max_tokens=0)
    for name in names:
        worker.wait_durable(NS, name)
    return names


def fire(
    worker: Any,
    jobs: list[tuple[str, list[tuple[str, str]], int]],
    delays: Sequence[float] = (),
) -> list[Stream]:
    """Sends every (agent, messages, max_tokens) Turn at once (each after its delay, s) from
    its own thread; returns the streams in order."""
    barrier = threading.Barrier(len(jobs))

    def one(i: int) -> Stream:
        barrier.wait()
        if i < len(delays):
            time.sleep(delays[i])
        return stream_turn(worker, *jobs[i])

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(one, i) for i in range(len(jobs))]
        return [f.result() for f in futures]


def check_hot(run: Run) -> Run:
    """Aborts unless every turn found its agent's whole context hot."""
    for s in run.streams:
        u = s.usage
        if u["cache_state"] != "hot" or u["reused_hot_tokens"] < 0.9 * run.context:
            raise RuntimeError(f"{s.agent}: expected a hot cache of ~{run.context}; usage {u}")
    return run


# throughput


def batch_worker(svc: Any) -> Any:
    """The throughput runs' worker: --max-batch of the largest batch measured."""
    return svc.workers[max(svc.workers, key=int)]


def one_run(svc: Any, bases: list[str], mode: str, tokens: int, tag: str, context: int = 0) -> Run:
    worker = batch_worker(svc)
    agents = hot_copies(svc, worker, bases, tag)
    jobs = [(a, [], tokens) for a in agents]
    if mode == "batched":
        streams = fire(worker, jobs)
    else:
        streams = [stream_turn(worker, *job) for job in jobs]
    for agent in agents:
        worker.delete(NS, agent)  # waits for the turn's store write
    return Run(context, len(bases), mode, streams)


def throughput(svc: Any, tokenizer: Any, args: Any, context: int, local: InProcess) -> list[Cell]:
    """Every batch size at one context, --passes times: batched, the same batch's forward in
    this process right after (paired, so both see the machine in the same state), sequential."""
    say(f"{label(context)}: creating {max(args.batches)} base agents")
    bases = make_bases(
        svc, batch_worker(svc), tokenizer, context, max(args.batches), args.tokens, f"c{context}"
    )
    one_run(svc, bases, "batched", 8, "settle", context)  # untimed: first steps at this length
    cells = [Cell(context, b, args.tokens) for b in args.batches]
    for p in range(args.passes):
        for cell in cells:
            for mode in ("batched", "sequential"):
                tag = f"p{p}-b{cell.batch}-{mode[0]}"
                run = one_run(svc, bases[: cell.batch], mode, args.tokens, tag, context)
                cell.runs[mode].append(check_hot(run))
                if mode == "batched":
                    cell.step_passes.append(step_pass(local, run))
            say(
                f"  {label(context)} pass {p + 1}/{args.passes} batch {cell.batch}: SysTPS "
                f"{cell.runs['batched'][-1].sys_tps:.1f} batched, "
                f"{cell.runs['sequential'][-1].sys_tps:.1f} sequential"
            )
    return cells


def warm_up(svc: Any, tokenizer: Any, args: Any) -> None:
    """One untimed batched and sequential run at the largest batch, on short agents."""
    texts = source_slices(tokenizer, 256, max(args.batches))
    bases = [new_base(batch_worker(svc), f"warm-base{i}", t) for i, t in enumerate(texts)]
    for mode in ("batched", "sequential"):
        one_run(svc, bases, mode, 8, f"warm-{mode}")
    for stagger_worker in svc.workers.values():
        stagger_worker.create_agent(NS, "warm-up")
        stream_turn(stagger_worker, "warm-up", [("user", "Hello.")], 4)
        stagger_worker.delete(NS, "warm-up")


# staggered arrivals


@dataclass(slots=True)
class Staggered:
    mode: str  # sequential (--max-batch 1) or batched (--max-batch 2)
    a: Stream
    b: Stream

    @property
    def b_prefill(self) -> tuple[float, float]:
        """From B's send to B's first token: when B waits or prefills."""
        return self.b.sent, self.b.arrivals[0] if self.b.arrivals else self.b.ended

    def a_gaps_during_b(self) -> list[float]:
        return self.a.gaps_ms(*self.b_prefill)

    def as_dict(self) -> dict[str, Any]:
        origin = self.a.sent
        return {
            "mode": self.mode,
            "a": self.a.summary(origin),
            "b": self.b.summary(origin),
            "a_arrivals_s": [t - origin for t in self.a.arrivals],
            "b_arrivals_s": [t - origin for t in self.b.arrivals],
            "a_gaps_during_b_prefill_ms": self.a_gaps_during_b(),
        }


def staggered(svc: Any, tokenizer: Any, args: Any) -> list[Staggered]:
    """A, then B 2 s later, both cold; per pass on the sequential and the batched worker."""
    context = max(args.contexts)
    text_a, text_b = source_slices(tokenizer, context, 2)
    out = []
    for p in range(args.passes):
        for mode, max_batch in (("sequential", 1), ("batched", 2)):
            worker = svc.workers[str(max_batch)]
            names = [f"stagger-{mode}-p{p}-{x}" for x in "ab"]
            for name in names:
                worker.create_agent(NS, name)
                worker.wait_durable(NS, name)
            texts = (text_a, text_b)
            jobs = [(n, [("user", t)], STAGGER_TOKENS) for n, t in zip(names, texts, strict=True)]
            a, b = fire(worker, jobs, delays=(0.0, STAGGER_S))
            out.append(Staggered(mode, a, b))
            for name in names:
                worker.delete(NS, name)
            say(
                f"  staggered {label(context)} pass {p + 1} {mode}: TTFT A {a.ttft_ms:.0f} ms, "
                f"B {b.ttft_ms:.0f} ms"
            )
    return out


# in this process: the model step and the batch cache's bookkeeping

STEP_ROWS = {
    "forward": "batched forward + eval, one decode step",
    "sample": "Batcher sampling: logsumexp + one argmax .item() per row",
    "sample_batched": "(alternative) one argmax over the batch + .tolist()",
    "extend": "extend: one agent joins a batch of B-1",
    "leave": "extract + filter: one agent leaves a batch of B",
    "e2e": "end-to-end ms per decode step of the paired batched run: B / decode-only SysTPS",
    "rest": "e2e - forward - sample: gRPC, queues, Python, contention for the cores",
}


def prefilled(model: Any, tokens: list[int]) -> list:
    """One agent's Q4 caches after a chunked prefill of `tokens`, as the worker makes them."""
    import mlx.core as mx

    from agentkv.layers import KVFormat
    from inference_worker.kv_cache import QuantizedKV

    caches = [QuantizedKV(KVFormat()) for _ in model.layers]
    for start in range(0, len(tokens), PREFILL_CHUNK):
        mx.eval(model(mx.array([tokens[start : start + PREFILL_CHUNK]]), cache=caches))
    return caches


def decode_costs(model: Any, caches: list, batch: int, repeats: int) -> dict[str, float]:
    """ms of one batched decode forward and of sampling its logits, `batch` copies of caches."""
    import mlx.core as mx

    from inference_worker.batch_cache import BatchQuantizedKV

    live = [BatchQuantizedKV.merge([c] * batch) for c in caches]
    tokens = mx.array([[7]] * batch)

    def forward() -> mx.array:
        logits = model(tokens, cache=live)[:, -1]
        mx.eval(logits)
        return logits

    logits = forward()

    def sample() -> list[int]:  # as Batcher._decode and a greedy sampler do it
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [int(mx.argmax(logprobs[row]).item()) for row in range(batch)]

    return {
        "forward": fastest(forward, repeats),
        "sample": fastest(sample, repeats),
        "sample_batched": fastest(lambda: mx.argmax(logits, axis=-1).tolist(), repeats),
    }


def cache_op_costs(caches: list, batch: int) -> dict[str, float]:
    """ms of one agent joining a batch of batch-1 (extend) and leaving one of batch
    (extract + filter), every result evaluated; building the batch itself is not counted."""
    import mlx.core as mx

    from inference_worker.batch_cache import BatchQuantizedKV

    def merged(n: int) -> list:
        layers = [BatchQuantizedKV.merge([c] * n) for c in caches]
        mx.eval([a for layer in layers for a in layer.state_arrays()])
        return layers

    def extend() -> list:
        layers = merged(batch - 1)
        for layer, cache in zip(layers, caches, strict=True):
            layer.extend([cache])
        return layers

    def leave() -> list:
        layers = merged(batch)
        out = [layer.extract(0) for layer in layers]
        for layer in layers:
            layer.filter(list(range(1, batch)))
        return [*layers, *out]

    def run(fn: Callable[[], list]) -> None:
        mx.eval([a for layer in fn() for a in layer.state_arrays()])

    return {
        "extend": fastest(lambda: run(extend), 5) - fastest(lambda: merged(batch - 1), 5),
        "leave": fastest(lambda: run(leave), 5) - fastest(lambda: merged(batch), 5),
    }


def hot_scan_us(caches: list, num_agents: int = 32) -> float:
    """µs per idle hot agent of the sum HotTier.make_room takes before every
    model step (Engine.step asks it)."""
    from inference_worker.agents import Agent

    agents = [Agent(NS, f"idle{i}", [], caches) for i in range(num_agents)]
    return fastest(lambda: sum(a.nbytes for a in agents), 20) * 1e3 / num_agents


@dataclass(slots=True)
class InProcess:
    """The model in this process, and one agent's caches per context."""

    model: Any
    caches: dict[int, list]


def in_process(path: Path, tokenizer: Any, contexts: list[int]) -> InProcess:
    """Loads the model here and prefills one agent per context, as the worker would."""
    from mlx_lm import load

    model, _ = load(str(path))
    bos = json.loads((path / "config.json").read_text()).get("bos_token_id") or 0
    caches = {}
    for context in contexts:
        text = source_slices(tokenizer, context, 1)[0]
        ids = [bos, *tokenizer.encode(text, add_special_tokens=False).ids]
        say(f"in-process prefill at {label(context)} ({len(ids)} tokens)")
        caches[context] = prefilled(model, ids)
    return InProcess(model, caches)


def step_pass(local: InProcess, run: Run) -> dict[str, float]:
    """This batch's in-process step costs next to the run's own end-to-end ms per step."""
    costs = decode_costs(local.model, local.caches[run.context], run.batch, STEP_REPEATS)
    e2e = run.batch * 1e3 / run.decode_tps
    return costs | {"e2e": e2e, "rest": e2e - costs["forward"] - costs["sample"]}


def finish_steps(cells: list[Cell], local: InProcess) -> dict[int, float]:
    """Each cell's step_ms (medians over passes, plus joins and leaves); hot_scan_us by
    context."""
    for cell in cells:
        keys = cell.step_passes[0] if cell.step_passes else {}
        cell.step_ms = {k: statistics.median(p[k] for p in cell.step_passes) for k in keys}
        if cell.batch > 1:
            cell.step_ms |= cache_op_costs(local.caches[cell.context], cell.batch)
    return {context: hot_scan_us(caches) for context, caches in local.caches.items()}


# reporting


def throughput_table(cells: list[Cell]) -> str:
    rows = []
    for c in cells:
        batched, sequential = c.sys_tps("batched"), c.sys_tps("sequential")
        rows.append(
            (label(c.context), c.batch, fmt(batched), fmt(sequential), ratio(batched, sequential))
            + (fmt(c.per_agent()), fmt(c.gap(50)), fmt(c.gap(99)))
        )
    headers = ("context", "batch", "SysTPS batched", "SysTPS sequential", "ratio")
    return table((*headers, "per-agent tok/s", "p50 gap ms", "p99 gap ms"), rows)


def detail_table(cells: list[Cell]) -> str:
    rows = []
    for c in cells:
        streams, sys_tps = c.streams("batched"), [r.sys_tps for r in c.runs["batched"]]
        worst = max((g for r in c.runs["batched"] for g in r.agent_gaps(100)), default=None)
        rows.append(
            (label(c.context), c.batch, f"{min(sys_tps):.1f}-{max(sys_tps):.1f}")
            + (fmt(c.sys_tps("batched", True)), fmt(c.sys_tps("sequential", True)))
            + (fmt(median([s.ttft_ms for s in streams])), fmt(worst))
            + (fmt(c.gap(99, "sequential")), fmt(median([s.num_tokens for s in streams]), 0))
            + (c.early_stops(),)
        )
    headers = ("context", "batch", "SysTPS batched min-max", "decode-only SysTPS batched")
    headers += ("decode-only sequential", "client TTFT ms batched (median)")
    headers += ("worst gap ms batched", "p99 gap ms sequential", "tokens/turn", "early EOS")
    return table(headers, rows, "lrl" + "r" * 7)


STEP_COLUMNS = {  # step_table's columns: Cell.step_ms key, header
    "e2e": "end-to-end ms/step",
    "forward": "forward ms",
    "sample": "Batcher sampling ms",
    "sample_batched": "batched argmax ms",
    "rest": "rest ms (e2e - forward - sampling)",
    "extend": "extend ms",
    "leave": "leave ms",
}


def step_table(cells: list[Cell]) -> str:
    """In-process costs against the end-to-end time per decode step, medians of the
    passes' pairs."""
    rows = [
        (label(c.context), c.batch, *(fmt(c.step_ms.get(k), 2) for k in STEP_COLUMNS))
        for c in cells
    ]
    return table(("context", "batch", *STEP_COLUMNS.values()), rows)


def staggered_rows(runs: list[Staggered], mode: str) -> dict[str, float | None]:
    mine = [r for r in runs if r.mode == mode]
    return {
        "A TTFT client ms": median([r.a.ttft_ms for r in mine]),
        "A TTFT server ms": median([r.a.usage["time_to_first_token_ms"] for r in mine]),
        "B TTFT client ms (from B's send)": median([r.b.ttft_ms for r in mine]),
        "B TTFT server ms": median([r.b.usage["time_to_first_token_ms"] for r in mine]),
        "A p99 gap ms while B waits or prefills": median(
            [percentile(r.a_gaps_during_b(), 99) for r in mine]
        ),
        "A gaps in that window (count)": median([len(r.a_gaps_during_b()) for r in mine]),
        "A p99 gap ms, whole stream": median([percentile(r.a.gaps_ms(), 99) for r in mine]),
        "B p99 gap ms, whole stream": median([percentile(r.b.gaps_ms(), 99) for r in mine]),
        "both done, s after A's send": median([max(r.a.ended, r.b.ended) - r.a.sent for r in mine]),
    }


def staggered_table(runs: list[Staggered]) -> str:
    seq, bat = staggered_rows(runs, "sequential"), staggered_rows(runs, "batched")
    headers = ("median over passes", "sequential (--max-batch 1)", "batched (--max-batch 2)")
    return table(headers, [(k, fmt(seq[k]), fmt(bat[k])) for k in seq])


def targets(cells: list[Cell]) -> list[dict[str, Any]]:
    """Batch 4 against batch 1 per context. With one agent, batched and sequential runs are
    the same request, so batch 1's SysTPS is the median of both (twice the samples)."""
    goals = []
    for context in sorted({c.context for c in cells}):
        by_batch = {c.batch: c for c in cells if c.context == context}
        if TARGET_BATCH not in by_batch or 1 not in by_batch:
            continue
        solo, many = by_batch[1], by_batch[TARGET_BATCH]
        one = median([r.sys_tps for runs in solo.runs.values() for r in runs]) or 0.0
        four = many.sys_tps("batched") or 0.0
        goal = {
            "context": context,
            "target": f"{label(context)}: SysTPS at batch {TARGET_BATCH} >= {TARGET_RATIO}x batch"
            " 1",
            "measured": f"{four / one:.2f}x ({four:.1f} vs {one:.1f} tok/s)",
            "met": four / one >= TARGET_RATIO,
        }
        if "forward" in solo.step_ms and "forward" in many.step_ms:
            ceiling = TARGET_BATCH * solo.step_ms["forward"] / many.step_ms["forward"]
            goal["model_forward_ceiling"] = round(ceiling, 2)
            goal["measured"] += f"; the batched forward alone allows {ceiling:.2f}x"
        goals.append(goal)
    return goals


def paper_notes(cells: list[Cell], runs: list[Staggered]) -> list[str]:
    notes = []
    for c in (c for c in cells if c.batch == 2):
        paper = ", ".join(
            f"{m} {v[c.context][0]} (per agent {v[c.context][1]})"
            for m, v in TABLE4.items()
            if c.context in v
        )
        notes.append(
            f"{label(c.context)} batch 2: SysTPS {fmt(c.sys_tps('batched'))}, per agent "
            f"{fmt(c.per_agent())}; paper Table 4 warm batch 2 SysTPS: {paper or '-'}"
        )
    if runs:
        seq, bat = staggered_rows(runs, "sequential"), staggered_rows(runs, "batched")
        key = "B TTFT client ms (from B's send)"
        paper = ", ".join(f"{m} {b / s:.1f}x" for m, (b, s) in FIGURE3.items())
        notes.append(
            f"staggered: B's own TTFT batched / sequential = {ratio(bat[key], seq[key])}; "
            f"paper Figure 3 (4K cold): {paper} (worse when batched)"
        )
    return notes


def other_notes(runs: list[Staggered], scans: dict[int, float]) -> list[str]:
    notes = [
        f"HotTier.make_room re-sums every idle hot agent's bytes before each model step: "
        f"{us:.0f} us per agent at {label(context)} (in-process)"
        for context, us in scans.items()
    ]
    if any(r.a.ended <= r.b.sent for r in runs):
        notes.append(
            "staggered: A had finished before B was sent, so nothing overlapped; its prefill "
            "is too short at this context on this CPU to show the effect (use a larger one)"
        )
    return notes


def draw(cells: list[Cell], runs: list[Staggered]):
    """SysTPS against batch size, and the staggered token timelines."""

    def panels(axes: Any) -> None:
        left, right = axes
        for context in sorted({c.context for c in cells}):
            mine = [c for c in cells if c.context == context]
            for mode, style in (("batched", "o-"), ("sequential", "s--")):
                ys = [c.sys_tps(mode) for c in mine]
                left.plot([c.batch for c in mine], ys, style, label=f"{label(context)} {mode}")
        left.set_xscale("log", base=2)
        left.set_xticks(BATCHES, [str(b) for b in BATCHES])
        left.set_xlabel("agents (batch size)")
        left.set_ylabel("SysTPS, tokens/s (median of passes)")
        left.legend(fontsize=7)
        for r in runs[-2:]:
            for who, s in (("A", r.a), ("B", r.b)):
                xs = [t - r.a.sent for t in s.arrivals]
                right.plot(xs, range(1, len(xs) + 1), ".-", ms=3, label=f"{r.mode} {who}")
        right.set_xlabel("s since A was sent (B sent at 2 s)")
        right.set_ylabel("tokens received")
        right.legend(fontsize=7)

    return panels


def write_report(
    cells: list[Cell], runs: list[Staggered], args: Any, blas: str, scans: dict
) -> None:
    header = machine(blas=blas, model=args.model, model_dir=describe_model(args.path))
    header |= {"contexts": args.contexts, "batches": args.batches}
    header |= {"tokens": args.tokens, "passes": args.passes}
    sections = [
        ("throughput (median of passes)", throughput_table(cells)),
        ("detail", detail_table(cells)),
        ("where a batched decode step goes (median over passes)", step_table(cells)),
        (f"staggered arrivals, {label(max(args.contexts))} cold", staggered_table(runs)),
    ]
    notes = paper_notes(cells, runs) + other_notes(runs, scans)
    notes.append(
        "SysTPS = all generated tokens / wall time from the first Turn sent to the last stream "
        "ended (this client's clock). Decode-only SysTPS = tokens after each stream's first / "
        "the union of the streams' first-to-last-token spans. Per-agent tok/s = median of "
        "usage.decode_tokens_per_second. Gaps: between streamed TokenChunks at this client; "
        "p50/p99 = median over agents of each agent's own. One worker (--max-batch "
        f"{max(args.batches)}) serves every batch size; client, store and worker share "
        "this machine's cores."
    )
    document = {
        "cells": [
            {"context": c.context, "batch": c.batch, "step_ms": c.step_ms}
            | {"step_passes": c.step_passes}
            | {"runs": {m: [r.as_dict() for r in rs] for m, rs in c.runs.items()}}
            for c in cells
        ],
        "step_rows_ms": STEP_ROWS,
        "staggered": [r.as_dict() for r in runs],
        "hot_scan_us_per_agent": scans,
    }
    png = report("batching", args.out, header, sections, targets(cells), notes, document)
    plot(png, header, "batching", draw(cells, runs), ncols=2, figsize=(13, 4.8))


def parse_args(argv: list[str] | None) -> Any:
    p = parser(
        __doc__, contexts=(1024, 2048), passes=2, quick="512 only, batch 1,2,4, N=16, 1 pass"
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens each measured turn generates")
    args = p.parse_args(argv)
    args.batches = list(BATCHES)
    if args.quick:
        args.contexts, args.batches, args.tokens, args.passes = [512], [1, 2, 4], 16, 1
    if args.passes < 1 or args.tokens < 2:
        p.error("--passes must be at least 1 and --tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_optimized_blas()  # before anything here imports mlx; each worker loads its own
    args.path = model_dir(args.model)  # what the workers load, too
    say(describe_model(args.path, args.model))
    tokenizer = load_tokenizer(args.path)
    local = in_process(args.path, tokenizer, args.contexts)
    root = Path(tempfile.mkdtemp(prefix="agentkv-batching-"))
    cells: list[Cell] = []
    workers = {str(b): ["--max-batch", str(b)] for b in sorted({1, 2, max(args.batches)})}
    try:
        with services(root, args.path, workers) as svc:
            blas = svc.info["1"].blas
            say(f"store and workers up ({blas}); warming up")
            warm_up(svc, tokenizer, args)
            for context in args.contexts:
                cells += throughput(svc, tokenizer, args, context, local)
            say(f"staggered arrivals at {label(max(args.contexts))}")
            runs = staggered(svc, tokenizer, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    scans = finish_steps(cells, local)
    write_report(cells, runs, args, blas, scans)


if __name__ == "__main__":
    main()
