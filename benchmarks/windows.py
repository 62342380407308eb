"""Sliding-window benchmark: what window-aware Q4 caches save on a Gemma-3-shaped model.

A random-weight model with Gemma 3's layer pattern (10 sliding layers of 1024, 2 global), a
store, and two workers, window-aware (the default) and --full-window-layers: bytes a warm
restore reads, its TTFT, hot bytes per agent and the agents that fit, beside the planner; the
README explains the method. Run: python benchmarks/windows.py [--contexts 4096,8192,16384]
[--passes 3] [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import paper
from harness import (
    Services,
    context_axis,
    context_text,
    label,
    machine,
    parser,
    plot,
    report,
    say,
    services,
    span,
    spread,
    table,
    usage_dict,
    whiskers,
)
from paper import table14_gemma

from agentkv import planner
from agentkv.client.worker import WorkerClient
from agentkv.layers import KVStorage, describe, layer_bytes_per_token, layer_specs
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


# the model and the processes


def build_model(root: Path) -> tuple[Path, dict[str, Any], Any]:
    """The Gemma-3-shaped random-weight model directory, its config.json, its tokenizer."""
    tokenizer = model_kit.tiny_tokenizer(VOCAB)
    config = {**GEMMA3_SHAPE, "vocab_size": tokenizer.get_vocab_size()}
    path = model_kit.save_model(
        root / "gemma3-shape", model_kit.random_model(config), config, tokenizer
    )
    return path, json.loads((path / "config.json").read_text()), tokenizer


WORKER_FLAGS = [
    "--block-tokens",
    str(BLOCK_TOKENS),
    "--restore-path",
    "locate",
    "--hot-budget",
    "4G",
]
WORKERS = {m: [*WORKER_FLAGS, *(["--full-window-layers"] if m == "full" else [])] for m in MODES}


# turns


def checked_turn(worker: WorkerClient, ns: str, agent: str, state: str) -> tuple[Any, dict]:
    """The short greedy turn; aborts unless the agent's cache was in `state` ("warm": restored
    by locate, with no failure)."""
    result = worker.turn(ns, agent, [("user", SHORT)], max_tokens=MAX_TOKENS)
    if (u := result.usage) is None:
        raise RuntimeError(f"turn of {ns}/{agent} ended without a usage")
    usage = usage_dict(u)
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
    rows = []
    for r in runs:
        f, w = r.full.median("restored_bytes"), r.window.median("restored_bytes")
        blocks = f"{len(r.window.block_tokens)} ({sliding_blocks(r)})"
        rows.append(
            (label(r.nominal), sum(r.window.block_tokens), mb(f), mb(w), f"{w / f:.3f}")
            + (mb(r.window.expected_bytes), blocks)
        )
    headers = ("context", "tokens restored", "full-length MB read", "window-aware MB read")
    headers += ("window/full", "expected window-aware MB (block_layers)")
    return table((*headers, "blocks (sliding layers read)"), rows, "l" + "r" * 5 + "l")


def sliding_blocks(r: ContextRun) -> int:
    """Blocks of the window-aware agent whose sliding layers a restore reads."""
    from inference_worker.blocks import window_starts

    total = sum(r.window.block_tokens)
    start = window_starts([GEMMA3_SHAPE["sliding_window"]], total, BLOCK_TOKENS)[0]
    ends = [sum(r.window.block_tokens[: i + 1]) for i in range(len(r.window.block_tokens))]
    return sum(end > start for end in ends)


def ttft_table(runs: list[ContextRun]) -> str:
    rows = []
    for r in runs:
        cells = [span(m.series("ttft_ms")) for m in (r.full, r.window)]
        ratio = r.window.median("ttft_ms") / r.full.median("ttft_ms")
        hot = [m.median("hot_ttft_ms") for m in (r.full, r.window)]
        gap = [m.median("ttft_ms") - h for m, h in zip((r.full, r.window), hot, strict=True)]
        rows.append(
            (label(r.nominal), *cells, f"{ratio:.2f}x")
            + (f"{hot[0]:.1f} / {hot[1]:.1f}", f"{gap[0]:.1f} / {gap[1]:.1f}")
        )
    headers = ("context", "full-length warm TTFT ms min / median / max")
    headers += ("window-aware warm TTFT ms min / median / max", "window/full (medians)")
    return table(
        (*headers, "hot TTFT ms, full / window (medians)", "warm - hot ms, full / window"), rows
    )


def replies_table(runs: list[ContextRun]) -> str:
    rows = []
    for r in runs:
        same, b = r.same_replies(), r.blocks
        cross = r.cross.token_ids if r.cross else []
        first, window = b.get("first_difference"), r.window.passes[0].token_ids
        where = "-"
        if first:
            block, (a, z), layers = first["block"], first["tokens"], first["layers"]
            where = f"{block}, [{a}, {z}), {','.join(map(str, layers))}"
        diff = f"{len(b.get('differing_blocks', []))} of {b.get('blocks', 0)} ({where})"
        rows.append(
            (label(r.nominal), r.full.passes[0].token_ids, window, f"{sum(same)} of {len(same)}")
            + (cross, "yes" if cross == window else "no", diff)
        )
    headers = ("context", "full-length reply (own blocks)", "window-aware reply", "same, passes")
    headers += ("full-length worker on the window-aware blocks", "same as window-aware")
    last = "blocks whose bytes differ between the workers (first: block, tokens, layers)"
    return table((*headers, last), rows, "lllrlll")


def hot_table(runs: list[ContextRun]) -> str:
    rows = []
    for r in runs:
        f, w = r.full.median("hot_bytes"), r.window.median("hot_bytes")
        rows.append(
            (label(r.nominal), mb(r.full.reply_bytes), mb(r.window.reply_bytes))
            + (mb(r.full.created_bytes), mb(r.window.created_bytes), mb(f), mb(w), f"{w / f:.3f}")
        )
    headers = ("context",) + tuple(
        f"{mode} MB, {when}"
        for when in ("CreateAgent reply", "created + durable", "after a warm turn")
        for mode in ("full-length", "window-aware")
    )
    return table((*headers, "window/full after a turn"), rows)


def planned(cap: planner.Capacity, prefix: str = "") -> dict[str, int]:
    """The planner's bytes per agent and agents that fit: FP16, Q4 and Q4 window-aware."""
    sizes = (cap.fp16_bytes, cap.q_bytes, cap.q_window_bytes)
    counts = (cap.num_fp16_agents, cap.num_q_agents, cap.num_q_window_agents)
    kinds = ("fp16", "q4", "q4_window")
    return {f"{prefix}{k}_bytes": v for k, v in zip(kinds, sizes, strict=True)} | {
        f"{prefix}{k}_agents": v for k, v in zip(kinds, counts, strict=True)
    }


