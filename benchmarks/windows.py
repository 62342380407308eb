"""Sliding-window benchmark: what window-aware Q4 caches save on a Gemma-3-shaped model.

Two workers, window-aware (the default) and --full-window-layers, on a random-weight model of
Gemma 3's layer pattern; the README explains the method.
Run: python benchmarks/windows.py [--contexts 4096,8192,16384] [--passes 3] [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness as h

from agentkv import planner
from agentkv.layers import KVStorage, describe, layer_bytes_per_token, layer_specs
from inference_worker.blas import load_optimized_blas
from tests import model_kit

BLOCK_TOKENS = 256
MODES = ("full", "window")  # --full-window-layers, and the default
MODE_NAMES = {"full": "full-length", "window": "window-aware"}
NAMESPACES = {"full": "windows-full", "window": "windows-aware"}
SHORT, MAX_TOKENS = "Go on.", 4
PREFILL = 512  # the workers' --prefill-chunk (default)
SETTLE_S = 0.3  # after wait_durable, before the DescribeAgent whose bytes are reported
BUDGET = 1 << 30  # the benchmark model's KV budget
TARGET_CONTEXT, TARGET_RATIO = 8192, 1 / 3
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
FLAGS = ["--block-tokens", str(BLOCK_TOKENS), "--restore-path", "locate", "--hot-budget", "4G"]
WORKERS = {"full": [*FLAGS, "--full-window-layers"], "window": FLAGS}


@dataclass(slots=True)
class Pass:
    ttft_ms: float  # usage.time_to_first_token_ms of the warm turn
    hot_ttft_ms: float  # the same of the next short turn, the agent now hot
    restored_bytes: int  # usage.restored_bytes
    token_ids: list[int]  # the greedy reply
    hot_bytes: int  # the fork's DescribeAgent.num_bytes, SETTLE_S after the turn is durable
    cached_tokens: int  # tokens in its cache then
    usage: dict[str, Any]


@dataclass(slots=True)
class ModeRun:
    create_s: float = 0.0  # CreateAgent, client wall time (the prefill)
    context_tokens: int = 0  # tokens of the created agent
    created_bytes: int = 0  # its hot bytes once durable (+ SETTLE_S), before any turn
    reply_bytes: int = 0  # the CreateAgent reply's num_bytes (before the commit)
    block_tokens: list[int] = field(default_factory=list)  # the store manifest's blocks
    expected_bytes: int = 0  # what block_layers says a restore reads
    passes: list[Pass] = field(default_factory=list)

    def series(self, name: str) -> list[float]:
        return [getattr(p, name) for p in self.passes]

    def median(self, name: str) -> float:
        return statistics.median(self.series(name))


@dataclass(slots=True)
class ContextRun:
    nominal: int
    modes: dict[str, ModeRun]
    cross: Pass | None = None  # the full-length worker restoring the window-aware blocks

    @property
    def full(self) -> ModeRun:
        return self.modes["full"]

    @property
    def window(self) -> ModeRun:
        return self.modes["window"]

    def same_replies(self) -> list[bool]:
        pairs = zip(self.full.passes, self.window.passes, strict=True)
        return [f.token_ids == w.token_ids for f, w in pairs]

    def as_dict(self) -> dict[str, Any]:
        keys = ("ttft_ms", "restored_bytes", "hot_bytes")
        summary = {m: {k: h.spread(r.series(k)) for k in keys} for m, r in self.modes.items()}
        modes = {m: {"run": r, "summary": summary[m]} for m, r in self.modes.items()}
        return {"nominal_tokens": self.nominal, "modes": modes, "cross": self.cross}


def build_model(root: Path) -> tuple[Path, dict[str, Any], Any]:
    """The Gemma-3-shaped random-weight model directory, its config.json, its tokenizer."""
    tokenizer = model_kit.tiny_tokenizer(4096)
    config = {**GEMMA3_SHAPE, "vocab_size": tokenizer.get_vocab_size()}
    path = root / "gemma3-shape"
    model_kit.save_model(path, model_kit.random_model(config), config, tokenizer)
    return path, json.loads((path / "config.json").read_text()), tokenizer


def checked_turn(worker: Any, ns: str, agent: str, state: str) -> Any:
    """The short greedy turn; aborts unless the agent's cache was in `state` ("warm": restored
    by locate), with no restore failure."""
    u = (result := worker.turn(ns, agent, [("user", SHORT)], max_tokens=MAX_TOKENS)).usage
    path = "locate" if state == "warm" else u and u.restore_path
    if u is None or u.cache_state != state or u.restore_failure or u.restore_path != path:
        raise RuntimeError(f"{state} turn of {ns}/{agent}: expected {state} (locate); usage {u}")
    return result


def durable_state(worker: Any, ns: str, agent: str) -> Any:
    """DescribeAgent SETTLE_S after wait_durable returns (a window cache lets go of its
    committed past in a job the commit queues on the MLX thread)."""
    worker.wait_durable(ns, agent, timeout=300)
    time.sleep(SETTLE_S)
    return worker.describe(ns, agent)


def forked_turn(svc: Any, mode: str, agent: str, name: str, ns: str = "") -> Pass:
    """A store fork of `agent` (never hot anywhere) restored warm by a short turn on the
    `mode` worker; its hot bytes once durable; a second short turn, hot; the fork deleted.
    `ns`: the namespace to find the agent in (default: the worker's own)."""
    ns, worker = ns or NAMESPACES[mode], svc.workers[mode]
    svc.store.fork_agent(ns, agent, name)
    try:
        warm = checked_turn(worker, ns, name, "warm")
        state = durable_state(worker, ns, name)
        hot = checked_turn(worker, ns, name, "hot").usage.time_to_first_token_ms
        worker.wait_durable(ns, name, timeout=300)
    finally:
        worker.delete(ns, name)
    u, ids = warm.usage, list(warm.token_ids)
    return Pass(
        u.time_to_first_token_ms,
        hot,
        u.restored_bytes,
        ids,
        state.num_bytes,
        state.persisted_tokens,
        h.usage_dict(u),
    )


def read_plan(counts: list[int], config: dict[str, Any], mode: str) -> int:
    """Bytes a restore of blocks of `counts` tokens reads: block_layers' layers of each block,
    at agentkv.layers' Q4 bytes per token per layer."""
    from inference_worker.blocks import block_layers

    specs = layer_specs(config)
    windows = [s.window if mode == "window" else None for s in specs]
    per_token = [layer_bytes_per_token(s, Q4) for s in specs]
    plan = zip(counts, block_layers(counts, windows, BLOCK_TOKENS), strict=True)
    return sum(n * sum(per_token[i] for i in (layers or range(len(specs)))) for n, layers in plan)


def create(svc: Any, fp: str, mode: str, agent: str, text: str, config: dict) -> ModeRun:
    """The agent prefilled on the `mode` worker, its bytes once durable, evicted; then one
    untimed restore of a fork."""
    ns, worker, m = NAMESPACES[mode], svc.workers[mode], ModeRun()
    start = time.perf_counter()
    m.reply_bytes = worker.create_agent(ns, agent, text).num_bytes
    m.create_s = time.perf_counter() - start
    state = durable_state(worker, ns, agent)
    m.context_tokens, m.created_bytes = state.num_tokens, state.num_bytes
    worker.evict(ns, agent)
    m.block_tokens = list(svc.store.get_agent(ns, agent, fingerprint=fp).block_num_tokens)
    m.expected_bytes = read_plan(m.block_tokens, config, mode)
    h.say(f"  {MODE_NAMES[mode]}: {m.context_tokens} tokens in {m.create_s:.1f} s")
    forked_turn(svc, mode, agent, f"{agent}-warm-up")
    return m


def run_context(svc: Any, fp: str, config: dict, text: str, nominal: int, passes: int) -> Any:
    agent = f"ctx{nominal}"
    run = ContextRun(nominal, {mode: create(svc, fp, mode, agent, text, config) for mode in MODES})
    for p in range(passes):
        for mode in MODES:
            run.modes[mode].passes.append(forked_turn(svc, mode, agent, f"{agent}-p{p}"))
        f, w = run.full.passes[-1], run.window.passes[-1]
        h.say(f"  pass {p + 1}: ttft {f.ttft_ms:.1f} vs {w.ttft_ms:.1f} ms (full vs window)")
    # the same stored bytes both ways: the full-length worker restores the window-aware blocks
    run.cross = forked_turn(svc, "full", agent, f"{agent}-cross", ns=NAMESPACES["window"])
    return run


# reporting


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f}"


