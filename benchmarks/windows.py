"""Sliding-window benchmark: what window-aware Q4 caches save on a Gemma-3-shaped model.

Builds, in a temporary directory, a random-weight float32 model of mlx-lm's gemma3_text
architecture with Gemma 3's layer pattern (five sliding-window layers of 1024 tokens, then one
global, `sliding_window_pattern` 6): 12 layers (10 sliding, 2 global), head dim 256 as in
Gemma 3 12B, but 2 KV heads instead of 8 (and 2 query heads, hidden 256) so that a 16K
prefill fits this CPU. Its tokenizer, weights and config are written by
inference_worker.model_kit. Then it starts a real `agentkv-store` process and two real
`agentkv-worker` processes on loopback (--block-tokens 256, --restore-path locate):

  window-aware   the default: a sliding layer keeps the last W - 1 tokens from a block-aligned
                 start (plus tokens not yet durable), and a restore reads a sliding layer only
                 from the blocks that reach into its window
  full-length    --full-window-layers: every layer at full length in RAM, and a restore reads
                 every layer of every block (the paper's reference behaviour)

Each worker has its own namespace, so neither reads blocks the other wrote. For each context C
(--contexts, tokens) each worker creates an agent whose system prompt is C tokens of Python
standard-library source, waits until it is durable, records its hot bytes
(DescribeAgent.num_bytes, SETTLE_S after wait_durable returns: a window cache lets go of its
committed past in a job the commit queues), and evicts it. Then, --passes times, for each
worker in turn: a store fork of that agent (same tokens, same blocks, never hot anywhere)
takes one short turn ("Go on.", max_tokens 4, greedy) that restores it warm, and the
benchmark records the worker's usage.restored_bytes and usage.time_to_first_token_ms
(cache_state must be "warm", restored by locate, with no restore failure), then, once the
turn is durable, the fork's hot bytes, then the TTFT of a second short turn (hot: the same
forward with nothing to restore); the fork is then deleted. One untimed fork per context and
worker goes first (the worker's read buffer grows to the new size).

Replies: the two workers' greedy token ids are compared pass by pass. Each worker prefilled
its own copy of the context, so, to tell the restore apart from the prefill, the full-length
worker also restores a fork of the window-aware worker's agent (its namespace: every layer
of those blocks), and the two workers' stored blocks are compared byte for byte (which block
and which layers first differ).

Bytes read are checked against what `inference_worker.blocks.block_layers` says a restore of
the manifest's blocks must read, at agentkv.layers' bytes per token per layer. Capacity: how
many agents fit in 1 GiB of KV at the measured hot bytes (both ways), next to
agentkv.planner.plan() for the same config (FP16, Q4, Q4 window-aware), and the planner's
numbers for the real Gemma 3 12B (agentkv/model_configs/gemma3_12b.json) at 10.2 GiB beside
the paper's Table 14. Target: at 8K, a window-aware restore reads <= 1/3 of the full-length
bytes. The page cache is warm throughout (every block was just written). Prints Markdown
tables; writes JSON and a PNG (matplotlib is optional) to --out. Progress goes to stderr.

Run:  python benchmarks/windows.py [--contexts 4096,8192,16384] [--passes 3] [--quick]
                                   [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import paper
from google.protobuf.json_format import MessageToDict
from harness import context_text, int_list, label, machine, pyplot, save
from paper import table14_gemma

from agentkv import planner
from agentkv.errors import AgentKVError
from agentkv.launch import ServiceProcess, store_process, worker_process
from agentkv.layers import KVStorage, describe, layer_bytes_per_token, layer_specs
from client.store import StoreClient
from client.worker import WorkerClient
from inference_worker.blas import load_optimized_blas
from tests import model_kit

BLOCK_TOKENS = 256
MODES = ("full", "window")  # --full-window-layers, and the default
MODE_NAMES = {"full": "full-length", "window": "window-aware"}
NAMESPACES = {"full": "windows-full", "window": "windows-aware"}
SHORT = "Go on."
MAX_TOKENS = 4
PREFILL = 512  # the workers' --prefill-chunk (default)
SETTLE_S = 0.3  # after wait_durable, before the DescribeAgent whose bytes are reported
VOCAB = 4096
BUDGET = 1 << 30  # the benchmark model's KV budget
TARGET_CONTEXT, TARGET_RATIO = 8192, 1 / 3
GEMMA_CONTEXTS = (4096, 8192, 16384)
Q4 = KVStorage(4, 64, 2)  # the workers' default KV format, k4v4g64f16
# Gemma 3 (gemma3_12b.json's text_config) scaled down for a 2-core CPU: the layer pattern,
# window and head dim are Gemma 3 12B's; heads, width and depth are not.
GEMMA3_SHAPE = {
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "num_hidden_layers": 12,  # 10 sliding, 2 global
    "intermediate_size": 1024,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
}
_T0 = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


# results


@dataclass(slots=True)
class Pass:
    ttft_ms: float  # usage.time_to_first_token_ms of the warm turn
    hot_ttft_ms: float  # the same of the next short turn, the agent now hot
    restored_bytes: int  # usage.restored_bytes
    token_ids: list[int]  # the greedy reply
    hot_bytes: int  # the fork's DescribeAgent.num_bytes, SETTLE_S after the turn is durable
    hot_bytes_at_durable: int  # the same, the moment wait_durable returned
    cached_tokens: int  # tokens in its cache then
    usage: dict[str, Any]


@dataclass(slots=True)
class ModeRun:
    create_s: float = 0.0  # CreateAgent, client wall time (the prefill)
    context_tokens: int = 0  # tokens of the created agent
    created_bytes: int = 0  # its hot bytes once durable (+ SETTLE_S), before any turn
    created_bytes_at_durable: int = 0  # the same, the moment wait_durable returned
    reply_bytes: int = 0  # the CreateAgent reply's num_bytes (before the commit)
    stored_bytes: int = 0  # the store manifest's bytes (every layer of every block)
    block_tokens: list[int] = field(default_factory=list)  # the manifest's blocks
    expected_bytes: int = 0  # what block_layers says a restore reads
    passes: list[Pass] = field(default_factory=list)

    def series(self, name: str) -> list[float]:
        return [getattr(p, name) for p in self.passes]

    def median(self, name: str) -> float:
        return statistics.median(self.series(name))


@dataclass(slots=True)
class ContextRun:
    nominal: int
    modes: dict[str, ModeRun] = field(default_factory=lambda: {m: ModeRun() for m in MODES})
    # the full-length worker restoring the window-aware worker's blocks (its namespace)
    cross: Pass | None = None
    blocks: dict[str, Any] = field(default_factory=dict)  # compare_blocks

    @property
    def full(self) -> ModeRun:
        return self.modes["full"]

    @property
    def window(self) -> ModeRun:
        return self.modes["window"]

    def same_replies(self) -> list[bool]:
        return [
            f.token_ids == w.token_ids
            for f, w in zip(self.full.passes, self.window.passes, strict=True)
        ]


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# the model and the processes


def build_model(root: Path) -> tuple[Path, dict[str, Any], Any]:
    """The Gemma-3-shaped random-weight model directory, its config.json, its tokenizer."""
    tokenizer = model_kit.tiny_tokenizer(VOCAB)
    config = {**GEMMA3_SHAPE, "vocab_size": tokenizer.get_vocab_size()}
    path = model_kit.save_model(
        root / "gemma3-shape", model_kit.random_model(config), config, tokenizer
    )
    return path, json.loads((path / "config.json").read_text()), tokenizer


@dataclass(slots=True)
class Services:
    store: StoreClient
    workers: dict[str, WorkerClient]  # by mode
    logs: dict[str, Path]  # each worker's log, by mode


@contextmanager
def running_services(model: Path, root: Path) -> Iterator[Services]:
    """A store and the two workers as their own processes, SIGTERMed afterwards."""
    with ExitStack() as stack:

        def start(service: ServiceProcess) -> ServiceProcess:
            stack.callback(service.stop)
            return service.start(timeout=600)

        store = start(store_process(root / "data", root / "store.log"))
        args = ["--block-tokens", str(BLOCK_TOKENS), "--restore-path", "locate"]
        args += ["--hot-budget", "4G"]
        workers = {
            mode: start(
                worker_process(
                    str(model),
                    store.address,
                    root / f"worker-{mode}.log",
                    extra_args=[*args, *(["--full-window-layers"] if mode == "full" else [])],
                )
            )
            for mode in MODES
        }
        svc = Services(
            StoreClient(store.address),
            {m: WorkerClient(w.address) for m, w in workers.items()},
            {m: w.log_path for m, w in workers.items()},
        )
        for client in (svc.store, *svc.workers.values()):
            stack.callback(client.close)
        yield svc


def worker_facts(svc: Services, mode: str, notes: list[str]) -> dict[str, Any]:
    """The worker's GetWorkerInfo; if that RPC fails, the same facts from its "model loaded"
    log line (and a note saying so)."""
    try:
        return MessageToDict(svc.workers[mode].info(), preserving_proto_field_name=True)
    except AgentKVError as exc:
        notes.append(
            f"GetWorkerInfo failed on the {MODE_NAMES[mode]} worker ({exc}); its "
            "facts come from its 'model loaded' log line"
        )
    for line in svc.logs[mode].read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "model loaded":
            return entry
    raise RuntimeError(f"no worker facts for {mode}: GetWorkerInfo failed and no log line")


# turns


def checked_turn(worker: WorkerClient, ns: str, agent: str, state: str) -> tuple[Any, dict]:
    """The short greedy turn; aborts unless the agent's cache was in `state` ("warm": restored
    by locate, with no failure)."""
    result = worker.turn(ns, agent, [("user", SHORT)], max_tokens=MAX_TOKENS)
    u = result.usage
    if u is None:
        raise RuntimeError(f"turn of {ns}/{agent} ended without a usage")
    usage = MessageToDict(
        u, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    problems = []
    if u.cache_state != state:
        problems.append(f"cache_state {u.cache_state!r}, expected {state!r}")
    if u.restore_failure:
        problems.append(f"restore failed: {u.restore_failure}")
    if state == "warm" and u.restore_path != "locate":
        problems.append(f"restore_path {u.restore_path!r}")
    if problems:
        raise RuntimeError(f"{state} turn of {ns}/{agent}: {'; '.join(problems)}; usage {usage}")
    return result, usage


def durable_state(worker: WorkerClient, ns: str, agent: str) -> tuple[Any, Any]:
    """DescribeAgent right after wait_durable returns, and again SETTLE_S later (a window
    cache lets go of its committed past in a job the commit queues on the MLX thread)."""
    worker.wait_durable(ns, agent, timeout=300)
    durable = worker.describe(ns, agent)
    time.sleep(SETTLE_S)
    return durable, worker.describe(ns, agent)


def forked_turn(svc: Services, mode: str, agent: str, name: str, ns: str = "") -> Pass:
    """A store fork of `agent` (never hot anywhere) restored warm by a short turn on the
    `mode` worker; its hot bytes once durable; a second short turn, hot; the fork deleted.
    `ns`: the namespace to find the agent in (default: the worker's own)."""
    ns, worker = ns or NAMESPACES[mode], svc.workers[mode]
    svc.store.fork_agent(ns, agent, name)
    try:
        result, usage = checked_turn(worker, ns, name, "warm")
        durable, state = durable_state(worker, ns, name)
        hot, _ = checked_turn(worker, ns, name, "hot")
        worker.wait_durable(ns, name, timeout=300)
    finally:
        worker.delete(ns, name)
    return Pass(
        result.usage.time_to_first_token_ms,
        hot.usage.time_to_first_token_ms,
        result.usage.restored_bytes,
        list(result.token_ids),
        state.num_bytes,
        durable.num_bytes,
        state.persisted_tokens,
        usage,
    )


def compare_blocks(svc: Services, fingerprint: str, agent: str) -> dict[str, Any]:
    """The two workers' stored blocks of `agent` (the same tokens, prefilled by each worker in
    its own namespace), tensor by tensor: where their bytes first differ."""
    manifests = {
        m: svc.store.get_agent(NAMESPACES[m], agent, fingerprint=fingerprint) for m in MODES
    }
    keys = list(manifests["window"].block_keys)
    out: dict[str, Any] = {
        "blocks": len(keys),
        "same_keys": keys == list(manifests["full"].block_keys),
    }
    if not out["same_keys"]:
        return out
    read = {m: svc.store.read_blocks_local(NAMESPACES[m], fingerprint, keys) for m in MODES}
    differing, first, pos = [], None, 0
    for i, (a, b) in enumerate(zip(read["full"], read["window"], strict=True)):
        layers = sorted(
            {
                int(ta.name.split(".")[1])
                for ta, tb in zip(a.tensors, b.tensors, strict=True)
                if bytes(memoryview(ta.data)) != bytes(memoryview(tb.data))
            }
        )
        if layers:
            differing.append(i)
            if first is None:
                first = {"block": i, "tokens": [pos, pos + len(a.token_ids)], "layers": layers}
        pos += len(a.token_ids)
    out |= {"differing_blocks": differing, "first_difference": first}
    return out


def warm_up(svc: Services, tokenizer: Any) -> None:
    """Every worker's first create, restore and turn, untimed."""
    text = context_text(tokenizer, 1500)
    for mode, worker in svc.workers.items():
        ns = NAMESPACES[mode]
        worker.create_agent(ns, "warm-up", text)
        worker.wait_durable(ns, "warm-up", timeout=300)
        worker.evict(ns, "warm-up")
        forked_turn(svc, mode, "warm-up", "warm-up-fork")


def read_plan(counts: list[int], config: dict[str, Any], mode: str) -> int:
    """Bytes a restore of blocks of `counts` tokens reads: block_layers' layers of each block,
    at agentkv.layers' Q4 bytes per token per layer."""
    from inference_worker.blocks import block_layers

    specs = layer_specs(config)
    windows = [s.window if mode == "window" else None for s in specs]
    per_token = [layer_bytes_per_token(s, Q4) for s in specs]
    total = 0
    for n, layers in zip(counts, block_layers(counts, windows, BLOCK_TOKENS), strict=True):
        total += n * sum(per_token[i] for i in (layers or range(len(specs))))
    return total


def run_context(
    svc: Services, fingerprint: str, config: dict[str, Any], text: str, nominal: int, passes: int
) -> ContextRun:
    run, agent = ContextRun(nominal), f"ctx{nominal}"
    for mode in MODES:
        ns, worker, m = NAMESPACES[mode], svc.workers[mode], run.modes[mode]
        start = time.perf_counter()
        state = worker.create_agent(ns, agent, text)
        m.create_s = time.perf_counter() - start
        m.reply_bytes = state.num_bytes
        durable, state = durable_state(worker, ns, agent)
        m.context_tokens, m.created_bytes = state.num_tokens, state.num_bytes
        m.created_bytes_at_durable = durable.num_bytes
        worker.evict(ns, agent)
        manifest = svc.store.get_agent(ns, agent, fingerprint=fingerprint)
        m.stored_bytes = manifest.num_bytes
        m.block_tokens = list(manifest.block_num_tokens)
        m.expected_bytes = read_plan(m.block_tokens, config, mode)
        say(
            f"  {label(nominal)} {MODE_NAMES[mode]}: created {m.context_tokens} tokens in "
            f"{m.create_s:.1f} s, hot {m.created_bytes / 1e6:.1f} MB; untimed restore"
        )
        forked_turn(svc, mode, agent, f"{agent}-warm-up")
    for p in range(passes):
        for mode in MODES:
            run.modes[mode].passes.append(forked_turn(svc, mode, agent, f"{agent}-p{p}"))
        f, w = run.full.passes[-1], run.window.passes[-1]
        say(
            f"  {label(nominal)} pass {p + 1}/{passes}: read {f.restored_bytes / 1e6:.1f} vs "
            f"{w.restored_bytes / 1e6:.1f} MB, ttft {f.ttft_ms:.1f} vs {w.ttft_ms:.1f} ms "
            f"(full vs window), same reply: {f.token_ids == w.token_ids}"
        )
    # Same stored bytes, both restore modes: the full-length worker restores the window-aware
    # worker's blocks (every layer of every block), and the two workers' blocks are compared.
    run.cross = forked_turn(svc, "full", agent, f"{agent}-cross", ns=NAMESPACES["window"])
    run.blocks = compare_blocks(svc, fingerprint, agent)
    say(
        f"  {label(nominal)} full-length worker on the window-aware blocks: reply "
        f"{run.cross.token_ids} vs {run.window.passes[-1].token_ids}; blocks that differ "
        f"between the workers: {len(run.blocks.get('differing_blocks', []))} of "
        f"{run.blocks['blocks']}, first {run.blocks.get('first_difference')}"
    )
    return run


# reporting


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f}"


