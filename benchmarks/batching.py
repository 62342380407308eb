"""Batching benchmark: system throughput and stream smoothness of continuous batching.

SysTPS of B hot agents sent at once against one after another (B = 1, 2, 4, 8), two cold
agents staggered by 2 s (Figure 3), and the model step in process; the README explains the
method. Run: python benchmarks/batching.py [--model SPEC] [--contexts 1024,2048] [--passes 2]
[--tokens 32] [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h
from paper import FIGURE3, TABLE4

NS = "batching"
BATCHES = (1, 2, 4, 8)
PROMPT = "Explain the code above in detail, line by line."  # answered at length
STAGGER_S, STAGGER_TOKENS = 2.0, 32
TARGET_BATCH, TARGET_RATIO = 4, 2.5
MAX_SLICES = 32  # source slices tried for base agents whose replies run to max_tokens
PREFILL_CHUNK = 512  # the worker's default --prefill-chunk, for the in-process prefill
STEP_REPEATS = 8  # in-process decode steps timed per pass (the fastest is kept)
MODES = ("batched", "sequential")


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


@dataclass(slots=True)
class Run:
    """B Turns sent together (batched) or one after another (sequential)."""

    context: int
    batch: int
    mode: str
    streams: list[Stream]

    @property
    def sys_tps(self) -> float:
        wall = max(s.ended for s in self.streams) - min(s.sent for s in self.streams)
        return sum(s.num_tokens for s in self.streams) / wall

    @property
    def decode_tps(self) -> float:
        spans = sorted((s.arrivals[0], s.arrivals[-1]) for s in self.streams if s.arrivals)
        covered, reach = 0.0, float("-inf")
        for start, end in spans:  # the union of the spans
            covered += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return sum(max(0, s.num_tokens - 1) for s in self.streams) / max(covered, 1e-9)

    def agent_gaps(self, q: float) -> list[float]:
        return [g for s in self.streams if (g := h.percentile(s.gaps_ms(), q)) is not None]


@dataclass(slots=True)
class Cell:
    """Every pass of one (context, batch)."""

    context: int
    batch: int
    tokens: int  # max_tokens of every measured turn
    runs: dict[str, list[Run]] = field(default_factory=lambda: {m: [] for m in MODES})
    step_ms: dict[str, float] = field(default_factory=dict)  # medians of step_passes, + ops
    step_passes: list[dict[str, float]] = field(default_factory=list)  # by STEPS key

    def sys_tps(self, mode: str, decode: bool = False) -> float | None:
        return h.median([r.decode_tps if decode else r.sys_tps for r in self.runs[mode]])

    def streams(self, mode: str = "batched") -> list[Stream]:
        return [s for r in self.runs[mode] for s in r.streams]

    def gap(self, q: float, mode: str = "batched") -> float | None:
        return h.median([g for r in self.runs[mode] for g in r.agent_gaps(q)])

    def as_dict(self) -> dict[str, Any]:
        tps = {m: [r.sys_tps for r in rs] for m, rs in self.runs.items()}
        decode = {m: [r.decode_tps for r in rs] for m, rs in self.runs.items()}
        return {
            "context": self.context,
            "batch": self.batch,
            "step_ms": self.step_ms,
            "sys_tps": tps,
            "decode_tps": decode,
            "step_passes": self.step_passes,
            "runs": self.runs,
        }


# agents and turns


def stream_turn(worker: Any, agent: str, messages: list, max_tokens: int) -> Stream:
    """One greedy Turn, every chunk's arrival timed."""
    stream = Stream(agent, time.perf_counter())
    for response in worker.stream_turn(NS, agent, messages, max_tokens=max_tokens, stop=[h.NEVER]):
        if response.HasField("tokens"):
            stream.arrivals.append(time.perf_counter())
            stream.num_tokens += len(response.tokens.token_ids)
        elif response.HasField("usage"):
            stream.usage = h.usage_dict(response.usage)
    stream.ended = time.perf_counter()
    if not stream.usage:
        raise RuntimeError(f"turn of {agent!r} ended without a usage")
    return stream


def new_base(worker: Any, name: str, system: str) -> str:
    """An agent with this system prompt, evicted once durable (only measured copies are hot)."""
    worker.create_agent(NS, name, system)
    worker.evict(NS, name)  # waits for its store write
    return name


