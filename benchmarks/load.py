"""A bounded load test: many agents, several client threads, two workers, evictions and
restores throughout; every turn is checked against a greedy replay (the README explains how).

Run: python benchmarks/load.py [--minutes 3] [--agents 16] [--threads 4] [--quick] [--model SPEC]
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import harness as h

from agentkv import planner
from agentkv.client.memory import AgentMemory
from agentkv.launch import ServiceProcess

# Each worker's default hot budget, in tokens of the model's Q4 cache: a few agents' worth
# (what 1M and 256K bytes held of the 4.2M-parameter model this test was first sized on).
HOT_TOKENS = 1736
QUICK_HOT_TOKENS = 444
TOPICS = ("json", "os.path", "sorted", "threading", "itertools", "re", "datetime", "heapq")
SYSTEM = "You answer questions about the Python standard library, briefly."
# What a worker logs when its hot budget pushes an agent out (inference_worker/engine.py).
BUDGET_EVICTIONS = ("agent evicted to the store", "agent evicted for a waiting turn")
TURN_TIMEOUT = 60.0  # seconds; a turn stuck longer fails the run instead of stalling it
REPLAY_THREADS = 16  # over two fresh workers, which batch them


def message(agent: str, turn: int) -> str:
    """The agent's user message for `turn`, the same in the run and in its replay."""
    topic = random.Random(f"{agent}/{turn}").choice(TOPICS)
    return f"What does {topic} do? ({agent}.{turn})"


def logged(path: Path, events: Iterable[str]) -> Counter[str]:
    """How often each of `events` occurs in a JSON-lines service log."""
    wanted, counts = set(events), Counter()
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line).get("event")
        except (ValueError, AttributeError):
            continue
        if event in wanted:
            counts[event] += 1
    return counts


@dataclass
class Slot:
    """A place for one agent at a time; a fresh agent takes it when its agent retires."""

    index: int
    generation: int = 1
    taken: int = 0  # turns the current agent has taken

    @property
    def agent(self) -> str:
        return f"agent-{self.index}" + (f".g{self.generation}" if self.generation > 1 else "")


class Load:
    """The load phase: client threads taking turns until the time or the turns run out."""

    def __init__(self, mem: AgentMemory, args: argparse.Namespace) -> None:
        self.mem, self.args, self.timed = mem, args, args.minutes > 0
        self.records: list[dict] = []  # (list.append is atomic: threads share these lists)
        self.errors: list[str] = []
        self.agents: list[str] = []  # every agent started, retired ones too
        self.evicted: list[str] = []  # agents an explicit eviction dropped from a worker's RAM
        self.lock = threading.Lock()  # for `open`
        self.seconds = 0.0
        self.todo: queue.Queue[Slot] = queue.Queue()
        self.open = args.agents  # slots still in play
        for i in range(args.agents):
            self.start(Slot(i))
        self.deadline = time.monotonic() + (args.minutes * 60 if self.timed else float("inf"))

    def run(self) -> Load:
        """Takes turns in every client thread until the time or the turns run out."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.args.threads) as pool:
            list(pool.map(self.client, range(self.args.threads)))
        self.seconds = time.perf_counter() - t0
        return self

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while (slot := self.next_slot()) is not None:
            if self.take_turn(slot, rng):
                self.after_turn(slot)

    def next_slot(self) -> Slot | None:
        """The next agent due a turn; None once the time is up or every agent is done."""
        while time.monotonic() < self.deadline:
            try:
                return self.todo.get(timeout=0.2)
            except queue.Empty:
                with self.lock:
                    if self.open == 0:
                        return None
        return None

    def take_turn(self, slot: Slot, rng: random.Random) -> bool:
        """Says the agent's next message, and now and then evicts it; False if that failed."""
        name, turn = slot.agent, slot.taken
        agent = self.mem.agent(name)
        try:
            reply = agent.say(message(name, turn), max_tokens=self.args.max_tokens).wait()
            u = reply.usage
            record = dict(agent=name, turn=turn, tokens=reply.token_ids, worker=reply.worker)
            self.records.append(
                record | {"ttft_ms": u.time_to_first_token_ms, "cache": u.cache_state}
            )
            slot.taken += 1
            if rng.random() < self.args.evict_rate and agent.evict():
                self.evicted.append(name)
        except Exception as exc:  # counted as lost; the run fails
            self.close(f"{name} turn {turn}: {type(exc).__name__}: {exc}")
            return False
        return True

    def after_turn(self, slot: Slot) -> None:
        """Queues the agent again, or retires it for a fresh one, or ends its slot."""
        if slot.taken < self.args.turns:
            self.todo.put(slot)
        elif self.timed:
            self.start(Slot(slot.index, slot.generation + 1))
        else:
            self.close()

    def start(self, slot: Slot) -> None:
        """Creates the slot's agent and queues it."""
        try:
            self.mem.agent(slot.agent, SYSTEM)
        except Exception as exc:
            self.close(f"{slot.agent} creation: {type(exc).__name__}: {exc}")
            return
        self.agents.append(slot.agent)
        self.todo.put(slot)

    def close(self, error: str = "") -> None:
        """Ends a slot: its agent takes no more turns. An error, if any, fails the run."""
        if error:
            self.errors.append(error)
        with self.lock:
            self.open -= 1


