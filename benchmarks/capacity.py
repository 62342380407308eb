"""Capacity from the planner: the paper's Tables 2 and 14 beside ours, window-aware too.

No model runs here (benchmarks/windows.py measures a worker): the planner's counts for the
configs in agentkv/model_configs/ at 4K to 32K and the paper's 10.2 GB budget.
"""

from __future__ import annotations

import harness as h
from paper import TABLE2_GEMMA, TABLE14_BUDGET_BYTES, TABLE14_CONTEXTS, TABLE14_NOTES, table14

from agentkv.planner import load_config, plan

GIB = 1 << 30


def gemma_sizes() -> list[tuple]:
    """Table 2: Gemma 3 12B's GiB per agent, the paper's beside the planner's."""
    rows, gemma = [], load_config("gemma3_12b")
    for context, (fp16, q4) in zip(TABLE14_CONTEXTS, TABLE2_GEMMA, strict=True):
        c = plan(gemma, context, TABLE14_BUDGET_BYTES)
        gib = (
            f"{c.fp16_bytes / GIB:.2f}",
            f"{c.q_bytes / GIB:.2f}",
            f"{c.q_window_bytes / GIB:.3f}",
        )
        rows.append((f"{context // 1024}K", fp16, gib[0], q4, *gib[1:]))
    return rows


def targets(gemma: list) -> list[dict]:
    """The Gemma 3 row reproduced, and Q4's ~4x the FP16 agents."""
    equal = 8 - sum(len(r.differences()) for r in gemma)
    q4 = [r.ours.num_q_agents / max(r.ours.num_fp16_agents, 1) for r in gemma[:3]]
    what = "the planner reproduces the paper's Table 14 Gemma 3 row (8 cells)"
    ratio = f"{min(q4):.1f}x-{max(q4):.1f}x"
    return [
        h.goal(what, f"{equal} of 8 equal", equal == 8),
        h.goal("about 4x more agents with Q4 than FP16 (Gemma 3, 4K-16K)", ratio, min(q4) >= 4),
    ]


def main(argv: list[str] | None = None) -> None:
    args = h.parser(__doc__, model=False, quick_help="the same (it takes no time)").parse_args(argv)
    rows = table14()
    gemma = [r for r in rows if r.model == "gemma3_12b"]
    window = [r.ours.num_q_window_agents / max(r.ours.num_q_agents, 1) for r in gemma]
    differ = "; ".join(d for r in rows for d in r.differences()) or "none"
    notes = [
        f"Q4 window-aware fits {min(window):.1f}x-{max(window):.1f}x Q4's agents (Gemma 3)",
        f"cells that differ from the paper: {differ}",
        *TABLE14_NOTES,
    ]
    ours = [
        (
            r.model,
            f"{r.ours.context_tokens // 1024}K",
            r.paper_fp16,
            r.ours.num_fp16_agents,
            r.paper_q4,
            r.ours.num_q_agents,
            r.ours.num_q_window_agents,
        )
        for r in rows
    ]
    heads = ["FP16 paper", "FP16 ours", "Q4 paper", "Q4 ours", "Q4 window-aware ours"]
    title = f"agents that fit in {TABLE14_BUDGET_BYTES / GIB:.1f} GiB (Table 14)"
    sections = [
        (title, h.table(["model", "context", *heads], ours, "ll" + "r" * 5)),
        ("Gemma 3 12B KV per agent, GiB (Table 2)", h.table(["context", *heads], gemma_sizes())),
    ]
    keys = ("model", "context", "paper_fp16", "fp16", "paper_q4", "q4", "q4_window")
    document = {"budget_bytes": TABLE14_BUDGET_BYTES}
    document["rows"] = [dict(zip(keys, r, strict=True)) for r in ours]
    h.report("capacity", args.out, {}, sections, targets(gemma), notes, document)


if __name__ == "__main__":
    main()
