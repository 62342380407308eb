"""Capacity from the planner: the paper's Tables 2 and 14 beside ours, window-aware too.

No model runs here (benchmarks/windows.py measures a worker): this prints what the planner
computes from the configs shipped in agentkv/model_configs/ at 4K to 32K and the paper's
10.2 GB budget, and whether it reproduces the paper's cells.
"""

from __future__ import annotations

from harness import parser, report, table
from paper import (
    TABLE2_GEMMA,
    TABLE14,
    TABLE14_BUDGET_BYTES,
    TABLE14_CONTEXTS,
    TABLE14_NOTES,
    table14,
)

from agentkv.planner import load_config, plan

GIB = 1 << 30


def gemma_sizes() -> list[tuple]:
    gemma, rows = load_config("gemma3_12b"), []
    for context, (fp16, q4) in zip(TABLE14_CONTEXTS, TABLE2_GEMMA, strict=True):
        c = plan(gemma, context, TABLE14_BUDGET_BYTES)
        rows.append((f"{context // 1024}K", fp16, f"{c.fp16_bytes / GIB:.2f}", q4))
        rows[-1] += (f"{c.q_bytes / GIB:.2f}", f"{c.q_window_bytes / GIB:.3f}")
    return rows


def goals(rows: list) -> list[dict]:
    gemma = [r for r in rows if r.model == "gemma3_12b"]
    equal = 8 - sum(len(r.differences()) for r in gemma)
    q4 = [r.ours.num_q_agents / max(r.ours.num_fp16_agents, 1) for r in gemma[:3]]
    return [
        {
            "target": "the planner reproduces the paper's Table 14 Gemma 3 row (8 cells)",
            "measured": f"{equal} of 8 equal",
            "met": equal == 8,
        },
        {
            "target": "about 4x more agents with Q4 than FP16 (Gemma 3, 4K-16K)",
            "measured": f"{min(q4):.1f}x-{max(q4):.1f}x",
            "met": min(q4) >= 4,
        },
    ]


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__, model=False, quick="the same (it takes no time)").parse_args(argv)
    rows = table14()
    heads = ["model", "context", "FP16 paper", "FP16 ours", "Q4 paper", "Q4 ours"]
    cells = [
        (r.model, f"{r.ours.context_tokens // 1024}K", r.paper_fp16, r.ours.num_fp16_agents)
        + (r.paper_q4, r.ours.num_q_agents, r.ours.num_q_window_agents)
        for r in rows
    ]
    gemma_heads = ["context", "FP16 paper", "FP16 ours", "Q4 paper", "Q4 ours"]
    gemma = [r for r in rows if r.model == "gemma3_12b"]
    window = [r.ours.num_q_window_agents / max(r.ours.num_q_agents, 1) for r in gemma]
    differ = [d for r in rows for d in r.differences()]
    notes = [
        f"Q4 window-aware fits {min(window):.1f}x-{max(window):.1f}x Q4's agents (Gemma 3)",
        f"cells that differ from the paper: {'; '.join(differ) or 'none'}",
        *TABLE14_NOTES,
    ]
    sections = [
        (
            f"agents that fit in {TABLE14_BUDGET_BYTES / GIB:.1f} GiB (Table 14)",
            table([*heads, "Q4 window-aware ours"], cells, "ll" + "r" * 5),
        ),
        (
            "Gemma 3 12B KV per agent, GiB (Table 2)",
            table([*gemma_heads, "Q4 window-aware ours"], gemma_sizes()),
        ),
    ]
    ours = [
        {"model": r.model, "context": r.ours.context_tokens, "fp16": r.ours.num_fp16_agents}
        | {"q4": r.ours.num_q_agents, "q4_window": r.ours.num_q_window_agents}
        for r in rows
    ]
    document = {"budget_bytes": TABLE14_BUDGET_BYTES, "paper": TABLE14, "rows": ours}
    report("capacity", args.out, {}, sections, goals(rows), notes, document)


if __name__ == "__main__":
    main()