def capacity_rows(runs: list[ContextRun], config: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        tokens = int(statistics.median(r.window.series("cached_tokens")))
        full, window = r.full.median("hot_bytes"), r.window.median("hot_bytes")
        measured = {"full": full, "window": window, "window_created": r.window.created_bytes}
        rows.append(
            {"context": r.nominal, "cached_tokens": tokens}
            | {f"measured_{k}_bytes": v for k, v in measured.items()}
            | {f"measured_{k}_agents": int(BUDGET // v) for k, v in measured.items()}
            | planned(planner.plan(config, tokens, BUDGET), "plan_")
        )
    return rows


def capacity_table(rows: list[dict[str, Any]]) -> str:
    counts = ("plan_fp16_agents", "plan_q4_agents", "plan_q4_window_agents")
    counts += ("measured_full_agents", "measured_window_agents", "measured_window_created_agents")
    cells = [
        (f"{label(row['context'])} ({row['cached_tokens']})", *(row[k] for k in counts))
        + (f"{mb(row['plan_q4_window_bytes'])} vs {mb(row['measured_window_bytes'])}",)
        for row in rows
    ]
    headers = ("context (cached tokens)", "planner FP16", "planner Q4", "planner Q4 window")
    headers += ("measured full-length", "measured window-aware")
    headers += (
        "measured window-aware, just created",
        "planner vs measured window-aware MB per agent",
    )
    return table(headers, cells, "l" + "r" * 6 + "l")


def gemma_rows() -> list[dict[str, Any]]:
    config, cells = planner.load_config("gemma3_12b"), table14_gemma()
    return [
        {"context": context}
        | planned(planner.plan(config, context, paper.TABLE14_BUDGET_BYTES))
        | {"paper_fp16_agents": cells[context][0], "paper_q4_agents": cells[context][1]}
        for context in GEMMA_CONTEXTS
    ]


def gemma_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        (label(row["context"]),)
        + tuple(f"{row[k] / (1 << 30):.3f}" for k in ("fp16_bytes", "q4_bytes", "q4_window_bytes"))
        + tuple(row[k] for k in ("fp16_agents", "q4_agents", "q4_window_agents"))
        + (f"{row['paper_fp16_agents']} / {row['paper_q4_agents']}",)
        for row in rows
    ]
    headers = ("context", "FP16 GiB/agent", "Q4 GiB/agent", "Q4 window GiB/agent", "FP16 agents")
    headers += ("Q4 agents", "Q4 window agents", "paper FP16 / Q4")
    return table(headers, cells, "l" + "r" * 6 + "l")


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


def context_notes(r: ContextRun, config: dict[str, Any]) -> list[str]:
    """What one context's numbers say beyond its table cells: bytes read off the plan, and
    window caches holding more than their window."""
    notes = []
    for mode in MODES:
        m = r.modes[mode]
        if (read := set(m.series("restored_bytes"))) != {m.expected_bytes}:
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
    if (reply := r.window.reply_bytes) > 1.5 * created:
        chunk = planner.plan(config, r.window.context_tokens, BUDGET, chunk_tokens=PREFILL)
        notes.append(
            f"{label(r.nominal)}: the window-aware worker's CreateAgent reply says "
            f"{mb(reply)} MB ({reply / r.full.reply_bytes:.2f}x the full-length worker's), "
            f"{mb(created)} MB once durable: a sliding layer keeps every token not yet in "
            "the store, so until the commit lands the whole prefill is held in every layer "
            f"(the planner's in-flight figure, a {PREFILL}-token chunk on top of the window, "
            f"is {mb(chunk.q_window_bytes)} MB)"
        )
    return notes


def late_release(runs: list[ContextRun]) -> list[str]:
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
    if not late:
        return []
    return [
        "DescribeAgent bytes the moment wait_durable returned differ from "
        f"{SETTLE_S} s later (the window release runs after the commit): " + "; ".join(late)
    ]


def notes_for(runs: list[ContextRun], config: dict[str, Any]) -> list[str]:
    pairs = [same for r in runs for same in r.same_replies()]
    cross = [
        r.cross is not None and r.cross.token_ids == r.window.passes[0].token_ids for r in runs
    ]
    notes = [
        f"greedy replies ({MAX_TOKENS} tokens): the two workers, each restoring its own blocks, "
        f"agree in {sum(pairs)} of {len(pairs)} passes; the full-length worker restoring the "
        f"window-aware worker's blocks agrees with it at {sum(cross)} of {len(cross)} contexts"
    ]
    notes += [n for r in runs for n in context_notes(r, config)] + late_release(runs)
    specs = layer_specs(config)
    per_token = sum(layer_bytes_per_token(s, Q4) for s in specs)
    return [
        *notes,
        f"the model: {describe(specs)}; Q4 {per_token} bytes per token over all layers; "
        f"blocks of {BLOCK_TOKENS} tokens",
        "planner vs measured: the planner's Q4 window counts a sliding layer at exactly "
        f"{GEMMA3_SHAPE['sliding_window']} tokens; the cache keeps the last W - 1 tokens from a "
        f"start aligned down to a block ({BLOCK_TOKENS}), so W - 1 to W + {BLOCK_TOKENS - 2} "
        "tokens at rest, plus the tokens of the last update (a turn's new tokens). Its full "
        "layers and the full-length worker hold every cached token, as the planner's Q4 does",
        "TTFT includes the turn's own forward: the full-length worker's sliding layers attend "
        "over (and dequantize) the whole context, masked to the window, the window-aware "
        "worker's over ~W + one block. The hot TTFT is that forward with nothing to restore "
        "(the next short turn); warm - hot is what restoring costs over it",
    ]


def sections_for(runs: list[ContextRun], passes: int, capacity: list, gemma: list) -> list:
    gib, budget = 1 << 30, paper.TABLE14_BUDGET_BYTES
    return [
        ("Bytes read by a warm restore (usage.restored_bytes, median)", bytes_table(runs)),
        (
            f"TTFT of the warm turn (usage.time_to_first_token_ms, {passes} passes)",
            ttft_table(runs),
        ),
        (
            f"Hot-tier bytes per agent (DescribeAgent.num_bytes, {SETTLE_S} s after durable)",
            hot_table(runs),
        ),
        ("Greedy replies (first pass)", replies_table(runs)),
        (
            f"Agents that fit in {BUDGET / gib:.0f} GiB of KV (benchmark model)",
            capacity_table(capacity),
        ),
        (
            f"Planner: Gemma 3 12B (gemma3_12b.json) at {budget / gib:.1f} GiB",
            gemma_table(gemma),
        ),
    ]


def draw(runs: list[ContextRun]) -> Any:
    """Bytes read and TTFT against context, both ways."""

    def panels(axes: Any) -> None:
        left, right = axes
        xs = [r.nominal for r in runs]
        for mode in MODES:
            modes, name = [r.modes[mode] for r in runs], MODE_NAMES[mode]
            left.plot(xs, [m.median("restored_bytes") / 1e6 for m in modes], marker="o", label=name)
            line = whiskers(right, xs, [m.series("ttft_ms") for m in modes], label=f"{name}, warm")
            hot = [m.median("hot_ttft_ms") for m in modes]
            style = {"linestyle": "--", "marker": ".", "color": line[0].get_color()}
            right.plot(xs, hot, **style, label=f"{name}, hot (the same forward, nothing restored)")
        context_axis(left, xs, "MB read by a warm restore", log_y=False)
        context_axis(right, xs, "TTFT, ms (median; whiskers min..max)", log_y=False)
        for ax in axes:
            ax.set_ylim(bottom=0)

    return panels


def context_json(r: ContextRun) -> dict[str, Any]:
    keys = ("ttft_ms", "restored_bytes", "hot_bytes")
    return {
        "nominal_tokens": r.nominal,
        "modes": {
            mode: asdict(m) | {"summary": {k: spread(m.series(k)) for k in keys}}
            for mode, m in r.modes.items()
        },
        "same_replies": r.same_replies(),
        "cross": asdict(r.cross) if r.cross else None,
        "blocks": r.blocks,
    }


def write_report(runs: list[ContextRun], args: Any, facts: dict, config: dict[str, Any]) -> None:
    window = facts["window"]
    header = machine(**{k: window.get(k, "") for k in ("blas", "device", "dtype", "kv_format")})
    header |= {"passes": args.passes, "contexts": args.contexts}
    header["model_shape"] = {k: config[k] for k in GEMMA3_SHAPE if k != "model_type"}
    capacity, gemma = capacity_rows(runs, config), gemma_rows()
    document = {
        "model_config": config,
        "workers": facts,
        "block_tokens": BLOCK_TOKENS,
        "budget_bytes": BUDGET,
        "contexts": [context_json(r) for r in runs],
        "capacity": capacity,
        "gemma3_12b_planner": gemma,
    }
    sections = sections_for(runs, args.passes, capacity, gemma)
    notes = notes_for(runs, config)
    png = report("windows", args.out, header, sections, targets(runs), notes, document)
    title = "sliding-window caches, Gemma-3-shaped model"
    plot(png, header, title, draw(runs), ncols=2, figsize=(12, 4.8))


# main


def parse_args(argv: list[str] | None) -> Any:
    quick = "smoke run: contexts 4K and 8K, 1 pass"
    p = parser(__doc__, model=False, contexts=(4096, 8192, 16384), passes=3, quick=quick)
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
    try:
        say("building the Gemma-3-shaped model (12 layers, float32, random weights)")
        path, config, tokenizer = build_model(root)
        with services(root, path, WORKERS) as svc:
            facts = {mode: usage_dict(svc.info[mode]) for mode in MODES}
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
    write_report(runs, args, facts, config)


if __name__ == "__main__":
    main()
