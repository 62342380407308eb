"""Batching benchmark: system throughput and stream smoothness of continuous batching.

Starts a real `agentkv-store` process and real `agentkv-worker` processes on loopback, with
--model SPEC (a shipped name, a .gguf file or an mlx-lm directory, as agentkv-worker --model
takes; default SmolLM2-135M-Instruct, imported as float32 on a CPU), and measures:

  throughput   for each context C (--contexts, tokens) and batch size B (1, 2, 4, 8): B agents
               each holding a C-token Q4 cache, hot in the worker's RAM, each asked for one
               Turn of N tokens (--tokens; greedy, with a stop string no reply contains, so a
               turn runs to max_tokens unless the model emits EOS, which the output counts).
               The B Turns are sent at once from B threads sharing one channel (batched); then
               fresh copies of the same agents get theirs one after another (sequential). One
               worker with --max-batch set to the largest B (8) serves every B: with B turns in
               flight its batch holds exactly B, as a worker with --max-batch B would.
  staggered    (the paper's Figure 3) new agents A and B, each with a first Turn carrying ~C
               tokens of user text (C = the largest of --contexts) and max_tokens 32; B is sent
               2 s after A. Once on a worker with --max-batch 1 (sequential: B waits for A),
               once with --max-batch 2 and the default --step-tokens and --prefill-chunk
               (batched: B's prefill chunks share model steps with A's decode).
  model step   in this process (the model loaded here, one agent's cache per context
               merged B times): right after each batched run, while the worker idles, one
               batched decode forward and the Batcher's per-row sampling (each the fastest of
               8 calls), paired with that run's end-to-end ms per decode step (B / its
               decode-only SysTPS); the rest is gRPC, queues, Python and contention. Then the
               batch cache's joins and leaves, and the sum of idle hot agents' bytes the
               engine takes before every step.

Definitions. SysTPS = all tokens generated / wall time from the first Turn sent to the last
stream ended, on this client's clock. Decode-only SysTPS = tokens after each stream's first /
the time covered by the streams' [first token, last token] spans (their union). Per-agent
tok/s = median of the worker's usage.decode_tokens_per_second. Inter-token gaps are measured
here, between arrivals of streamed TokenChunks; a cell's p50 and p99 are the medians over its
agents of each agent's own p50 and p99. TTFT is the client's wall time from its own send to
its first token, and the worker's usage.time_to_first_token_ms.

Agents. Per context, 8 base agents are created once (a system prompt of C tokens of Python
standard-library source, a different slice each) and evicted once durable. The user message
asks to explain the code line by line (SmolLM2 answers "Go on." after source code with a
token or two); a model may still stop early with EOS, which a Turn cannot ignore, so slices
whose greedy reply stops before N tokens (probed once, untimed) are skipped. Every measured
agent is a store fork of a base, loaded hot by an append-only Turn (max_tokens 0) carrying the
user message, so the measured Turn adds only the assistant header. No store write is in
flight when a measurement starts, and each run's agents are deleted after it.

Target, per context: at batch 4, SysTPS >= 2.5x that of batch 1 (the median of every batch-1
run: with one agent, batched and sequential are the same request), shown next to the bound
the in-process batched forward alone sets (4 x forward at 1 / forward at 4). Medians over
--passes passes (default 2; the spread is in the detail table). Prints Markdown tables;
writes JSON and a PNG (matplotlib is optional) to --out. Progress goes to stderr.

Sizes for SmolLM2 on this 2-core CPU (a 512-token prefill ~2.5 s, a decode step ~65-130 ms
by context, a batch-8 step ~3x a batch-1 step): contexts 1K and 2K (a 4K cell alone, with
its 8 base prefills of ~30 s and its staggered pair, would take ~15 minutes), N = 32 tokens a
turn, 2 passes: 17 minutes here with other jobs sharing the cores (load average 2-3), most
of it the sequential runs (15 turns of 32 tokens per pass and context), the 16 base prefills
and the staggered pairs. --quick: 512 only, batch 1,2,4, N = 16, 1 pass, about two minutes.

Run:  python benchmarks/batching.py [--model smollm2-135m-instruct] [--contexts 1024,2048]
                                    [--tokens 32] [--passes 2] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from common import add_model_argument, describe_model, load_tokenizer, model_dir, wait_ready
from google.protobuf.json_format import MessageToDict
from harness import int_list, label, machine

from agentkv.launch import ServiceProcess, store_process, worker_process
from client.store import StoreClient
from client.worker import WorkerClient
from inference_worker.blas import load_optimized_blas
from tests import model_kit

NS = "batching"
BATCHES = (1, 2, 4, 8)
PROMPT = "Explain the code above in detail, line by line."  # answered at length
NEVER = "\x00"  # a stop string no reply contains: turns run to max_tokens (or EOS)
STAGGER_S = 2.0
STAGGER_TOKENS = 32
TARGET_BATCH, TARGET_RATIO = 4, 2.5
MAX_SLICES = 32  # source slices tried for base agents whose replies run to max_tokens
PREFILL_CHUNK = 512  # the worker's default --prefill-chunk, for the in-process prefill
STEP_REPEATS = 8  # in-process decode steps timed per pass (the fastest is kept)
# Shkolnikov, "Agent Memory Below the Prompt" (2026), Apple M4 Pro. Table 4, warm rows: batch 2
# (non-streaming, median of 6 passes), (SysTPS, per-agent) where SysTPS is total tokens/s
# across both agents and per-agent = SysTPS / 2 (Table 6: "the 2.0x is definitional ... not a
# measured throughput gain over batch=1").
PAPER_TABLE4 = {
    "Gemma 3 12B": {1024: (22.6, 11.2), 4096: (19.6, 9.9)},
    "DeepSeek-Coder-V2-Lite": {1024: (63.0, 31.5), 4096: (52.6, 26.3)},
    "Llama 3.1 8B": {1024: (37.8, 18.9), 4096: (34.5, 17.2)},
}
# Figure 3 (4K cold, B 2 s after A): B's own TTFT in s, (batched, sequential).
PAPER_FIGURE3 = {"Gemma": (34.1, 16.7), "Llama": (20.2, 10.3), "DeepSeek": (6.8, 3.9)}
_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# what one client saw


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


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


# the processes


@dataclass(slots=True)
class Services:
    store: StoreClient
    workers: dict[int, WorkerClient]  # by --max-batch

    @property
    def batch_worker(self) -> WorkerClient:
        """The throughput runs' worker: --max-batch of the largest batch measured."""
        return self.workers[max(self.workers)]