class Replay:
    """Every agent's turns said again, one after another, by a fresh agent of its own."""

    def __init__(self, mem: AgentMemory, stored: dict[str, int], records: list[dict]) -> None:
        self.mem, self.stored = mem, stored
        self.turns: dict[str, list[dict]] = {}
        for r in sorted(records, key=lambda r: r["turn"]):
            self.turns.setdefault(r["agent"], []).append(r)
        self.wrong: list[str] = []
        self.lost: list[str] = []
        self.errors: list[str] = []
        self.seconds = 0.0

    def run(self, agents: list[str], max_tokens: int) -> Replay:
        """Replays `agents`, REPLAY_THREADS at once."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(REPLAY_THREADS) as pool:
            list(pool.map(lambda name: self.check(name, max_tokens), agents))
        self.seconds = time.perf_counter() - t0
        return self

    def check(self, name: str, max_tokens: int) -> None:
        """Each reply must match the run's; the store must hold every token of the agent."""
        try:
            fresh = self.mem.agent(name, SYSTEM)
            for r in self.turns.get(name, []):
                again = fresh.say(message(name, r["turn"]), max_tokens=max_tokens)
                if again.token_ids != r["tokens"]:
                    self.wrong.append(f"{name} turn {r['turn']}")
            held = fresh.describe().num_tokens
        except Exception as exc:
            self.errors.append(f"replay of {name}: {type(exc).__name__}: {exc}")
            return
        if self.stored.get(name) != held:
            stored = self.stored.get(name, "no")
            self.lost.append(f"{name}: the store holds {stored} tokens, the replay {held}")


def replay_all(args: argparse.Namespace, svc: h.Services, load: Load) -> Replay:
    """Replays every agent of the run on two fresh workers, against what the store holds."""
    for name in ("replay0", "replay1"):
        svc.start_worker(name, args.model)
    addresses = [svc.addresses["replay0"], svc.addresses["replay1"]]
    with AgentMemory(addresses, svc.store_address, "replay", timeout=TURN_TIMEOUT) as mem:
        stored = {a.agent_id: a.num_tokens for a in mem.store.list_agents("load")}
        return Replay(mem, stored, load.records).run(load.agents, args.max_tokens)


def summary(args: argparse.Namespace, load: Load, replay: Replay, budget: Counter[str]) -> dict:
    """The run's figures, as the JSON holds them."""
    records, wall = load.records, load.seconds
    ttft = [r["ttft_ms"] for r in records]
    caches = {s: sum(r["cache"] == s for r in records) for s in ("hot", "warm", "cold")}
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "agents": len(load.agents),
        "agents_at_once": args.agents,
        "threads": args.threads,
        "turns": len(records),
        "seconds": wall,
        "replay_seconds": replay.seconds,
        "turns_per_s": len(records) / wall,
        "tokens_per_s": sum(len(r["tokens"]) for r in records) / wall,
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": h.percentile(ttft, 99) or float("nan"),
        "cache_states": caches,
        "restores": caches["warm"],
        "evictions": {"client": len(load.evicted), "workers": budget.total(), **budget},
        "errors": load.errors + replay.errors,
        "lost": replay.lost,
        "wrong": replay.wrong,
    }