def sliding_blocks(r: ContextRun) -> int:
    """Blocks of the window-aware agent whose sliding layers a restore reads."""
    from inference_worker.blocks import window_starts

    counts = r.window.block_tokens
    start = window_starts([GEMMA3_SHAPE["sliding_window"]], sum(counts), BLOCK_TOKENS)[0]
    return sum(sum(counts[: i + 1]) > start for i in range(len(counts)))


def both(name: str, form: str = "{:.2f}", scale: float = 1e-6) -> Callable[[ContextRun], str]:
    """A cell of the two modes' medians of `name`, full / window."""
    return lambda r: " / ".join(form.format(m.median(name) * scale) for m in (r.full, r.window))


def over(name: str) -> Callable[[ContextRun], str]:
    """A cell of window-aware / full-length, medians of `name`."""
    return lambda r: f"{r.window.median(name) / r.full.median(name):.3f}"


BYTES = {  # the tables' columns: header, cell of a ContextRun
    "context": lambda r: h.label(r.nominal),
    "tokens restored": lambda r: sum(r.window.block_tokens),
    "MB read, full-length / window-aware": both("restored_bytes"),
    "window/full": over("restored_bytes"),
    "expected window-aware MB (block_layers)": lambda r: mb(r.window.expected_bytes),
    "blocks (sliding layers read)": lambda r: f"{len(r.window.block_tokens)} ({sliding_blocks(r)})",
}
TTFT = {
    "context": lambda r: h.label(r.nominal),
    "full-length warm TTFT ms min / median / max": lambda r: h.span(r.full.series("ttft_ms")),
    "window-aware warm TTFT ms min / median / max": lambda r: h.span(r.window.series("ttft_ms")),
    "window/full (medians)": over("ttft_ms"),
    "hot TTFT ms, full / window (medians)": both("hot_ttft_ms", "{:.1f}", 1),
}
HOT = {
    "context": lambda r: h.label(r.nominal),
    "MB, CreateAgent reply": lambda r: f"{mb(r.full.reply_bytes)} / {mb(r.window.reply_bytes)}",
    "MB, created + durable": lambda r: f"{mb(r.full.created_bytes)} / {mb(r.window.created_bytes)}",
    "MB, after a warm turn": both("hot_bytes"),
    "window/full after a turn": over("hot_bytes"),
}
REPLIES = {
    "context": lambda r: h.label(r.nominal),
    "full-length reply (own blocks)": lambda r: r.full.passes[0].token_ids,
    "window-aware reply": lambda r: r.window.passes[0].token_ids,
    "same, passes": lambda r: f"{sum(r.same_replies())} of {len(r.same_replies())}",
    "full-length worker on the window-aware blocks": lambda r: r.cross.token_ids,
}