@contextmanager
def running_services(model: Path, root: Path, max_batches: Sequence[int]) -> Iterator[Services]:
    """A store and one worker per --max-batch as their own processes, SIGTERMed afterwards."""
    with ExitStack() as stack:

        def start(service: ServiceProcess) -> ServiceProcess:
            stack.callback(service.stop)
            return service.start(timeout=600)

        store = start(store_process(root / "data", root / "store.log"))
        workers = {
            b: start(
                worker_process(
                    str(model),
                    store.address,
                    root / f"worker-{b}.log",
                    extra_args=["--max-batch", str(b)],
                )
            )
            for b in max_batches
        }
        services = Services(
            StoreClient(store.address), {b: WorkerClient(w.address) for b, w in workers.items()}
        )
        for client in (services.store, *services.workers.values()):
            stack.callback(client.close)
        for worker in services.workers.values():
            wait_ready(worker)
        yield services


# agents and turns


def source_slices(tokenizer: Any, num_tokens: int, count: int) -> list[str]:
    """`count` different runs of num_tokens tokens of standard-library source, as text."""
    ids: list[int] = []
    for text in model_kit.read_texts(model_kit.stdlib_files()):
        ids += tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= num_tokens * count:
            break
    return [tokenizer.decode(ids[i * num_tokens : (i + 1) * num_tokens]) for i in range(count)]