def make_bases(svc: Any, tokenizer: Any, context: int, count: int, tokens: int) -> list[str]:
    """The first `count` agents, over successive source slices, whose greedy reply to PROMPT
    runs to `tokens` tokens (probed once on a fork, untimed): this model often answers a chat
    question in a few tokens and then emits EOS, and the API has no way to ignore EOS."""
    worker, bases = batch_worker(svc), []
    for i, text in enumerate(h.source_slices(tokenizer, context, MAX_SLICES)):
        name = new_base(worker, f"c{context}-base{i}", text)
        probe = hot_copies(svc, [name], "probe")[0]
        if stream_turn(worker, probe, [], tokens).num_tokens == tokens:
            bases.append(name)
        worker.delete(NS, probe)
        if len(bases) == count:
            return bases
    raise RuntimeError(f"only {len(bases)} of {MAX_SLICES} slices ran to {tokens} tokens")


def hot_copies(svc: Any, bases: list[str], tag: str) -> list[str]:
    """Forks of the bases, loaded hot by an append-only Turn with the user message."""
    worker, names = batch_worker(svc), [f"{base}-{tag}" for base in bases]
    for base, name in zip(bases, names, strict=True):
        svc.store.fork_agent(NS, base, name)
        worker.turn(NS, name, [("user", PROMPT)], max_tokens=0)
    for name in names:
        worker.wait_durable(NS, name)
    return names


def fire(worker: Any, jobs: list[tuple], delays: Sequence[float] = ()) -> list[Stream]:
    """Sends every (agent, messages, max_tokens) Turn at once (each after its delay, s) from
    its own thread; returns the streams in order."""
    barrier = threading.Barrier(len(jobs))

    def one(i: int) -> Stream:
        barrier.wait()
        time.sleep(delays[i] if i < len(delays) else 0)
        return stream_turn(worker, *jobs[i])

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, range(len(jobs))))


def batch_worker(svc: Any) -> Any:
    """The throughput runs' worker: --max-batch of the largest batch measured."""
    return svc.workers[max(svc.workers, key=int)]


def one_run(svc: Any, bases: list[str], mode: str, tokens: int, tag: str, context: int) -> Run:
    """Hot copies of the bases, one Turn each, at once or one after another; aborts unless
    every turn found its agent's whole context hot."""
    worker, agents = batch_worker(svc), hot_copies(svc, bases, tag)
    jobs = [(a, [], tokens) for a in agents]
    streams = fire(worker, jobs) if mode == "batched" else [stream_turn(worker, *j) for j in jobs]
    for agent in agents:
        worker.delete(NS, agent)  # waits for the turn's store write
    for s in streams:
        if s.usage["cache_state"] != "hot" or s.usage["reused_hot_tokens"] < 0.9 * context:
            raise RuntimeError(f"{s.agent}: expected a hot cache of ~{context}; usage {s.usage}")
    return Run(context, len(bases), mode, streams)


def throughput(svc: Any, tokenizer: Any, args: Any, context: int, local: InProcess) -> list[Cell]:
    """Every batch size at one context, --passes times: batched, the same batch's forward in
    this process right after (paired, so both see the machine in the same state), sequential."""
    h.say(f"{h.label(context)}: creating {max(args.batches)} base agents")
    bases = make_bases(svc, tokenizer, context, max(args.batches), args.tokens)
    one_run(svc, bases, "batched", 8, "settle", context)  # untimed: first steps at this length
    cells = [Cell(context, b, args.tokens) for b in args.batches]
    for p in range(args.passes):
        for cell in cells:
            for mode in MODES:
                tag = f"p{p}-b{cell.batch}-{mode[0]}"
                run = one_run(svc, bases[: cell.batch], mode, args.tokens, tag, context)
                cell.runs[mode].append(run)
                if mode == "batched":
                    cell.step_passes.append(step_pass(local, run))
            tps = [f"{cell.runs[m][-1].sys_tps:.1f} {m}" for m in MODES]
            h.say(f"  {h.label(context)} pass {p + 1} batch {cell.batch}: SysTPS {', '.join(tps)}")
    return cells


def warm_up(svc: Any, tokenizer: Any, batches: list[int]) -> None:
    """One untimed batched and sequential run at the largest batch, on short agents; one turn
    on every worker."""
    texts = h.source_slices(tokenizer, 256, max(batches))
    bases = [new_base(batch_worker(svc), f"warm-base{i}", t) for i, t in enumerate(texts)]
    for mode in MODES:
        one_run(svc, bases, mode, 8, f"warm-{mode}", 0)
    for worker in svc.workers.values():
        worker.create_agent(NS, "warm-up")
        stream_turn(worker, "warm-up", [("user", "Hello.")], 4)
        worker.delete(NS, "warm-up")