def report(result: dict) -> bool:
    """Prints the table and the verdict; whether no turn was lost or wrong."""
    ev, wrong = result["evictions"], result["wrong"]
    lost = len(result["lost"]) + len(result["errors"])
    headers = ("agents (at once)", "threads", "workers", "turns", "s", "turns/s", "tokens/s")
    headers += ("TTFT p50 ms", "TTFT p99 ms", "hot", "restored", "evicted by clients")
    headers += ("evicted by workers", "lost", "wrong")
    row = (f"{result['agents']} ({result['agents_at_once']})", result["threads"], 2)
    row += (result["turns"], f"{result['seconds']:.1f}", f"{result['turns_per_s']:.2f}")
    row += (f"{result['tokens_per_s']:.1f}", f"{result['ttft_p50_ms']:.1f}")
    row += (f"{result['ttft_p99_ms']:.1f}", result["cache_states"]["hot"], result["restores"])
    row += (ev["client"], ev["workers"], lost, len(wrong))
    print(f"\n### load test\n\n{h.table(headers, [row], 'r' * 15)}\n")
    print(
        f"{'MET' if not (lost or wrong) else 'MISS'}  no turn lost or wrong, checked against "
        f"greedy replays: {lost} lost, {len(wrong)} wrong of {result['turns']} "
        f"(replay {result['replay_seconds']:.1f} s)"
    )
    for line in result["errors"] + result["lost"] + wrong:
        print(f"note: {line}")
    return not (lost or wrong)


def stop_workers(workers: list[ServiceProcess]) -> Counter[str]:
    """Stops the workers; returns the evictions their hot budgets made, by log event."""
    for w in workers:
        w.stop()
    return sum((logged(w.log_path, BUDGET_EVICTIONS) for w in workers), Counter())


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="agentkv-load-"))
    flags = ["--hot-budget", args.hot_budget, "--max-batch", "4"]
    with h.services(root, args.model, {"load0": flags, "load1": flags}) as svc:
        bound = f"for {args.minutes:g} min, retiring at" if args.minutes > 0 else "x"
        h.say(f"store and 2 workers up ({root}); {args.agents} agents {bound} {args.turns} turns")
        addresses, store = [svc.addresses["load0"], svc.addresses["load1"]], svc.store_address
        with AgentMemory(addresses, store, "load", durable=True, timeout=TURN_TIMEOUT) as mem:
            load = Load(mem, args).run()
        budget = stop_workers([svc.processes["load0"], svc.processes["load1"]])
        h.say(f"{len(load.records)} turns of {len(load.agents)} agents in {load.seconds:.1f} s")
        replay = replay_all(args, svc, load)
    result = summary(args, load, replay, budget)
    if report(result):
        shutil.rmtree(root, ignore_errors=True)  # kept, logs and all, when the run failed
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"load-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({**result, "records": load.records}, indent=2))
    print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, quick={"agents": 16, "turns": 3, "minutes": 0})
    p.add_argument("--minutes", type=float, default=3.0, help="how long; 0: --turns per agent")
    p.add_argument("--agents", type=int, default=16, help="agents at once")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--turns", type=int, default=40, help="turns per agent")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--evict-rate", type=float, default=0.25, help="chance of evicting after a turn")
    budget = f"{HOT_TOKENS} tokens' worth; {QUICK_HOT_TOKENS} with --quick"
    p.add_argument("--hot-budget", help=f"each worker's RAM for KV caches (default: {budget})")
    args = p.parse_args(argv)
    spec, args.model = args.model, h.model_dir(args.model)  # the workers load the directory
    print(h.describe_model(args.model, spec), flush=True)
    if not args.hot_budget:
        per_token = planner.plan(planner.load_config(args.model), 1, 1).q_bytes
        args.hot_budget = str(per_token * (QUICK_HOT_TOKENS if args.quick else HOT_TOKENS))
    result = run(args)
    return 0 if not (result["lost"] or result["wrong"] or result["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