def usage_dict(usage: Any) -> dict[str, Any]:
    return MessageToDict(
        usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def stream_turn(
    worker: WorkerClient, agent: str, messages: list[tuple[str, str]], max_tokens: int
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


def new_base(worker: WorkerClient, name: str, system: str) -> str:
    """An agent with this system prompt, evicted once durable (only measured copies are hot)."""
    worker.create_agent(NS, name, system)
    worker.evict(NS, name)  # waits for its store write
    return name


def make_bases(
    svc: Services, tokenizer: Any, context: int, count: int, tokens: int, tag: str
) -> list[str]:
    """The first `count` agents, over successive source slices, whose greedy reply to PROMPT
    runs to `tokens` tokens (probed once on a fork, untimed): this model often answers a chat
    question in a few tokens and then emits EOS, and the API has no way to ignore EOS."""
    worker, bases = svc.batch_worker, []
    for i, text in enumerate(source_slices(tokenizer, context, MAX_SLICES)):
        name = new_base(worker, f"{tag}-base{i}", text)
        probe = hot_copies(svc, [name], "probe")[0]
        if stream_turn(worker, probe, [], tokens).num_tokens == tokens:
            bases.append(name)
        worker.delete(NS, probe)
        if len(bases) == count:
            return bases
    raise RuntimeError(f"only {len(bases)} of {MAX_SLICES} slices ran to {tokens} tokens")


def hot_copies(svc: Services, bases: list[str], tag: str) -> list[str]:
    """Forks of the bases, loaded hot by an append-only Turn with the user message."""
    worker, names = svc.batch_worker, [f"{base}-{tag}" for base in bases]
    for base, name in zip(bases, names, strict=True):
        svc.store.fork_agent(NS, base, name)
        worker.turn(NS, name, [("user", PROMPT)], max_tokens=0)
    for name in names:
        worker.wait_durable(NS, name)
    return names


def fire(
    worker: WorkerClient,
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


def one_run(
    svc: Services, bases: list[str], mode: str, tokens: int, tag: str, context: int = 0
) -> Run:
    worker = svc.batch_worker
    agents = hot_copies(svc, bases, tag)
    jobs = [(a, [], tokens) for a in agents]
    if mode == "batched":
        streams = fire(worker, jobs)
    else:
        streams = [stream_turn(worker, *job) for job in jobs]
    for agent in agents:
        worker.delete(NS, agent)  # waits for the turn's store write
    return Run(context, len(bases), mode, streams)


def throughput(
    svc: Services, tokenizer: Any, args: argparse.Namespace, context: int, local: InProcess
) -> list[Cell]:
    """Every batch size at one context, --passes times: batched, the same batch's forward in
    this process right after (paired, so both see the machine in the same state), sequential."""
    say(f"{label(context)}: creating {max(args.batches)} base agents")
    bases = make_bases(svc, tokenizer, context, max(args.batches), args.tokens, f"c{context}")
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


def warm_up(svc: Services, tokenizer: Any, args: argparse.Namespace) -> None:
    """One untimed batched and sequential run at the largest batch, on short agents."""
    texts = source_slices(tokenizer, 256, max(args.batches))
    bases = [new_base(svc.batch_worker, f"warm-base{i}", t) for i, t in enumerate(texts)]
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


def staggered(svc: Services, tokenizer: Any, args: argparse.Namespace) -> list[Staggered]:
    """A, then B 2 s later, both cold; per pass on the sequential and the batched worker."""
    context = max(args.contexts)
    text_a, text_b = source_slices(tokenizer, context, 2)
    out = []
    for p in range(args.passes):
        for mode, max_batch in (("sequential", 1), ("batched", 2)):
            worker = svc.workers[max_batch]
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


def timed(fn: Callable[[], object], repeats: int) -> float:
    """ms of the fastest of `repeats` calls after one untimed call: what the operation costs
    without interference (on this 2-core VM a median drifts by 20% from run to run)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def prefilled(model: Any, tokens: list[int]) -> list:
    """One agent's Q4 caches after a chunked prefill of `tokens`, as the worker makes them."""
    import mlx.core as mx

    from inference_worker.kv_cache import QuantizedKV
    from inference_worker.kv_format import KVFormat

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
        "forward": timed(forward, repeats),
        "sample": timed(sample, repeats),
        "sample_batched": timed(lambda: mx.argmax(logits, axis=-1).tolist(), repeats),
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
        "extend": timed(lambda: run(extend), 5) - timed(lambda: merged(batch - 1), 5),
        "leave": timed(lambda: run(leave), 5) - timed(lambda: merged(batch), 5),
    }


def hot_scan_us(caches: list, num_agents: int = 32) -> float:
    """µs per idle hot agent of the sum Engine._step takes before every model step."""
    from inference_worker.agents import Agent

    agents = [Agent(NS, f"idle{i}", [], caches) for i in range(num_agents)]
    return timed(lambda: sum(a.nbytes for a in agents), 20) * 1e3 / num_agents


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


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def throughput_table(cells: list[Cell]) -> str:
    lines = [
        "| context | batch | SysTPS batched | SysTPS sequential | ratio | per-agent tok/s"
        " | p50 gap ms | p99 gap ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        batched, sequential = c.sys_tps("batched"), c.sys_tps("sequential")
        lines.append(
            f"| {label(c.context)} | {c.batch} | {fmt(batched)} | {fmt(sequential)} "
            f"| {ratio(batched, sequential)} | {fmt(c.per_agent())} | {fmt(c.gap(50))} "
            f"| {fmt(c.gap(99))} |"
        )
    return "\n".join(lines)


def detail_table(cells: list[Cell]) -> str:
    lines = [
        "| context | batch | SysTPS batched min-max | decode-only SysTPS batched"
        " | decode-only sequential | client TTFT"
        " ms batched (median) | worst gap ms batched | p99 gap ms sequential | tokens/turn"
        " | early EOS |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        streams = c.streams("batched")
        spread = [r.sys_tps for r in c.runs["batched"]]
        worst = max((g for r in c.runs["batched"] for g in r.agent_gaps(100)), default=None)
        lines.append(
            f"| {label(c.context)} | {c.batch} | {min(spread):.1f}-{max(spread):.1f} "
            f"| {fmt(c.sys_tps('batched', True))} "
            f"| {fmt(c.sys_tps('sequential', True))} "
            f"| {fmt(median([s.ttft_ms for s in streams]))} "
            f"| {fmt(worst)} "
            f"| {fmt(c.gap(99, 'sequential'))} "
            f"| {fmt(median([s.num_tokens for s in streams]), 0)} | {c.early_stops()} |"
        )
    return "\n".join(lines)


def step_table(cells: list[Cell]) -> str:
    """In-process costs against the end-to-end time per decode step, medians of the
    passes' pairs."""
    lines = [
        "| context | batch | end-to-end ms/step | forward ms | Batcher sampling ms"
        " | batched argmax ms | rest ms (e2e - forward - sampling) | extend ms | leave ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        s = c.step_ms
        lines.append(
            f"| {label(c.context)} | {c.batch} | {fmt(s.get('e2e'), 2)} "
            f"| {fmt(s.get('forward'), 2)} | {fmt(s.get('sample'), 2)} "
            f"| {fmt(s.get('sample_batched'), 2)} | {fmt(s.get('rest'), 2)} "
            f"| {fmt(s.get('extend'), 2)} | {fmt(s.get('leave'), 2)} |"
        )
    return "\n".join(lines)


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
    lines = [
        "| median over passes | sequential (--max-batch 1) | batched (--max-batch 2) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {fmt(seq[k])} | {fmt(bat[k])} |" for k in seq]
    return "\n".join(lines)


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
            "target": f"SysTPS at batch {TARGET_BATCH} >= {TARGET_RATIO}x batch 1",
            "measured": f"{four / one:.2f}x ({four:.1f} vs {one:.1f} tok/s)",
            "met": four / one >= TARGET_RATIO,
        }
        if "forward" in solo.step_ms and "forward" in many.step_ms:
            ceiling = TARGET_BATCH * solo.step_ms["forward"] / many.step_ms["forward"]
            goal["model_forward_ceiling"] = round(ceiling, 2)
        goals.append(goal)
    return goals


def paper_notes(cells: list[Cell], runs: list[Staggered]) -> list[str]:
    notes = []
    for c in (c for c in cells if c.batch == 2):
        paper = ", ".join(
            f"{m} {v[c.context][0]} (per agent {v[c.context][1]})"
            for m, v in PAPER_TABLE4.items()
            if c.context in v
        )
        notes.append(
            f"{label(c.context)} batch 2: SysTPS {fmt(c.sys_tps('batched'))}, per agent "
            f"{fmt(c.per_agent())}; paper Table 4 warm batch 2 SysTPS: {paper or '-'}"
        )
    if runs:
        seq, bat = staggered_rows(runs, "sequential"), staggered_rows(runs, "batched")
        key = "B TTFT client ms (from B's send)"
        paper = ", ".join(f"{m} {b / s:.1f}x" for m, (b, s) in PAPER_FIGURE3.items())
        notes.append(
            f"staggered: B's own TTFT batched / sequential = {ratio(bat[key], seq[key])}; "
            f"paper Figure 3 (4K cold): {paper} (worse when batched)"
        )
    return notes


def other_notes(runs: list[Staggered], scans: dict[int, float]) -> list[str]:
    notes = [
        f"Engine._step re-sums every idle hot agent's bytes before each model step: "
        f"{us:.0f} us per agent at {label(context)} (in-process)"
        for context, us in scans.items()
    ]
    if any(r.a.ended <= r.b.sent for r in runs):
        notes.append(
            "staggered: A had finished before B was sent, so nothing overlapped; its prefill "
            "is too short at this context on this CPU to show the effect (use a larger one)"
        )
    return notes


def plot(cells: list[Cell], runs: list[Staggered], header: dict[str, Any], path: Path) -> str:
    """SysTPS against batch size, and the staggered token timelines; says what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for context in sorted({c.context for c in cells}):
        mine = [c for c in cells if c.context == context]
        xs = [c.batch for c in mine]
        for mode, style in (("batched", "o-"), ("sequential", "s--")):
            ys = [c.sys_tps(mode) for c in mine]
            left.plot(xs, ys, style, label=f"{label(context)} {mode}")
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
    fig.suptitle(
        f"agentkv batching, {header['date']}; {header['cpu']}, {header['cores']} cores, "
        f"MLX {header['mlx']}, BLAS {header['blas']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def print_report(
    cells: list[Cell], runs: list[Staggered], header: dict[str, Any], notes: list[str]
) -> None:
    print(", ".join(f"{k}: {v}" for k, v in header.items()))
    for title, text in (
        ("throughput (median of passes)", throughput_table(cells)),
        ("detail", detail_table(cells)),
        ("where a batched decode step goes (median over passes)", step_table(cells)),
        (f"staggered arrivals, {label(max(header['contexts']))} cold", staggered_table(runs)),
    ):
        print(f"\n### {title}\n\n{text}")
    print()
    for goal in targets(cells):
        status = "PASS" if goal["met"] else "MISS"
        ceiling = goal.get("model_forward_ceiling")
        bound = f"; the batched forward alone allows {ceiling:.2f}x" if ceiling else ""
        print(f"{status}  {label(goal['context'])}: {goal['target']}: {goal['measured']}{bound}")
    for note in notes:
        print(f"note: {note}")
    print(
        "SysTPS = all generated tokens / wall time from the first Turn sent to the last stream "
        "ended (this client's clock). Decode-only SysTPS = tokens after each stream's first / "
        "the union of the streams' first-to-last-token spans. Per-agent tok/s = median of "
        "usage.decode_tokens_per_second. Gaps: between streamed TokenChunks at this client; "
        "p50/p99 = median over agents of each agent's own. One worker (--max-batch "
        f"{max(header['batches'])}) serves every batch size; client, store and worker share "
        "this machine's cores."
    )


def report(
    cells: list[Cell],
    runs: list[Staggered],
    args: argparse.Namespace,
    blas: str,
    scans: dict[int, float],
) -> None:
    header = machine() | {
        "blas": blas,
        "model": args.model,
        "model_dir": describe_model(args.path),
    }
    header |= {"contexts": args.contexts, "batches": args.batches}
    header |= {"tokens": args.tokens, "passes": args.passes}
    notes = paper_notes(cells, runs) + other_notes(runs, scans)
    print_report(cells, runs, header, notes)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"batching-{datetime.now():%Y%m%d-%H%M%S}"
    document = {
        "header": header,
        "cells": [
            {
                "context": c.context,
                "batch": c.batch,
                "step_ms": c.step_ms,
                "step_passes": c.step_passes,
                "runs": {m: [r.as_dict() for r in rs] for m, rs in c.runs.items()},
            }
            for c in cells
        ],
        "step_rows_ms": STEP_ROWS,
        "staggered": [r.as_dict() for r in runs],
        "targets": targets(cells),
        "hot_scan_us_per_agent": scans,
        "notes": notes,
    }
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    print(plot(cells, runs, header, stem.with_suffix(".png")))


# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(p)
    p.add_argument("--contexts", type=int_list, default=[1024, 2048])
    p.add_argument("--tokens", type=int, default=32, help="tokens each measured turn generates")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="512 only, batch 1,2,4, N=16, 1 pass")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
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
    try:
        with running_services(args.path, root, sorted({1, 2, max(args.batches)})) as svc:
            blas = svc.workers[1].info().blas
            say(f"store and workers up ({blas}); warming up")
            warm_up(svc, tokenizer, args)
            for context in args.contexts:
                cells += throughput(svc, tokenizer, args, context, local)
            say(f"staggered arrivals at {label(max(args.contexts))}")
            runs = staggered(svc, tokenizer, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    scans = finish_steps(cells, local)
    report(cells, runs, args, blas, scans)


if __name__ == "__main__":
    main()