# staggered arrivals


@dataclass(slots=True)
class Staggered:
    mode: str  # sequential (--max-batch 1) or batched (--max-batch 2)
    a: Stream
    b: Stream

    def a_gaps_during_b(self) -> list[float]:
        """A's gaps from B's send to B's first token: while B waits or prefills."""
        return self.a.gaps_ms(self.b.sent, self.b.arrivals[0] if self.b.arrivals else self.b.ended)


def staggered(svc: Any, tokenizer: Any, context: int, passes: int) -> list[Staggered]:
    """A, then B 2 s later, both cold; per pass on the sequential and the batched worker."""
    texts, out = h.source_slices(tokenizer, context, 2), []
    for p in range(passes):
        for mode, max_batch in (("sequential", 1), ("batched", 2)):
            worker, names = svc.workers[str(max_batch)], [f"stagger-{mode}-p{p}-{x}" for x in "ab"]
            for name in names:
                worker.create_agent(NS, name)
                worker.wait_durable(NS, name)
            jobs = [(n, [("user", t)], STAGGER_TOKENS) for n, t in zip(names, texts, strict=True)]
            a, b = fire(worker, jobs, delays=(0.0, STAGGER_S))
            out.append(Staggered(mode, a, b))
            for name in names:
                worker.delete(NS, name)
            h.say(f"  staggered pass {p + 1} {mode}: TTFT A {a.ttft_ms:.0f}, B {b.ttft_ms:.0f} ms")
    return out


# in this process: the model step and the batch cache's bookkeeping

# Cell.step_ms key: the step table's header (what each is: the README)
STEPS = {
    "e2e": "end-to-end ms/step",
    "forward": "forward ms",
    "sample": "Batcher sampling ms",
    "rest": "rest ms (e2e - forward - sampling)",
    "extend": "extend ms",
    "leave": "leave ms",
}


@dataclass(slots=True)
class InProcess:
    """The model in this process, and one agent's Q4 caches per context."""

    model: Any
    caches: dict[int, list]


def in_process(path: Path, tokenizer: Any, contexts: list[int]) -> InProcess:
    """Loads the model here and prefills one agent per context in chunks, as the worker would."""
    import mlx.core as mx
    from mlx_lm import load

    from agentkv.layers import KVFormat
    from inference_worker.kv_cache import QuantizedKV

    model, _ = load(str(path))
    bos = json.loads((path / "config.json").read_text()).get("bos_token_id") or 0
    local = InProcess(model, {})
    for context in contexts:
        text = h.source_slices(tokenizer, context)[0]
        ids = [bos, *tokenizer.encode(text, add_special_tokens=False).ids]
        h.say(f"in-process prefill at {h.label(context)} ({len(ids)} tokens)")
        caches = local.caches[context] = [QuantizedKV(KVFormat()) for _ in model.layers]
        for start in range(0, len(ids), PREFILL_CHUNK):
            mx.eval(model(mx.array([ids[start : start + PREFILL_CHUNK]]), cache=caches))
    return local


def decode_costs(model: Any, caches: list, batch: int) -> dict[str, float]:
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

    return {"forward": h.fastest(forward, STEP_REPEATS), "sample": h.fastest(sample, STEP_REPEATS)}


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

    def cost(fn: Callable[[], list], n: int) -> float:
        run = lambda: mx.eval([a for layer in fn() for a in layer.state_arrays()])  # noqa: E731
        return h.fastest(run, 5) - h.fastest(lambda: merged(n), 5)

    return {"extend": cost(extend, batch - 1), "leave": cost(leave, batch)}


def step_pass(local: InProcess, run: Run) -> dict[str, float]:
    """This batch's in-process step costs next to the run's own end-to-end ms per step."""
    costs = decode_costs(local.model, local.caches[run.context], run.batch)
    e2e = run.batch * 1e3 / run.decode_tps
    return costs | {"e2e": e2e, "rest": e2e - costs["forward"] - costs["sample"]}


def finish_steps(cells: list[Cell], local: InProcess) -> None:
    """Each cell's step_ms: medians over passes, plus joins and leaves."""
    for cell in cells:
        keys = cell.step_passes[0] if cell.step_passes else {}
        cell.step_ms = {k: statistics.median(p[k] for p in cell.step_passes) for k in keys}
        if cell.batch > 1:
            cell.step_ms |= cache_op_costs(local.caches[cell.context], cell.batch)