def capacity(runs: list[ContextRun], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per context: bytes per agent, planned and measured, and the agents that fit BUDGET."""
    rows = []
    for r in runs:
        tokens = int(statistics.median(r.window.series("cached_tokens")))
        plan = planner.plan(config, tokens, BUDGET)
        sizes = {
            "plan_fp16": plan.fp16_bytes,
            "plan_q4": plan.q_bytes,
            "plan_q4_window": plan.q_window_bytes,
            "measured_full": r.full.median("hot_bytes"),
            "measured_window": r.window.median("hot_bytes"),
            "measured_window_created": r.window.created_bytes,
        }
        row = {"context": r.nominal, "cached_tokens": tokens}
        row |= {f"{k}_bytes": v for k, v in sizes.items()}
        rows.append(row | {f"{k}_agents": int(BUDGET // v) for k, v in sizes.items()})
    return rows


AGENTS = {
    "plan_fp16": "planner FP16",
    "plan_q4": "planner Q4",
    "plan_q4_window": "planner Q4 window",
    "measured_full": "measured full-length",
    "measured_window": "measured window-aware",
    "measured_window_created": "measured window-aware, just created",
}
CAPACITY = {
    "context (cached tokens)": lambda c: f"{h.label(c['context'])} ({c['cached_tokens']})",
    **{header: lambda c, k=k: c[f"{k}_agents"] for k, header in AGENTS.items()},
    "planner vs measured window-aware MB per agent": lambda c: (
        f"{mb(c['plan_q4_window_bytes'])} vs {mb(c['measured_window_bytes'])}"
    ),
}


def targets(runs: list[ContextRun]) -> list[dict[str, Any]]:
    what = "window-aware restore reads <= 1/3 of the full-length bytes at "
    what += h.label(TARGET_CONTEXT)
    if not (at := [r for r in runs if r.nominal == TARGET_CONTEXT]):
        return [h.goal(what, "not run at this context", None)]
    f, w = at[0].full.median("restored_bytes"), at[0].window.median("restored_bytes")
    return [h.goal(what, f"{w / f:.3f} ({mb(w)} of {mb(f)} MB)", w / f <= TARGET_RATIO)]


def notes_for(runs: list[ContextRun], config: dict[str, Any]) -> list[str]:
    """Replies, bytes read off the plan, window caches holding more than their window."""
    pairs = [same for r in runs for same in r.same_replies()]
    cross = [r.cross.token_ids == r.window.passes[0].token_ids for r in runs]
    specs = layer_specs(config)
    notes = [
        f"greedy replies ({MAX_TOKENS} tokens): each worker restoring its own blocks, they agree "
        f"in {sum(pairs)} of {len(pairs)} passes; the full-length worker restoring the "
        f"window-aware blocks agrees with the window-aware worker at {sum(cross)} of {len(cross)}",
        f"the model: {describe(specs)}; Q4 {sum(layer_bytes_per_token(s, Q4) for s in specs)} "
        f"bytes per token over all layers; blocks of {BLOCK_TOKENS} tokens",
    ]
    for r in runs:
        notes += [
            f"{h.label(r.nominal)} {MODE_NAMES[mode]}: restored_bytes {sorted(read)} but "
            f"block_layers expects {m.expected_bytes}"
            for mode, m in r.modes.items()
            if (read := set(m.series("restored_bytes"))) != {m.expected_bytes}
        ]
        created, reply = r.window.created_bytes, r.window.reply_bytes
        if created > 1.5 * r.window.median("hot_bytes"):
            notes.append(
                f"{h.label(r.nominal)}: once durable the window-aware worker still holds "
                f"{mb(created)} MB: its sliding layers kept their past beyond the commit"
            )
        if reply > 1.5 * created:
            chunk = planner.plan(config, r.window.context_tokens, BUDGET, chunk_tokens=PREFILL)
            notes.append(
                f"{h.label(r.nominal)}: the window-aware CreateAgent reply holds {mb(reply)} "
                f"MB before the commit (the planner's in-flight figure: "
                f"{mb(chunk.q_window_bytes)} MB)"
            )
    return notes


def draw(runs: list[ContextRun], axes: Any) -> None:
    """Bytes read and TTFT against context, both ways."""
    left, right = axes
    xs = [r.nominal for r in runs]
    for mode in MODES:
        modes, name = [r.modes[mode] for r in runs], MODE_NAMES[mode]
        left.plot(xs, [m.median("restored_bytes") / 1e6 for m in modes], marker="o", label=name)
        ttft = [m.series("ttft_ms") for m in modes]
        line = h.whiskers(right, xs, ttft, label=f"{name}, warm")
        style = {"linestyle": "--", "marker": ".", "color": line[0].get_color()}
        right.plot(xs, [m.median("hot_ttft_ms") for m in modes], **style, label=f"{name}, hot")
    h.context_axis(left, xs, "MB read by a warm restore", log_y=False)
    h.context_axis(right, xs, "TTFT, ms (median; whiskers min..max)", log_y=False)
    for ax in axes:
        ax.set_ylim(bottom=0)


def write_report(runs: list[ContextRun], args: Any, facts: dict, config: dict[str, Any]) -> None:
    window = facts["window"]
    header = h.machine(**{k: window.get(k, "") for k in ("blas", "device", "dtype", "kv_format")})
    header |= {"passes": args.passes, "contexts": args.contexts}
    header["model_shape"] = {k: config[k] for k in GEMMA3_SHAPE if k != "model_type"}
    fits = capacity(runs, config)
    document = {"model_config": config, "workers": facts, "block_tokens": BLOCK_TOKENS}
    document |= {"budget_bytes": BUDGET, "contexts": [r.as_dict() for r in runs], "capacity": fits}
    sections = [
        ("Bytes read by a warm restore (usage.restored_bytes, median)", h.columns(runs, BYTES)),
        (f"TTFT of the warm turn ({args.passes} passes)", h.columns(runs, TTFT)),
        (
            f"Hot-tier bytes per agent, full / window ({SETTLE_S} s after durable)",
            h.columns(runs, HOT),
        ),
        ("Greedy replies (first pass)", h.columns(runs, REPLIES, "lllrl")),
        (
            f"Agents that fit in {BUDGET >> 30} GiB of KV (benchmark model)",
            h.columns(fits, CAPACITY),
        ),
    ]
    notes = notes_for(runs, config)
    png = h.report("windows", args.out, header, sections, targets(runs), notes, document)
    title = "sliding-window caches, Gemma-3-shaped model"
    h.plot(png, header, title, draw, runs, ncols=2, figsize=(12, 4.8))


def main(argv: list[str] | None = None) -> None:
    quick = {"contexts": [TARGET_CONTEXT], "passes": 1}  # the target's context
    p = h.parser(__doc__, model=False, contexts=(4096, 8192, 16384), passes=3, quick=quick)
    args = p.parse_args(argv)
    if args.passes < 1 or max(args.contexts) + 64 > GEMMA3_SHAPE["max_position_embeddings"]:
        most = GEMMA3_SHAPE["max_position_embeddings"]
        p.error(f"--passes must be at least 1, contexts under {most}")
    load_optimized_blas()  # before anything here imports mlx; each worker loads its own
    h.say("building the Gemma-3-shaped model (12 layers, float32, random weights)")
    with h.services(None) as svc:
        path, config, tokenizer = build_model(svc.root)
        for mode, flags in WORKERS.items():
            svc.start_worker(mode, path, flags)
        facts = {mode: h.usage_dict(svc.info[mode]) for mode in MODES}
        if len({f["fingerprint"] for f in facts.values()}) != 1:
            raise RuntimeError(f"the two workers' fingerprints differ: {facts}")
        h.say("store and workers up; warming up: every worker's first create, restore and turn")
        for mode, worker in svc.workers.items():
            worker.create_agent(NAMESPACES[mode], "warm-up", h.context_text(tokenizer, 1500))
            worker.evict(NAMESPACES[mode], "warm-up")  # waits for its store write
            forked_turn(svc, mode, "warm-up", "warm-up-fork")
        fp = facts["window"]["fingerprint"]
        texts = {n: h.context_text(tokenizer, n) for n in args.contexts}
        runs = [run_context(svc, fp, config, texts[n], n, args.passes) for n in sorted(texts)]
    write_report(runs, args, facts, config)


if __name__ == "__main__":
    main()
