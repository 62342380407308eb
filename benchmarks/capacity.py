"""Capacity from the planner: the paper's Tables 2 and 14 beside ours, window-aware too.

    python benchmarks/capacity.py

No model runs here (benchmarks/windows.py measures a worker); this prints what the planner
(agentkv/planner.py) computes from the public configs shipped in agentkv/model_configs/,
at 4K to 32K and the paper's 10.2 GB budget, and whether it reproduces the paper's cells.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from agentkv.planner import (
    TABLE14,
    TABLE14_BUDGET_BYTES,
    TABLE14_CONTEXTS,
    TABLE14_NOTES,
    load_config,
    plan,
    table14,
)

GIB = 1 << 30
# Table 2 of the paper: Gemma 3 12B KV GB per agent (FP16, Q4) at 4K, 8K, 16K, 32K.
TABLE2_GEMMA = ((1.5, 0.42), (3.0, 0.84), (6.0, 1.7), (12.0, 3.4))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the same (it takes no time)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)

    rows = table14()
    print(f"### agents that fit in {TABLE14_BUDGET_BYTES / GIB:.1f} GiB (Table 14)\n")
    print(
        "| model | context | FP16 paper | FP16 ours | Q4 paper | Q4 ours | Q4 window-aware ours |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r.ours
        print(
            f"| {r.model} | {c.context_tokens // 1024}K | {r.paper_fp16} | {c.num_fp16_agents} "
            f"| {r.paper_q4} | {c.num_q_agents} | {c.num_q_window_agents} |"
        )
    gemma = load_config("gemma3_12b")
    print("\n### Gemma 3 12B KV per agent, GiB (Table 2)\n")
    print("| context | FP16 paper | FP16 ours | Q4 paper | Q4 ours | Q4 window-aware ours |")
    print("|---|---:|---:|---:|---:|---:|")
    sizes = []
    for context, (fp16, q4) in zip(TABLE14_CONTEXTS, TABLE2_GEMMA, strict=True):
        c = plan(gemma, context, TABLE14_BUDGET_BYTES)
        sizes.append((c.fp16_bytes / GIB, c.q_bytes / GIB, c.q_window_bytes / GIB))
        print(
            f"| {context // 1024}K | {fp16} | {sizes[-1][0]:.2f} | {q4} | {sizes[-1][1]:.2f} "
            f"| {sizes[-1][2]:.3f} |"
        )
    print()
    gemma_rows = [r for r in rows if r.model == "gemma3_12b"]
    exact = all(not r.differences() for r in gemma_rows)
    print(
        f"{'MET' if exact else 'MISS'}  the planner reproduces the paper's Table 14 Gemma 3 row "
        f"(8 cells): {8 - sum(len(r.differences()) for r in gemma_rows)} of 8 equal"
    )
    differ = [d for r in rows for d in r.differences()]
    q4 = [r.ours.num_q_agents / max(r.ours.num_fp16_agents, 1) for r in gemma_rows[:3]]
    window = [r.ours.num_q_window_agents / max(r.ours.num_q_agents, 1) for r in gemma_rows]
    print(
        f"{'MET' if min(q4) >= 4 else 'MISS'}  about 4x more agents with Q4 than FP16 "
        f"(Gemma 3, 4K-16K): {min(q4):.1f}x-{max(q4):.1f}x"
    )
    print(f"note: Q4 window-aware fits {min(window):.1f}x-{max(window):.1f}x Q4's agents (Gemma 3)")
    print(f"note: cells that differ from the paper: {'; '.join(differ) or 'none'}")
    for note in TABLE14_NOTES:
        print(f"note: {note}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"capacity-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
    path.write_text(
        json.dumps(
            {
                "budget_bytes": TABLE14_BUDGET_BYTES,
                "paper": TABLE14,
                "rows": [
                    {
                        "model": r.model,
                        "context": r.ours.context_tokens,
                        "fp16": r.ours.num_fp16_agents,
                        "q4": r.ours.num_q_agents,
                        "q4_window": r.ours.num_q_window_agents,
                    }
                    for r in rows
                ],
            },
            indent=2,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