def bytes_table(runs: list[ContextRun]) -> str:
    lines = [
        "| context | tokens restored | full-length MB read | window-aware MB read | window/full"
        " | expected window-aware MB (block_layers) | blocks (sliding layers read) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        f, w = r.full.median("restored_bytes"), r.window.median("restored_bytes")
        blocks = len(r.window.block_tokens)
        reaching = sliding_blocks(r)
        lines.append(
            f"| {label(r.nominal)} | {sum(r.window.block_tokens)} | {mb(f)} | {mb(w)} | "
            f"{w / f:.3f} | {mb(r.window.expected_bytes)} | {blocks} ({reaching}) |"
        )
    return "\n".join(lines)


def sliding_blocks(r: ContextRun) -> int:
    """Blocks of the window-aware agent whose sliding layers a restore reads."""
    from inference_worker.blocks import window_starts

    total = sum(r.window.block_tokens)
    start = window_starts([GEMMA3_SHAPE["sliding_window"]], total, BLOCK_TOKENS)[0]
    ends = [sum(r.window.block_tokens[: i + 1]) for i in range(len(r.window.block_tokens))]
    return sum(end > start for end in ends)


def ttft_table(runs: list[ContextRun]) -> str:
    lines = [
        "| context | full-length warm TTFT ms min / median / max | window-aware warm TTFT ms"
        " min / median / max | window/full (medians) | hot TTFT ms, full / window (medians)"
        " | warm - hot ms, full / window |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        cells = []
        for m in (r.full, r.window):
            s = spread(m.series("ttft_ms"))
            cells.append(f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}")
        ratio = r.window.median("ttft_ms") / r.full.median("ttft_ms")
        hot = [m.median("hot_ttft_ms") for m in (r.full, r.window)]
        gap = [m.median("ttft_ms") - h for m, h in zip((r.full, r.window), hot, strict=True)]
        lines.append(
            f"| {label(r.nominal)} | {cells[0]} | {cells[1]} | {ratio:.2f}x"
            f" | {hot[0]:.1f} / {hot[1]:.1f} | {gap[0]:.1f} / {gap[1]:.1f} |"
        )
    return "\n".join(lines)


def replies_table(runs: list[ContextRun]) -> str:
    lines = [
        "| context | full-length reply (own blocks) | window-aware reply | same, passes"
        " | full-length worker on the window-aware blocks | same as window-aware"
        " | blocks whose bytes differ between the workers (first: block, tokens, layers) |",
        "|---|---|---|---:|---|---|---|",
    ]
    for r in runs:
        same = r.same_replies()
        cross = r.cross.token_ids if r.cross else []
        b = r.blocks
        first = b.get("first_difference")
        where = (
            f"{first['block']}, [{first['tokens'][0]}, {first['tokens'][1]}),"
            f" {','.join(map(str, first['layers']))}"
            if first
            else "-"
        )
        diff = f"{len(b.get('differing_blocks', []))} of {b.get('blocks', 0)} ({where})"
        lines.append(
            f"| {label(r.nominal)} | {r.full.passes[0].token_ids} | {r.window.passes[0].token_ids}"
            f" | {sum(same)} of {len(same)} | {cross}"
            f" | {'yes' if cross == r.window.passes[0].token_ids else 'no'} | {diff} |"
        )
    return "\n".join(lines)


def hot_table(runs: list[ContextRun]) -> str:
    lines = [
        "| context | full-length MB, CreateAgent reply | window-aware MB, CreateAgent reply"
        " | full-length MB, created + durable | window-aware MB, created + durable"
        " | full-length MB, after a warm turn | window-aware MB, after a warm turn"
        " | window/full after a turn |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        f, w = r.full.median("hot_bytes"), r.window.median("hot_bytes")
        lines.append(
            f"| {label(r.nominal)} | {mb(r.full.reply_bytes)} | {mb(r.window.reply_bytes)}"
            f" | {mb(r.full.created_bytes)} | {mb(r.window.created_bytes)}"
            f" | {mb(f)} | {mb(w)} | {w / f:.3f} |"
        )
    return "\n".join(lines)


def capacity_rows(runs: list[ContextRun], config: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        tokens = int(statistics.median(r.window.series("cached_tokens")))
        cap = planner.plan(config, tokens, BUDGET)
        full, window = r.full.median("hot_bytes"), r.window.median("hot_bytes")
        rows.append(
            {
                "context": r.nominal,
                "cached_tokens": tokens,
                "measured_full_bytes": full,
                "measured_window_bytes": window,
                "measured_window_created_bytes": r.window.created_bytes,
                "measured_full_agents": int(BUDGET // full),
                "measured_window_agents": int(BUDGET // window),
                "measured_window_created_agents": BUDGET // r.window.created_bytes,
                "plan_fp16_bytes": cap.fp16_bytes,
                "plan_q4_bytes": cap.q_bytes,
                "plan_q4_window_bytes": cap.q_window_bytes,
                "plan_fp16_agents": cap.num_fp16_agents,
                "plan_q4_agents": cap.num_q_agents,
                "plan_q4_window_agents": cap.num_q_window_agents,
            }
        )
    return rows


def capacity_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| context (cached tokens) | planner FP16 | planner Q4 | planner Q4 window | measured"
        " full-length | measured window-aware | measured window-aware, just created |"
        " planner vs measured window-aware MB per agent |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {label(row['context'])} ({row['cached_tokens']}) | {row['plan_fp16_agents']}"
            f" | {row['plan_q4_agents']} | {row['plan_q4_window_agents']}"
            f" | {row['measured_full_agents']} | {row['measured_window_agents']}"
            f" | {row['measured_window_created_agents']}"
            f" | {mb(row['plan_q4_window_bytes'])} vs {mb(row['measured_window_bytes'])} |"
        )
    return "\n".join(lines)


def gemma_rows() -> list[dict[str, Any]]:
    config = planner.load_config("gemma3_12b")
    cells = table14_gemma()
    rows = []
    for context in GEMMA_CONTEXTS:
        cap = planner.plan(config, context, paper.TABLE14_BUDGET_BYTES)
        rows.append(
            {
                "context": context,
                "fp16_bytes": cap.fp16_bytes,
                "q4_bytes": cap.q_bytes,
                "q4_window_bytes": cap.q_window_bytes,
                "fp16_agents": cap.num_fp16_agents,
                "q4_agents": cap.num_q_agents,
                "q4_window_agents": cap.num_q_window_agents,
                "paper_fp16_agents": cells[context][0],
                "paper_q4_agents": cells[context][1],
            }
        )
    return rows


def gemma_table(rows: list[dict[str, Any]]) -> str:
    gib = 1 << 30
    lines = [
        "| context | FP16 GiB/agent | Q4 GiB/agent | Q4 window GiB/agent | FP16 agents | Q4 agents"
        " | Q4 window agents | paper FP16 / Q4 |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        sizes = " | ".join(
            f"{row[k] / gib:.3f}" for k in ("fp16_bytes", "q4_bytes", "q4_window_bytes")
        )
        counts = " | ".join(str(row[k]) for k in ("fp16_agents", "q4_agents", "q4_window_agents"))
        paper = f"{row['paper_fp16_agents']} / {row['paper_q4_agents']}"
        lines.append(f"| {label(row['context'])} | {sizes} | {counts} | {paper} |")
    return "\n".join(lines)


def targets(runs: list[ContextRun]) -> list[dict[str, Any]]:
    goal = f"window-aware restore reads <= 1/3 of the full-length bytes at {label(TARGET_CONTEXT)}"
    at = [r for r in runs if r.nominal == TARGET_CONTEXT]
    if not at:
        return [{"target": goal, "met": None, "measured": "not run at this context"}]
    r = at[0]
    f, w = r.full.median("restored_bytes"), r.window.median("restored_bytes")
    return [
        {
            "target": goal,
            "met": w / f <= TARGET_RATIO,
            "measured": f"{w / f:.3f} ({mb(w)} of {mb(f)} MB)",
        }
    ]


def notes_for(runs: list[ContextRun], config: dict[str, Any]) -> list[str]:
    notes = []
    pairs = [same for r in runs for same in r.same_replies()]
    cross = [
        r.cross is not None and r.cross.token_ids == r.window.passes[0].token_ids for r in runs
    ]
    notes.append(
        f"greedy replies ({MAX_TOKENS} tokens): the two workers, each restoring its own blocks, "
        f"agree in {sum(pairs)} of {len(pairs)} passes; the full-length worker restoring the "
        f"window-aware worker's blocks agrees with it at {sum(cross)} of {len(cross)} contexts"
    )
    for r in runs:
        for mode in MODES:
            m = r.modes[mode]
            read = set(m.series("restored_bytes"))
            if read != {m.expected_bytes}:
                notes.append(
                    f"{label(r.nominal)} {MODE_NAMES[mode]}: restored_bytes {sorted(read)} but "
                    f"block_layers expects {m.expected_bytes}"
                )
        created, after = r.window.created_bytes, r.window.median("hot_bytes")
        if created > 1.5 * after:
            notes.append(
                f"{label(r.nominal)}: once durable the window-aware worker still holds "
                f"{mb(created)} MB of the created agent ({mb(after)} MB after a warm turn): its "
                "sliding layers kept their past beyond the commit"
            )
        reply = r.window.reply_bytes
        if reply > 1.5 * created:
            chunk = planner.plan(config, r.window.context_tokens, BUDGET, chunk_tokens=PREFILL)
            notes.append(
                f"{label(r.nominal)}: the window-aware worker's CreateAgent reply says "
                f"{mb(reply)} MB ({reply / r.full.reply_bytes:.2f}x the full-length worker's), "
                f"{mb(created)} MB once durable: a sliding layer keeps every token not yet in "
                "the store, so until the commit lands the whole prefill is held in every layer "
                f"(the planner's in-flight figure, a {PREFILL}-token chunk on top of the window, "
                f"is {mb(chunk.q_window_bytes)} MB)"
            )
    late = [
        f"{label(r.nominal)} {MODE_NAMES[mode]} {what}: {mb(at)} MB then {mb(settled)} MB"
        for r in runs
        for mode, m in r.modes.items()
        for what, at, settled in [
            ("created", m.created_bytes_at_durable, m.created_bytes),
            *(
                (f"pass {i + 1}", p.hot_bytes_at_durable, p.hot_bytes)
                for i, p in enumerate(m.passes)
            ),
        ]
        if at != settled
    ]
    if late:
        notes.append(
            "DescribeAgent bytes the moment wait_durable returned differ from "
            f"{SETTLE_S} s later (the window release runs after the commit): " + "; ".join(late)
        )
    specs = layer_specs(config)
    per_token = sum(layer_bytes_per_token(s, Q4) for s in specs)
    notes.append(
        f"the model: {describe(specs)}; Q4 {per_token} bytes per token over all layers; "
        f"blocks of {BLOCK_TOKENS} tokens"
    )
    notes.append(
        "planner vs measured: the planner's Q4 window counts a sliding layer at exactly "
        f"{GEMMA3_SHAPE['sliding_window']} tokens; the cache keeps the last W - 1 tokens from a "
        f"start aligned down to a block ({BLOCK_TOKENS}), so W - 1 to W + {BLOCK_TOKENS - 2} "
        "tokens at rest, plus the tokens of the last update (a turn's new tokens). Its full "
        "layers and the full-length worker hold every cached token, as the planner's Q4 does"
    )
    notes.append(
        "TTFT includes the turn's own forward: the full-length worker's sliding layers attend "
        "over (and dequantize) the whole context, masked to the window, the window-aware "
        "worker's over ~W + one block. The hot TTFT is that forward with nothing to restore "
        "(the next short turn); warm - hot is what restoring costs over it"
    )
    return notes


def print_report(
    runs: list[ContextRun],
    header: dict[str, Any],
    config: dict[str, Any],
    capacity: list[dict[str, Any]],
    gemma: list[dict[str, Any]],
    goals: list[dict[str, Any]],
    notes: list[str],
) -> None:
    print(", ".join(f"{k}: {v}" for k, v in header.items()))
    print()
    model = {k: config[k] for k in GEMMA3_SHAPE if k != "model_type"}
    print(f"## Gemma-3-shaped model (gemma3_text, random float32 weights): {model}")
    sections = (
        ("Bytes read by a warm restore (usage.restored_bytes, median)", bytes_table(runs)),
        (
            f"TTFT of the warm turn (usage.time_to_first_token_ms, {header['passes']} passes)",
            ttft_table(runs),
        ),
        (
            f"Hot-tier bytes per agent (DescribeAgent.num_bytes, {SETTLE_S} s after durable)",
            hot_table(runs),
        ),
        ("Greedy replies (first pass)", replies_table(runs)),
        (
            f"Agents that fit in {BUDGET / (1 << 30):.0f} GiB of KV (benchmark model)",
            capacity_table(capacity),
        ),
        (
            f"Planner: Gemma 3 12B (gemma3_12b.json) at "
            f"{paper.TABLE14_BUDGET_BYTES / (1 << 30):.1f} GiB",
            gemma_table(gemma),
        ),
    )
    for title, text in sections:
        print(f"\n### {title}\n\n{text}")
    print()
    for goal in goals:
        status = {True: "MET", False: "MISS", None: "INFO"}[goal["met"]]
        print(f"{status}  {goal['target']}: {goal['measured']}")
    for note in notes:
        print(f"note: {note}")
    print()


def plot(runs: list[ContextRun], header: dict[str, Any], path: Path) -> str:
    """Bytes read and TTFT against context, both ways; says what it did."""
    if (plt := pyplot()) is None:
        return ""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = [r.nominal for r in runs]
    for mode in MODES:
        modes = [r.modes[mode] for r in runs]
        left.plot(
            xs,
            [m.median("restored_bytes") / 1e6 for m in modes],
            marker="o",
            label=MODE_NAMES[mode],
        )
        series = [m.series("ttft_ms") for m in modes]
        mid = [statistics.median(v) for v in series]
        err = [
            [a - min(v) for a, v in zip(mid, series, strict=True)],
            [max(v) - a for a, v in zip(mid, series, strict=True)],
        ]
        line = right.errorbar(
            xs, mid, yerr=err, marker="o", capsize=3, label=f"{MODE_NAMES[mode]}, warm"
        )
        right.plot(
            xs,
            [m.median("hot_ttft_ms") for m in modes],
            linestyle="--",
            marker=".",
            color=line[0].get_color(),
            label=f"{MODE_NAMES[mode]}, hot (the same forward, nothing restored)",
        )
    for ax, ylabel in (
        (left, "MB read by a warm restore"),
        (right, "TTFT, ms (median; whiskers min..max)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [label(x) for x in xs])
        ax.set_xlabel("context, tokens")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return save(fig, path, header, "sliding-window caches, Gemma-3-shaped model")


def report(
    runs: list[ContextRun],
    args: argparse.Namespace,
    facts: dict[str, dict[str, Any]],
    config: dict[str, Any],
    notes: list[str],
) -> None:
    window = facts["window"]
    header = machine() | {k: window.get(k, "") for k in ("blas", "device", "dtype", "kv_format")}
    header |= {"passes": args.passes, "contexts": args.contexts}
    capacity = capacity_rows(runs, config)
    gemma = gemma_rows()
    goals = targets(runs)
    notes = notes_for(runs, config) + notes
    print_report(runs, header, config, capacity, gemma, goals, notes)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"windows-{datetime.now():%Y%m%d-%H%M%S}"
    document = {
        "header": header,
        "model_config": config,
        "workers": facts,
        "block_tokens": BLOCK_TOKENS,
        "budget_bytes": BUDGET,
        "contexts": [
            {
                "nominal_tokens": r.nominal,
                "modes": {
                    mode: asdict(m)
                    | {
                        "summary": {
                            k: spread(m.series(k))
                            for k in ("ttft_ms", "restored_bytes", "hot_bytes")
                        }
                    }
                    for mode, m in r.modes.items()
                },
                "same_replies": r.same_replies(),
                "cross": asdict(r.cross) if r.cross else None,
                "blocks": r.blocks,
            }
            for r in runs
        ],
        "capacity": capacity,
        "gemma3_12b_planner": gemma,
        "targets": goals,
        "notes": notes,
    }
    stem.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    print(plot(runs, header, stem.with_suffix(".png")))


# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int_list, default=[4096, 8192, 16384])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 4K and 8K, 1 pass")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.passes = [4096, 8192], 1
    if args.passes < 1:
        p.error("--passes must be at least 1")
    if max(args.contexts) + 64 > GEMMA3_SHAPE["max_position_embeddings"]:
        p.error(f"contexts must stay under {GEMMA3_SHAPE['max_position_embeddings']} tokens")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_optimized_blas()  # before anything here imports mlx; each worker loads its own
    root = Path(tempfile.mkdtemp(prefix="agentkv-windows-"))
    runs: list[ContextRun] = []
    notes: list[str] = []  # what happened along the way
    try:
        say("building the Gemma-3-shaped model (12 layers, float32, random weights)")
        path, config, tokenizer = build_model(root)
        with running_services(path, root) as svc:
            facts = {mode: worker_facts(svc, mode, notes) for mode in MODES}
            if len({f["fingerprint"] for f in facts.values()}) != 1:
                raise RuntimeError(f"the two workers' fingerprints differ: {facts}")
            fingerprint, blas = facts["window"]["fingerprint"], facts["window"]["blas"]
            say(f"store and workers up ({blas}); warming up")
            warm_up(svc, tokenizer)
            for n in sorted(args.contexts):
                say(f"context {label(n)}")
                text = context_text(tokenizer, n)
                runs.append(run_context(svc, fingerprint, config, text, n, args.passes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(runs, args, facts, config, notes)


if __name__ == "__main__":
    main()
