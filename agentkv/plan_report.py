"""`agentkv plan`'s table: the planner's figures for a model and budget."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from agentkv.layers import GROUP_SIZES, KV_BITS, KVFormat, describe, layer_specs
from agentkv.planner import load_config, plan
from agentkv.units import table


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"


def _notes(lines: Sequence[str]) -> str:
    wrap = textwrap.TextWrapper(width=100, initial_indent="  - ", subsequent_indent="    ")
    return "notes:\n" + "\n".join(wrap.fill(line) for line in lines)


def print_plan(
    name: str, contexts: Sequence[int], budget: int, bits: int, group: int, chunk: int
) -> None:
    """`agentkv plan`: per-agent KV bytes and how many agents fit in `budget`, per context."""
    config = load_config(name)
    specs = layer_specs(config)
    if bits not in KV_BITS:  # KVFormat's, said as the flags were typed
        raise ValueError(f"--bits {bits}: a worker stores {', '.join(map(str, KV_BITS))} bits")
    if group not in GROUP_SIZES:
        raise ValueError(
            f"--group-size {group}: a worker's is {' or '.join(map(str, GROUP_SIZES))}"
        )
    KVFormat(bits, bits, group).check_fits(specs)  # "... not multiples of --group-size 128"
    caps = [plan(config, n, budget, bits, group, chunk_tokens=chunk) for n in contexts]
    print(f"{name}: {describe(specs)}")
    print(
        f"budget {_gib(budget)} ({budget:,} bytes); "
        f"Q{bits} = {bits}-bit values, an fp16 scale and bias per {group}\n"
    )
    headers = ["context", "FP16/agent", f"Q{bits}/agent", f"Q{bits} window/agent"]
    headers += ["FP16 agents", f"Q{bits} agents", f"Q{bits} window agents"]
    rows = [
        (c.context_tokens, _gib(c.fp16_bytes), _gib(c.q_bytes), _gib(c.q_window_bytes))
        + (c.num_fp16_agents, c.num_q_agents, c.num_q_window_agents)
        for c in caps
    ]
    print(table(headers, rows) + "\n")
    sliding = any(s.kind == "sliding" for s in specs)
    print(
        _notes(
            [
                "per agent: the KV cache only, no weights, activations or allocator slack",
                f"FP16 and Q{bits}: every layer holds the whole context, as the paper counts",
                f"Q{bits} window: a sliding layer holds min(context, window + chunk - 1) tokens "
                "(mlx-lm's RotatingKVCache; a cache trimmed at block boundaries holds up to a "
                "block more)"
                if sliding
                else f"no sliding-window layers: Q{bits} window = Q{bits}",
                "the paper's '10.2 GB' is --budget 10.2Gi (its Table 14: benchmarks/capacity.py)",
                "--budget reads G as 10^9 and Gi as 2^30; a worker's --hot-budget and a "
                "store's --quota read both as 2^30",
            ]
        )
    )