# reporting

THROUGHPUT = {  # the throughput table's columns: header, cell of a Cell
    "context": lambda c: h.label(c.context),
    "batch": lambda c: c.batch,
    "SysTPS batched": lambda c: h.fmt(c.sys_tps("batched")),
    "SysTPS sequential": lambda c: h.fmt(c.sys_tps("sequential")),
    "ratio": lambda c: h.ratio(c.sys_tps("batched"), c.sys_tps("sequential")),
    "decode-only SysTPS batched": lambda c: h.fmt(c.sys_tps("batched", decode=True)),
    "decode-only sequential": lambda c: h.fmt(c.sys_tps("sequential", decode=True)),
    "per-agent tok/s": lambda c: h.fmt(
        h.median([s.usage["decode_tokens_per_second"] for s in c.streams()])
    ),
    "client TTFT ms": lambda c: h.fmt(h.median([s.ttft_ms for s in c.streams()])),
    "p50 gap ms": lambda c: h.fmt(c.gap(50)),
    "p99 gap ms": lambda c: h.fmt(c.gap(99)),
    "worst gap ms": lambda c: h.fmt(c.gap(100)),
    "early EOS": lambda c: sum(s.num_tokens < c.tokens for m in MODES for s in c.streams(m)),
}
STEP_TABLE = {
    "context": lambda c: h.label(c.context),
    "batch": lambda c: c.batch,
    **{header: lambda c, k=k: h.fmt(c.step_ms.get(k), 2) for k, header in STEPS.items()},
}


def staggered_rows(runs: list[Staggered], mode: str) -> dict[str, float | None]:
    mine = [r for r in runs if r.mode == mode]

    def of(fn: Callable[[Staggered], float | None]) -> float | None:
        return h.median([fn(r) for r in mine])

    return {
        "A TTFT client ms": of(lambda r: r.a.ttft_ms),
        "A TTFT server ms": of(lambda r: r.a.usage["time_to_first_token_ms"]),
        "B TTFT client ms (from B's send)": of(lambda r: r.b.ttft_ms),
        "B TTFT server ms": of(lambda r: r.b.usage["time_to_first_token_ms"]),
        "A p99 gap ms while B waits or prefills": of(
            lambda r: h.percentile(r.a_gaps_during_b(), 99)
        ),
        "A gaps in that window (count)": of(lambda r: len(r.a_gaps_during_b())),
        "A p99 gap ms, whole stream": of(lambda r: h.percentile(r.a.gaps_ms(), 99)),
        "B p99 gap ms, whole stream": of(lambda r: h.percentile(r.b.gaps_ms(), 99)),
        "both done, s after A's send": of(lambda r: max(r.a.ended, r.b.ended) - r.a.sent),
    }


def staggered_table(runs: list[Staggered]) -> str:
    seq, bat = staggered_rows(runs, "sequential"), staggered_rows(runs, "batched")
    headers = ("median over passes", "sequential (--max-batch 1)", "batched (--max-batch 2)")
    return h.table(headers, [(k, h.fmt(seq[k]), h.fmt(bat[k])) for k in seq])


def targets(cells: list[Cell]) -> list[dict[str, Any]]:
    """Batch 4 against batch 1 per context. With one agent, batched and sequential runs are
    the same request, so batch 1's SysTPS is the median of both (twice the samples)."""
    goals = []
    for context in sorted({c.context for c in cells}):
        by_batch = {c.batch: c for c in cells if c.context == context}
        if TARGET_BATCH not in by_batch or 1 not in by_batch:
            continue
        solo, many = by_batch[1], by_batch[TARGET_BATCH]
        one = h.median([r.sys_tps for runs in solo.runs.values() for r in runs]) or 0.0
        four = many.sys_tps("batched") or 0.0
        measured = f"{four / one:.2f}x ({four:.1f} vs {one:.1f} tok/s)"
        if "forward" in solo.step_ms and "forward" in many.step_ms:
            ceiling = TARGET_BATCH * solo.step_ms["forward"] / many.step_ms["forward"]
            measured += f"; the batched forward alone allows {ceiling:.2f}x"
        target = f"{h.label(context)}: SysTPS at batch {TARGET_BATCH} >= {TARGET_RATIO}x batch 1"
        goals.append(h.goal(target, measured, four / one >= TARGET_RATIO, context=context))
    return goals


