"""A bounded load test: many agents, several client threads, two workers, evictions and
restores throughout; every turn is checked against a greedy replay.

    python benchmarks/load.py                # 16 agents x 40 turns, 4 threads, 2 workers
    python benchmarks/load.py --quick        # the CI size: 16 agents, a few turns each

Each agent has a fixed script of user messages. Client threads take agents from a queue
(one thread per agent at a time, so its history stays in order) and say the next message
through AgentMemory (rendezvous routing, durable turns); now and then a thread evicts an
agent, and each worker's hot budget holds only a few agents, so agents are restored warm all
the time. Afterwards every agent's conversation is replayed, one turn after another, on a
fresh agent of a fresh worker: every reply must match token for token (greedy decoding, and
a restored or batched cache answers exactly like a hot one). The run fails if a turn was
lost (missing from the store) or wrong.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentkv.launch import store_process, worker_process  # noqa: E402
from client.memory import AgentMemory  # noqa: E402

MODEL = ROOT / "models" / "agentkv-default"
TOPICS = ("json", "os.path", "sorted", "threading", "itertools", "re", "datetime", "heapq")


def script(agent: int, turns: int) -> list[str]:
    rng = random.Random(agent)
    return [f"What does {rng.choice(TOPICS)} do? ({agent}.{t})" for t in range(turns)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="agentkv-load-"))

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {text}", flush=True)

    store = store_process(root / "data", root / "store.log").start()
    model = str(args.model)
    flags = ["--hot-budget", args.hot_budget, "--max-batch", "4"]
    workers = [
        worker_process(model, store.address, root / f"worker{i}.log", extra_args=flags).start()
        for i in range(2)
    ]
    say(
        f"store and 2 workers up; {args.agents} agents x {args.turns} turns, {args.threads} threads"
    )
    mem = AgentMemory([w.address for w in workers], store.address, "load", durable=True)
    system = "You answer questions about the Python standard library, briefly."
    for i in range(args.agents):
        mem.agent(f"agent-{i}", system)
    todo: queue.Queue = queue.Queue()
    for i in range(args.agents):
        todo.put(i)
    progress = [0] * args.agents
    records: list[dict] = []
    lock = threading.Lock()
    errors: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            agent = mem.agent(f"agent-{i}")
            message = script(i, args.turns)[progress[i]]
            try:
                reply = agent.say(message, max_tokens=args.max_tokens).wait()
            except Exception as exc:  # counted as lost; the run fails
                with lock:
                    errors.append(f"agent-{i} turn {progress[i]}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                records.append(
                    {
                        "agent": i,
                        "turn": progress[i],
                        "tokens": reply.token_ids,
                        "ttft_ms": reply.usage.time_to_first_token_ms,
                        "cache": reply.usage.cache_state,
                        "worker": reply.worker,
                    }
                )
            progress[i] += 1
            if rng.random() < args.evict_rate:
                agent.evict()
            if progress[i] < args.turns:
                todo.put(i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(s,)) for s in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    say(f"{len(records)} turns in {wall:.1f} s; replaying every agent on a fresh worker")

    replay_worker = worker_process(model, store.address, root / "replay.log").start()
    replay = AgentMemory(replay_worker.address, store.address, "replay", durable=True)
    wrong, lost = [], []
    by_agent: dict[int, list[dict]] = {}
    for r in records:
        by_agent.setdefault(r["agent"], []).append(r)
    for i in range(args.agents):
        turns = sorted(by_agent.get(i, []), key=lambda r: r["turn"])
        if len(turns) != args.turns:
            lost.append(f"agent-{i}: {len(turns)} of {args.turns} turns")
        stored = mem.agent(f"agent-{i}").describe()
        fresh = replay.agent(f"agent-{i}", system)
        for r in turns:
            again = fresh.say(script(i, args.turns)[r["turn"]], max_tokens=args.max_tokens)
            if again.token_ids != r["tokens"]:
                wrong.append(f"agent-{i} turn {r['turn']}")
        if stored.num_tokens != fresh.describe().num_tokens:
            lost.append(
                f"agent-{i}: the store holds {stored.num_tokens} tokens, the replay "
                f"{fresh.describe().num_tokens}"
            )
    for proc in (*workers, replay_worker, store):
        proc.stop()
    ttft = [r["ttft_ms"] for r in records]
    caches = {s: sum(r["cache"] == s for r in records) for s in ("hot", "warm", "cold")}
    generated = sum(len(r["tokens"]) for r in records)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "agents": args.agents,
        "threads": args.threads,
        "turns": len(records),
        "seconds": wall,
        "turns_per_s": len(records) / wall,
        "tokens_per_s": generated / wall,
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "cache_states": caches,
        "errors": errors,
        "lost": lost,
        "wrong": wrong,
    }
    print("\n### load test\n")
    print(
        "| agents | threads | workers | turns | s | turns/s | tokens/s | TTFT p50 ms "
        "| TTFT p99 ms | hot | warm (restored) | lost | wrong |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.agents} | {args.threads} | 2 | {len(records)} | {wall:.1f} "
        f"| {result['turns_per_s']:.2f} | {result['tokens_per_s']:.1f} "
        f"| {result['ttft_p50_ms']:.1f} | {result['ttft_p99_ms']:.1f} | {caches['hot']} "
        f"| {caches['warm']} | {len(lost) + len(errors)} | {len(wrong)} |\n"
    )
    ok = not (lost or wrong or errors)
    print(
        f"{'MET' if ok else 'MISS'}  no turn lost or wrong, checked against greedy replays: "
        f"{len(lost) + len(errors)} lost, {len(wrong)} wrong of {len(records)}"
    )
    for line in errors + lost + wrong:
        print(f"note: {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"load-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({**result, "records": records}, indent=2))
    print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--turns", type=int, default=40, help="turns per agent")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--evict-rate", type=float, default=0.25, help="chance of evicting after a turn")
    p.add_argument("--hot-budget", default="1M", help="each worker's RAM for KV caches")
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--quick", action="store_true", help="16 agents, 3 turns each")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.turns = 3
    result = run(args)
    return 0 if not (result["lost"] or result["wrong"] or result["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