def notes_for(cells: list[Cell], runs: list[Staggered]) -> list[str]:
    """The paper's Table 4 and Figure 3 beside ours."""
    notes = []
    for c in (c for c in cells if c.batch == 2):
        paper = ", ".join(f"{m} {v[c.context][0]}" for m, v in TABLE4.items() if c.context in v)
        tps = THROUGHPUT["SysTPS batched"](c)
        notes.append(f"{h.label(c.context)} batch 2: SysTPS {tps}; paper Table 4: {paper or '-'}")
    key = "B TTFT client ms (from B's send)"
    seq, bat = staggered_rows(runs, "sequential")[key], staggered_rows(runs, "batched")[key]
    paper = ", ".join(f"{m} {b / s:.1f}x" for m, (b, s) in FIGURE3.items())
    notes.append(f"staggered: B's TTFT batched / sequential {h.ratio(bat, seq)}; Figure 3: {paper}")
    if any(r.a.ended <= r.b.sent for r in runs):
        notes.append("staggered: A had finished before B was sent, so nothing overlapped")
    return notes


def draw(cells: list[Cell], runs: list[Staggered], axes: Any) -> None:
    """SysTPS against batch size, and the staggered token timelines."""
    left, right = axes
    for context in sorted({c.context for c in cells}):
        mine = [c for c in cells if c.context == context]
        for mode, style in (("batched", "o-"), ("sequential", "s--")):
            ys = [c.sys_tps(mode) for c in mine]
            left.plot([c.batch for c in mine], ys, style, label=f"{h.label(context)} {mode}")
    left.set_xscale("log", base=2)
    left.set_xticks(BATCHES, [str(b) for b in BATCHES])
    left.set(xlabel="agents (batch size)", ylabel="SysTPS, tokens/s (median of passes)")
    for r in runs[-2:]:
        for who, s in (("A", r.a), ("B", r.b)):
            xs = [t - r.a.sent for t in s.arrivals]
            right.plot(xs, range(1, len(xs) + 1), ".-", ms=3, label=f"{r.mode} {who}")
    right.set(xlabel="s since A was sent (B sent at 2 s)", ylabel="tokens received")
    for ax in axes:
        ax.legend(fontsize=7)


def write_report(cells: list[Cell], runs: list[Staggered], args: Any) -> None:
    header = h.machine(blas=args.info.blas, model=args.model, model_dir=args.described)
    header |= {"contexts": args.contexts, "batches": args.batches}
    header |= {"tokens": args.tokens, "passes": args.passes}
    sections = [
        ("throughput (median of passes)", h.columns(cells, THROUGHPUT)),
        ("where a batched decode step goes (median over passes)", h.columns(cells, STEP_TABLE)),
        (f"staggered arrivals, {h.label(max(args.contexts))} cold", staggered_table(runs)),
    ]
    document = {"cells": [c.as_dict() for c in cells], "staggered": runs}
    png = h.report(
        "batching", args.out, header, sections, targets(cells), notes_for(cells, runs), document
    )
    h.plot(png, header, "batching", draw, cells, runs, ncols=2, figsize=(13, 4.8))


def parse_args(argv: list[str] | None) -> Any:
    quick = {"contexts": [512], "batches": [1, 2, 4], "tokens": 16, "passes": 1}
    p = h.parser(__doc__, contexts=(1024, 2048), passes=2, quick=quick)
    p.add_argument("--tokens", type=int, default=32, help="tokens each measured turn generates")
    p.set_defaults(batches=list(BATCHES))
    args = p.parse_args(argv)
    if args.passes < 1 or args.tokens < 2:
        p.error("--passes must be at least 1 and --tokens at least 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = h.open_model(args)
    local = in_process(args.path, tokenizer, args.contexts)
    workers = {str(b): ["--max-batch", str(b)] for b in sorted({1, 2, max(args.batches)})}
    with h.services(None, args.path, workers) as svc:
        args.info = svc.info["1"]
        h.say(f"store and workers up ({args.info.blas}); warming up")
        warm_up(svc, tokenizer, args.batches)
        cells = [c for n in args.contexts for c in throughput(svc, tokenizer, args, n, local)]
        h.say(f"staggered arrivals at {h.label(max(args.contexts))}")
        runs = staggered(svc, tokenizer, max(args.contexts), args.passes)
    finish_steps(cells, local)
    write_report(cells, runs, args)


if __name__ == "__main__":
    main()
